"""Command line shared by the three hand-made contenders, and the generated project's
model, data and loss, imported from its main_multi_gpu.py so all four train the same.
"""

import argparse
import importlib
import os
import sys
from types import SimpleNamespace


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--project", required=True, help="the generated project folder")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, required=True, help="per process")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True, help="per process")
    parser.add_argument("--val-size", type=int, required=True)
    return parser.parse_args()


def load_project(args):
    """(project module, training set of exactly --steps batches per process)."""
    sys.path.insert(0, os.path.abspath(args.project))
    project = importlib.import_module("main_multi_gpu")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    data_args = SimpleNamespace(
        seed=args.seed,
        train_size=args.steps * args.batch_size * world_size,
        val_size=args.val_size,
    )
    train_set, _ = project.build_datasets(data_args)
    return project, train_set
