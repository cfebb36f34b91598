"""The speed and insight flags: --amp, --compile, the per-epoch time breakdown,
--tensorboard, a run without NumPy, the allocator
setting that keeps page faults out of the CPU step, and the objects spared the
garbage collector. (--grad-accum: test_workbench.py
and test_elastic.py.) Speed itself is measured in bench/, never here."""

import math
import os
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (
    HERE,
    TINY,
    UPDATE,
    bake,
    edit,
    load_weights,
    max_difference,
    metrics,
    run_job,
    run_single,
    run_warm,
)

COMMON = ["--num-workers", "0", "--val-size", "37", "--train-size", "64"]


def train(project, out_dir, *args, nproc=2, env=None):
    return run_warm(project, out_dir, nproc, *args, env=env)


def without_modules(tmp_path, *names):
    """An environment in which NAME looks as if it were not installed, to every
    process: importlib.util.find_spec(NAME) is None, and `import NAME` fails."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        f"import sys\nsys.modules.update(dict.fromkeys({list(names)!r}))\n"
    )
    return {"PYTHONPATH": str(shim)}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return bake(tmp_path_factory.mktemp("features"), save_strategy="last")


@pytest.fixture(scope="module")
def fp32_weights(project, tmp_path_factory):
    """The final weights of the run the --amp runs are compared with."""
    out = tmp_path_factory.mktemp("fp32")
    train(project, out, *COMMON, "--batch-size", "8", "--epochs", "2")
    return load_weights(out / "model_final.pt")


@pytest.mark.xdist_group("features_fp32")
def test_bf16_autocast_trains_close_to_fp32(project, fp32_weights, tmp_path):
    out = tmp_path / "bf16"
    train(project, out, *COMMON, "--batch-size", "8", "--amp", "bf16", "--epochs", "2")
    difference = max_difference(load_weights(out / "model_final.pt"), fp32_weights)
    assert 0 < difference < 0.05  # autocast was on, and it still trained the same task
    assert load_weights(out / "checkpoint_last.pt")["scaler"] == {}  # none needed


@pytest.mark.xdist_group("features_fp32")
def test_fp16_trains_close_to_fp32_and_resumes_its_loss_scaler(
    project, fp32_weights, tmp_path
):
    args = [*COMMON, "--batch-size", "8", "--amp", "fp16"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(project, full, *args, "--epochs", "2")
    difference = max_difference(load_weights(full / "model_final.pt"), fp32_weights)
    assert 0 < difference < 0.05
    for row in metrics(full):
        assert math.isfinite(float(row["train_loss"]))

    train(project, cut, *args, "--epochs", "1")
    train(project, cut, *args, "--epochs", "2")
    assert (
        max_difference(
            load_weights(full / "model_final.pt"), load_weights(cut / "model_final.pt")
        )
        < 1e-6
    )
    scaler = load_weights(cut / "checkpoint_last.pt")["scaler"]
    assert scaler == load_weights(full / "checkpoint_last.pt")["scaler"]
    assert scaler["scale"] > 0  # GradScaler state, saved and restored


def test_compile_builds_graphs_and_matches_eager(tmp_path):
    project = bake(tmp_path, save_strategy="final_only")
    edit(
        project,
        '    print("done: " + ", ".join(parts), flush=True)\n',
        '    print("done: " + ", ".join(parts), flush=True)\n'
        "    from torch._dynamo.utils import counters\n"
        '    print("graphs:", counters["stats"]["unique_graphs"])\n',
    )
    args = [*COMMON, "--batch-size", "8", "--epochs", "2", "--grad-accum", "2"]
    output = train(project, tmp_path / "compiled", *args, "--compile")
    assert "graphs: 0" not in output and "graphs: " in output
    eager = train(project, tmp_path / "eager", *args)
    assert "graphs: 0" in eager
    compiled = load_weights(tmp_path / "compiled" / "model_final.pt")
    assert not any(key.startswith("_orig_mod") for key in compiled)
    assert (
        max_difference(compiled, load_weights(tmp_path / "eager" / "model_final.pt"))
        < 1e-5
    )


SAVE_S = 0.5  # each save made this slow, here


def test_time_breakdown_and_tensorboard(tmp_path):
    """The time columns split the training; saves (made slow here, one after each of
    the 4 updates of an epoch) count in epoch_s only."""
    project = bake(tmp_path, save_strategy="last")
    old = '    with replacing(path, "wb") as f:\n'
    edit(project, old, f"    time.sleep({SAVE_S})\n{old}")
    out_dir = tmp_path / "out"
    args = [*TINY, "--tensorboard", "--save-every", "1"]
    output = train(project, out_dir, *args)

    # Epoch 1's row comes before its end-of-epoch save: 3 saves; epoch 2's, 4.
    for row, saves in zip(metrics(out_dir), (3, 4), strict=True):
        parts = [float(row[key]) for key in ("data_s", "compute_s")]
        assert min(parts) >= 0 and parts[1] > 0
        assert sum(parts) < SAVE_S, row
        trained_s = 64 / float(row["samples_per_s"])  # --train-size 64: an epoch
        assert float(row["epoch_s"]) - trained_s > saves * SAVE_S, row
        assert trained_s == pytest.approx(sum(parts), abs=1e-4), row

    assert output.count(f"metrics {out_dir / 'metrics.csv'}\n") == 1

    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    val_loss = [event.value for event in events.Scalars("val_loss")]
    expected = [float(row["val_loss"]) for row in metrics(out_dir)]
    assert val_loss == pytest.approx(expected, abs=1e-6)


def test_without_numpy_or_tensorboard(project, tmp_path):
    """torch does not need NumPy, and neither does the script; the optional
    TensorBoard says how to get it."""
    env = without_modules(tmp_path, "numpy", "tensorboard")
    out_dir = tmp_path / "out"
    output = train(project, out_dir, *TINY, env=env)
    assert output.count(f"metrics {out_dir / 'metrics.csv'}\n") == 1
    assert [row["epoch"] for row in metrics(out_dir)] == ["1", "2"]

    command = ["./run_single.sh", *TINY, "--output-dir", str(tmp_path / "tb")]
    code, output = run_job([*command, "--tensorboard"], project, env)
    assert code == 2  # refused before anything starts
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    line = "error: --tracker tensorboard needs tensorboard: pip install tensorboard"
    assert lines == [line]


# After each optimizer step: rank 0 prints its minor page faults per step over 180
# steady steps (10 to 190), memory the C allocator returned to the kernel and takes back.
PAGE_FAULTS = f"""{HERE}            if here in ("0:0:10", "0:0:190"):
                import resource

                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                if here == "0:0:190":
                    print(f"page faults per step: {{(faults - faults_at_10) / 180}}")
                    print(f"frozen objects: {{gc.get_freeze_count()}}")
                faults_at_10 = faults
"""
KEEP_FREED_MEMORY = "    keep_freed_memory()  # before any tensor"


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc tuning")
def test_freed_memory_is_kept_instead_of_faulted_in_every_step(tmp_path):
    """keep_freed_memory() takes the kernel out of the CPU step: without it, glibc
    returns and re-faults ~1000 pages a step here (a fifth of the step time)."""
    faults = {}
    # The control (the call removed) faults anywhere from 20 to 1500 times a step
    # here, with the same code (where glibc's heap happens to end): up to 3 runs of
    # it, to show the measurement sees faults.
    for run, kept in enumerate((True, False, False, False)):
        if faults.get(False, 0) > 20:
            break
        project = bake(tmp_path / str(run), save_strategy="final_only")
        edit(project, UPDATE, PAGE_FAULTS)
        if not kept:  # the control: the call removed
            edit(project, KEEP_FREED_MEMORY, "    pass  #")
        # 12800 samples: 200 steps of 32 per rank, as in bench/ (smaller data sets
        # happen to fault less, with the same code). Launched afresh, not forked from
        # a warm interpreter: its heap, grown by earlier jobs, would hide the faults.
        args = ["--epochs", "1", "--num-workers", "0", "--train-size", "12800"]
        output = run_single(project, tmp_path / f"out{run}", 2, *args)
        [line] = [x for x in output.splitlines() if x.startswith("page faults per")]
        faults[kept] = max(faults.get(kept, 0), float(line.split(":")[1]))
        # And torch's objects are out of the garbage collector's sight (see below).
        [line] = [x for x in output.splitlines() if x.startswith("frozen objects")]
        assert int(line.split(":")[1]) > FROZEN_AT_LEAST, output
    assert faults[True] < 2, faults  # 0.3-0.45 here
    assert faults[False] > 20, faults


PRINT_MALLOC_ENV = (
    "import os; print(*(os.environ.get(f'MALLOC_{name}_THRESHOLD_') "
    "for name in ('TRIM', 'MMAP')))"
)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc tuning")
def test_processes_that_do_not_fork_get_the_same_malloc_setting(project):
    """DataLoader workers under spawn or forkserver (Python 3.14's default on Linux)
    start a new C library: glibc reads the setting from their environment."""
    script = f"""
import subprocess, sys
sys.path.insert(0, {str(project)!r})
import main_multi_gpu
child = [sys.executable, "-c", {PRINT_MALLOC_ENV!r}]
print(subprocess.run(child, capture_output=True, text=True).stdout.strip())
main_multi_gpu.keep_freed_memory()
print(subprocess.run(child, capture_output=True, text=True).stdout.strip())
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.splitlines()
    assert before == "None None"
    assert after == f"{1 << 30} {1 << 30}"


# Objects that importing torch makes for the garbage collector to track (some 170,000
# in torch 2.13; the test takes a lower bound).
FROZEN_AT_LEAST = 100_000
SPARE_THE_COLLECTOR = """
import atexit, gc, sys
sys.path.insert(0, PROJECT)
import main_multi_gpu
before = gc.get_freeze_count()
main_multi_gpu.spare_the_garbage_collector()
frozen = gc.get_freeze_count()
made_later = [[] for _ in range(1000)]
watched = len(gc.get_objects())
atexit._run_exitfuncs()  # as the interpreter does at exit, before its last collection
print(before, frozen, watched, len(gc.get_objects()))
"""


def test_what_lives_until_exit_is_spared_the_garbage_collector(project):
    """spare_the_garbage_collector() freezes the objects made so far (torch's), so
    no full collection walks them again, and at exit everything made since: the last
    collection, at the interpreter's exit, then walks nothing."""
    script = SPARE_THE_COLLECTOR.replace("PROJECT", repr(str(project)))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    before, frozen, watched, at_exit = map(int, result.stdout.split())
    assert before == 0
    assert frozen > FROZEN_AT_LEAST
    assert watched >= 1000  # made after the call, so still watched until exit
    assert at_exit == 0


@pytest.mark.gpu
def test_gpu_fast_path_trains(project, tmp_path):
    """bf16 autocast, channels_last, cudnn.benchmark, compile and accumulation on a GPU
    (2 ranks share the GPU over gloo when there is only one)."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    args = [*TINY, "--amp", "bf16", "--compile", "--grad-accum", "2"]
    train(project, tmp_path / "out", *args, "--backend", backend)
    for row in metrics(tmp_path / "out"):
        assert math.isfinite(float(row["val_loss"]))
        assert float(row["compute_s"]) > 0
