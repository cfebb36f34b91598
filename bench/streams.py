"""The generated project with its data as a stream, for run.py's `generated_stream`
contender, and what a resume costs on a stream that cannot seek.

The stream project is the generated main_multi_gpu.py with one change: the default
build_datasets() is renamed map_style_datasets(), and a new build_datasets() returns
its training set as an IterableDataset (no length, no random access; the same shuffle
seed and epoch as DistributedSampler's). Model, loss, loop and everything else are the
generated code, so generated_stream / generated measures the stream path alone.

    python3 bench/streams.py [--project DIR]   # the resume cost, printed and saved
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent

AS_STREAM = '''

class AsStream(IterableDataset):
    """A map-style dataset read as a stream: in a seeded order, new each pass."""

    def __init__(self, data, seed):
        self.data, self.seed, self.epoch = data, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        shuffle = torch.Generator().manual_seed(self.seed + self.epoch)
        for i in torch.randperm(len(self.data), generator=shuffle).tolist():
            yield self.data[i]


def build_datasets(args):
    train_set, val_set = map_style_datasets(args)
    return AsStream(train_set, args.seed), val_set
'''
GUARD = '\n\nif __name__ == "__main__":'


def make_stream_project(project, out_dir):
    """A copy of the project's main_multi_gpu.py whose training data is a stream."""
    source = (Path(project) / "main_multi_gpu.py").read_text()
    source = source.replace("def build_datasets(", "def map_style_datasets(", 1)
    head, guard, tail = source.rpartition(GUARD)
    if not guard or "map_style_datasets" not in source:
        raise SystemExit(f"error: {project}/main_multi_gpu.py is not as generated")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "main_multi_gpu.py").write_text(head + AS_STREAM + guard + tail)
    return out_dir


def resume_cost(stream_project, samples, batch_size, repeats):
    """Seconds a stream reader takes to its first batch `samples` items into a pass,
    having to read up to there (no state_dict), and from the start of a pass (where a
    load_state_dict() puts it at once): the price of a stream that cannot seek, on
    the default data in memory, in one process."""
    import torch.distributed as dist

    sys.path.insert(0, str(stream_project))
    import main_multi_gpu as project

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    data_args = project.parse_args(["--train-size", str(samples + batch_size)])
    train_set, _ = project.build_datasets(data_args)

    def first_batch(start):
        shard = project.StreamShard(train_set, batch_size, lockstep=True)
        shard.set_epoch(0, start)
        began = time.perf_counter()
        next(iter(shard))
        return time.perf_counter() - began

    at_start = min(first_batch(0) for _ in range(repeats))
    read_ahead = min(first_batch(samples) for _ in range(repeats))
    dist.destroy_process_group()
    return {
        "samples": samples,
        "batch_size": batch_size,
        "first_batch_at_start_s": at_start,
        "first_batch_after_reading_ahead_s": read_ahead,
        "us_per_item_read_ahead": 1e6 * (read_ahead - at_start) / samples,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", help="a generated project (default: generate)")
    parser.add_argument("--samples", type=int, default=100_000, help="items to skip")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--results", default=str(BENCH / "results" / "stream-resume.json")
    )
    args = parser.parse_args()
    import torch

    from run import generate_project, machine_info, template_version

    workdir = Path(tempfile.mkdtemp(prefix="ddp-stream-"))
    project = Path(args.project or generate_project(str(BENCH.parent), workdir))
    stream_project = make_stream_project(project, workdir / "stream_project")
    cost = resume_cost(stream_project, args.samples, args.batch_size, args.repeats)
    report = {
        "machine": machine_info(torch, 1),
        "template_version": None if args.project else template_version(BENCH.parent),
        "resume_cost": cost,
    }
    Path(args.results).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(cost, indent=1))
    print(
        f"reading ahead: {cost['us_per_item_read_ahead']:.1f} us an item; a resume "
        f"{args.samples} items into a pass waits "
        f"{cost['first_batch_after_reading_ahead_s']:.2f} s for its first batch, "
        f"{cost['first_batch_at_start_s']:.3f} s where the stream can seek"
    )


if __name__ == "__main__":
    main()
