"""Streams read by shard (guarantee 14): a training stream with n_shards and shard()
is read as its shards, each by one reader (a process's DataLoader worker), so that
every item of a pass is read once in all, while a global batch holds the same items
for any number of processes and workers (guarantee 8):

- 16 shards of uneven length (3 to 18 rows) that note every row they read: each
  row is read once a pass on 2 processes x 2 workers, on 1 x 2 and on 1 without
  workers, and the three runs end with the same weights and validation rows;
- stopped mid-pass on 2 processes x 2 workers, resumed on 1 process: each shard's
  state goes to the one reader that now owns it (or, without state_dict(), each
  shard is read again up to there, once), and the run ends as one never stopped;
- a process killed without a signal after a periodic save, then the same command
  again, ends as a run never killed;
- a Hugging Face `IterableDataset` streamed from local JSON files, with a .map()
  that counts its calls: each row mapped once a pass, and 2 x 8 equals 1 x 16;
- dict rows with a string: each worker's part crosses collated, the training process
  joins the parts, and 2 processes x 2 workers equal 1 without workers.

A lost host on an elastic job that trains on this stream: test_elastic_hosts.py."""

import json

import pytest
import torch

from conftest import (
    bake,
    edit,
    max_difference,
    metrics,
    replace_user_functions,
    run_warm,
)
from test_faults import watch
from test_streams import final, stream_project
from test_workbench import REGRESSION

# 16 files' worth of rows, file f holding 3 + f of them: 168 a pass. Placed
# round-robin by shard, the last (18 rows) ends the pass at place 17 x 16 + 15: 288
# places, 18 updates of 16.
SHARDS = (
    '''
class Shards(torch.utils.data.IterableDataset):
    """Rows (12 features, a target from a fixed linear rule plus noise) in `files`,
    file f holding 3 + f rows in an order shuffled anew each pass (set_epoch); split
    by file. Each row read is noted in READ_LOG (seed, pass, file, row)."""

    def __init__(self, seed, files):
        self.seed, self.files, self.epoch = seed, files, 0

    @property
    def n_shards(self):
        return len(self.files)

    def shard(self, num_shards, index):
        return type(self)(self.seed, self.files[index::num_shards])

    def set_epoch(self, epoch):
        self.epoch = epoch

    def rows(self):
        weights = torch.randn(12, 1, generator=torch.Generator().manual_seed(0))
        for f in self.files:
            generator = torch.Generator().manual_seed(100 * self.seed + f)
            x = torch.randn(3 + f, 12, generator=generator)
            y = x @ weights + 0.1 * torch.randn(3 + f, 1, generator=generator)
            order = torch.Generator().manual_seed(1000 * self.epoch + f)
            for i in torch.randperm(3 + f, generator=order).tolist():
                yield f, i, x[i], y[i]

    def __iter__(self):
        for f, i, x, y in self.rows():
            self.note(f, i)
            yield x, y

    def note(self, f, i):
        if "READ_LOG" in os.environ:
            with open(os.environ["READ_LOG"], "a") as log:
                print(self.seed, self.epoch, f, i, file=log)


def build_datasets(args):
    return Shards(args.seed, tuple(range(16))), Shards(args.seed + 1, tuple(range(8)))


def build_model(args):
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 1))
'''
    + REGRESSION
)

# The same shards, able to say where they are and to go back there: a shard
# started from a state notes it in SEEK_LOG (its first file, the rows it skips).
SEEKABLE = SHARDS.replace(
    """    def __iter__(self):
        for f, i, x, y in self.rows():
            self.note(f, i)
            yield x, y
""",
    """    def set_epoch(self, epoch):
        self.epoch, self.done = epoch, 0

    def __iter__(self):
        start = self.done
        if start and "SEEK_LOG" in os.environ:
            with open(os.environ["SEEK_LOG"], "a") as log:
                print(self.files[0], start, file=log)
        for j, (f, i, x, y) in enumerate(self.rows()):
            if j >= start:  # (a real stream would seek)
                self.done = j + 1
                self.note(f, i)
                yield x, y

    def state_dict(self):
        return {"epoch": self.epoch, "done": self.done}

    def load_state_dict(self, state):
        assert state["epoch"] == self.epoch
        self.done = state["done"]
""",
).replace(
    "        self.seed, self.files, self.epoch = seed, files, 0",
    "        self.seed, self.files, self.epoch, self.done = seed, files, 0, 0",
)

assert "def state_dict" in SEEKABLE and "self.done = seed, files, 0, 0" in SEEKABLE

PASS = 168  # rows a pass
UPDATES = 18  # updates of 16 a pass
RUN = ["--lr", "0.01", "--max-steps", str(2 * UPDATES), "--eval-every", "9"]
# 4 evaluations (updates 9, 18, 27, 36) of the 8 validation shards, each row once.
VALIDATED = sorted((f, i) for f in range(8) for i in range(3 + f) for _ in range(4))
SIGTERM = "os.killpg(os.getpgrp(), signal.SIGTERM)"
KILL = "os.kill(os.getpid(), signal.SIGKILL)"


def reads(log, seed=0):
    """{pass: [(file, row), ...]} of the training stream (seed 0), as read."""
    found = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        s, epoch, f, i = map(int, line.split())
        if s == seed:
            found.setdefault(epoch, []).append((f, i))
    return found


def every_row_once(rows):
    return sorted(rows) == sorted((f, i) for f in range(16) for i in range(3 + f))


def test_each_row_is_read_once_a_pass_for_any_processes_and_workers(tmp_path):
    project = stream_project(tmp_path, "shards", SHARDS, save_strategy="final_only")
    runs = {"2x2": (2, 8, 2), "1x2": (1, 16, 2), "1x0": (1, 16, 0)}
    for name, (nproc, batch, workers) in runs.items():
        log = tmp_path / f"{name}.log"
        args = [*RUN, "--batch-size", str(batch), "--num-workers", str(workers)]
        output = run_warm(
            project, tmp_path / name, nproc, *args, env={"READ_LOG": str(log)}
        )
        passes = reads(log)
        assert sorted(passes) == [0, 1], name
        for rows in passes.values():  # once each, in all: no reader reads all
            assert len(rows) == PASS and every_row_once(rows), name
        assert sorted(reads(log, seed=1)[0]) == VALIDATED, name
        if workers:  # 16 shards for 2 or 4 readers: none idle, none reads all
            assert "note: the training stream" not in output, output
    weights = [final(tmp_path / name) for name in runs]
    assert max_difference(weights[0], weights[1]) < 1e-5
    assert max_difference(weights[0], weights[2]) < 1e-5
    rows = {name: metrics(tmp_path / name) for name in runs}
    # An evaluation at updates 9 and 27, and at each pass's end: 18 updates each.
    assert [row["step"] for row in rows["2x2"]] == ["9", "18", "27", "36"]
    assert [row["epoch"] for row in rows["2x2"]] == ["1", "1", "2", "2"]
    for key in ("train_loss", "val_loss", "val_mae"):
        values = [[float(row[key]) for row in rows[name]] for name in runs]
        assert values[1] == pytest.approx(values[0], abs=1e-5), key
        assert values[2] == pytest.approx(values[0], abs=1e-5), key


def test_fsdp2_reads_each_row_once_and_evaluates_exactly(tmp_path):
    """parallelism=fsdp2, whose evaluation takes every forward on every process: a
    process whose validation shards ran out takes stand-ins until none has more."""
    project = stream_project(tmp_path, "fsdp2", SHARDS, parallelism="fsdp2")
    log = tmp_path / "reads.log"
    runs = {"2x2": (2, 8, 2), "1x0": (1, 16, 0)}
    for name, (nproc, batch, workers) in runs.items():
        args = [*RUN, "--batch-size", str(batch), "--num-workers", str(workers)]
        run_warm(project, tmp_path / name, nproc, *args, env={"READ_LOG": str(log)})
        assert all(every_row_once(rows) for rows in reads(log).values()), name
        assert sorted(reads(log, seed=1)[0]) == VALIDATED, name
        log.unlink()
    assert max_difference(final(tmp_path / "2x2"), final(tmp_path / "1x0")) < 1e-5
    rows = [[row["val_loss"] for row in metrics(tmp_path / name)] for name in runs]
    assert [float(v) for v in rows[0]] == pytest.approx([float(v) for v in rows[1]])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The final weights of the run that never stopped: 2 processes x batch 8,
    without DataLoader workers (the runs compared with it have some)."""
    root = tmp_path_factory.mktemp("straight")
    project = stream_project(root, "shards", SHARDS, save_strategy="last")
    run_warm(project, root / "out", 2, *RUN, "--batch-size", "8", "--num-workers", "0")
    return final(root / "out")


@pytest.mark.xdist_group("shards_straight")
def test_the_pass_end_reaches_every_rank_beside_huge_weights(tmp_path, straight):
    """n of 2**28 a row (the token count of a large batch, say): whether any rank has
    rows left travels apart from the weights, so float32 cannot round it away (the
    ranks would end the pass apart and fail in the next collective), and the run
    trains as with n = 1 (the mean loss is the same)."""
    project = stream_project(tmp_path, "shards", SHARDS, save_strategy="last")
    edit(
        project,
        "F.mse_loss(model(x), y), len(y)\n",
        "F.mse_loss(model(x), y), len(y) * 2.0**28\n",
    )
    run_warm(
        project, tmp_path / "out", 2, *RUN, "--batch-size", "8", "--num-workers", "0"
    )
    assert max_difference(final(tmp_path / "out"), straight) < 1e-6


@pytest.mark.xdist_group("shards_straight")
def test_each_shard_resumes_from_its_state_on_another_number_of_processes(
    tmp_path, straight
):
    """Stopped after update 9 of pass 1 on 2 processes x 2 workers, resumed on 1
    process without workers: its one reader loads the states of the shards not yet
    read to their end, and reads none of the others."""
    project = stream_project(tmp_path, "seek", SEEKABLE, save_strategy="last")
    out, seeks, log = tmp_path / "out", tmp_path / "seek.log", tmp_path / "read.log"
    env = {"SEEK_LOG": str(seeks), "READ_LOG": str(log)}
    two = [*RUN, "--batch-size", "8", "--num-workers", "2"]
    stop = {**env, "TEST_ACTION": SIGTERM, "TEST_ACT_AT": "0:0:8"}
    output = run_warm(project, out, 2, *two, env=stop, expect=143)
    assert "preempted: saved" in output and "in epoch 1 after 9 batches" in output
    log.unlink()
    one = [*RUN, "--batch-size", "8", "--num-workers", "0"]
    output = run_warm(project, out, 1, *one, env=env)
    assert "global batch 16 kept: 1 process x batch 8 x grad-accum 2" in output
    assert "reads its first" not in output and "read again" not in output
    # 9 updates: 144 places, 9 of each shard's rows; files 0 to 6 (3 to 9 rows) are
    # done, the others start at row 9.
    assert sorted(seeks.read_text().split("\n")[:-1]) == sorted(
        f"{f} 9" for f in range(7, 16)
    )
    rows = reads(log)  # of the resumed run: the rest of pass 1, and pass 2
    assert len(rows[0]) == len(set(rows[0])) == PASS - (3 + 4 + 5 + 6 + 7 + 8 + 90)
    assert every_row_once(rows[1])
    assert max_difference(final(out), straight) < 1e-5


@pytest.mark.xdist_group("shards_straight")
def test_each_shard_without_state_is_read_again_by_one_reader(tmp_path, straight):
    """The spawn launcher; stopped after update 9 of pass 1 on 2 processes x 2
    workers, resumed on 1 process with 2 workers."""
    project = stream_project(
        tmp_path, "shards", SHARDS, save_strategy="last", launcher="spawn"
    )
    out, log = tmp_path / "out", tmp_path / "read.log"
    args = [*RUN, "--batch-size", "8", "--num-workers", "2"]
    stop = {"TEST_ACTION": SIGTERM, "TEST_ACT_AT": "0:0:8", "READ_LOG": str(log)}
    run_warm(project, out, 2, *args, env=stop, expect=143)
    first = reads(log)[0]
    log.unlink()
    output = run_warm(project, out, 1, *args, env={"READ_LOG": str(log)})
    line = (
        "resume: the training stream has no state_dict(), so each of its 16 shards "
        "is read again, by one reader, to get there"
    )
    assert output.count(line) == 1, output
    # The resumed run reads pass 1's shards not read to their end (files 7 to 15)
    # once more, whole (up to where they stopped, and on), and pass 2 once.
    again = reads(log)
    assert sorted(again[0]) == [(f, i) for f in range(7, 16) for i in range(3 + f)]
    assert every_row_once(again[1])
    assert len(first) < PASS
    assert max_difference(final(out), straight) < 1e-5


@pytest.mark.xdist_group("shards_straight")
def test_a_shard_reader_killed_without_warning_resumes_from_its_last_save(
    tmp_path, straight
):
    project = stream_project(tmp_path, "seek", SEEKABLE, save_strategy="every_epoch")
    out = tmp_path / "out"
    args = [*RUN, "--batch-size", "8", "--num-workers", "2", "--save-every", "4"]
    command = ["./run_single.sh", *args, "--output-dir", str(out)]
    # After the save at update 8, rank 1 killed at update 11.
    kill = {"NPROC_PER_NODE": "2", "TEST_ACT_AT": "1:0:10", "TEST_ACTION": KILL}
    code, output, _, left = watch(command, project, kill)
    assert code == 1 and left == [], output
    assert "error: rank 1 died (SIGKILL)" in output
    output = run_warm(project, out, 2, *args)
    assert "in epoch 1 after 8 batches" in output, output
    assert max_difference(final(out), straight) < 1e-5


HUGGING_FACE = """
import glob

from datasets import load_dataset


def build_datasets(args):
    \"\"\"data/train-*.jsonl and data/val.jsonl, streamed by Hugging Face datasets,
    through a .map() that notes each row it sees in MAP_LOG.\"\"\"
    files = {"train": sorted(glob.glob("data/train-*")), "val": sorted(glob.glob("data/val-*"))}
    streams = load_dataset("json", data_files=files, streaming=True)
    train = streams["train"].map(Noted()).shuffle(seed=args.seed, buffer_size=4)
    return train.with_format("torch"), streams["val"].map(Noted()).with_format("torch")


class Noted:
    def __call__(self, row):
        if "MAP_LOG" in os.environ:
            with open(os.environ["MAP_LOG"], "a") as log:
                print(row["id"], file=log)
        return row


def build_model(args):
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 1))


def compute_loss(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"]), len(batch["y"])


def compute_metrics(model, batch):
    loss = F.mse_loss(model(batch["x"]), batch["y"], reduction="sum")
    return {"loss": (loss, len(batch["y"]))}
"""


def test_a_hugging_face_stream_is_mapped_once_a_pass_and_exact(tmp_path):
    """4 JSON Lines files of 9, 13, 6 and 11 rows, shuffled (a buffer of 4) anew each
    pass: 4 shards, one for each of 2 processes x 2 workers; 50 places a pass, 4
    updates of 16. Two passes, on 2 processes x batch 8 and on 1 x 16. Validation:
    2 files, one for each process."""
    project = bake(tmp_path / "hf", save_strategy="final_only")
    replace_user_functions(project, HUGGING_FACE)
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(12, 1, generator=generator)
    (project / "data").mkdir()
    ids = iter(range(1000))
    sizes = {"train-0": 9, "train-1": 13, "train-2": 6, "train-3": 11}
    for name, count in {**sizes, "val-0": 9, "val-1": 8}.items():
        x = torch.randn(count, 12, generator=generator)
        y = x @ weights
        rows = [
            {"id": next(ids), "x": a.tolist(), "y": b.tolist()}
            for a, b in zip(x, y, strict=True)
        ]
        text = "".join(json.dumps(row) + "\n" for row in rows)
        (project / "data" / f"{name}.jsonl").write_text(text)
    args = ["--lr", "0.05", "--max-steps", "8", "--eval-every", "2"]
    runs = {"2x2": (2, 8, 2), "1x0": (1, 16, 0)}
    for name, (nproc, batch, workers) in runs.items():
        log = tmp_path / f"{name}.log"
        run_args = [*args, "--batch-size", str(batch), "--num-workers", str(workers)]
        run_warm(project, tmp_path / name, nproc, *run_args, env={"MAP_LOG": str(log)})
        mapped = [int(line) for line in log.read_text().split()]
        train = sorted(i for i in mapped if i < 39)
        assert train == sorted(list(range(39)) * 2), name  # once a pass each
        # Validation: 17 rows, at updates 2, 4 (a pass's end), 6 and 8.
        assert sorted(i for i in mapped if i >= 39) == sorted(list(range(39, 56)) * 4)
    assert max_difference(final(tmp_path / "2x2"), final(tmp_path / "1x0")) < 1e-5
    rows = {name: metrics(tmp_path / name) for name in runs}
    assert [row["step"] for row in rows["2x2"]] == ["2", "4", "6", "8"]
    for key in ("train_loss", "val_loss"):
        values = [[float(row[key]) for row in rows[name]] for name in runs]
        assert values[1] == pytest.approx(values[0], abs=1e-5), key


# The same rows as dicts with a string beside the tensors: each DataLoader worker
# collates its part (the strings become a list), the training process joins the
# parts. compute_loss checks that every string still sits beside its own row.
NAMED = (
    SHARDS.replace(
        """            self.note(f, i)
            yield x, y
""",
        """            self.note(f, i)
            yield {"x": x, "y": y, "name": f"{y.item():.6f}"}
""",
    )
    + """

def compute_loss(model, batch):
    named = torch.tensor([float(name) for name in batch["name"]])
    if not torch.allclose(named, batch["y"].flatten(), atol=1e-5):
        raise ValueError("a row's name is not beside its row")
    return F.mse_loss(model(batch["x"]), batch["y"]), len(batch["y"])


def compute_metrics(model, batch):
    error = model(batch["x"]) - batch["y"]
    return {"loss": (error.pow(2).sum(), len(batch["y"]))}
"""
)


def test_workers_parts_with_strings_join_into_one_micro_batch(tmp_path):
    """Dict rows with a string: the parts of 2 processes x 2 workers, joined, train
    exactly as 1 process without workers, each string beside its row."""
    project = stream_project(tmp_path, "named", NAMED, save_strategy="final_only")
    runs = {"2x2": (2, 8, 2), "1x0": (1, 16, 0)}
    for name, (nproc, batch, workers) in runs.items():
        args = [*RUN, "--batch-size", str(batch), "--num-workers", str(workers)]
        run_warm(project, tmp_path / name, nproc, *args)
    assert max_difference(final(tmp_path / "2x2"), final(tmp_path / "1x0")) < 1e-5
    rows = [[float(r["val_loss"]) for r in metrics(tmp_path / name)] for name in runs]
    assert rows[0] == pytest.approx(rows[1], abs=1e-5) and len(rows[0]) == 4
