"""The README's timm recipe, with the real timm (a tiny model of its own, random
init, no download), in a spawn project with SyncBatchNorm and the best checkpoint,
run with the environment of requirements-timm.txt (timm_env.py): timm's model,
optimizer, cosine schedule counted in updates (PerUpdate), ModelEmaV3 told the update
count, and Mixup/CutMix on the even batches DROP_LAST leaves. The ranks are forked
from a warm interpreter of that environment (run_warm), which imported torch and
timm once: 12 s instead of 145 s of fresh launches."""

import csv
import functools
import json
import re
import subprocess

import pytest
from test_recipes import SIGTERM
from timm_env import timm_env

from conftest import (
    act_after_step,
    bake,
    edit,
    load_weights,
    max_difference,
    replace_user_functions,
    run_warm,
)
from test_streams import readme_block

# 50 samples on 2 processes x batch 8: 25 a process, 3 whole batches and a batch of 1
# that Mixup refuses, unless DROP_LAST leaves it out.
ARGS = ["--model", "test_resnet", "--lr", "0.01", "--epochs", "2", "--warmup", "0.4"]
ARGS += ["--train-size", "50", "--val-size", "20", "--batch-size", "8"]
ARGS += ["--num-workers", "0", "--eval-every", "1"]
ANSWERS = {"launcher": "spawn", "sync_bn": True, "save_strategy": "best"}
TIMM = ["timm", "timm.data", "timm.loss", "timm.optim", "timm.scheduler", "timm.utils"]

# The LR timm's own cosine schedule gives after each of 6 updates, counted by
# step_update, as the recipe builds it: the numbers the project's rows must show.
TIMM_LRS = """
import json, torch, timm.scheduler
optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.01)
cosine = timm.scheduler.CosineLRScheduler(
    optimizer, t_initial=6, warmup_t=2, warmup_lr_init=1e-4, t_in_epochs=False
)
lrs = []
for update in range(1, 7):
    cosine.step_update(update)
    lrs.append(optimizer.param_groups[0]["lr"])
print(json.dumps(lrs))
"""


@pytest.fixture(scope="module")
def run():
    """run_warm() with the timm environment's python, timm imported there once."""
    python = timm_env() / "bin" / "python"
    return functools.partial(run_warm, python=python, preload=TIMM)


def rows(out_dir):
    with (out_dir / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def final(out_dir, name="model_final.pt"):
    return load_weights(out_dir / name)


def test_the_readmes_timm_recipe(tmp_path, run):
    project = bake(tmp_path / "project", **ANSWERS)
    replace_user_functions(project, readme_block(project, "class PerUpdate"))
    act_after_step(project)
    whole = tmp_path / "whole"
    run(project, whole, 2, *ARGS)

    # DROP_LAST: 3 updates a pass; the LR of each is timm's at that update's count.
    table = rows(whole)
    assert [int(row["step"]) for row in table] == [1, 2, 3, 4, 5, 6], table
    python = timm_env() / "bin" / "python"
    lrs = json.loads(subprocess.check_output([python, "-c", TIMM_LRS], text=True))
    assert [float(row["lr"]) for row in table] == pytest.approx(lrs, rel=1e-6)
    assert lrs[1] > lrs[0] and lrs[5] < lrs[2]  # a warm-up, then the cosine

    # The EMA is what is evaluated (keep(..., evaluate=)): the checkpoints' evaluated
    # weights are model_final_ema.pt, not the trained ones. (That --evaluate of such
    # a file prints the last row: test_recipes.py's EMA.)
    ema = whole / "model_final_ema.pt"
    evaluated = load_weights(whole / "checkpoint_last.pt")["evaluated"]
    assert max_difference(evaluated, final(whole, ema.name)) == 0
    assert max_difference(final(whole, ema.name), final(whole)) > 1e-4

    # SIGTERM after the first update of pass 2 (saved at once: --eval-every 1 checks
    # every update), then the same command: the trained and the EMA weights of a run
    # never stopped (the schedule's count and the EMA's step resumed with them).
    cut = tmp_path / "cut"
    stop = {"TEST_ACT_AT": "0:1:0", "TEST_ACTION": SIGTERM}
    run(project, cut, 2, *ARGS, env=stop, expect=143)
    output = run(project, cut, 2, *ARGS)
    assert "in epoch 2 after 1 batch" in output, output
    assert max_difference(final(cut), final(whole)) < 1e-6
    assert max_difference(final(cut, ema.name), final(whole, ema.name)) < 1e-6
    assert [row["lr"] for row in rows(cut)] == [row["lr"] for row in table]

    # The control: without DROP_LAST, a pass's last batch may be odd (49 samples, 1
    # process: 6 batches of 8, then 1), and Mixup refuses it (timm's traceback, then
    # the run's line).
    edit(project, "DROP_LAST = True", "DROP_LAST = False")
    odd = [*ARGS, "--train-size", "49"]  # (the last --train-size counts)
    output = run(project, tmp_path / "odd", 1, *odd, expect=1)
    line = r"\[rank 0\] error: AssertionError in compute_loss, line \d+: Batch size"
    assert re.match(line + " should be even", output.splitlines()[-1]), output
