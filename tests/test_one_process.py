"""One process alone: the Step trains as it is, without the DDP wrapper (or FSDP2's
sharding), so a one-GPU run pays nothing for the machinery, and every guarantee of a
run of several processes holds. What differs at one process is checked here:
- no DDP wrapper, no fully_shard(): the Step itself trains (with 2 processes: wrapped);
- a parameter the loss leaves out is named in the same line as under DDP (DDP's own
  check is gone; a scan of the gradients takes its place);
- the hang watch names a process stuck alone;
- a kill -9 with --save-every, then the same command: the end of a run never killed;
- one micro-batch an update: its loss's weight (n / batch size) cancels, so the
  gradients are the loss's own, never divided by it (a pass over every gradient,
  1.4% of a GPT-2 step on an H200); a stand-in step at a stream's end still weighs
  nothing.
What is the same whatever the number of processes is proved elsewhere, at one process
too: 1 x 2B equal to 2 x B (test_guarantees, test_workbench, test_recipes: several
optimizers, ALTERNATE, keep() with evaluate=, --compile with --grad-accum), resumes
from one process to two and back in both formats (test_elastic, test_fsdp2)."""

import pytest
import torch
from test_run import SYNC_BN_WARNING
from test_shards import SHARDS

from conftest import (
    TINY,
    act_after_step,
    bake,
    edit,
    error_lines,
    load_weights,
    max_difference,
    replace_user_functions,
    run_warm,
)
from test_faults import watch
from test_hangs import STUCK_IN_COMPUTE_LOSS, summary
from test_streams import final, readme_block, stream_project

# Where build_training() has made what trains: print its kind once, on rank 0.
TRAINED = (
    "    t.trained = list(t.{}.parameters())  # the model's, and the Step's units\n"
)
SAY_KIND = "    print0('trains a', type(t.{}).__name__)\n"


@pytest.mark.parametrize(
    ("parallelism", "module", "wrapped"),
    [("ddp", "ddp_model", "DistributedDataParallel"), ("fsdp2", "sharded", "FSDPStep")],
)
def test_one_process_trains_the_step_itself(tmp_path, parallelism, module, wrapped):
    project = bake(tmp_path, parallelism=parallelism, save_strategy="final_only")
    trained = TRAINED.format("step" if parallelism == "ddp" else "sharded")
    edit(project, trained, SAY_KIND.format(module) + trained)
    one = run_warm(project, tmp_path / "one", 1, *TINY, "--batch-size", "16")
    two = run_warm(project, tmp_path / "two", 2, *TINY)
    assert one.count("trains a Step\n") == 1, one
    assert two.count(f"trains a {wrapped}\n") == 1, two


def test_a_parameter_left_out_is_named_in_the_same_words(tmp_path):
    """The README's recipe with a head the loss leaves out, without
    FIND_UNUSED_PARAMETERS: the first update stops the run in one line, the one a run
    of two processes gives (test_recipes.py)."""
    project = bake(tmp_path / "project")
    replace_user_functions(project, readme_block(project, "class Net("))
    edit(
        project, "FIND_UNUSED_PARAMETERS = True  #", "FIND_UNUSED_PARAMETERS = False  #"
    )
    line = (
        "error: the step left extra.weight, extra.bias out of its loss: set "
        "FIND_UNUSED_PARAMETERS = True at the top of this file (or freeze them with "
        "requires_grad_(False))"
    )
    for nproc in (1, 2):
        out = tmp_path / f"out{nproc}"
        output = run_warm(project, out, nproc, *TINY, expect=1)
        assert error_lines(output) == [line], output
        assert "Traceback" not in output and not (out / "model_final.pt").exists()


def test_a_process_stuck_alone_is_named(tmp_path):
    project = bake(tmp_path)
    # Rank 1's third call stalls in STUCK_IN_COMPUTE_LOSS: alone, rank 0's.
    replace_user_functions(
        project, STUCK_IN_COMPUTE_LOSS.replace("dist.get_rank() == 1", "True")
    )
    command = ["./run_single.sh", *TINY, "--dist-timeout", "5"]
    command += ["--output-dir", str(tmp_path / "out")]
    code, output, seconds, left = watch(command, project, {"NPROC_PER_NODE": "1"})
    assert code == 1 and left == [] and seconds < 45, output
    [rank0, verdict] = summary(output)
    assert rank0.startswith("  rank 0: compute_loss, line "), output
    assert rank0.endswith("time.sleep(1000)  # stuck  (busy outside any collective)")
    assert verdict.startswith("rank 0: no progress outside a collective"), output


def test_a_kill_and_the_same_command_end_as_a_run_never_killed(tmp_path):
    """One process, --save-every 3: killed by SIGKILL after update 5 (no handler runs),
    then the same command repeats updates 4 and 5 and ends with a straight run's
    weights."""
    project = bake(tmp_path, save_strategy="last")
    act_after_step(project)
    args = [*TINY, "--save-every", "3"]
    run_warm(project, tmp_path / "straight", 1, *args)
    out = tmp_path / "out"
    command = ["./run_single.sh", *args, "--output-dir", str(out)]
    kill = {"TEST_ACT_AT": "0:0:4", "TEST_ACTION": "os.kill(os.getpid(), 9)"}
    code, output, _, left = watch(command, project, {"NPROC_PER_NODE": "1", **kill})
    assert code == 1 and left == [], output
    assert "error: rank 0 died (SIGKILL)" in output, output
    assert load_weights(out / "checkpoint_last.pt")["step"] == 3
    output = run_warm(project, out, 1, *args)
    assert "resumed from" in output and "after 3 batches" in output, output
    final = load_weights(out / "model_final.pt")
    assert (
        max_difference(final, load_weights(tmp_path / "straight" / "model_final.pt"))
        < 1e-6
    )


# Each division of a list of tensors in place (torch._foreach_div_), as one line.
COUNT_DIVISIONS = """import torch

_divide = torch._foreach_div_


def _say_and_divide(tensors, *rest):  # one write: the ranks' lines never mix
    sys.stdout.write(f"divided {len(tensors)}\\n")
    return _divide(tensors, *rest)


torch._foreach_div_ = _say_and_divide
"""


def test_one_micro_batch_an_update_leaves_the_gradients_as_they_are(tmp_path):
    """The default project (SGD, which divides nothing itself), 8 updates: alone with
    one micro-batch an update, no division at all; with --grad-accum 2, or with 2
    processes, each update divides every gradient by the units' mean weight once. (1 x
    2B equal to 2 x B, alone too: test_guarantees, test_workbench.)"""
    project = bake(tmp_path, save_strategy="final_only")
    edit(project, "import torch\n", COUNT_DIVISIONS)
    alone = run_warm(project, tmp_path / "one", 1, *TINY, "--batch-size", "16")
    accum = run_warm(project, tmp_path / "accum", 1, *TINY, "--grad-accum", "2")
    two = run_warm(project, tmp_path / "two", 2, *TINY)
    alone, accum, two = ([*divisions(out), out] for out in (alone, accum, two))
    assert "done: " in alone[-1] and len(alone) == 1, alone[-1]
    assert len(accum) == 8 + 1 and len(two) == 2 * 8 + 1, (accum[-1], two[-1])
    # Every gradient of the optimizer's parameters (the model's) at once.
    saved = load_weights(tmp_path / "one" / "model_final.pt")
    parameters = sum(key.endswith((".weight", ".bias")) for key in saved)
    assert set(accum[:-1] + two[:-1]) == {f"divided {parameters}"}, accum[-1]


def divisions(output):
    return [line for line in output.splitlines() if line.startswith("divided")]


def test_a_stand_in_step_alone_moves_no_weight(tmp_path):
    """16 shards of uneven length (3 to 18 rows) read by one process at batch 4: once
    shards 0 to 3 have run out, the blocks of places they held are empty while other
    shards go on, and each is a stand-in step (real False: a copy of the batch before,
    weighing nothing). One process x 4 ends as 2 processes x 2, whose update divides
    by the mean weight over the ranks; a stand-in trained as a real batch would not."""
    project = stream_project(tmp_path, "shards", SHARDS, save_strategy="final_only")
    args = ["--lr", "0.01", "--max-steps", "72", "--num-workers", "0"]  # one pass
    run_warm(project, tmp_path / "w1", 1, *args, "--batch-size", "4")
    run_warm(project, tmp_path / "w2", 2, *args, "--batch-size", "2")
    assert max_difference(final(tmp_path / "w1"), final(tmp_path / "w2")) < 1e-6


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's warning")
def test_one_process_does_not_warn_about_sync_batchnorm_on_cpu(tmp_path):
    """sync_bn on a CPU: 2 processes are told, in one line, that BatchNorm stays
    per process; one process, which has nothing to synchronise, is told nothing."""
    project = bake(tmp_path / "project", sync_bn=True)
    one = run_warm(project, tmp_path / "one", 1, *TINY)
    two = run_warm(project, tmp_path / "two", 2, *TINY)
    assert SYNC_BN_WARNING not in one, one
    assert two.count(SYNC_BN_WARNING) == 1, two
