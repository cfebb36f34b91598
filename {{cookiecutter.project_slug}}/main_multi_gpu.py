{% set spawn = cookiecutter.launcher == "spawn" %}
{% set multi = cookiecutter.nodes == "multi" %}
{% set strategy = cookiecutter.save_strategy %}
# {{ cookiecutter.project_name }}
#
# Data-parallel training with PyTorch DistributedDataParallel (DDP): one process per GPU
# (or two on CPU), each training a replica of the model on its share of every batch.
# The four changes from a single-GPU script are marked "DDP change N":
#   1. join the process group described by the launcher's environment
#   2. a DistributedSampler shards the data, and set_epoch reshuffles it every epoch
#   3. the model is wrapped in DDP, which averages gradients across processes
#   4. only rank 0 prints and saves (the plain model, model.module)
# Your own data, model and loss go in the three functions marked "EDIT HERE".
"""Train a model with DistributedDataParallel; run with --help for the options."""

import argparse
import contextlib
import csv
import ctypes
import io
import itertools
import math
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from pickle import UnpicklingError

import torch
import torch.distributed as dist
{% if spawn %}
import torch.multiprocessing as mp
{% endif %}
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
{% if cookiecutter.use_batch_sampler %}
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    Sampler,
    Subset,
    TensorDataset,
)
{% else %}
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    Sampler,
    Subset,
    TensorDataset,
)
{% endif %}
from tqdm import tqdm

NUM_CLASSES = 10
LOG_EVERY = 20  # steps between progress updates and SIGTERM checks (each waits for GPU)
PREEMPTED = 143  # exit status after SIGTERM: checkpoint saved, run again to continue
STOP = threading.Event()  # set by SIGTERM
# Columns of metrics.csv, one row per epoch.
METRICS = ["epoch", "train_loss", "val_loss", "val_acc", "lr"]
METRICS += ["samples_per_s", "epoch_s", "data_s", "compute_s", "optimizer_s"]
CHANNELS_LAST = True  # NHWC images and weights on GPU: faster convolutions
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=2, help="per process")
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--val-size", type=int, default=512)
    parser.add_argument("--output-dir", default="outputs")
    parser.add_argument(
        "--amp",
        choices=tuple(AMP_DTYPES),
        default="none",
        help="mixed precision: autocast to bfloat16 or float16 (with loss scaling)",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per optimizer step (global batch: N x batch x world size)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the DDP model"
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        metavar="N",
        help="write a torch.profiler trace of N steps of rank 0 to OUTPUT_DIR/profile",
    )
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="also log metrics to OUTPUT_DIR/tensorboard (needs tensorboard)",
    )
    parser.add_argument(
        "--resume",
        default="auto",
        metavar="{auto,never,PATH}",
        help="auto: continue from OUTPUT_DIR/checkpoint_last.pt when it exists",
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: nccl when CUDA is usable, else gloo",
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=os.environ.get("DIST_TIMEOUT", "600"),
        help="seconds to wait for peers at start-up and in every collective "
        "(default: $DIST_TIMEOUT, else 600)",
    )
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="check every rank and the network, print a table, exit without training",
    )
{% if spawn %}
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=torch.cuda.device_count() or 2,
        help="processes on this machine (default: one per GPU, or 2 on CPU)",
    )
{% if multi %}
    parser.add_argument("--nnodes", type=int, default=1, help="machines taking part")
    parser.add_argument("--node-rank", type=int, default=0, help="0 to nnodes - 1")
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    parser.add_argument(
        "--master-port",
        type=int,
        help="port on node 0 (default: a free port; 29500 when nnodes > 1)",
    )
{% else %}
    parser.add_argument("--master-port", type=int, help="default: a free port")
{% endif %}
    # Accepted for torch.distributed.launch compatibility and ignored: workers get their
    # rank from mp.spawn.
{% else %}
    # DDP change 1: torch.distributed.launch passes --local-rank=N; LOCAL_RANK from the
    # environment (set by torchrun and by torch.distributed.launch) is what counts.
{% endif %}
    parser.add_argument("--local-rank", "--local_rank", help=argparse.SUPPRESS)
    return parser.parse_args()


# --------------------------------------------------------------------------------------
# EDIT HERE: your data. Return (train_set, val_set), any map-style datasets.
# --------------------------------------------------------------------------------------
def build_datasets(args):
    """A synthetic 10-class image task, identical on every rank for a given seed.

    For your own data, return e.g. torchvision.datasets.ImageFolder("data/train", ...)
    and ImageFolder("data/val", ...). Download data before launching, or on local rank 0
    followed by dist.barrier(), so processes don't write the same files at once.
    """
    generator = torch.Generator().manual_seed(args.seed)
    prototypes = torch.randn(NUM_CLASSES, 3, 16, 16, generator=generator)

    def make(size):
        labels = torch.randint(NUM_CLASSES, (size,), generator=generator)
        noise = torch.randn(size, 3, 16, 16, generator=generator)
        return TensorDataset(prototypes[labels] + 2 * noise, labels)

    return make(args.train_size), make(args.val_size)


# --------------------------------------------------------------------------------------
# EDIT HERE: your model. Normalization layers are written inline, to swap in one place.
# --------------------------------------------------------------------------------------
def build_model():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, NUM_CLASSES),
    )


# --------------------------------------------------------------------------------------
# EDIT HERE: your loss and metric.
# --------------------------------------------------------------------------------------
def compute_loss(outputs, targets):
    """Mean over the batch: DDP averages gradients over ranks, so W ranks x B samples
    train exactly like one process with W*B samples."""
    return F.cross_entropy(outputs, targets)


def count_correct(outputs, targets):
    return (outputs.argmax(dim=1) == targets).sum()


# --------------------------------------------------------------------------------------
# Distributed plumbing
# --------------------------------------------------------------------------------------
def setup_distributed(backend, timeout):
    """DDP change 1: join the process group and pick this process's device.

    A single-GPU script would only pick a device.
    """
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise failure("error: --backend nccl needs a CUDA GPU; none is visible")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend == "nccl" and local_world_size > torch.cuda.device_count():
        raise failure(
            f"error: {local_world_size} processes on this machine, "
            f"{torch.cuda.device_count()} GPUs visible: NCCL needs one GPU per process"
        )
    if cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)  # before anything else touches CUDA
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=timeout)
{% if not spawn %}
    if "RANK" not in os.environ:  # started without a launcher: a group of one
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        return device
{% endif %}
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        dist.init_process_group(backend, timeout=timeout)  # RANK, WORLD_SIZE, MASTER_*
    except dist.DistError as err:  # every rank says why: each may be on its own machine
        if "EADDRINUSE" in str(err):
{% if spawn %}
            sys.exit(f"error: port {address} is in use; choose another --master-port")
{% else %}
            sys.exit(f"error: port {address} is in use; choose another MASTER_PORT")
{% endif %}
        reason = str(err).strip().splitlines()[0]
{% if multi %}
        sys.exit(
            f"error: rendezvous with {address} failed ({reason}); check MASTER_ADDR, "
            "MASTER_PORT, NNODES, the firewall, and that every node was started"
        )
{% else %}
        sys.exit(f"error: rendezvous with {address} failed ({reason})")
{% endif %}
    return device


def failure(message):
    """The exit for a clear error: code 1, and rank 0 alone prints why, once."""
    return SystemExit(message if os.environ.get("RANK", "0") == "0" else 1)


def print0(*args, **kwargs):
    """DDP change 4: only rank 0 prints, so messages appear once, not once per rank."""
    if dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def stop_requested(device):
    """True on every rank once any rank has received SIGTERM: one tiny all-reduce."""
    flag = torch.tensor(float(STOP.is_set()), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


class ResumableSampler(Sampler):
    """The shard of a DistributedSampler, from a given position: a run stopped
    mid-epoch resumes with the next batch, without reading the ones already done."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, 0

    def set_epoch(self, epoch, start=0):
        self.sampler.set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return itertools.islice(self.sampler, self.start, None)

    def __len__(self):
        return len(self.sampler) - self.start


def build_loaders(train_set, val_set, args, device):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    common = {
        "num_workers": args.num_workers,
        "pin_memory": device.type == "cuda",
        "persistent_workers": args.num_workers > 0,
    }
    # DDP change 2: each rank reads a different 1/world_size of the training set
    # (a single-GPU script would pass shuffle=True to the DataLoader instead).
    shard = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_sampler = ResumableSampler(shard)
{% if cookiecutter.use_batch_sampler %}
    batch_sampler = BatchSampler(train_sampler, args.batch_size, drop_last=False)
    train_loader = DataLoader(train_set, batch_sampler=batch_sampler, **common)
{% else %}
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=train_sampler, **common
    )
{% endif %}
    # Validation shards take every world_size-th sample with no padding, so the summed
    # metrics count each sample exactly once (DistributedSampler would repeat some).
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, **common)
    return train_sampler, train_loader, val_loader


@torch.no_grad()
def evaluate(model, loader, device):
    """Loss and accuracy over the whole validation set, exact for any world size."""
    model.eval()
    # Sums of loss, correct predictions and samples, in float64 for exact counts.
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        outputs = model(images)
        totals[0] += compute_loss(outputs, targets).double() * len(targets)
        totals[1] += count_correct(outputs, targets)
        totals[2] += len(targets)
    dist.all_reduce(totals)  # sum over ranks
    model.train()
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples


def preflight(device, backend):
    """Every rank reports where it runs, then one all-reduce and a bandwidth probe."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones)
    if ones.item() != world_size:
        raise failure(f"error: all-reduce gave {ones.item()}, not {world_size}")
    payload = torch.ones(8 * 2**20, device=device)  # 32 MiB of float32
    dist.all_reduce(payload)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, repeats = time.perf_counter(), 5
    for _ in range(repeats):
        dist.all_reduce(payload)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    # Bus bandwidth, as nccl-tests reports it: what each link carries in a ring.
    gb_per_s = payload.numel() * 4 * 2 * (world_size - 1) / world_size / seconds / 1e9
    label = str(device)
    if device.type == "cuda":
        label += f" {torch.cuda.get_device_name(device)}"
    local_rank = os.environ.get("LOCAL_RANK", "0")
    row = f"{rank:>4}  {socket.gethostname():<20} {local_rank:>5}  {label:<29}"
    # Gather the rows as fixed-size byte tensors (all_gather_object would need NumPy).
    text = f"{row} {gb_per_s:>8.2f}".encode()[:128].ljust(128)
    mine = torch.tensor(list(text), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    rows = [bytes(t.tolist()).decode().rstrip() for t in gathered]
    print0(f"preflight: {world_size} ranks, backend {backend}, all-reduce ok")
    print0(f"{'rank':>4}  {'host':<20} {'local':>5}  {'device':<29} {'GB/s':>8}")
    print0("\n".join(rows))


def mark(device):
    """A point in time. On GPU, an event queued on the stream: no wait for the GPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds(begin, end):
    if isinstance(begin, float):
        return end - begin
    return begin.elapsed_time(end) / 1000  # call after torch.cuda.synchronize()


# --------------------------------------------------------------------------------------
# Checkpoints and metrics (rank 0 writes; every rank reads through rank 0)
# --------------------------------------------------------------------------------------
def save_atomic(obj, path):
    """Write a temporary file, then rename it: a crash mid-write keeps the old file."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(resume, last_path, device):
    """Return the checkpoint to resume from, or None to start fresh.

    Rank 0 reads the file and sends its bytes to the other ranks, so machines need not
    share a disk; each rank then loads them with weights_only=True.
    """
    path = last_path if resume == "auto" else Path(resume)
    data, error = b"", None
    wanted = resume != "never" and (resume != "auto" or path.exists())
    if dist.get_rank() == 0 and wanted:
        try:
            data = path.read_bytes()
        except OSError as err:
            error = f"error: cannot resume from {path}: {err.strerror or err}"
    size = torch.tensor(-1 if error else len(data), device=device)
    dist.broadcast(size, src=0)  # -1: rank 0 failed, 0: nothing to resume from
    if size.item() < 0:
        raise failure(error)
    if size.item() == 0:
        return None
    buffer = bytearray(data) if data else bytearray(size.item())
    received = torch.frombuffer(buffer, dtype=torch.uint8).to(device)
    dist.broadcast(received, src=0)
    torch.frombuffer(buffer, dtype=torch.uint8).copy_(received)
    try:
        # weights_only=True: a checkpoint is data; never run code from a pickle.
        checkpoint = torch.load(
            io.BytesIO(buffer), map_location="cpu", weights_only=True
        )
        if not {"model", "optimizer", "epoch"} <= set(checkpoint):
            raise ValueError("no model, optimizer and epoch keys")
    except UnpicklingError as err:
        message = f"error: cannot resume from {path}: refused by weights_only=True"
        raise failure(message) from err
    except Exception as err:  # torch.load raises many kinds on a corrupt file
        reason = (str(err).strip() or type(err).__name__).splitlines()[0]
        message = f"error: cannot resume from {path}: not a checkpoint ({reason})"
        raise failure(message) from err
    return checkpoint | {"path": str(path)}


def start_metrics(path, done):
    """Keep the rows of epochs already done (none on a fresh start); drop the rest."""
    rows = []
    if done and path.exists():
        with path.open(newline="") as f:
            rows = [row for row in csv.DictReader(f) if int(row["epoch"]) <= done]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, METRICS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def append_metrics(path, row):
    with path.open("a", newline="") as f:
        csv.DictWriter(f, METRICS).writerow(row)


def plot_losses(metrics_path, png_path):
    """Train and validation loss per epoch, when matplotlib is installed."""
    try:
        import matplotlib  # optional: imported only here

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no {png_path.name}: pip install matplotlib to plot the losses")
        return
    with metrics_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    epochs = [int(row["epoch"]) for row in rows]
    figure, axes = plt.subplots(figsize=(6, 4))
    for key in ("train_loss", "val_loss"):
        axes.plot(epochs, [float(row[key]) for row in rows], marker="o", label=key)
    axes.set_xlabel("epoch")
    axes.set_ylabel("loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(png_path)
    plt.close(figure)
    print(f"saved {png_path}", flush=True)


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------
def train(args, device):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    out_dir = Path(args.output_dir)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)

    if args.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency
        except ImportError as err:
            message = "error: --tensorboard needs TensorBoard: pip install tensorboard"
            raise failure(message) from err
    torch.manual_seed(args.seed)  # same data and initial weights on every rank
    train_set, val_set = build_datasets(args)
    train_sampler, train_loader, val_loader = build_loaders(
        train_set, val_set, args, device
    )
    model = build_model()
{% if cookiecutter.sync_bn %}
    if device.type == "cuda":
        # DDP change 3a: BatchNorm statistics over the global batch, not per rank.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    else:
        print0(
            "warning: SyncBatchNorm runs on GPUs only; training with BatchNorm on CPU",
            file=sys.stderr,
        )
{% endif %}
    memory_format = torch.preserve_format
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fastest kernels for fixed shapes
        if CHANNELS_LAST:
            memory_format = torch.channels_last
    model.to(device, memory_format=memory_format)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4
    )
    amp_dtype = AMP_DTYPES[args.amp]
    # float16 needs loss scaling against underflowing gradients; otherwise a no-op.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    steps_per_epoch = len(train_loader)  # micro-batches, grad_accum per update
    # Linear warm-up over the first epoch: large global batches (many GPUs) need it.
    warmup = math.ceil(steps_per_epoch / args.grad_accum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
    )

    last_path = out_dir / "checkpoint_last.pt"

    def snapshot(epoch, step=0, sums=(0.0, 0.0)):
        """Everything a resume needs: epochs done (and steps into the next), state."""
        # DDP change 4: the plain model (ddp_model.module, not the DDP wrapper), so
        # the weights load without DDP and without a "module." prefix in their keys.
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": epoch,
            "step": step,
            "train_sums": list(sums),  # loss and samples of those steps, all ranks
{% if strategy == "best" %}
            "best_val_loss": best_val_loss,
{% endif %}
            "args": vars(args),
        }

    start_epoch, start_step, resumed_sums = 0, 0, [0.0, 0.0]
{% if strategy == "best" %}
    best_val_loss = float("inf")
{% endif %}
    checkpoint = load_checkpoint(args.resume, last_path, device)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch, start_step = checkpoint["epoch"], checkpoint["step"]
        resumed_sums = checkpoint["train_sums"]
{% if strategy == "best" %}
        best_val_loss = checkpoint["best_val_loss"]
{% endif %}
        where = f"after epoch {start_epoch}"
        if start_step:
            where = f"in epoch {start_epoch + 1} after {start_step} steps"
        print0(f"resumed from {checkpoint['path']} {where}")
    if is_main:
        start_metrics(out_dir / "metrics.csv", start_epoch)

    # DDP change 3: wrap the model. Its backward pass averages gradients over all ranks,
    # so every replica takes the same optimizer step. Train through ddp_model; save
    # and evaluate the plain model (they share the parameters).
    device_ids = [device.index] if device.type == "cuda" else None
    # torch.compile inside DDP: the compiled graph is split at DDP's gradient buckets,
    # so the all-reduce still overlaps with the backward pass.
    ddp_model = DDP(
        torch.compile(model) if args.compile else model,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
    )
    profiler = None
    if is_main and args.profile_steps:
        profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(
                wait=1, warmup=1, active=args.profile_steps, repeat=1
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(out_dir / "profile")
            ),
        )
        profiler.start()
    writer = None
    if is_main and args.tensorboard:
        writer = SummaryWriter(out_dir / "tensorboard")

    preempted = False  # by SIGTERM: stop after saving, with exit status PREEMPTED
    for epoch in range(start_epoch, args.epochs):
        first_step = start_step if epoch == start_epoch else 0  # > 0 after SIGTERM
        # DDP change 2: a new shuffle each epoch, the same on every rank. Without this
        # call every epoch repeats the first epoch's order.
{% if cookiecutter.use_batch_sampler %}
        # (The BatchSampler draws from this same sampler, so it follows.)
{% endif %}
        train_sampler.set_epoch(epoch, start=first_step * args.batch_size)
        # Per-rank randomness (dropout, augmentation): the same after a resume at an
        # epoch boundary; after a mid-epoch stop, the rest of that epoch draws anew.
        torch.manual_seed(args.seed + epoch * world_size + rank)
        ddp_model.train()
        start = time.perf_counter()
        # This rank's loss sum, kept on the device (no sync per step), and sample count;
        # rank 0 also carries those of the steps done before a SIGTERM.
        carried = resumed_sums if is_main and first_step else [0.0, 0.0]
        loss_sum, samples = torch.tensor(carried[0], device=device), int(carried[1])
        stopped_at = None
        data_s, marks = 0.0, []  # data wait; (start, backward done, step done) per step
        progress = tqdm(
            train_loader,
            desc=f"epoch {epoch + 1}/{args.epochs}",
            leave=False,
            disable=not (is_main and sys.stderr.isatty()),
        )
        tick = time.perf_counter()
        for step, (images, targets) in enumerate(progress, start=first_step):
            data_s += time.perf_counter() - tick  # waiting for the DataLoader
            begin = mark(device)
            if images.dim() == 4:
                images = images.to(memory_format=memory_format)
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            # Gradient accumulation: an optimizer step every grad_accum micro-batches
            # (and at the end of the epoch), the loss divided by the group's size.
            group = step // args.grad_accum * args.grad_accum
            group_size = min(args.grad_accum, steps_per_epoch - group)
            update = step + 1 == group + group_size
            # DDP change 3: the gradient all-reduce runs in the backward pass of the
            # last micro-batch only; no_sync() skips it for the others.
            with contextlib.nullcontext() if update else ddp_model.no_sync():
                with torch.autocast(device.type, amp_dtype, enabled=bool(amp_dtype)):
                    loss = compute_loss(ddp_model(images), targets)
                scaler.scale(loss / group_size).backward()
            backward_done = step_done = mark(device)
            if update:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step_done = mark(device)
            marks.append((begin, backward_done, step_done))
            if profiler:
                profiler.step()
            loss_sum += loss.detach() * len(targets)
            samples += len(targets)
            if update and (step + 1) // args.grad_accum % LOG_EVERY == 0:
                if not progress.disable:
                    progress.set_postfix(loss=f"{loss.item():.4f}")
                if stop_requested(device):
                    stopped_at = step + 1
                    break
            tick = time.perf_counter()
        train_seconds = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.synchronize()  # the events above have all happened
        compute_s = sum(seconds(a, b) for a, b, _ in marks)
        optimizer_s = sum(seconds(b, c) for _, b, c in marks)
        totals = torch.stack([loss_sum, torch.tensor(float(samples), device=device)])
        dist.all_reduce(totals)
        train_loss, global_samples = totals.tolist()
        if stopped_at is not None:
            if is_main:
                sums = [train_loss, global_samples]
                save_atomic(snapshot(epoch, stopped_at, sums), last_path)
                print(
                    f"preempted: saved {last_path} in epoch {epoch + 1} after "
                    f"{stopped_at} steps; run again to resume (--resume auto)",
                    flush=True,
                )
            preempted = True
            break

        # Evaluate the weights rank 0 saves: parameters match on every rank, but each
        # rank keeps its own BatchNorm running statistics, so take rank 0's. Use the
        # plain model: DDP's forward would wait for ranks with more validation batches.
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        val_loss, val_acc = evaluate(model, val_loader, device)

        if is_main:
            row = {
                "epoch": epoch + 1,
                "train_loss": f"{train_loss / global_samples:.6f}",
                "val_loss": f"{val_loss:.6f}",
                "val_acc": f"{val_acc:.6f}",
                "lr": f"{scheduler.get_last_lr()[0]:.6g}",
                "samples_per_s": f"{global_samples / train_seconds:.1f}",
                "epoch_s": f"{time.perf_counter() - start:.3f}",
                "data_s": f"{data_s:.3f}",
                "compute_s": f"{compute_s:.3f}",
                "optimizer_s": f"{optimizer_s:.3f}",
            }
            append_metrics(out_dir / "metrics.csv", row)
            if writer:
                for key in METRICS[1:]:
                    writer.add_scalar(key, float(row[key]), epoch + 1)
            summary = "  ".join(f"{key} {row[key]}" for key in METRICS[1:])
            print(f"epoch {epoch + 1}/{args.epochs}  {summary}", flush=True)
{% if strategy == "best" %}
            improved = val_loss < best_val_loss
            best_val_loss = min(best_val_loss, val_loss)
{% endif %}
{% if strategy != "final_only" %}
            # DDP change 4: rank 0 alone saves.
            save_atomic(snapshot(epoch + 1), last_path)
{% endif %}
{% if strategy == "best" %}
            if improved:
                save_atomic(snapshot(epoch + 1), out_dir / "checkpoint_best.pt")
{% elif strategy == "every_epoch" %}
            epoch_path = out_dir / f"checkpoint_epoch{epoch + 1:03d}.pt"
            save_atomic(snapshot(epoch + 1), epoch_path)
{% endif %}
        if epoch + 1 < args.epochs and stop_requested(device):
            if is_main:
{% if strategy == "final_only" %}
                save_atomic(snapshot(epoch + 1), last_path)
{% endif %}
                print(
                    f"preempted: saved {last_path} after epoch {epoch + 1}; "
                    "run again to resume (--resume auto)",
                    flush=True,
                )
            preempted = True
            break

    if profiler:
        profiler.stop()  # writes the trace if the run had fewer steps than asked
    if writer:
        writer.close()
    if preempted:
        return PREEMPTED
    if is_main:
        # DDP change 4: the plain model's weights, saved once.
        save_atomic(model.state_dict(), out_dir / "model_final.pt")
        print(f"saved {out_dir / 'model_final.pt'}", flush=True)
        plot_losses(out_dir / "metrics.csv", out_dir / "loss.png")
    return 0


def keep_freed_memory(limit=1 << 30):
    """Linux: let freed tensor memory stay in the process for the next step.

    By default glibc hands large freed blocks straight back to the kernel, so every
    step faults the same memory in again: ~1000 page faults a step and a fifth of the
    step time for the CPU default here. Blocks up to `limit` bytes now stay reserved.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None)
        if hasattr(libc, "mallopt"):  # glibc (other C libraries: absent or a no-op)
            libc.mallopt(-3, limit)  # M_MMAP_THRESHOLD: larger blocks get their own map
            libc.mallopt(-1, limit)  # M_TRIM_THRESHOLD: free heap top kept up to this
        # The same for processes started from here that do not fork (DataLoader
        # workers under the spawn or forkserver start method): glibc reads these.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(limit))
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(limit))


def run(args):
    """One process's life: join the group, train (or check), always leave the group.

    Returns the exit status: 0, or PREEMPTED after a SIGTERM.
    """
    keep_freed_memory()  # before any tensor, and so before any DataLoader worker
    device = setup_distributed(args.backend, args.dist_timeout)
    # SIGTERM (how Slurm and Kubernetes preempt, and how torchrun stops workers) no
    # longer kills at once: training stops at the next check and saves a checkpoint.
    signal.signal(signal.SIGTERM, lambda signum, frame: STOP.set())
    try:
        if args.preflight:
            preflight(device, dist.get_backend())
            status = 0
        else:
            status = train(args, device)
        dist.barrier()  # everyone finishes together, after rank 0's last save
    finally:
        dist.destroy_process_group()
    return status
{% if spawn %}


def free_port():
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def worker(local_rank, args, master_port):
    """Entry point of each process that mp.spawn starts, with local_rank 0..nproc-1."""
    # DDP change 1: describe this process in the environment, as torchrun would.
    os.environ.update(
{% if multi %}
        MASTER_ADDR=args.master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(args.node_rank * args.nproc_per_node + local_rank),
        WORLD_SIZE=str(args.nnodes * args.nproc_per_node),
{% else %}
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        RANK=str(local_rank),
        WORLD_SIZE=str(args.nproc_per_node),
{% endif %}
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(args.nproc_per_node),
    )
    # Share the CPU cores between processes instead of oversubscribing them.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc_per_node))
    sys.exit(run(args))


def main():
    args = parse_args()
{% if multi %}
    master_port = args.master_port or (29500 if args.nnodes > 1 else free_port())
    first_rank = args.node_rank * args.nproc_per_node
{% else %}
    master_port = args.master_port or free_port()
    first_rank = 0
{% endif %}
    # DDP change 1: start one process per GPU; if one fails, the others are stopped.
    workers = mp.start_processes(
        worker, args=(args, master_port), nprocs=args.nproc_per_node, join=False
    )

    def forward_sigterm(signum, frame):
        for process in workers.processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: each worker saves, then exits

    signal.signal(signal.SIGTERM, forward_sigterm)
    try:
        while not workers.join():
            pass
    except mp.ProcessRaisedException as error:
        print(error, file=sys.stderr)
        rank = first_rank + error.error_index
        sys.exit(f"error: rank {rank} failed; the other workers were stopped")
    except mp.ProcessExitedException as error:
        if error.exit_code in (1, PREEMPTED):
            sys.exit(error.exit_code)  # the worker has said why
        rank = first_rank + error.error_index
        cause = error.signal_name or f"exit code {error.exit_code}"
        sys.exit(f"error: rank {rank} died ({cause}); the other workers were stopped")


if __name__ == "__main__":
    main()
{% else %}


if __name__ == "__main__":
    sys.exit(run(parse_args()))
{% endif %}
