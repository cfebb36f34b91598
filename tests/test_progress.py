"""A run you can watch: rank 0 shows where a pass stands between the evaluations'
lines, at the loop's checks (every LOG_EVERY updates; no wait of its own). On a
terminal one line drawn again in place; into a pipe or a log, a plain line every tenth
of a pass (or 5 minutes); --no-progress quiets it. A stream without a length under
--max-steps shows what it knows; a resumed pass counts from where it stands."""

import os
import re
import select
import subprocess
import time

from test_libraries import TABULAR_DATA

from conftest import (
    act_after_step,
    bake,
    replace_user_functions,
    run_warm,
)
from test_streams import REGRESSION

# One pass of 512 updates (4096 samples, batch 8, one process): 25 checks.
LONG = ["--epochs", "1", "--train-size", "4096", "--val-size", "64"]
LONG += ["--batch-size", "8", "--num-workers", "0", "--lr", "0.01"]
PROGRESS = re.compile(
    r"epoch 1  update (\d+)/512  [0-9.]+ samples/s  train_loss [0-9.]+  "
    r"left: pass \d+:\d\d:\d\d, run \d+:\d\d:\d\d"
)
TABULAR = (
    TABULAR_DATA
    + """

def build_model(args):
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
"""
)


def project_of(tmp_path, source=TABULAR):
    project = bake(tmp_path / "project")
    replace_user_functions(project, source)
    act_after_step(project)
    return project


def test_into_a_pipe_a_line_every_tenth_of_a_pass(tmp_path):
    project = project_of(tmp_path)
    output = run_warm(project, tmp_path / "out", 1, *LONG)
    before, _, after = output.partition("epoch 1/1  step 512 ")
    assert after, output
    lines = [line for line in before.splitlines() if "update" in line]
    assert 2 <= len(lines) <= 40, output
    assert all(PROGRESS.fullmatch(line) for line in lines), lines
    updates = [int(PROGRESS.fullmatch(line)[1]) for line in lines]
    assert updates == sorted(updates) and updates[-1] < 512, updates
    tenths = [10 * u // 512 for u in updates]
    assert len(set(tenths)) == len(tenths), updates  # one a tenth
    assert "\r" not in output and "\033[K" not in output, output

    quiet = run_warm(project, tmp_path / "quiet", 1, *LONG, "--no-progress")
    assert "update" not in quiet and quiet.count("epoch 1/1  step 512") == 1, quiet


def on_terminal(project, out_dir, *args, timeout=120):
    """./run_single.sh (2 processes) with a pseudo-terminal as its stdout and stderr,
    as a user at a terminal runs it: returns (exit status, what the terminal got)."""
    master, slave = os.openpty()
    command = ["./run_single.sh", *args, "--output-dir", str(out_dir)]
    env = {**os.environ, "NPROC_PER_NODE": "2"}
    proc = subprocess.Popen(command, cwd=project, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    got, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 1)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's last writer is gone
                break
            if not chunk:
                break
            got += chunk
    os.close(master)
    return proc.wait(timeout=10), got.decode()


def test_on_a_terminal_one_line_drawn_again(tmp_path):
    project = project_of(tmp_path)
    args = [*LONG, "--batch-size", "4"]  # 2 processes x 4: still 512 updates
    code, screen = on_terminal(project, tmp_path / "out", *args)
    assert code == 0, screen
    before = screen.split("epoch 1/1  step 512")[0]
    # Every drawing starts at the line's start and clears what an older one left.
    drawings = re.findall(r"\r(epoch 1  update \d+/512 [^\r\n]*?)\033\[K", before)
    assert len(drawings) >= 20, screen  # at every check of the pass
    assert all(PROGRESS.fullmatch(each) for each in drawings), drawings
    # No progress line ends with a new line: the pass's line replaces the last one.
    assert not re.search(r"update \d+/512[^\r\n]*\r?\n", screen), screen
    assert "\r\033[Kepoch 1/1  step 512" in screen, screen


STREAM = (
    """
class Rows(torch.utils.data.IterableDataset):
    def __init__(self, size, seed):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 12, generator=generator)
        self.y = self.x.sum(1, keepdim=True)

    def __iter__(self):
        yield from zip(self.x, self.y)


def build_datasets(args):
    return Rows(4096, args.seed), Rows(20, args.seed + 1)


def build_model(args):
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 1))
"""
    + REGRESSION
)


def test_a_stream_without_a_length_shows_the_runs_time_left(tmp_path):
    project = project_of(tmp_path, STREAM)
    args = ["--max-steps", "60", "--batch-size", "8", "--num-workers", "0"]
    output = run_warm(project, tmp_path / "out", 1, *args, "--lr", "0.01")
    lines = [line for line in output.splitlines() if "update" in line]
    assert len(lines) == 1, output  # at update 20; the next after 5 minutes
    pattern = r"epoch 1  update 20/\?  [0-9.]+ samples/s  train_loss [0-9.]+  "
    assert re.fullmatch(pattern + r"left: run \d+:\d\d:\d\d", lines[0]), lines


def test_a_resumed_pass_counts_from_where_it_stands(tmp_path):
    """SIGTERM after update 100 (saved at that update's check), then the same
    command: the pass's count goes on from 100, not from 0."""
    project = project_of(tmp_path)
    out = tmp_path / "out"
    stop = {"TEST_ACT_AT": "0:0:99", "TEST_ACTION": "os.kill(os.getpid(), 15)"}
    run_warm(project, out, 1, *LONG, env=stop, expect=143)
    output = run_warm(project, out, 1, *LONG)
    assert "in epoch 1 after 100 batches" in output, output
    updates = [int(m[1]) for m in PROGRESS.finditer(output)]
    assert updates and updates[0] == 120 and updates == sorted(updates), output
