"""Long runs and streams: build_datasets() may return IterableDatasets (here without
a length, 37 items, which no batch size divides), runs are sized in optimizer updates
(--max-steps), evaluated (--eval-every) and saved (--save-every) every N updates.

- W ranks x batch B equal 1 rank x W*B, with 2 DataLoader workers per rank, weights
  and exact validation metrics (guarantee 8);
- every item of a pass is used once across ranks and workers, and an end of data
  that leaves one rank nothing neither hangs nor weighs (guarantee 8);
- a stream resumes mid-pass on another number of ranks and workers, twice in a row;
  one with state_dict()/load_state_dict() starts there without reading the pass
  again, one without says it reads up to there (guarantees 5 and 8);
- a worker killed without a signal after a periodic save, then the same command
  again, ends like a run never killed, having repeated fewer than --save-every
  updates: a stream and a map-style set (guarantee 9)."""

import pytest
import torch

from conftest import (
    act_after_step,
    bake,
    load_module,
    load_weights,
    max_difference,
    metrics,
    replace_user_functions,
    run_warm,
)
from test_faults import watch
from test_workbench import REGRESSION

ROWS = (
    '''
class Rows(torch.utils.data.IterableDataset):
    """SIZE rows (12 features, a target from a fixed linear rule plus noise), in an
    order shuffled anew each pass (set_epoch); no __len__."""

    def __init__(self, size, seed):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 12, generator=generator)
        weights = torch.randn(12, 1, generator=torch.Generator().manual_seed(0))
        self.y = self.x @ weights + 0.1 * torch.randn(size, 1, generator=generator)
        self.seed, self.epoch, self.start = seed, 0, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        shuffle = torch.Generator().manual_seed(self.seed + self.epoch)
        for i in torch.randperm(len(self.x), generator=shuffle).tolist():
            yield self.x[i], self.y[i]


def build_datasets(args):
    return Rows(37, args.seed), Rows(23, args.seed + 1)


def build_model(args):
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 1))
'''
    + REGRESSION
)

# The same stream, able to say where it is and to go back there: a resume loads the
# state, and each reader that starts from one notes where (SEEK_LOG).
SEEKABLE = ROWS.replace(
    """    def __iter__(self):
        shuffle = torch.Generator().manual_seed(self.seed + self.epoch)
        for i in torch.randperm(len(self.x), generator=shuffle).tolist():
            yield self.x[i], self.y[i]
""",
    """    def __iter__(self):
        shuffle = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.x), generator=shuffle).tolist()
        if self.start and len(self.x) == 37:
            with open(os.environ["SEEK_LOG"], "a") as log:
                print(self.epoch, self.start, file=log)
        for self.start in range(self.start, len(order)):
            yield self.x[order[self.start]], self.y[order[self.start]]
        self.start = 0

    def state_dict(self):
        return {"epoch": self.epoch, "start": self.start + 1}

    def load_state_dict(self, state):
        assert state["epoch"] == self.epoch
        self.start = state["start"]
""",
)

# Items that are their own numbers, and a model with one weight per item, from 0:
# plain SGD at lr 1 moves an item's weight by -1 / (samples of its update) for each
# time it is trained, and not at all for a stand-in.
PROBE = """
class Numbers(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from torch.arange(33)


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(33))

    def forward(self, numbers):
        return self.weight[numbers]


def build_datasets(args):
    return Numbers(), Numbers()


def build_model(args):
    return Probe()


def build_optimizer(model, args, total_updates):
    return torch.optim.SGD(model.parameters(), lr=1.0), None


def compute_loss(model, batch):
    return model(batch).mean(), len(batch)


def compute_metrics(model, batch):
    return {"loss": (model(batch).sum(), len(batch))}
"""

# 37 items, 16 a global batch: 3 updates a pass (16, 16, 5); 12 updates: 4 passes.
RUN = ["--lr", "0.05", "--max-steps", "12", "--save-every", "2"]
SIGTERM = "os.killpg(os.getpgrp(), signal.SIGTERM)"
NO_WORKERS = ("--num-workers", "0")  # where DataLoader workers are not the point


def stream_project(tmp_path, name, source, **answers):
    project = bake(tmp_path / name, **answers)
    replace_user_functions(project, source)
    act_after_step(project)
    return project


def final(out_dir):
    return load_weights(out_dir / "model_final.pt")


def test_a_stream_on_two_processes_equals_one_with_twice_the_batch(tmp_path):
    project = stream_project(tmp_path, "rows", ROWS, save_strategy="best")
    args = ["--lr", "0.05", "--max-steps", "6", "--eval-every", "2"]
    args += ["--num-workers", "2"]
    output = run_warm(project, tmp_path / "w2", 2, *args, "--batch-size", "8")
    # No shard(): each of 2 processes x 2 workers reads it all, and one line says so.
    line = "note: the training stream has no shard(), 4 readers: each reads all of it"
    assert output.count(line) == 1, output
    run_warm(project, tmp_path / "w1", 1, *args, "--batch-size", "16")
    assert max_difference(final(tmp_path / "w2"), final(tmp_path / "w1")) < 1e-5

    # A row at every 2nd update and at each pass's end (3 updates a pass).
    rows = {world: metrics(tmp_path / f"w{world}") for world in (1, 2)}
    assert [row["step"] for row in rows[2]] == ["2", "3", "4", "6"]
    assert [row["epoch"] for row in rows[2]] == ["1", "1", "2", "2"]
    for one, two in zip(rows[1], rows[2], strict=True):
        for key in ("train_loss", "val_loss", "val_mae"):
            assert float(one[key]) == pytest.approx(float(two[key]), abs=1e-5), key
    # best: the evaluation with the lowest validation loss, of all rows.
    losses = {int(row["step"]): float(row["val_loss"]) for row in rows[2]}
    best = load_weights(tmp_path / "w2" / "checkpoint_best.pt")
    assert best["step"] == min(losses, key=losses.get)

    # Exact: the final row is the mean over the whole validation stream, worked out
    # here in one process from the saved weights.
    module = load_module(project)
    _, val_set = module.build_datasets(module.parse_args([]))
    model = module.build_model(None)
    model.load_state_dict(final(tmp_path / "w2"))
    x, y = zip(*val_set, strict=True)
    with torch.no_grad():
        error = model(torch.stack(x)) - torch.stack(y)
    assert float(rows[2][-1]["val_loss"]) == pytest.approx(
        error.pow(2).mean().item(), abs=1e-5
    )
    assert float(rows[2][-1]["val_mae"]) == pytest.approx(
        error.abs().mean().item(), abs=1e-5
    )


def test_every_item_of_a_pass_is_used_once_and_an_uneven_end_does_not_hang(tmp_path):
    """33 items, 2 ranks x batch 4 x 2 workers each: 4 updates of 8 items, then one
    of a single item, which leaves rank 1 nothing: it takes a stand-in step that
    moves no weight, and the job ends at once, leaving no process."""
    project = bake(tmp_path, save_strategy="final_only")
    replace_user_functions(project, PROBE)
    out = tmp_path / "out"
    args = ["--max-steps", "5", "--batch-size", "4", "--num-workers", "2"]
    command = ["./run_single.sh", *args, "--output-dir", str(out)]
    code, output, seconds, left = watch(command, project, {"NPROC_PER_NODE": "2"})
    assert code == 0 and left == [] and seconds < 60, output
    moved = sorted((-final(out)["weight"]).tolist())
    assert moved == pytest.approx([1 / 8] * 32 + [1.0], abs=1e-6)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The final weights of the run that never stopped: 2 ranks x batch 8, without
    DataLoader workers (the runs compared with it have some)."""
    root = tmp_path_factory.mktemp("straight")
    project = stream_project(root, "rows", ROWS, save_strategy="last")
    run_warm(project, root / "out", 2, *RUN, "--batch-size", "8", *NO_WORKERS)
    return final(root / "out")


@pytest.mark.xdist_group("streams_straight")
def test_a_seekable_stream_resumes_mid_pass_on_other_ranks_twice(tmp_path, straight):
    """2 ranks (2 workers each), stopped after update 2 (32 items into pass 1); 1
    rank (no workers), stopped after update 4 (16 items into pass 2); 2 ranks again
    to the end. Each resumed reader loads the stream's state and starts there."""
    project = stream_project(tmp_path, "seek", SEEKABLE, save_strategy="last")
    out, log = tmp_path / "out", tmp_path / "seek.log"
    env = {"TEST_ACTION": SIGTERM, "SEEK_LOG": str(log)}
    two = [*RUN, "--batch-size", "8", "--num-workers", "2"]
    one = [*RUN, "--batch-size", "8", "--num-workers", "0"]
    output = run_warm(
        project, out, 2, *two, env={**env, "TEST_ACT_AT": "0:0:0"}, expect=143
    )
    assert "preempted: saved" in output and "in epoch 1 after 2 batches" in output
    output = run_warm(
        project, out, 1, *one, env={**env, "TEST_ACT_AT": "0:1:1"}, expect=143
    )
    assert "resumed from" in output and "in epoch 1 after 4 batches" in output
    assert "global batch 16 kept: 1 process x batch 8 x grad-accum 2" in output
    assert "in epoch 2 after 2 batches" in output  # stopped again
    assert log.read_text() == "0 32\n"  # the one reader started at item 32
    output = run_warm(project, out, 2, *two, env=env)
    assert "in epoch 2 after 1 batch" in output and "reads its first" not in output
    # 2 ranks x 2 workers, each at item 16 of pass 2.
    assert log.read_text() == "0 32\n" + "1 16\n" * 4
    assert max_difference(final(out), straight) < 1e-5


@pytest.mark.xdist_group("streams_straight")
def test_a_stream_without_state_reads_up_to_where_it_stopped(tmp_path, straight):
    """The spawn launcher (the other tests: torchrun), 2 ranks then 1."""
    project = stream_project(
        tmp_path, "rows", ROWS, save_strategy="final_only", launcher="spawn"
    )
    out = tmp_path / "out"
    two = [*RUN, "--batch-size", "8"]  # 2 DataLoader workers a rank
    # At the first update, as DataLoader workers may still be starting.
    env = {"TEST_ACTION": SIGTERM, "TEST_ACT_AT": "0:0:0"}
    run_warm(project, out, 2, *two, env=env, expect=143)
    output = run_warm(project, out, 1, *two)
    line = (
        "resume: the training stream has no state_dict(), so every reader reads its "
        "first 32 items again to get there"
    )
    assert output.count(line) == 1, output
    assert max_difference(final(out), straight) < 1e-5


KILL = "os.kill(os.getpid(), signal.SIGKILL)"  # no signal handler runs


@pytest.mark.xdist_group("streams_straight")
def test_a_stream_killed_without_warning_resumes_from_its_last_save(tmp_path, straight):
    project = stream_project(tmp_path, "seek", SEEKABLE, save_strategy="every_epoch")
    out = tmp_path / "out"
    args = [*RUN[:-1], "4", "--batch-size", "8", "--num-workers", "2"]
    env = {"SEEK_LOG": str(tmp_path / "seek.log")}
    command = ["./run_single.sh", *args, "--output-dir", str(out)]
    # After the save at update 4, rank 1 killed at update 5 (pass 2, its 2nd step).
    kill = {"NPROC_PER_NODE": "2", "TEST_ACT_AT": "1:1:1", "TEST_ACTION": KILL}
    code, output, _, left = watch(command, project, {**kill, **env})
    assert code == 1 and left == [], output
    assert "error: rank 1 died (SIGKILL)" in output
    output = run_warm(project, out, 2, *args, env=env)
    # Update 4's save, 16 items into pass 2: only update 5 is trained again.
    assert "in epoch 2 after 1 batch" in output, output
    assert max_difference(final(out), straight) < 1e-5


LINEAR_DECAY = '''
def build_optimizer(model, args, total_updates):
    """SGD with a learning rate that falls linearly to 0 at total_updates."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda update: 1 - update / total_updates
    )
    return optimizer, schedule
'''


def test_a_map_style_run_killed_without_warning_resumes_from_its_last_save(tmp_path):
    """The default data (64 samples: 4 updates a pass), 10 updates, a save every 3
    (final_only: no other save); rank 1 killed after update 5, the same command
    again: the weights of a run never killed, and the schedule ends at --max-steps."""
    project = bake(tmp_path, save_strategy="final_only")
    replace_user_functions(project, LINEAR_DECAY)
    act_after_step(project)
    args = ["--max-steps", "10", "--save-every", "3", "--train-size", "64"]
    args += ["--batch-size", "8", "--num-workers", "0"]
    run_warm(project, tmp_path / "straight", 2, *args)
    out = tmp_path / "out"
    command = ["./run_single.sh", *args, "--output-dir", str(out)]
    # Rank 1 killed after update 5 (pass 2, its 1st step).
    kill = {"NPROC_PER_NODE": "2", "TEST_ACT_AT": "1:1:0", "TEST_ACTION": KILL}
    code, output, _, left = watch(command, project, kill)
    assert code == 1 and left == [], output
    assert "error: rank 1 died (SIGKILL)" in output
    output = run_warm(project, out, 2, *args)
    # Update 3's save: updates 4 and 5 are trained again (fewer than 3).
    assert "resumed from" in output and "in epoch 1 after 3 batches" in output
    assert max_difference(final(out), final(tmp_path / "straight")) < 1e-6
    same = ("epoch", "step", "train_loss", "val_loss", "val_acc", "lr")
    rows = [[row[key] for key in same] for row in metrics(out)]
    assert rows == [
        [row[key] for key in same] for row in metrics(tmp_path / "straight")
    ]
    assert [row[1] for row in rows] == ["4", "8", "10"]  # two passes' ends, the end
    assert float(rows[-1][-1]) == pytest.approx(0.0, abs=1e-9)  # the schedule's end
    assert not (out / "checkpoint_last.pt").exists()  # final_only keeps none


def readme_block(project, marker):
    """The Python block of the generated README that contains `marker`."""
    parts = (project / "README.md").read_text().split("```python\n")[1:]
    blocks = [part.partition("```")[0] for part in parts]  # not the prose after it
    (block,) = [b for b in blocks if marker in b]
    return block


TABULAR = """
def build_model(args):
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def compute_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y), len(y)


def compute_metrics(model, batch):
    x, y = batch
    logits = model(x)
    return {
        "loss": (F.cross_entropy(logits, y, reduction="sum"), len(y)),
        "acc": ((logits.argmax(1) == y).sum(), len(y)),
    }
"""


def test_the_readme_stream_examples_train_and_resume(tmp_path):
    """The README's two streams, as written there: the endless generator trains with
    --max-steps (under FSDP2, whose evaluation pads the validation stream's shares);
    the shard files resume mid-pass on another number of processes from their state,
    without reading the pass again, and end like a run never stopped (which had no
    DataLoader workers; the stopped and resumed runs have 2 a process)."""
    project = bake(tmp_path / "synthetic", parallelism="fsdp2")
    replace_user_functions(project, readme_block(project, "class Synthetic("))
    out = tmp_path / "synthetic_out"
    run_warm(project, out, 2, "--max-steps", "4", "--eval-every", "2", *NO_WORKERS)
    assert [row["step"] for row in metrics(out)] == ["2", "4"]

    project = bake(tmp_path / "shards")
    replace_user_functions(project, readme_block(project, "class Shards(") + TABULAR)
    act_after_step(project)
    generator = torch.Generator().manual_seed(0)
    (project / "data").mkdir()
    for name, lines in (("train-0", 15), ("train-1", 11), ("train-2", 13), ("val", 17)):
        x = torch.randn(lines, 12, generator=generator)
        rows = [[*map(float, row), int(row[:3].argmax())] for row in x]
        text = "".join(",".join(map(str, row)) + "\n" for row in rows)
        (project / "data" / f"{name}.csv").write_text(text)
    # 39 lines, 16 a global batch: 3 updates a pass.
    args = ["--lr", "0.2", "--max-steps", "9", "--save-every", "1"]
    run_warm(project, tmp_path / "straight", 2, *args, "--batch-size", "8", *NO_WORKERS)
    stop = {"TEST_ACTION": SIGTERM, "TEST_ACT_AT": "0:1:0"}
    out = tmp_path / "out"
    output = run_warm(project, out, 2, *args, "--batch-size", "8", env=stop, expect=143)
    assert "in epoch 2 after 1 batch" in output
    # 3 files for 2 processes x 2 workers: read by file, one reader idle.
    assert (
        output.count("note: the training stream has 3 shards, 4 readers: 1 idle") == 1
    )
    output = run_warm(project, out, 1, *args, "--batch-size", "8")
    assert "in epoch 2 after 2 batches" in output and "reads its first" not in output
    assert max_difference(final(out), final(tmp_path / "straight")) < 1e-5
