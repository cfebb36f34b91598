"""parallelism=fsdp2 keeps the guarantees (10): W ranks equal one with a W-times
batch, a resume equals a run never stopped (also on another number of ranks, from a
SIGTERM), evaluation is exact, a non-finite loss saves nothing, and each rank holds
about 1/W of the parameters, gradients and optimizer state. Checkpoints are
torch.distributed.checkpoint folders, committed whole; model_final.pt stays one plain
file. CPU and gloo; the same with NCCL and bf16 on a GPU."""

import shutil

import pytest
import torch

from conftest import (
    act_after_step,
    bake,
    default_model,
    edit,
    error_lines,
    load_weights,
    max_difference,
    metrics,
    replace_user_functions,
    run_warm,
    without_batchnorm,
)
from test_faults import watch

COMMON = ["--num-workers", "0", "--val-size", "37", "--lr", "0.02"]
# 2 ranks x batch 8: 24 steps an epoch, 48 in all; checks after updates 20 and 40.
RUN = [*COMMON, "--epochs", "2", "--train-size", "384"]
SIGTERM_IN_EPOCH_1 = {  # rank 0 after its 4th step, as Slurm would: seen at update 20
    "TEST_ACT_AT": "0:0:3",
    "TEST_ACTION": "os.killpg(os.getpgrp(), signal.SIGTERM)",
}


def fsdp_project(tmp_path, name="fsdp", **answers):
    """An fsdp2 project whose model has no BatchNorm, able to stop itself."""
    project = bake(tmp_path / name, parallelism="fsdp2", **answers)
    without_batchnorm(project)
    act_after_step(project)
    return project


def final(out_dir):
    return load_weights(out_dir / "model_final.pt")


def assert_same_rows(a, b):
    """The same rows of metrics.csv (timings aside), to float tolerance."""
    rows_a, rows_b = metrics(a), metrics(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for row_a, row_b in zip(rows_a, rows_b, strict=True):
        for key in ("train_loss", "val_loss", "val_acc", "lr"):
            assert float(row_a[key]) == pytest.approx(float(row_b[key]), abs=1e-5), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An fsdp2 run never stopped, 2 ranks x batch 8."""
    root = tmp_path_factory.mktemp("reference")
    project = fsdp_project(root, save_strategy="last")
    run_warm(project, root / "out", 2, *RUN, "--batch-size", "8")
    return project, root / "out"


@pytest.mark.xdist_group("fsdp2_reference")
def test_two_ranks_equal_one_with_twice_the_batch_and_ddp(reference, tmp_path):
    project, two = reference
    one = tmp_path / "one"
    run_warm(project, one, 1, *RUN, "--batch-size", "16")
    assert max_difference(final(two), final(one)) < 1e-5
    assert max_difference(final(two), default_model(project).state_dict()) > 1e-2
    # Exact evaluation (37 validation samples, uneven shares): the same rows.
    assert_same_rows(two, one)
    # The same arithmetic as DDP, whose project has no FSDP code at all.
    ddp = bake(tmp_path / "ddp", save_strategy="last")
    without_batchnorm(ddp)
    code = (ddp / "main_multi_gpu.py").read_text()
    assert "fully_shard" not in code and "torch.distributed.checkpoint" not in code
    run_warm(ddp, tmp_path / "ddp_out", 2, *RUN, "--batch-size", "8")
    assert max_difference(final(two), final(tmp_path / "ddp_out")) < 1e-5
    assert_same_rows(two, tmp_path / "ddp_out")

    # model_final.pt: one plain state_dict, no DTensor, no prefix, that loads with
    # weights_only=True into the model build_model() returns.
    weights = final(two)
    assert all(type(tensor) is torch.Tensor for tensor in weights.values())
    model = default_model(project)
    model.load_state_dict(weights)
    assert set(weights) == set(model.state_dict())
    # Checkpoints are folders: every rank's shards, DCP's .metadata, the train state.
    folder = two / "checkpoint_last"
    names = sorted(path.name for path in folder.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"]
    assert load_weights(folder / "train_state.pt")["epoch"] == 2
    assert sorted(path.name for path in two.iterdir()) == [
        "checkpoint_last",
        "metrics.csv",
        "model_final.pt",
    ]


@pytest.mark.xdist_group("fsdp2_reference")
def test_resume_on_fewer_and_more_ranks_equals_a_run_never_stopped(reference, tmp_path):
    """2 ranks stopped by SIGTERM in epoch 1, resumed on 1 (DCP reshards the
    folder); 1 rank with --grad-accum 2 for an epoch, resumed on 2: both end like the
    reference."""
    project, straight = reference
    out = tmp_path / "two_then_one"
    args = [*RUN, "--batch-size", "8"]
    output = run_warm(project, out, 2, *args, env=SIGTERM_IN_EPOCH_1, expect=143)
    saved = f"preempted: saved {out / 'checkpoint_last'} in epoch 1 after 20 batches"
    assert saved in output, output
    assert not list(out.glob("*.tmp")) and not list(out.glob("*.old"))
    output = run_warm(project, out, 1, *args)
    assert "resume: global batch 16 kept: 1 process x batch 8 x grad-accum 2" in output
    assert "in epoch 1 after 40 batches" in output
    assert max_difference(final(out), final(straight)) < 1e-5
    assert_same_rows(out, straight)

    out = tmp_path / "one_then_two"
    first = [*RUN[:-3], "1", *RUN[-2:], "--batch-size", "8", "--grad-accum", "2"]
    run_warm(project, out, 1, *first)
    output = run_warm(project, out, 2, *args)
    assert "resumed from" in output and "after epoch 1" in output
    assert max_difference(final(out), final(straight)) < 1e-5


@pytest.mark.xdist_group("fsdp2_reference")
def test_clipping_the_sharded_gradients_equals_clipping_whole_ones(reference, tmp_path):
    """--clip-grad-norm on 2 ranks (each holding half of every gradient) equals 1 rank
    (whole gradients), and differs from the reference (unclipped); --evaluate of the
    checkpoint folder gives the last row again; --amp bf16 (a MixedPrecisionPolicy)
    trains close to float32."""
    project, unclipped = reference
    args = [*RUN, "--clip-grad-norm", "0.05"]
    run_warm(project, tmp_path / "two", 2, *args, "--batch-size", "8")
    run_warm(project, tmp_path / "one", 1, *args, "--batch-size", "16")
    assert max_difference(final(tmp_path / "two"), final(tmp_path / "one")) < 1e-5
    assert max_difference(final(tmp_path / "two"), final(unclipped)) > 1e-3

    folder = tmp_path / "two" / "checkpoint_last"
    output = run_warm(project, tmp_path / "two", 1, *COMMON, "--evaluate", str(folder))
    (line,) = [x for x in output.splitlines() if x.startswith("evaluate ")]
    head, _, values = line.partition("  ")
    assert head == f"evaluate {folder}"
    scores = dict(pair.split(" ") for pair in values.split("  "))
    last = metrics(tmp_path / "two")[-1]
    for key in ("val_loss", "val_acc"):
        assert float(scores[key]) == pytest.approx(float(last[key]), rel=1e-5)

    bf16 = tmp_path / "bf16"
    run_warm(project, bf16, 2, *RUN, "--batch-size", "8", "--amp", "bf16")
    assert 0 < max_difference(final(bf16), final(unclipped)) < 0.01


# A model of 1.8 million parameters and AdamW (two moments each).
BIG = """
def build_model(args):
    return nn.Sequential(
        nn.Flatten(), nn.Linear(768, 1024), nn.ReLU(), nn.Linear(1024, 1024),
        nn.ReLU(), nn.Linear(1024, NUM_CLASSES),
    )


def build_optimizer(model, args, total_updates):
    return torch.optim.AdamW(model.parameters(), lr=args.lr), None
"""


def test_each_rank_holds_one_over_world_size(tmp_path):
    project = bake(tmp_path, parallelism="fsdp2", save_strategy="final_only")
    replace_user_functions(project, BIG)
    memory = {}
    for world in (1, 2, 4):
        output = run_warm(
            project,
            tmp_path / f"w{world}",
            world,
            *COMMON,
            "--max-steps",
            "1",
            "--batch-size",
            "4",
            "--train-size",
            "64",
        )
        (line,) = [x for x in output.splitlines() if x.startswith("memory per rank")]
        memory[world] = [float(part.split()[-2]) for part in line.split(", ")]
    parameters, gradients, state = memory[1]
    whole = sum(p.numel() for p in default_model(project).parameters()) * 4 / 2**20
    assert parameters == pytest.approx(whole, abs=0.01) and gradients == parameters
    assert state == pytest.approx(2 * parameters, abs=0.01)  # AdamW: two moments
    for world in (2, 4):
        assert memory[world] == pytest.approx([x / world for x in memory[1]], rel=0.01)


@pytest.mark.xdist_group("fsdp2_reference")
def test_a_crash_while_saving_keeps_the_previous_folder_and_a_nan_saves_nothing(
    reference, tmp_path
):
    """Killed after writing the second checkpoint's shards, before committing it: the
    first one stays whole under its name, and the run started again ends like the
    reference. A NaN loss stops with one line, and the folder stays as it was."""
    project, straight = reference
    crash = fsdp_project(tmp_path, "crash", save_strategy="last")
    edit(
        crash,
        "        dcp.save(shards, checkpoint_id=tmp, planner=RANK_0_WRITES_REPLICAS)\n",
        "        dcp.save(shards, checkpoint_id=tmp, planner=RANK_0_WRITES_REPLICAS)\n"
        "        if at.epoch == 2:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n",
    )
    out = tmp_path / "out"
    command = ["./run_single.sh", *RUN, "--batch-size", "8", "--output-dir", str(out)]
    code, output, _, left = watch(command, crash, {"NPROC_PER_NODE": "2"})
    assert code != 0 and left == [], output
    assert (out / "checkpoint_last.tmp" / ".metadata").exists()  # written, not kept
    assert load_weights(out / "checkpoint_last" / "train_state.pt")["epoch"] == 1
    output = run_warm(project, out, 2, *RUN, "--batch-size", "8")
    assert "after epoch 1" in output
    assert max_difference(final(out), final(straight)) < 1e-5

    # The reference's folder (2 epochs), resumed for a third in which rank 1's 2nd
    # loss is NaN.
    nan = fsdp_project(tmp_path, "nan", save_strategy="last")
    out = tmp_path / "nan_out"
    shutil.copytree(straight, out)
    before = {p.name: p.read_bytes() for p in (out / "checkpoint_last").iterdir()}
    edit(nan, "NUM_CLASSES = 10\n", "NUM_CLASSES = 10\nCALLS = []\n")
    edit(
        nan,
        "    return F.cross_entropy(model(images), labels), len(labels)\n",
        "    loss = F.cross_entropy(model(images), labels)\n"
        "    CALLS.append(1)\n"
        "    if dist.get_rank() == 1 and len(CALLS) == 2:\n"
        '        loss = loss * float("nan")\n'
        "    return loss, len(labels)\n",
    )
    third = [*RUN[:-3], "3", *RUN[-2:], "--batch-size", "8"]
    output = run_warm(nan, out, 2, *third, expect=1)
    errors = error_lines(output)
    line = (
        "error: the loss is nan in epoch 3 at batch 2 (rank 1); stopped without saving "
        "it. Try a lower --lr, --clip-grad-norm 1.0, or --amp bf16 instead of fp16"
    )
    assert errors == [line], output
    after = {p.name: p.read_bytes() for p in (out / "checkpoint_last").iterdir()}
    assert after == before


@pytest.mark.gpu
def test_fsdp2_on_gpu_with_nccl_and_bf16(tmp_path):
    project = fsdp_project(tmp_path, save_strategy="last")
    out = tmp_path / "out"
    args = [*RUN, "--batch-size", "8", "--amp", "bf16", "--backend", "nccl"]
    output = run_warm(project, out, torch.cuda.device_count(), *args)
    assert "memory per rank: parameters" in output
    assert all(type(t) is torch.Tensor for t in final(out).values())
    assert [row["epoch"] for row in metrics(out)] == ["1", "2"]
