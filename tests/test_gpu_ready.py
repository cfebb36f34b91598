"""What a GPU run needs that a CPU run would not show: files that load anywhere, no
collective of the loop's own per update, and --deterministic. The gpu-marked tests
check the same on a CUDA device where one exists."""

import os

import pytest
import torch
from test_shards import SHARDS

from conftest import (
    TINY,
    bake,
    edit,
    load_module,
    load_weights,
    max_difference,
    replace_user_functions,
    run_single,
    run_warm,
)


class OnDevice(torch.Tensor):
    """Stands for a tensor on a GPU: it says it is on cuda:0, and only a copy to the
    CPU gives a plain tensor."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    def to(self, device, *args, **kwargs):
        assert torch.device(device).type == "cpu", device
        return self.as_subclass(torch.Tensor).clone()


def tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_every_saved_file_holds_cpu_tensors(tmp_path, monkeypatch, parallelism):
    """save_atomic, which writes model_final.pt and every checkpoint, hands torch.save
    CPU tensors only, whatever device the state is on."""
    module = load_module(bake(tmp_path, parallelism=parallelism))
    on_gpu = torch.arange(4.0).as_subclass(OnDevice)
    state = {
        "model": {"weight": on_gpu},
        "optimizer": {"state": {0: {"momentum_buffer": on_gpu}}, "param_groups": []},
        "train_sums": [1.0, 2.0],
    }
    saved = []
    monkeypatch.setattr(torch, "save", lambda obj, f: saved.append(obj))
    module.save_atomic(state, tmp_path / "checkpoint_last.pt")
    [written] = saved
    found = list(tensors(written))
    assert len(found) == 2
    assert [type(t) for t in found] == [torch.Tensor, torch.Tensor]
    assert all(t.device.type == "cpu" and t.tolist() == [0, 1, 2, 3] for t in found)


# Counts, per rank, the collectives that main_multi_gpu.py itself calls (not DDP's or
# FSDP2's own, which run in C++ or in torch's files), and writes the count at exit.
COUNTING = """
import atexit, os, sys
import torch.distributed as dist

CALLS = []
for name in ("all_reduce", "broadcast", "all_gather", "barrier", "reduce_scatter"):
    def counted(*args, _real=getattr(dist, name), _name=name, **kwargs):
        if sys._getframe(1).f_code.co_filename.endswith("main_multi_gpu.py"):
            CALLS.append(_name)
        return _real(*args, **kwargs)
    setattr(dist, name, counted)

def write():
    if "RANK" in os.environ:
        path = os.path.join(os.environ["COUNT_DIR"], "rank" + os.environ["RANK"])
        with open(path, "w") as f:
            f.write(" ".join(CALLS))
atexit.register(write)
"""


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2", "ddp-shards"])
def test_an_update_calls_no_collective_of_its_own(tmp_path, parallelism):
    """Guarantee 13: 100 updates call collectives from Python only for the checks
    (one per 20 updates), the evaluations and the saves; before, every update
    all-reduced its units as well (108 all-reduces here). ddp-shards: the 16 uneven
    shards of test_shards.py (36 updates a pass), whose ends ride the gradients."""
    project = bake(tmp_path, parallelism=parallelism.split("-")[0])
    if parallelism == "ddp-shards":
        replace_user_functions(project, SHARDS)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(COUNTING)
    env = {
        "COUNT_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])
        ),
    }
    args = ["--max-steps", "100", "--batch-size", "4", "--train-size", "800"]
    args += ["--val-size", "16", "--num-workers", "0", "--save-every", "0"]
    run_single(project, tmp_path / "out", 2, *args, env=env)
    for rank in (0, 1):
        calls = (tmp_path / f"rank{rank}").read_text().split()
        # ddp-shards: 2 more evaluations (its passes' ends), 2 more all-reduces each.
        most = 16 if parallelism == "ddp-shards" else 12
        assert 5 <= calls.count("all_reduce") <= most, calls
        assert len(calls) <= 40, calls


def test_the_trained_step_is_wholly_on_the_training_device(tmp_path):
    """DDP refuses a module with parameters on two kinds of device: the Step it wraps
    (the model and the units) goes to the training device whole (and trains as it is
    in a process alone). The meta device stands for a GPU here."""
    module = load_module(bake(tmp_path))
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        args = module.parse_args(["--num-workers", "0", "--output-dir", str(tmp_path)])
        t = module.build_training(args, torch.device("meta"), None)
    finally:
        torch.distributed.destroy_process_group()
    assert t.ddp_model is t.step  # alone: no DDP wrapper
    devices = {name: p.device.type for name, p in t.step.named_parameters()}
    assert set(devices.values()) == {"meta"}, devices
    assert "units" in devices


DETERMINISM = """
def compute_loss(model, batch):
    wanted = os.environ.get("WANT_DETERMINISTIC") == "1"
    if torch.are_deterministic_algorithms_enabled() != wanted:
        raise RuntimeError(f"deterministic algorithms should be {wanted}")
    images, labels = batch
    return F.cross_entropy(model(images), labels), len(labels)
"""


def test_deterministic_turns_on_deterministic_algorithms(tmp_path):
    project = bake(tmp_path)
    replace_user_functions(project, DETERMINISM)
    on = {"WANT_DETERMINISTIC": "1"}
    run_warm(project, tmp_path / "on", 2, *TINY, "--deterministic", env=on)
    run_warm(project, tmp_path / "off", 2, *TINY)
    # The same run either way on the CPU, where nothing else changes.
    a = load_weights(tmp_path / "on" / "model_final.pt")
    assert max_difference(a, load_weights(tmp_path / "off" / "model_final.pt")) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_gpu_files_load_without_a_gpu_and_deterministic_runs_repeat(
    tmp_path, parallelism
):
    """On CUDA with NCCL (one rank per GPU): model_final.pt and checkpoint_last hold
    CPU tensors; two --deterministic runs end bit for bit the same."""
    project = bake(tmp_path, parallelism=parallelism)
    nproc = torch.cuda.device_count()
    args = [*TINY, "--backend", "nccl", "--deterministic"]
    run_single(project, tmp_path / "a", nproc, *args)
    run_single(project, tmp_path / "b", nproc, *args)
    final = torch.load(tmp_path / "a" / "model_final.pt", weights_only=True)
    assert {t.device.type for t in final.values()} == {"cpu"}
    if parallelism == "ddp":
        checkpoint = torch.load(tmp_path / "a" / "checkpoint_last.pt")
        assert {t.device.type for t in tensors(checkpoint)} == {"cpu"}
    assert max_difference(final, load_weights(tmp_path / "b" / "model_final.pt")) == 0


# A model of 24 blocks of 16 MiB and a few small layers: 390 MiB in all.
BIG_MODEL = """
def build_model(args):
    blocks = [nn.Linear(2048, 2048) for _ in range(24)]
    return nn.Sequential(nn.Flatten(), nn.Linear(768, 2048), *blocks, nn.Linear(2048, 10))
"""
MODEL_MIB = (24 * 2048 * 2049 + 768 * 2048 + 2048 + 2048 * 10 + 10) * 4 / 2**20
BUILD = "    t.sharded = t.evaluated = build_sharded(args, device)\n"
# Each rank writes its resident memory before the build and its peak after (bytes),
# and stops: the build is what this measures.
MEASURED_BUILD = f"""    import resource
    before = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
{BUILD}    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(os.environ["PEAK_DIR"], f"rank{{dist.get_rank()}}").write_text(f"{{before}} {{peak}}")
    raise SystemExit(0)
"""


def build_memory(tmp_path, nproc):
    """What building the sharded model added to each rank's peak memory (MiB)."""
    project = bake(tmp_path / str(nproc), parallelism="fsdp2")
    replace_user_functions(project, BIG_MODEL)
    edit(project, BUILD, MEASURED_BUILD)
    args = ["--max-steps", "1", "--batch-size", "4", "--num-workers", "0"]
    env = {"PEAK_DIR": str(tmp_path / str(nproc))}
    run_single(project, tmp_path / str(nproc) / "out", nproc, *args, env=env)
    added = []
    for rank in range(nproc):
        before, peak = (tmp_path / str(nproc) / f"rank{rank}").read_text().split()
        added.append((int(peak) - int(before)) / 2**20)
    return added


@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp2_builds_the_whole_model_on_rank_0_only(tmp_path, nproc):
    """With a 390 MiB model, every rank but 0 holds its shards only while the model
    is built (1 / W of it, and one tensor at a time from rank 0): what the build adds
    to its memory is about the shards, and stays below the whole model's size, which
    a rank building the model whole (as before) would add on top of its shards. Rank
    0 builds it whole once, for the seed's initial weights."""
    added = build_memory(tmp_path, nproc)
    shards = MODEL_MIB / nproc
    for rank in range(1, nproc):
        assert 0.7 * shards < added[rank] < shards + MODEL_MIB / 2, added
    assert added[0] > MODEL_MIB, added
