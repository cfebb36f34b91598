"""What reading a stream by shard buys, where each item costs about a millisecond of
CPU to read (decoding, tokenizing: in the stream, not in collate_fn).

Three ways to give the generated project the same training data, each item busy for
--cost ms when it is read:
- `shards`: a stream of 16 shards (n_shards, shard()), each read by one reader;
- `whole`: the same stream without shard(), read whole by every reader, which skips
  the others' items (the project's way for such streams);
- `map`: the same data map-style, the cost in __getitem__ (each process reads its
  own items through DistributedSampler).
The default project otherwise (its model, loss and loop), 2 processes x 2 DataLoader
workers, --max-steps updates, within one pass. The rate is samples_per_s of
metrics.csv's rows after the first (the first holds the workers' start), the median
over rows, then over --repeats runs of each, interleaved.

    python3 bench/shards.py [--cost 1.0] [--steps 60] [--repeats 3]

Printed, and saved in results/shards.json.
"""

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
GUARD = '\n\nif __name__ == "__main__":'

DATA = '''

def busy(seconds):
    """CPU work, as a decoder's."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Costly(torch.utils.data.Dataset):
    """The default data, each sample costly to get."""

    def __init__(self, data, cost):
        self.data, self.cost = data, cost

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        busy(self.cost)
        return self.data[i]


class CostlyStream(IterableDataset):
    """The default data as a stream: 16 files, the samples i = f mod 16 in file f,
    each file in an order shuffled anew each pass; each item costly to read."""

    def __init__(self, data, cost, seed, files=tuple(range(16))):
        self.data, self.cost, self.seed, self.files = data, cost, seed, files
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        for f in self.files:
            order = torch.Generator().manual_seed(self.seed + 1000 * self.epoch + f)
            indices = range(f, len(self.data), 16)
            for j in torch.randperm(len(indices), generator=order).tolist():
                busy(self.cost)
                yield self.data[indices[j]]


class CostlyShards(CostlyStream):
    """The same, split by file."""

    @property
    def n_shards(self):
        return len(self.files)

    def shard(self, num_shards, index):
        files = self.files[index::num_shards]
        return CostlyShards(self.data, self.cost, self.seed, files)


def build_datasets(args):
    train_set, val_set = default_datasets(args)
    cost, kind = float(os.environ["BENCH_COST_MS"]) / 1000, os.environ["BENCH_DATA"]
    if kind == "map":
        return Costly(train_set, cost), val_set
    stream = CostlyShards if kind == "shards" else CostlyStream
    return stream(train_set, cost, args.seed), val_set
'''


def make_project(root):
    """The default project, its build_datasets() renamed default_datasets() and a new
    one choosing the data by BENCH_DATA."""
    subprocess.run(
        ["cookiecutter", "--no-input", "-o", str(root), str(BENCH.parent)],
        check=True,
        capture_output=True,
    )
    (project,) = Path(root).iterdir()
    script = project / "main_multi_gpu.py"
    source = script.read_text().replace(
        "def build_datasets(", "def default_datasets(", 1
    )
    head, guard, tail = source.rpartition(GUARD)
    if not guard or "default_datasets" not in source:
        raise SystemExit("error: the generated main_multi_gpu.py is not as expected")
    script.write_text(head + DATA + guard + tail)
    return project


def rate(project, kind, args, out_dir):
    """samples_per_s of one run: the median of its rows after the first."""
    env = {**os.environ, "BENCH_DATA": kind, "BENCH_COST_MS": str(args.cost)}
    env["NPROC_PER_NODE"] = "2"
    command = ["./run_single.sh", "--max-steps", str(args.steps)]
    command += ["--eval-every", str(args.steps // 6), "--val-size", "64"]
    command += ["--batch-size", "16", "--num-workers", "2", "--train-size", "4096"]
    command += ["--output-dir", str(out_dir)]
    subprocess.run(command, cwd=project, env=env, check=True, capture_output=True)
    with open(out_dir / "metrics.csv") as rows:
        rates = [float(row["samples_per_s"]) for row in csv.DictReader(rows)]
    return statistics.median(rates[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost", type=float, default=1.0, help="ms to read an item")
    parser.add_argument("--steps", type=int, default=60, help="updates a run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", default=str(BENCH / "results" / "shards.json"))
    args = parser.parse_args()
    kinds = ("shards", "whole", "map")
    rates = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as root:
        project = make_project(root)
        for repeat in range(args.repeats):
            for kind in kinds:
                out = Path(root) / f"{kind}{repeat}"
                rates[kind].append(rate(project, kind, args, out))
                print(f"{kind:6} run {repeat + 1}: {rates[kind][-1]:.0f} samples/s")
    median = {kind: statistics.median(rates[kind]) for kind in kinds}
    print(f"\n{'data':8} {'samples/s':>10} {'/ map':>7}   runs")
    for kind in kinds:
        runs = ", ".join(f"{r:.0f}" for r in rates[kind])
        print(
            f"{kind:8} {median[kind]:10.0f} {median[kind] / median['map']:7.3f}   {runs}"
        )
    ratio = median["shards"] / median["map"]
    print(
        f"goal: shards / map >= 0.9: {ratio:.3f} - {'holds' if ratio >= 0.9 else 'missed'}"
    )
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    results = {
        "machine": machine,
        "python": sys.version.split()[0],
        "cost_ms": args.cost,
        "steps": args.steps,
        "runs": rates,
        "median": median,
    }
    Path(args.results).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
