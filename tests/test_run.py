"""Every combination trains: 2 workers on gloo (or NCCL on a GPU), 2 tiny epochs."""

import csv
import math
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from combinations import COMBINATIONS, IDS
from conftest import (
    TINY,
    bake,
    default_model,
    free_port,
    run_job,
    run_warm,
)

EPOCHS = 2
SYNC_BN_WARNING = "warning: SyncBatchNorm runs on GPUs only"


def promised_files(answers):
    """The files a run writes; fsdp2 checkpoints are folders (no .pt)."""
    strategy, ext = answers["save_strategy"], checkpoint_ending(answers)
    files = {"model_final.pt", "metrics.csv"}
    if strategy != "final_only":
        files.add(f"checkpoint_last{ext}")
    if strategy == "best":
        files.add(f"checkpoint_best{ext}")
    if strategy == "every_epoch":
        files |= {f"checkpoint_epoch{e:03d}{ext}" for e in range(1, EPOCHS + 1)}
    return files


def checkpoint_ending(answers):
    return "" if answers["parallelism"] == "fsdp2" else ".pt"


def load_checkpoint(path, model):
    """A checkpoint's dict, its model's weights under "model": a ddp file as it is; an
    fsdp2 folder's train_state.pt, and its shards gathered into `model`'s shapes."""
    if path.is_file():
        return torch.load(path, weights_only=True)
    state = torch.load(path / "train_state.pt", weights_only=True)
    shards = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single..."
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(shards, checkpoint_id=path, no_dist=True)
    return state | shards


def launch(project, answers, args, nproc=2):
    """Run the project as its README says: run_single.sh, or run_multi.sh as a
    one-machine job (NNODES=1) of nproc processes. (Two machines, with each launcher:
    test_multinode.py, test_hangs.py, test_faults.py.) Returns the output."""
    if answers["nodes"] == "single":
        command, env = ["./run_single.sh", *args], {}
    else:
        command = ["./run_multi.sh", *args]
        env = {
            "NNODES": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
    return run_job(command, project, {**env, "NPROC_PER_NODE": str(nproc)})


def check_outputs(project, answers, out_dir, result):
    code, log = result
    assert code == 0, log
    files = {p.name for p in out_dir.iterdir()}
    assert files == promised_files(answers)

    rows = list(csv.DictReader((out_dir / "metrics.csv").open()))
    assert [int(row["epoch"]) for row in rows] == list(range(1, EPOCHS + 1))
    for row in rows:
        for key in ("train_loss", "val_loss", "val_acc", "samples_per_s", "epoch_s"):
            assert math.isfinite(float(row[key])), row
        for key in ("data_s", "compute_s"):
            assert 0 <= float(row[key]) <= float(row["epoch_s"]), row
        assert 0 <= float(row["val_acc"]) <= 1

    # The final weights load safely into the plain model: no "module." prefix.
    final = torch.load(out_dir / "model_final.pt", weights_only=True)
    model = default_model(project)
    model.load_state_dict(final)
    assert not any(key.startswith("module.") for key in final)

    ext = checkpoint_ending(answers)
    checkpoints = sorted(out_dir.glob(f"checkpoint_*{ext}"))
    assert {p.name for p in checkpoints} == {
        name for name in promised_files(answers) if name.startswith("checkpoint_")
    }
    for path in checkpoints:
        checkpoint = load_checkpoint(path, default_model(project))
        assert {"model", "optimizer", "scheduler", "epoch", "args"} <= set(checkpoint)
        assert checkpoint["args"]["epochs"] == EPOCHS
        if path.name.startswith("checkpoint_epoch"):
            assert checkpoint["epoch"] == int(path.name[16:19])
    if answers["save_strategy"] != "final_only":
        last = load_checkpoint(out_dir / f"checkpoint_last{ext}", model)
        assert last["epoch"] == EPOCHS
        for key, value in final.items():  # the last checkpoint holds the final weights
            assert torch.equal(value, last["model"][key]), key
    if answers["save_strategy"] == "best":
        best = load_checkpoint(out_dir / f"checkpoint_best{ext}", model)
        losses = [float(row["val_loss"]) for row in rows]
        assert best["epoch"] == 1 + losses.index(min(losses))
        assert best["best_val_loss"] == pytest.approx(min(losses), abs=1e-6)
        # A line for each new best: the first evaluation, then every improvement.
        better = [
            loss < min(losses[:i], default=math.inf) for i, loss in enumerate(losses)
        ]
        saving = f"best val_loss so far: saving checkpoint_best{ext}\n"
        assert log.count(saving) == sum(better) > 0, log

    # Rank 0 alone prints, and ends with one line saying where the results are.
    done = (
        f"done: weights {out_dir / 'model_final.pt'}, metrics "
        f"{out_dir / 'metrics.csv'}\n"
    )
    assert log.count("done: ") == 1 and log.count(done) == 1, log
    assert "Warning:" not in log, log  # no deprecation or user warning from torch
    warned = log.count(SYNC_BN_WARNING)
    on_gpu = torch.cuda.is_available()
    assert warned == (1 if answers["sync_bn"] and not on_gpu else 0), log


# The first combination of each way to start (nodes, launcher, parallelism) runs its
# script as a user does; the others differ from it only in what training does, and
# their ranks start warm (conftest.run_warm: forked from an interpreter that imported
# torch once), which spares 3 imports of torch (about 7 CPU-seconds) a run.
LAUNCHED = {}
for _answers in COMBINATIONS:
    _way = (_answers["nodes"], _answers["launcher"], _answers["parallelism"])
    LAUNCHED.setdefault(_way, _answers)


@pytest.mark.parametrize("answers", COMBINATIONS, ids=IDS)
def test_trains_on_cpu(tmp_path, answers):
    project = bake(tmp_path, **answers)
    out_dir = tmp_path / "out"
    args = [*TINY, "--backend", "gloo"]
    if answers in LAUNCHED.values():
        result = launch(project, answers, [*args, "--output-dir", str(out_dir)])
    else:
        result = 0, run_warm(project, out_dir, 2, *args)
    check_outputs(project, answers, out_dir, result)


@pytest.mark.gpu
@pytest.mark.parametrize("answers", COMBINATIONS, ids=IDS)
def test_trains_on_gpu_with_nccl(tmp_path, answers):
    project = bake(tmp_path, **answers)
    out_dir = tmp_path / "out"
    args = [*TINY, "--backend", "nccl", "--output-dir", str(out_dir)]
    nproc = torch.cuda.device_count()
    check_outputs(project, answers, out_dir, launch(project, answers, args, nproc))
