"""Command line shared by the three hand-made contenders, and the generated project's
model, data and loss, imported from its main_multi_gpu.py so all four train the same
(build_model(args) and compute_loss(model, batch), as a user edits them).
"""

import argparse
import importlib
import os
import sys
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--project", required=True, help="the generated project folder")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, required=True, help="per process")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True, help="per process")
    parser.add_argument("--val-size", type=int, required=True)
    parser.add_argument(
        "--amp",
        choices=("none", "bf16"),
        default="none",
        help="autocast to bfloat16, as the generated project's --amp bf16",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model before DDP wraps it, as the generated project's "
        "--compile (hand-written loop only)",
    )
    parser.add_argument(
        "--no-ddp",
        action="store_true",
        help="no DDP wrapper, one process only: what DDP costs at world size 1 "
        "(hand-written loop only)",
    )
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


def shuffled_loader(train_set, args, cuda):
    """The loader Accelerate and Fabric start from; each framework then shards it."""
    return DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        pin_memory=cuda,
    )


def gpu_settings(model, device):
    """The generated project's GPU defaults, given to every contender alike, so a ratio
    measures the loops and not the settings: cuDNN's fastest algorithm for each shape,
    TF32 for float32 matmuls and convolutions, NHWC weights for 2-D convolutions."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        model.to(memory_format=torch.channels_last)
    return model


def autocast(args, device):
    """bfloat16 autocast with --amp bf16 (the generated project's), else a no-op."""
    return torch.autocast(device.type, torch.bfloat16, enabled=args.amp == "bf16")


def sgd(model, args):
    """The generated project's optimizer settings."""
    return torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4
    )
