"""The generated project with its data as a stream, for run.py's `generated_stream`
contender, and what a resume costs on a stream that cannot seek.

The stream project is the generated main_multi_gpu.py with one change: the default
build_datasets() is renamed map_style_datasets(), and a new build_datasets() returns
its training set as an IterableDataset (no length, no random access; the same shuffle
seed and epoch as DistributedSampler's). Model, loss, loop and everything else are the
generated code, so generated_stream / generated measures the stream path alone.

    python3 bench/streams.py [--project DIR]   # printed, and saved in results/

It measures, in one process, the two things the stream path changes: the data path
(rank 0's batches of a 2-process run, map-style through DistributedSampler and
BatchSampler against the same data as a stream through StreamShard: CPU time per step,
interleaved repeats, the median), and the cost of a resume on a stream that cannot
seek. The whole training loop is compared by run.py (contender generated_stream).
"""

import argparse
import json
import statistics
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

    project = load(stream_project)
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


def data_path_cost(stream_project, steps, batch_size, repeats, world_size=2):
    """CPU ms per step that rank 0 of a `world_size`-process run spends getting its
    batches (no workers: in the training process), map-style and as a stream."""
    import torch.distributed as dist
    from torch.utils.data import BatchSampler, DataLoader

    project = load(stream_project)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    size = str(steps * batch_size * world_size)
    data_args = project.parse_args(["--train-size", size])
    map_style, _ = project.map_style_datasets(data_args)
    stream, _ = project.build_datasets(data_args)

    def map_style_loader():
        shard = project.ResumableSampler(map_style, world_size, rank=0, seed=0)
        batches = BatchSampler(shard, batch_size, False)
        return DataLoader(map_style, batch_sampler=batches)

    def stream_loader():
        shard = project.StreamShard(stream, batch_size, lockstep=True)
        shard.rank, shard.world_size = 0, world_size  # rank 0 of world_size
        return DataLoader(shard, batch_size=None)

    def cpu_ms_per_step(make):
        began = time.process_time()
        taken = sum(1 for _ in make())
        assert taken == steps, taken
        return 1e3 * (time.process_time() - began) / steps

    times = {"map_style": [], "stream": []}
    for _ in range(repeats):
        times["map_style"].append(cpu_ms_per_step(map_style_loader))
        times["stream"].append(cpu_ms_per_step(stream_loader))
    dist.destroy_process_group()
    return {name: statistics.median(values) for name, values in times.items()} | {
        "steps": steps,
        "batch_size": batch_size,
        "world_size": world_size,
        "repeats": repeats,
    }


def load(stream_project):
    sys.path.insert(0, str(stream_project))
    import main_multi_gpu

    return main_multi_gpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", help="a generated project (default: generate)")
    parser.add_argument("--samples", type=int, default=100_000, help="items to skip")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="of the data path")
    parser.add_argument(
        "--results", default=str(BENCH / "results" / "stream-data-path.json")
    )
    args = parser.parse_args()
    import torch

    from run import generate_project, machine_info, template_version

    workdir = Path(tempfile.mkdtemp(prefix="ddp-stream-"))
    project = Path(args.project or generate_project(str(BENCH.parent), workdir))
    stream_project = make_stream_project(project, workdir / "stream_project")
    path = data_path_cost(stream_project, args.steps, args.batch_size, args.repeats)
    cost = resume_cost(stream_project, args.samples, args.batch_size, args.repeats)
    report = {
        "machine": machine_info(torch, 1),
        "template_version": None if args.project else template_version(BENCH.parent),
        "data_path_cpu_ms_per_step": path,
        "resume_cost": cost,
    }
    Path(args.results).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["data_path_cpu_ms_per_step"], indent=1))
    print(json.dumps(cost, indent=1))
    print(
        f"data path, rank 0 of 2, batch {args.batch_size}: map-style "
        f"{path['map_style']:.3f} ms a step, stream {path['stream']:.3f} ms a step"
    )
    print(
        f"reading ahead: {cost['us_per_item_read_ahead']:.1f} us an item; a resume "
        f"{args.samples} items into a pass waits "
        f"{cost['first_batch_after_reading_ahead_s']:.2f} s for its first batch, "
        f"{cost['first_batch_at_start_s']:.3f} s where the stream can seek"
    )


if __name__ == "__main__":
    main()
