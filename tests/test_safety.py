"""Failing safely: a diverging loss stops the run without writing anything worse than
what was there; a flag that cannot work is one line (exit 2) before anything starts,
through every run script; Ctrl-C saves and stops like SIGTERM, and a second Ctrl-C
stops at once. Each case: one clear line, no traceback, no process left behind."""

import os
import re
import subprocess
import time

import pytest
import torch

from conftest import (
    act_after_step,
    bake,
    error_lines,
    load_module,
    load_weights,
    max_difference,
    nan_loss_on_rank_1,
    replace_user_functions,
    run_warm,
    without_batchnorm,
)
from test_faults import watch

LONG = ["--epochs", "3", "--batch-size", "8", "--num-workers", "0", "--val-size", "37"]
LONG += ["--train-size", "512"]  # 2 processes: 32 steps an epoch


def single(project, out_dir, args, **env):
    command = ["./run_single.sh", *args, "--output-dir", str(out_dir)]
    return watch(command, project, {"NPROC_PER_NODE": "2", **env})


def all_finite(path):
    state = load_weights(path)
    tensors = state.get("model", state)
    return all(
        torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()
    )


# -- divergence --------------------------------------------------------------------------

# On rank 1 the loss's 45th call (epoch 2, batch 13) returns NaN.
NAN_ON_RANK_1 = nan_loss_on_rank_1(45)


def test_a_nan_loss_stops_the_run_and_names_the_step(tmp_path):
    project = bake(tmp_path, save_strategy="last")
    replace_user_functions(project, NAN_ON_RANK_1)
    out = tmp_path / "out"
    code, output, _, left = single(project, out, LONG)
    assert code == 1 and left == [], output
    errors = error_lines(output)
    line = (
        "error: the loss is nan in epoch 2 at batch 13 (rank 1); stopped without saving "
        "it. Try a lower --lr, --clip-grad-norm 1.0, or --amp bf16 instead of fp16"
    )
    assert errors == [line], output
    assert "Traceback" not in output
    # Epoch 1's checkpoint stays, and nothing non-finite was written.
    assert load_weights(out / "checkpoint_last.pt")["epoch"] == 1
    assert all_finite(out / "checkpoint_last.pt")
    assert not (out / "model_final.pt").exists()
    assert (out / "metrics.csv").read_text().count("\n") == 2  # header, epoch 1


def test_a_huge_learning_rate_or_a_full_disk_keeps_the_last_good_checkpoint(tmp_path):
    """The cases a user meets: resumed with --lr 1e6, the loss becomes NaN within an
    epoch; resumed on a disk too full for a checkpoint (here a file size limit), the
    save fails. checkpoint_last.pt keeps every byte of the good one (spawn launcher:
    it says nothing more than the workers)."""
    project = bake(tmp_path, launcher="spawn", save_strategy="last")
    out = tmp_path / "out"
    run_warm(project, out, 2, *LONG[:1], "1", *LONG[2:])
    good = {
        name: (out / name).read_bytes()
        for name in ("checkpoint_last.pt", "model_final.pt", "metrics.csv")
    }
    files = sorted(p.name for p in out.iterdir())
    code, output, _, left = single(project, out, [*LONG, "--lr", "1e6"])
    assert code == 1 and left == [], output
    assert "error: the loss is nan in epoch 2 at batch " in output, output
    assert "Traceback" not in output
    assert {name: (out / name).read_bytes() for name in good} == good

    # Files of at most 64 KiB (the checkpoint has 170): writing one fails with EFBIG,
    # as on a full disk with ENOSPC. Epoch 2's row is written, then its save fails.
    limited = ["bash", "-c", 'ulimit -f 64 && exec ./run_single.sh "$@"', "bash"]
    command = [*limited, *LONG, "--output-dir", str(out)]
    code, output, _, left = watch(command, project, {"NPROC_PER_NODE": "2"})
    assert code == 1 and left == [], output
    errors = error_lines(output)
    last = out / "checkpoint_last.pt"
    assert len(errors) == 1, output
    assert errors[0].startswith(f"error: cannot write {last} (")
    assert errors[0].endswith("GB free): left as it was")
    assert "Traceback" not in output
    assert {name: (out / name).read_bytes() for name in good} == good | {
        "metrics.csv": (out / "metrics.csv").read_bytes()
    }
    assert (out / "metrics.csv").read_text().count("\n") == 3  # header, epochs 1, 2
    assert sorted(p.name for p in out.iterdir()) == files  # no .tmp left


# -- a save that fails loses nothing -----------------------------------------------------

SAVED = ["--batch-size", "8", "--num-workers", "0", "--val-size", "37"]
SAVED += ["--train-size", "64"]  # 2 processes: 4 updates an epoch


@pytest.mark.parametrize(
    ("parallelism", "limit_kib"),
    # Files of at most this size: a checkpoint is larger (DDP's 170 KiB; FSDP2's
    # shards 100-130 KiB a rank), metrics.csv and the rest smaller.
    [("ddp", 64), ("fsdp2", 40)],
)
def test_a_save_that_fails_part_way_loses_nothing(tmp_path, parallelism, limit_kib):
    """Epoch 1 saved; then a file size limit (as a full disk or a quota would)
    makes epoch 2's checkpoint fail part-way: one line names it and the reason, exit
    1, the checkpoint of epoch 1 stays whole and loadable, and once there is room
    the same command resumes from it and ends as a run never stopped. The same for
    model_final.pt (a folder where its temporary file goes)."""
    project = bake(tmp_path, parallelism=parallelism, save_strategy="last")
    without_batchnorm(project)
    straight, out = tmp_path / "straight", tmp_path / "out"
    run_warm(project, straight, 2, *SAVED, "--epochs", "3")
    run_warm(project, out, 2, *SAVED, "--epochs", "1")
    last = out / ("checkpoint_last.pt" if parallelism == "ddp" else "checkpoint_last")
    files = {p.name: p.read_bytes() for p in last.rglob("*") if p.is_file()} or {
        last.name: last.read_bytes()
    }

    limited = ["bash", "-c", f'ulimit -f {limit_kib} && exec ./run_single.sh "$@"']
    command = [*limited, "bash", *SAVED, "--epochs", "3", "--output-dir", str(out)]
    code, output, _, left = watch(command, project, {"NPROC_PER_NODE": "2"})
    assert code == 1 and left == [], output
    [line] = error_lines(output)
    assert re.fullmatch(
        rf"error: cannot write {re.escape(str(last))} \(File too large; "
        r"[\d.]+ GB free\): left as it was",
        line,
    ), output
    assert "Traceback" not in output
    now = {p.name: p.read_bytes() for p in last.rglob("*") if p.is_file()} or {
        last.name: last.read_bytes()
    }
    assert now == files  # every byte of epoch 1's
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [last.name, "metrics.csv", "model_final.pt"]
    )  # no temporary file or folder left

    # Room again: the same command goes on from epoch 1, as if never stopped.
    (out / "model_final.pt.tmp").mkdir()  # ... but model_final.pt cannot be written
    output = run_warm(project, out, 2, *SAVED, "--epochs", "3", expect=1)
    assert f"resumed from {last} after epoch 1" in output
    [line] = error_lines(output)
    assert line.startswith(f"error: cannot write {out / 'model_final.pt'}")
    (out / "model_final.pt.tmp").rmdir()
    output = run_warm(project, out, 2, *SAVED, "--epochs", "3")
    assert "resume: the run is done" in output and "done: weights" in output
    final = load_weights(out / "model_final.pt")
    assert max_difference(final, load_weights(straight / "model_final.pt")) < 1e-6


# -- flags that cannot work ----------------------------------------------------------------

BAD_FLAGS = [
    (["--batch-size", "0"], "argument --batch-size: must be at least 1, not 0"),
    (["--grad-accum", "0"], "argument --grad-accum: must be at least 1, not 0"),
    (["--val-size", "0"], "argument --val-size: must be at least 1, not 0"),
    (["--epochs", "-2"], "argument --epochs: must be at least 1, not -2"),
    (["--num-workers", "-1"], "argument --num-workers: must be at least 0, not -1"),
    (["--train-size", "0"], "argument --train-size: must be at least 1, not 0"),
    (["--lr", "-1"], "argument --lr: must be at least 0, not -1"),
    (["--clip-grad-norm", "-1"], "argument --clip-grad-norm: must be above 0, not -1"),
    (["--dist-timeout", "nan"], "argument --dist-timeout: must be above 0, not nan"),
    (["--epochs", "two"], "argument --epochs: invalid int value: 'two'"),
]
BAD_SPAWN_FLAGS = [
    (["--nproc-per-node", "0"], "argument --nproc-per-node: must be at least 1, not 0"),
    (["--master-port", "70000"], "argument --master-port: must be at least 1 and at"),
    (["--nnodes", "2", "--node-rank", "2"], "argument --node-rank: must be below"),
]
BAD_MULTI_ENV = [
    ({"NNODES": "0"}, "NNODES must be a whole number of at least 1, not '0'"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK must be below NNODES (2), not 2"),
    ({"NPROC_PER_NODE": "x"}, "NPROC_PER_NODE must be a whole number of at least 1"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT must be at most 65535, not 70000"),
]
# NNODES=MIN:MAX (elastic) with torchrun; spawn has no such thing.
BAD_ELASTIC_ENV = {
    "torchrun": [
        ({"NNODES": "3:2"}, "NNODES=MIN:MAX needs 1 <= MIN <= MAX, not '3:2'"),
        ({"NNODES": "0:2"}, "NNODES=MIN:MAX needs 1 <= MIN <= MAX, not '0:2'"),
        ({"NNODES": "2:x"}, "NNODES must be a whole number of at least 1, not '2:x'"),
        ({"NNODES": "1:2", "NODE_RANK": "0"}, "NODE_RANK is not used with NNODES=1:2"),
    ],
    "spawn": [
        (
            {"NNODES": "1:2"},
            "NNODES=1:2: elastic membership (MIN:MAX) needs the torchrun",
        ),
    ],
}


def refusals(project, cases, script="./run_single.sh"):
    """Run every (args or env, message) case at once: each must end soon (no process
    group was started), with exit 2 and one line. (run_multi.sh says which network
    interface and rendezvous it will use before main_multi_gpu.py checks the flags:
    there, the error is the one line that is not such a note.)"""
    procs = []
    for case, message in cases:
        args, env = (case, {}) if isinstance(case, list) else ([], case)
        out = project / f"out{len(procs)}"
        procs.append(
            (
                subprocess.Popen(
                    [script, "--output-dir", str(out), *args],
                    cwd=project,
                    env={**os.environ, "NPROC_PER_NODE": "2", **env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
                message,
                out,
            )
        )
    start = time.monotonic()
    for proc, message, out in procs:
        output = proc.communicate(timeout=60)[0]
        assert proc.returncode == 2, output
        notes = ("network: ", "rendezvous: ")
        lines = [x for x in output.splitlines() if not x.startswith(notes)]
        assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), output
        assert not out.exists()
    assert time.monotonic() - start < 20 * len(procs) / 2


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_every_number_flag_is_checked(tmp_path, launcher, capsys):
    """Each bad value, through the script's own parse_args: one line, exit 2."""
    module = load_module(bake(tmp_path, launcher=launcher, nodes="multi"))
    cases = BAD_FLAGS + (BAD_SPAWN_FLAGS if launcher == "spawn" else [])
    for args, message in cases:
        with pytest.raises(SystemExit) as stop:
            module.parse_args(args)
        assert stop.value.code == 2, args
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines

    # An output folder that cannot be made is refused too, but not where nothing is
    # written (--evaluate, --preflight).
    (tmp_path / "notes.txt").write_text("a file where a folder is asked for")
    inside_a_file = str(tmp_path / "notes.txt" / "out")
    with pytest.raises(SystemExit) as stop:
        module.parse_args(["--output-dir", inside_a_file])
    assert stop.value.code == 2
    line = f"error: argument --output-dir: {tmp_path}/notes.txt is a file, not a folder"
    assert capsys.readouterr().err.startswith(line)
    for mode in (["--evaluate", "model_final.pt"], ["--preflight"]):
        args = module.parse_args([*mode, "--output-dir", inside_a_file])
        assert args.output_dir == inside_a_file


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_flag_that_cannot_work_is_one_line_through_every_script(tmp_path, launcher):
    """Before any process starts, through each run script (run_slurm.sbatch:
    test_slurm.py); run_multi.sh's own variables too."""
    project = bake(tmp_path, launcher=launcher, nodes="multi")
    cases = [BAD_FLAGS[0], BAD_FLAGS[-1], (["--bogus"], "unrecognized arguments")]
    cases += [({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE must be a whole number")]
    (project / "notes.txt").write_text("a file where a folder is asked for")
    in_a_file = f"argument --output-dir: {project}/notes.txt is a file, not a folder"
    cases += [(["--output-dir", "notes.txt/out"], in_a_file)]
    refusals(project, cases)
    cases = [BAD_FLAGS[1], *BAD_MULTI_ENV, *BAD_ELASTIC_ENV[launcher]]
    refusals(project, cases, script="./run_multi.sh")


def test_a_learning_rate_of_zero_is_a_probe_that_moves_nothing(tmp_path):
    """--lr 0 runs the whole set-up (data, steps, evaluation, saving) and leaves every
    weight where build_model() put it; only BatchNorm's running statistics move."""
    project = bake(tmp_path, save_strategy="final_only")
    out = tmp_path / "out"
    run_warm(project, out, 2, *LONG[:1], "1", *LONG[2:], "--lr", "0")
    module = load_module(project)
    torch.manual_seed(0)  # as the script seeds before build_model()
    model = module.build_model(module.parse_args([]))
    initial = dict(model.named_parameters())
    final = load_weights(out / "model_final.pt")
    assert all(torch.equal(final[name], value) for name, value in initial.items())
    moved = [name for name in final if "running_mean" in name]
    assert moved and all(
        not torch.equal(final[name], model.state_dict()[name]) for name in moved
    )


# -- Ctrl-C ----------------------------------------------------------------------------------

# Ctrl-C in a terminal reaches the foreground process group: under the spawn launcher
# that is every process; torchrun keeps its workers in sessions of their own, so only
# the launcher gets it and passes it on. Rank 0 sends it after step 2 of epoch 2, 6
# steps before the check at step 8 (a loaded machine may take a few to pass it on).
CTRL_C = {
    "torchrun": "os.kill(os.getppid(), signal.SIGINT)",
    "spawn": "os.killpg(os.getpgrp(), signal.SIGINT)",
}


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_ctrl_c_saves_like_sigterm(tmp_path, launcher):
    """(A resume from such a checkpoint: test_faults.py's SIGTERM test.)"""
    project = bake(tmp_path, launcher=launcher, save_strategy="final_only")
    act_after_step(project)
    out = tmp_path / "out"
    env = {"TEST_ACT_AT": "0:1:1", "TEST_ACTION": CTRL_C[launcher]}
    code, output, seconds, left = single(project, out, LONG, **env)
    assert code == 130 and left == [] and seconds < 60, output
    last = out / "checkpoint_last.pt"
    line = f"interrupted: saved {last} in epoch 2 after 8 batches; run again to resume"
    assert output.count(line) == 1, output
    assert "Traceback" not in output and "error" not in output.lower(), output
    checkpoint = load_weights(last)
    assert (checkpoint["epoch"], checkpoint["epoch_samples"]) == (1, 8 * 2 * 8)
    if launcher == "spawn":
        # Resumed to its end, final_only keeps no checkpoint: a rerun starts afresh.
        assert "resumed from" in run_warm(project, out, 2, *LONG)
        assert not last.exists()


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_second_ctrl_c_stops_at_once(tmp_path, launcher):
    project = bake(tmp_path, launcher=launcher, save_strategy="last")
    act_after_step(project)
    out = tmp_path / "out"
    twice = f"{CTRL_C[launcher]}; time.sleep(0.3); {CTRL_C[launcher]}; time.sleep(60)"
    env = {"TEST_ACT_AT": "0:1:5", "TEST_ACTION": twice}
    code, output, seconds, left = single(project, out, LONG, **env)
    assert code == 130 and left == [], output
    assert seconds < 55, output  # not the 60 s the action sleeps, start-up aside
    lines = [line for line in output.splitlines() if not line.startswith("epoch ")]
    assert lines == ["aborted: a second Ctrl-C stopped the workers at once"], output
    assert load_weights(out / "checkpoint_last.pt")["epoch"] == 1  # nothing new
