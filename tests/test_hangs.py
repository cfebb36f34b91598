"""A rank that hangs ends the job within --dist-timeout plus a bounded margin: every
rank prints its stack with its rank in front, the output ends with where each rank
stood and which one the others wait for, and no process is left. The hangs are made
as a user's bug would make them, by replacing one of the five functions: a rank stuck
in compute_loss, a rank that takes a collective the others do not, a rank whose
DataLoader worker is stuck."""

import ast
import re
import time

import pytest

from conftest import (
    TINY,
    bake,
    free_port,
    live_members,
    replace_user_functions,
    started,
)
from test_faults import watch

TIMEOUT = 5  # --dist-timeout, seconds without progress
# Start-up (imports, rendezvous, DDP) and two steps, then the timeout, then the
# report; generous for a loaded 2-core machine, and below the 40 s a collective
# waits (2 x --dist-timeout + 30) before it fails on its own.
LIMIT = 45
ARGS = [*TINY, "--dist-timeout", str(TIMEOUT)]
# With DataLoader workers: the fork server's first start (it imports torch) takes
# seconds on a loaded machine, and a rank waiting for it must not count as stuck.
SLOW_START_ARGS = [*TINY, "--dist-timeout", str(3 * TIMEOUT)]
# Its bound: below the 60 s (twice 15, and 30) after which a collective fails alone.
SLOW_LIMIT = 57

STUCK_IN_COMPUTE_LOSS = """
CALLS = []


def compute_loss(model, batch):
    images, labels = batch
    CALLS.append(1)
    if dist.get_rank() == 1 and len(CALLS) == 3:
        time.sleep(1000)  # stuck
    return F.cross_entropy(model(images), labels), len(labels)
"""

AN_EXTRA_COLLECTIVE = """
CALLS = []


def compute_loss(model, batch):
    images, labels = batch
    CALLS.append(1)
    if dist.get_rank() == 0 and len(CALLS) == 3:
        dist.barrier()  # a collective that rank 1 does not take
    return F.cross_entropy(model(images), labels), len(labels)
"""

# The first lines of build_datasets in the two sources below: random images, split into
# two TensorDatasets, train and val.
MAKE_DATA = """\
    generator = torch.Generator().manual_seed(args.seed)
    images = torch.randn(args.train_size + args.val_size, 3, 16, 16, generator=generator)
    labels = torch.randint(NUM_CLASSES, (len(images),), generator=generator)
    train = TensorDataset(images[: args.train_size], labels[: args.train_size])
    val = TensorDataset(images[args.train_size :], labels[args.train_size :])
"""

STUCK_DATALOADER_WORKER = f"""
class Stalling(torch.utils.data.Dataset):
    \"\"\"Rank 1's DataLoader worker gets stuck on its 20th item (its third batch).\"\"\"

    def __init__(self, data):
        self.data, self.calls = data, 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        self.calls += 1
        if os.environ["RANK"] == "1" and self.calls == 20:
            time.sleep(1000)  # stuck
        return self.data[index]


def build_datasets(args):
{MAKE_DATA}    return Stalling(train), val
"""

STUCK_AS_IT_STARTS = f"""
class StuckOnArrival(torch.utils.data.Dataset):
    \"\"\"Rank 1's DataLoader worker hangs as it starts, before a line of its own (as
    it unpickles its copy of the dataset), as a fork could in Python before 3.12
    (CPython gh-112275).\"\"\"

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.environ["RANK"] == "1":
            time.sleep(1000)


def build_datasets(args):
{MAKE_DATA}    return StuckOnArrival(train), val
"""

HEADLINE = f"hang: no progress for {TIMEOUT} s (--dist-timeout); where each rank stood:"


def hang(tmp_path, source, launcher="torchrun", args=ARGS, **answers):
    project = bake(tmp_path, launcher=launcher, **answers)
    replace_user_functions(project, source)
    out = tmp_path / "out"
    command = ["./run_single.sh", *args, "--output-dir", str(out)]
    code, output, seconds, left = watch(command, project, {"NPROC_PER_NODE": "2"})
    assert code == 1, output
    assert seconds < (LIMIT if args == ARGS else SLOW_LIMIT), output
    assert left == [], output
    assert "Traceback" not in output
    return output


def summary(output):
    """The last lines of the output, from the headline on."""
    lines = output.rstrip("\n").splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith(HEADLINE[:22])]
    assert heads, output
    return lines[heads[-1] + 1 :]


def stack_of(output, rank):
    return "\n".join(
        line for line in output.splitlines() if line.startswith(f"[rank {rank}] ")
    )


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_rank_stuck_in_compute_loss_is_named_with_its_stack(tmp_path, launcher):
    output = hang(tmp_path, STUCK_IN_COMPUTE_LOSS, launcher)
    rank0, rank1, verdict = summary(output)
    if launcher == "torchrun":  # the default project, whose README shows this summary
        (readme,) = tmp_path.glob("*/README.md")
        shown = readme.read_text()
        assert [rank0, rank1, verdict] == [
            line for line in (rank0, rank1, verdict) if f"\n{line}\n" in shown
        ], output
        frames = re.findall(r'main_multi_gpu\.py", (line \d+, in \S+)\n', shown)
        assert len(frames) == 3 and all(frame in output for frame in frames), frames
    # Rank 1 is stuck inside DDP's forward pass, after its broadcast of the buffers:
    # rank 0 goes on to the backward pass, and waits there for the gradients.
    assert re.fullmatch(
        r"  rank 0: backward, line \d+: \(total if ahead is None else total \+ ahead\)"
        r"\.backward\(\)  "
        r"\(waits for the other ranks\)",
        rank0,
    ), output
    assert re.fullmatch(
        r"  rank 1: compute_loss, line \d+: time\.sleep\(1000\)  # stuck  "
        r"\(busy outside any collective\)",
        rank1,
    ), output
    assert verdict == (
        "rank 1: no progress outside a collective, while the others wait; see the "
        "lines above that start with [rank 1]."
    )
    # Rank 1's stack, all threads, main thread first, down to the line.
    stack = stack_of(output, 1)
    assert stack.startswith("[rank 1] thread MainThread (most recent call last):")
    assert "in compute_loss\n[rank 1]     time.sleep(1000)  # stuck" in stack
    assert "thread hang watch" not in stack  # the reporter itself is left out
    assert "in train_pass" in stack_of(output, 0)


def test_a_rank_that_takes_an_extra_collective(tmp_path):
    """The others take the next one: every rank waits, each in a different one."""
    output = hang(tmp_path, AN_EXTRA_COLLECTIVE, save_strategy="final_only")
    rank0, rank1, verdict = summary(output)
    assert re.fullmatch(
        r"  rank 0: compute_loss, line \d+: dist\.barrier\(\)  # a collective that "
        r"rank 1 does not take  \(waits for the other ranks\)",
        rank0,
    ), output
    assert rank1.endswith("(waits for the other ranks)"), output
    assert verdict.startswith("every rank waits in a collective: not all in the same")


def test_a_rank_with_a_stuck_dataloader_worker(tmp_path):
    output = hang(
        tmp_path,
        STUCK_DATALOADER_WORKER,
        args=[*SLOW_START_ARGS, "--num-workers", "1"],
        save_strategy="final_only",
    )
    _, rank1, verdict = summary(output)
    assert re.fullmatch(
        r"  rank 1: pass_data, line \d+: .*\(waits for its DataLoader workers\)", rank1
    ), output
    assert verdict.startswith("rank 1: no progress outside a collective"), output
    # The worker's own stack follows its announcement, down to the stuck line.
    worker = output.partition("[rank 1] DataLoader worker ")[2]
    assert re.search(r"line \d+ in __getitem__", worker), output
    assert "[rank 0] DataLoader worker" not in output  # rank 0 waits on rank 1


def test_a_dataloader_worker_stuck_as_it_starts_is_named_and_not_signalled(tmp_path):
    """A worker without its SIGUSR1 handler yet would die of the signal that asks
    for its stack (and its rank would fail in a traceback): it is named instead."""
    args = [*SLOW_START_ARGS, "--num-workers", "1"]
    output = hang(tmp_path, STUCK_AS_IT_STARTS, args=args, save_strategy="final_only")
    _, rank1, _ = summary(output)
    assert rank1.endswith("(waits for its DataLoader workers)"), output
    workers = [x for x in output.splitlines() if "] DataLoader worker" in x]
    assert len(workers) == 1, output
    assert re.fullmatch(
        r"\[rank 1\] DataLoader worker \d+: stuck before its first line \(no stack\)",
        workers[0],
    ), output


def test_a_hang_across_two_nodes(tmp_path):
    """Two machines (run_multi.sh twice, one process each): node 0's output ends
    with the summary for both ranks; both end, and nothing of either is left."""
    project = bake(
        tmp_path, launcher="spawn", nodes="multi", save_strategy="final_only"
    )
    replace_user_functions(project, STUCK_IN_COMPUTE_LOSS)
    node = {"NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1"}
    node["MASTER_PORT"] = str(free_port())
    command = ["./run_multi.sh", *ARGS, "--output-dir", str(tmp_path / "out")]
    jobs = [(command, {**node, "NODE_RANK": str(rank)}) for rank in (0, 1)]
    with started(jobs, project) as (_, nodes):
        codes = [proc.wait(timeout=LIMIT) for proc in nodes]
        time.sleep(5)
        left = [live_members(proc.pid) for proc in nodes]
    output0, output1 = (proc.output for proc in nodes)
    assert codes == [1, 1], (output0, output1)
    assert left == [[], []], (output0, output1)
    assert summary(output0)[1].startswith("  rank 1: compute_loss"), output0
    assert "[rank 1] thread MainThread" in output1
    assert HEADLINE not in output1  # rank 0 summarizes


COLLECTIVE_CALLS = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor"}


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_every_host_read_after_a_collective_is_named_a_wait(tmp_path, parallelism):
    """A stack stopped in a function that reads a collective's result on the host
    (.item(), .tolist()) is reported as waiting for the others (HOST_SYNCS), not as
    busy: every such function of the generated file is listed, and only those, with
    to_device, whose copy to the GPU waits for the work queued before it (NCCL's),
    and train_pass, which reads the gradients' reduction (at a stream's end)."""
    project = bake(tmp_path, parallelism=parallelism)
    tree = ast.parse((project / "main_multi_gpu.py").read_text())
    waits = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            called = {
                call.func.attr
                for call in ast.walk(node)
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            }
            if called & COLLECTIVE_CALLS and called & {"item", "tolist"}:
                waits.add(node.name)
    listed = set()  # HOST_SYNCS = {...}, then HOST_SYNCS |= {...}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if ast.unparse(target) == "HOST_SYNCS":
                listed |= ast.literal_eval(node.value)
    assert waits | {"to_device", "train_pass"} == listed
