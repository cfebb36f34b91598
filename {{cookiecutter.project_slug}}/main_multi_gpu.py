{% set spawn = cookiecutter.launcher == "spawn" %}
{% set multi = cookiecutter.nodes == "multi" %}
{% set strategy = cookiecutter.save_strategy %}
{% set fsdp = cookiecutter.parallelism == "fsdp2" %}
{% set wrapper = "train_model" if fsdp else "ddp_model" %}
{% set ext = "" if fsdp else ".pt" %}
# {{ cookiecutter.project_name }}
#
{% if fsdp %}
# Data-parallel training with PyTorch's fully sharded data parallelism (FSDP2): one
# process per GPU (or two on CPU), each training the model on its share of every batch
# while holding only 1/world_size of the parameters, gradients and optimizer state.
# The four changes from a single-GPU script are marked "DDP change N":
#   1. join the process group described by the launcher's environment
#   2. a DistributedSampler shards the data, and set_epoch reshuffles it every epoch
#   3. fully_shard() shards the model's parameters over the processes
#   4. only rank 0 prints; every rank writes its shards of a checkpoint, and rank 0
#      the whole model at the end
{% else %}
# Data-parallel training with PyTorch DistributedDataParallel (DDP): one process per GPU
# (or two on CPU), each training a replica of the model on its share of every batch.
# The four changes from a single-GPU script are marked "DDP change N":
#   1. join the process group described by the launcher's environment
#   2. a DistributedSampler shards the data, and set_epoch reshuffles it every epoch
#   3. the model is wrapped in DDP, which averages gradients across processes
#   4. only rank 0 prints and saves (the plain model, not the DDP wrapper)
{% endif %}
# Your data, model, loss, metrics and optimizer go in the five functions under
# "EDIT HERE"; nothing else in this file needs to change for them.
{% if fsdp %}
"""Train a model sharded with FSDP2, on one machine or several."""
{% else %}
"""Train a model with DistributedDataParallel, on one machine or several."""
{% endif %}

import argparse
import atexit
import contextlib
import copy
import csv
import ctypes
import faulthandler
import gc
import io
import itertools
import logging
import math
import multiprocessing
import os
{% if not spawn %}
import shlex
{% endif %}
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sized
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
{% if fsdp %}
import torch.distributed.checkpoint as dcp
{% endif %}
{% if spawn %}
import torch.multiprocessing as mp
{% endif %}
import torch.nn.functional as F
from torch import nn
{% if fsdp %}
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
{% endif %}
{% if not spawn %}
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
{% endif %}
{% if fsdp %}
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
{% endif %}
{% if not spawn %}
from torch.distributed.run import get_args_parser
from torch.distributed.run import main as torchrun
{% endif %}
{% if not fsdp %}
from torch.nn.parallel import DistributedDataParallel as DDP
{% endif %}
{% if cookiecutter.use_batch_sampler %}
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Sampler,
    Subset,
    TensorDataset,
    default_collate,
    get_worker_info,
)
{% else %}
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Sampler,
    Subset,
    TensorDataset,
    default_collate,
    get_worker_info,
)
{% endif %}
from tqdm import tqdm

# --------------------------------------------------------------------------------------
# EDIT HERE: the five functions that make this project yours. Replace their bodies with
# your data, model, optimizer, loss and metrics; the rest of the file works unchanged.
# --------------------------------------------------------------------------------------
NUM_CLASSES = 10


def build_datasets(args):
    """Return (train_set, val_set): datasets whose items DataLoader's default collate
    can batch (tensors, or tuples, lists and dicts of them); a dataset with a
    collate_fn attribute (e.g. to pad sequences) is batched with it. Map-style
    (__len__ and __getitem__), or streams (IterableDataset: see the README's "Your
    data as a stream"; a training stream without __len__ needs --max-steps).

    Here a synthetic 10-class image task, identical on every rank for a given seed.
    For your own data, return e.g. torchvision.datasets.ImageFolder("data/train", ...)
    and ImageFolder("data/val", ...). Download data before launching, or on local rank 0
    followed by dist.barrier(), so processes don't write the same files at once (a
    download longer than --dist-timeout counts as a hang).
    """

    def seeded(part):  # a generator per part: --train-size leaves the others alone
        return torch.Generator().manual_seed(1000 * args.seed + part)

    prototypes = torch.randn(NUM_CLASSES, 3, 16, 16, generator=seeded(0))

    def make(size, part):
        generator = seeded(part)
        labels = torch.randint(NUM_CLASSES, (size,), generator=generator)
        noise = torch.randn(size, 3, 16, 16, generator=generator)
        return TensorDataset(prototypes[labels] + 2 * noise, labels)

    return make(args.train_size, 1), make(args.val_size, 2)


def build_model(args):
{% if fsdp %}
    """Return the plain model (FSDP2 shards it later). Its normalization layers are
    written inline, nn.BatchNorm2d(C), so they are easy to find and swap."""
{% else %}
    """Return the plain model (DDP wraps it later). Its normalization layers are
    written inline, nn.BatchNorm2d(C), so they are easy to find and swap."""
{% endif %}
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


def build_optimizer(model, args, total_updates):
    """Return (optimizer, scheduler or None). The scheduler is stepped once per
    optimizer update; total_updates counts the updates of the whole run (all --epochs,
    or --max-steps).

    Here SGD with momentum, and a learning rate that warms up linearly over the first
    1/--epochs of the run (the first epoch; a tenth of --max-steps at the default 10
    epochs: large global batches need it), then stays.
    """
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4
    )
    warmup = max(1, total_updates // args.epochs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda update: min(1.0, (update + 1) / warmup)
    )
    return optimizer, scheduler


def compute_loss(model, batch):
    """Return (loss, n): the training loss as a mean over the n units of this batch
    (samples here; tokens for a language model, where sum / n.clamp(min=1) keeps a
    batch of padding alone finite), and n, an int or a tensor.

    `batch` is one DataLoader batch, already on the device, under autocast with --amp.
{% if fsdp %}
    `model` is the model sharded by FSDP2 (compiled with --compile): call it, as here.
{% else %}
    `model` is the DDP-wrapped model: call it, as here, and nothing else of it.
{% endif %}
    """
    images, labels = batch
    return F.cross_entropy(model(images), labels), len(labels)


def compute_metrics(model, batch):
    """Return {name: (sum, n)} for one validation batch; each metric is summed over all
    batches and ranks and reported as val_<name> = sum / n (nan where n sums to 0).
    Return the same names for every batch. "loss" is required: it
{% if fsdp %}
    is val_loss. `model` is the sharded model (not compiled), in eval mode, without
    grad and without --amp's autocast.
{% else %}
    is val_loss. `model` is the plain model (not DDP, not compiled), in eval mode,
    without grad and without --amp's autocast.
{% endif %}
    """
    images, labels = batch
    logits = model(images)
    n = len(labels)
    return {
        "loss": (F.cross_entropy(logits, labels, reduction="sum"), n),
        "acc": ((logits.argmax(dim=1) == labels).sum(), n),
    }


# --------------------------------------------------------------------------------------
# The training loop, and the four DDP changes
# --------------------------------------------------------------------------------------
LOG_EVERY = 20  # optimizer updates between progress reports and checks (each waits)
{% if fsdp %}
# What every rank holds whole (BatchNorm's buffers, which FSDP2 does not shard, and
# each rank keeps its own of): rank 0's copy goes into a checkpoint, consistent.
RANK_0_WRITES_REPLICAS = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
{% else %}
CHANNELS_LAST = True  # on GPUs, 2-D convolutions in NHWC: faster
{% endif %}
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def run(args):
    """One process's life: join the group, train (or check), always leave the group.

    Returns the exit status: 0; 1 when another rank was lost; 1 or 2 after a clear
    error line (failure()); or 128 + the signal that stopped training.
    """
    keep_freed_memory()  # before any tensor, and so before any DataLoader worker
    spare_the_garbage_collector()
    faulthandler.enable()  # a crash in C code (an abort) still shows the Python stack
{% if not spawn %}
    # A torchrun worker runs in a session of its own: were torchrun killed (kill -9,
    # out of memory), it would train on alone, holding its GPU. It gets SIGTERM
    # instead, so it saves and stops.
    if "TORCHELASTIC_RUN_ID" in os.environ:
        signal_when_parent_ends(signal.SIGTERM)
{% endif %}
    device, store = setup_distributed(args.backend, args.dist_timeout)
    # From here on, SIGTERM and Ctrl-C stop training at the next check, with a save.
    # (Before, SIGTERM ends the process at once; the rendezvous waits in C++, where a
    # Python handler would not run.)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_stop_signal)
    WATCH.start(store, args.dist_timeout)
    try:
        if args.preflight:
            preflight(device, dist.get_backend())
            status = 0
        elif args.evaluate:
            status = evaluate_saved(args, device)
        else:
            status = train(args, device)
        dist.barrier()  # everyone finishes together, after rank 0's last save
    except RuntimeError as err:
        if not lost_peer(err):
            raise
        if WATCH.reporting:  # the other ranks left after a hang report: finish it
            WATCH.thread.join()
        report_lost_peer(err)
        status = 1
    except SystemExit as stop:  # failure(): rank 0 has said why
        status = stop.code
    finally:
        WATCH.stop()
        stop_loader_workers()
        dist.destroy_process_group()
    return status


def cuda_problem(backend, processes_here):
    """Why `backend` cannot serve this machine's processes, as an error line; or None.

    The launchers ask before they start any process: were the ranks to find it out
    alone, a launcher could stop rank 0, which says it, after another rank exits.
    """
    if backend == "nccl" and not torch.cuda.is_available():
        return "error: --backend nccl needs a CUDA GPU; none is visible"
    if backend == "nccl" and processes_here > torch.cuda.device_count():
        return (
            f"error: {processes_here} processes on this machine, "
            f"{torch.cuda.device_count()} GPUs visible: NCCL needs one GPU per process"
        )
    return None


def setup_distributed(backend, timeout):
    """DDP change 1: join the process group and pick this process's device.

    A single-GPU script would only pick a device.
    """
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    problem = cuda_problem(backend, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if problem:
        raise failure(problem)
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
        return device, store
{% endif %}
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        # The rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) gives a store the
        # hang watch uses too. A collective may wait COLLECTIVE_GRACE longer than the
        # timeout, so that the hang watch, which acts at the timeout, reports first.
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout + timedelta(seconds=COLLECTIVE_GRACE),
        )
    except dist.DistError as err:  # every rank says why: each may be on its own machine
        sys.exit(rendezvous_failed(err, address))
    return device, store


def rendezvous_failed(err, address):
    """The one line for a rendezvous that failed: why, and what to check."""
    reason = str(err).strip().splitlines()[0]
    if "EADDRINUSE" in reason:
{% if spawn %}
        return f"error: port {address} is in use; choose another --master-port"
{% else %}
        return (  # a port torchrun picked free for the workers
            f"error: port {address} is in use (another program took it after "
            "torchrun picked it); run the job again"
        )
{% endif %}
{% if multi %}
    return (
        f"error: rendezvous with {address} failed ({reason}); check MASTER_ADDR, "
        "MASTER_PORT, NNODES, the firewall, and that every node was started"
    )
{% else %}
    return f"error: rendezvous with {address} failed ({reason})"
{% endif %}


def print0(*args, **kwargs):
    """DDP change 4: only rank 0 prints, so messages appear once, not once per rank."""
    if dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


@dataclass
class Training:
    """What the loop works with, built once by build_training()."""

    args: argparse.Namespace
    device: torch.device
{% if fsdp %}
    model: nn.Module  # sharded over the ranks (DDP change 3): evaluated and saved
    train_model: nn.Module  # the same, compiled with --compile: trained
{% else %}
    model: nn.Module  # the plain model: evaluated and saved (DDP change 4)
    ddp_model: DDP  # the same parameters in the DDP wrapper: trained (DDP change 3)
{% endif %}
    optimizer: torch.optim.Optimizer
    scheduler: object  # an LR scheduler, or None
    scaler: torch.amp.GradScaler
    train_data: object  # what places a pass: a ResumableSampler, or a StreamShard
    train_loader: DataLoader
    val_loader: DataLoader
    steps_per_pass: int  # micro-batches per pass and rank (None: a stream's, unknown)
    total_updates: int  # optimizer updates in the whole run
    sums: object = None  # the LossSums of the training since the last evaluation
{% if strategy == "best" %}
    best_val_loss: float = math.inf
{% endif %}


@dataclass
class Position:
    """Where training stands, as a checkpoint keeps it."""

    epoch: int = 0  # passes over the training data done
    samples: int = 0  # samples of the pass under way trained, over all ranks
    step: int = 0  # optimizer updates done
    stream: dict = None  # the training stream's state_dict() there, where it has one


def train(args, device):
    """Build, resume, train pass by pass, save. Returns the exit status: 0, or
    128 + the signal (SIGTERM, Ctrl-C) that stopped it after saving a checkpoint."""
    out_dir = Path(args.output_dir)
{% if fsdp %}
    last_path = out_dir / "checkpoint_last"  # a folder of every rank's shards
{% else %}
    last_path = out_dir / "checkpoint_last.pt"
{% endif %}
    checkpoint = load_checkpoint(args.resume, last_path, device)
    t = build_training(args, device, checkpoint)
    at = resume(t, checkpoint, out_dir)
    with Reports(t, out_dir) as reports:
        while not finished(t, at):
            if train_pass(t, at, reports):  # a stop signal: saved, so stop
                return stopped(last_path, at, args.batch_size)
{% if fsdp %}
    # DDP change 4 (FSDP2): the whole model, gathered from every rank's shards into
    # rank 0's memory (every rank takes part), saved once, as one plain file.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(t.model, options=options)
{% else %}
    # DDP change 4: the plain model's weights (not the DDP wrapper's), saved once.
    weights = t.model.state_dict()
{% endif %}
    by_rank_0(device, save_final, weights, out_dir, args.tensorboard)
    return 0


def save_final(weights, out_dir, tensorboard):
    """Rank 0, at the run's end: model_final.pt, the plot, and where they are."""
    save_atomic(weights, out_dir / "model_final.pt")
{% if strategy == "final_only" and fsdp %}
    # final_only: the checkpoint a stop or --save-every wrote goes
    shutil.rmtree(out_dir / "checkpoint_last", ignore_errors=True)
{% elif strategy == "final_only" %}
    # final_only: the checkpoint a stop or --save-every wrote goes
    (out_dir / "checkpoint_last.pt").unlink(missing_ok=True)
{% endif %}
    plotted = plot_losses(out_dir / "metrics.csv", out_dir / "loss.png")
    report_outputs(out_dir, plotted, tensorboard)


def finished(t, at):
    if t.args.max_steps:
        return at.step >= t.args.max_steps
    return at.epoch >= t.args.epochs


def train_pass(t, at, reports):
    """Train on this rank's share of a pass, from `at` to the pass's end (or to
    --max-steps): forward, backward, an optimizer update every --grad-accum
    micro-batches, and after each update what falls due (a check, an evaluation, a
    save). Returns True when a stop signal asks to stop, after saving."""
    args, device = t.args, t.device
    t.{{ wrapper }}.train()
    # Per-rank randomness (dropout, augmentation): the same after a resume at a pass
    # boundary; after a mid-pass stop, the rest of the pass differs.
    torch.manual_seed(args.seed + at.epoch * dist.get_world_size() + dist.get_rank())
    t.sums.start_pass(at, args.batch_size)
    micro = 0  # micro-batches of this pass in this run
    for batch, real, position, last, state in reports.batches(pass_data(t, at), at):
        batch = to_device(batch, device)
        micro += 1
        sync = micro % args.grad_accum == 0 or last
{% if fsdp %}
        # DDP change 3 (FSDP2): gradients are reduce-scattered over the ranks in the
        # backward pass of the last micro-batch of each update only.
        t.model.set_requires_gradient_sync(sync)
        with torch.autocast(device.type, AMP_DTYPES[args.amp], args.amp != "none"):
            loss, n = compute_loss(t.train_model, batch)
        n = n if real else 0  # a stand-in batch at a stream's end weighs nothing
        # The loss summed over the batch's n units, at the usual scale (n / batch size
        # is 1 for a per-sample loss); update() divides by the global units.
        t.scaler.scale(loss * (n / args.batch_size)).backward()
{% else %}
        # DDP change 3: the gradient all-reduce runs in the backward pass of the last
        # micro-batch of each update only; no_sync() skips it for the others.
        with contextlib.nullcontext() if sync else t.ddp_model.no_sync():
            with torch.autocast(device.type, AMP_DTYPES[args.amp], args.amp != "none"):
                loss, n = compute_loss(t.ddp_model, batch)
            n = n if real else 0  # a stand-in batch at a stream's end weighs nothing
            # The loss summed over the batch's n units, at the usual scale (n / batch
            # size is 1 for a per-sample loss); update() divides by the global units.
            t.scaler.scale(loss * (n / args.batch_size)).backward()
{% endif %}
        t.sums.add(loss, n)
        if sync:
            update(t, t.sums.take_group_units())
            at.step, at.samples, at.stream = at.step + 1, position, state
            if last:  # the pass is done
                at.epoch, at.samples, at.stream = at.epoch + 1, 0, None
            if after_update(t, at, reports, last):
                return True
            if at.step == args.max_steps:
                return False
    if not micro:
        raise failure("error: build_datasets() returned an empty training stream")
    return False


def pass_data(t, at):
    """This rank's batches of the pass from `at` on, each as (batch, real: False for
    a stand-in, the pass's samples done after it over all ranks, whether it ends the
    pass, the stream's state_dict() there or None)."""
    # DDP change 2: a new shuffle each pass, the same on every rank. Without this
    # call every pass repeats the first one's order.
{% if cookiecutter.use_batch_sampler %}
    # (The BatchSampler draws from this same sampler, so it follows.)
{% endif %}
    t.train_data.set_epoch(at.epoch, at.samples, at.stream)
    if isinstance(t.train_data, StreamShard):
        yield from t.train_loader  # it says all of that itself
        return
    start, per_step = at.samples, t.args.batch_size * dist.get_world_size()
    total = len(t.train_data.sampler) * dist.get_world_size()  # padded to equal shares
    steps = len(t.train_loader)
    for j, batch in enumerate(t.train_loader, 1):
        yield batch, True, min(start + j * per_step, total), j == steps, None


def after_update(t, at, reports, last):
    """What falls due after an update: every LOG_EVERY updates a check; an
    evaluation at --eval-every, a pass's end and the run's end; a checkpoint at
{% if strategy == "final_only" %}
    --save-every and a stop signal. Returns True when a stop signal asks to stop
    (after saving)."""
{% elif strategy == "best" %}
    --save-every, a pass's end, the run's end, a stop signal and a better
    evaluation. Returns True when a stop signal asks to stop (after saving)."""
{% else %}
    --save-every, a pass's end, the run's end and a stop signal. Returns True when a
    stop signal asks to stop (after saving)."""
{% endif %}
    args = t.args
    end = last or at.step == args.max_steps
    evaluating = end or (args.eval_every and at.step % args.eval_every == 0)
    saving = args.save_every and at.step % args.save_every == 0
    if not (evaluating or saving or at.step % LOG_EVERY == 0):
        return False
    stop = check(t, reports) and not finished(t, at)
    reports.step_done()  # the step ends here: evaluations and saves are not training
{% if strategy == "best" %}
    names = []  # the checkpoints to write
{% endif %}
    if evaluating:
{% if fsdp %}
        # Each rank keeps its own BatchNorm running statistics: take rank 0's, which
        # the checkpoints and model_final.pt hold. Every rank takes every forward.
{% else %}
        # Evaluate the weights rank 0 saves: parameters match on every rank, but
        # each rank keeps its own BatchNorm running statistics, so take rank 0's.
        # Use the plain model: DDP's forward would wait for ranks with more
        # validation batches.
{% endif %}
        for buffer in t.model.buffers():
            dist.broadcast(buffer, src=0)
        metrics = evaluate(t.model, t.val_loader, t.device)
        reports.row(at, metrics)
{% if strategy == "best" %}
        if metrics["loss"] < t.best_val_loss:
            t.best_val_loss = metrics["loss"]
            names.append("checkpoint_best{{ ext }}")
    if stop or saving or end:
        names.append("checkpoint_last{{ ext }}")
    if names:
        with reports.aside():  # not training: kept out of the step times
            save_checkpoints(t, at, names)
{% elif strategy == "every_epoch" %}
    if stop or saving or end:
        names = ["checkpoint_last{{ ext }}"]
        if last:
            names.append(f"checkpoint_epoch{at.epoch:03d}{{ ext }}")
        with reports.aside():  # not training: kept out of the step times
            save_checkpoints(t, at, names)
{% elif strategy == "final_only" %}
    if stop or saving:  # final_only keeps none at a pass's end
        with reports.aside():  # not training: kept out of the step times
            save_checkpoints(t, at, ["checkpoint_last{{ ext }}"])
{% else %}
    if stop or saving or end:
        with reports.aside():  # not training: kept out of the step times
            save_checkpoints(t, at, ["checkpoint_last{{ ext }}"])
{% endif %}
    return stop


{% if fsdp %}
def save_checkpoints(t, at, names):
    """DDP change 4 (FSDP2): a checkpoint is a folder into which every rank writes its
    shards of the model and the optimizer (torch.distributed.checkpoint), and rank 0
    the rest of the state (train_state.pt). It is written as NAME.tmp, renamed once
    complete: a folder under its own name is always whole."""
    state = snapshot(t, at)
    shards = dict(zip(("model", "optimizer"), get_state_dict(t.model, t.optimizer)))
    out_dir = Path(t.args.output_dir)
    tmp = out_dir / f"{names[0]}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crash left
        tmp.mkdir(parents=True)
    dist.barrier()  # before anyone writes into it
    dcp.save(shards, checkpoint_id=tmp, planner=RANK_0_WRITES_REPLICAS)
    by_rank_0(t.device, commit, state, tmp, [out_dir / name for name in names])


def commit(state, tmp, paths):
    """Rank 0: the rest of the state into the folder `tmp`, which then takes the
    place of each path (a copy for all but the first)."""
    save_atomic(state, tmp / "train_state.pt")
{% if strategy in ("best", "every_epoch") %}
    for path in paths[1:]:  # the same checkpoint under another name: a copy
        copy = path.with_name(f"{path.name}.tmp")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(tmp, copy)
        replace_folder(copy, path)
{% endif %}
    replace_folder(tmp, paths[0])


def replace_folder(new, path):
    """Put the folder `new` in `path`'s place. The old one moves aside first (as
    NAME.old, which load_checkpoint takes if a crash comes between the two renames)."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)
{% else %}
def save_checkpoints(t, at, names):
    """DDP change 4: rank 0 alone saves, the state at `at` under each name. (Every
    rank calls it: the checkpoint's loss sums are added up over the ranks.)"""
    state = snapshot(t, at)
    out_dir = Path(t.args.output_dir)
    by_rank_0(t.device, save_each, state, [out_dir / name for name in names])


def save_each(state, paths):
    """Rank 0: the same checkpoint under each name."""
    for path in paths:
        save_atomic(state, path)
{% endif %}


def datasets(args):
    """build_datasets(), refusing an empty set in one line (a stream without a
    length: when it yields nothing)."""
    train_set, val_set = build_datasets(args)
    for name, data in (("training", train_set), ("validation", val_set)):
        if isinstance(data, Sized) and len(data) == 0:
            raise failure(f"error: build_datasets() returned an empty {name} set")
    return train_set, val_set


def build_training(args, device, checkpoint):
{% if fsdp %}
    """Data, model sharded with FSDP2, optimizer and loss scaler, as build_* say."""
{% else %}
    """Data, model, DDP wrapper, optimizer and loss scaler, as build_* say."""
{% endif %}
    world_size = dist.get_world_size()
    settle_global_batch(args, checkpoint, world_size)
    torch.manual_seed(args.seed)  # reproducible initial weights and data
    train_set, val_set = datasets(args)
    train_data, train_loader, val_loader = build_loaders(
        train_set, val_set, args, device
    )
    steps_per_pass = pass_steps(train_set, train_loader, args)
    if args.max_steps:
        total_updates = args.max_steps
    elif steps_per_pass is None:
        raise failure(
            "error: build_datasets() returned a training stream without a length: "
            "give the run's length in optimizer updates, --max-steps N",
            status=2,
        )
    else:
        total_updates = args.epochs * math.ceil(steps_per_pass / args.grad_accum)
    model = build_model(args)
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
{% if fsdp %}
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fastest kernels for fixed shapes
    model.to(device)
    shard(model, args)  # DDP change 3 (FSDP2), before the optimizer sees the model
    optimizer, scheduler = build_optimizer(model, args, total_updates)
    # float16 needs loss scaling against underflowing gradients; otherwise a no-op.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    return Training(
        args,
        device,
        model,
        torch.compile(model) if args.compile else model,
        optimizer,
        scheduler,
        scaler,
        train_data,
        train_loader,
        val_loader,
        steps_per_pass,
        total_updates,
    )


def shard(model, args):
    """DDP change 3 (FSDP2): shard the parameters over the ranks, block by block:
    fully_shard() on each of sharded_blocks(model), then on the root, which keeps the
    rest. A block's parameters are gathered from all ranks for its forward and
    backward, and freed after; its gradients are reduce-scattered. So each rank holds
    1/world_size of the parameters, of the gradients, and of the optimizer state (the
    optimizer, built after this, sees the shards)."""
    # fully_shard() sends nothing: every rank starts from rank 0's weights.
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    for block in reversed(sharded_blocks(model)):  # inner blocks before outer ones
        fully_shard(block, **precision(block, args))
    fully_shard(model, **precision(model, args))


def sharded_blocks(model):
    """The modules sharded on their own: the blocks of every nn.ModuleList (such as a
    transformer's layers), else each child of the root that holds parameters (the
    default model's layers). Another rule for your model goes here."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        return [block for blocks in lists for block in blocks]
    return [child for child in model.children() if list(child.parameters())]


def precision(module, args):
    """With --amp bf16: gather the parameters in bfloat16 and reduce the gradients in
    float32; not for BatchNorm, whose running statistics stay in float32."""
    batch_norm = nn.modules.batchnorm._BatchNorm
    if args.amp != "bf16" or any(isinstance(m, batch_norm) for m in module.modules()):
        return {}
    policy = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)
    return {"mp_policy": policy}
{% else %}
    memory_format = torch.preserve_format
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fastest kernels for fixed shapes
        # NHWC weights for 2-D convolutions (which convert their input to match);
        # models with 5-D weights (3-D convolutions) keep their layout.
        if CHANNELS_LAST and all(p.dim() < 5 for p in model.parameters()):
            memory_format = torch.channels_last
    model.to(device, memory_format=memory_format)
    optimizer, scheduler = build_optimizer(model, args, total_updates)
    # float16 needs loss scaling against underflowing gradients; otherwise a no-op.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    # DDP change 3: wrap the model. Its backward pass averages gradients over all ranks,
    # so every replica takes the same optimizer step. Train through ddp_model; save
    # and evaluate the plain model, whose parameters ddp_model trains.
    device_ids = [device.index] if device.type == "cuda" else None
    # torch.compile inside DDP: the compiled graph is split at DDP's gradient buckets,
    # so the all-reduce still overlaps with the backward pass.
    ddp_model = DDP(
        torch.compile(model) if args.compile else model,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
    )
    return Training(
        args,
        device,
        model,
        ddp_model,
        optimizer,
        scheduler,
        scaler,
        train_data,
        train_loader,
        val_loader,
        steps_per_pass,
        total_updates,
    )
{% endif %}


def pass_steps(train_set, train_loader, args):
    """Micro-batches per pass and rank; None for a stream without a length."""
    if not isinstance(train_set, IterableDataset):
        return len(train_loader)
    if not isinstance(train_set, Sized):
        return None
    return math.ceil(len(train_set) / (args.batch_size * dist.get_world_size()))


def loader_options(data, args, device):
    """The DataLoader settings every loader here shares."""
    return {
        "collate_fn": getattr(data, "collate_fn", None),
        "num_workers": args.num_workers,
        "pin_memory": device.type == "cuda",
        "worker_init_fn": loader_worker_init,
    }


def build_loaders(train_set, val_set, args, device):
    """DDP change 2: each rank reads a different 1/world_size of the training set
    (a single-GPU script would pass shuffle=True to the DataLoader instead)."""
    if isinstance(train_set, IterableDataset):
        train_data = StreamShard(
            train_set, args.batch_size, lockstep=True, keep_state=True
        )
        options = loader_options(train_data, args, device)
        train_loader = DataLoader(train_data, batch_size=None, **options)
        return train_data, train_loader, build_val_loader(val_set, args, device)
    common = loader_options(train_set, args, device)
    shard = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_data = ResumableSampler(shard)
{% if cookiecutter.use_batch_sampler %}
    batch_sampler = BatchSampler(train_data, args.batch_size, drop_last=False)
    train_loader = DataLoader(train_set, batch_sampler=batch_sampler, **common)
{% else %}
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=train_data, **common
    )
{% endif %}
    return train_data, train_loader, build_val_loader(val_set, args, device)


def build_val_loader(val_set, args, device):
    """Validation shards take every world_size-th sample with no padding, so the
    summed metrics count each sample exactly once (DistributedSampler would repeat
    some); a stream is cut the same way."""
    if isinstance(val_set, IterableDataset):
        shard = StreamShard(val_set, args.batch_size, lockstep={{ fsdp }})
        return DataLoader(shard, batch_size=None, **loader_options(shard, args, device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = Subset(val_set, range(rank, len(val_set), world_size))
    options = loader_options(val_set, args, device)
    return DataLoader(shard, batch_size=args.batch_size, **options)


class ResumableSampler(Sampler):
    """The shard of a DistributedSampler, from a given position: a run stopped
    mid-pass resumes with the next batch, without reading the ones already done."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, 0

    def set_epoch(self, epoch, samples=0, state=None):
        """Pass `epoch`, after `samples` of it (over all ranks); a sampler needs no
        `state` to get there."""
        self.sampler.set_epoch(epoch)
        self.start = samples // self.sampler.num_replicas

    def __iter__(self):
        return itertools.islice(self.sampler, self.start, None)

    def __len__(self):
        return len(self.sampler) - self.start


class StreamShard(IterableDataset):
    """DDP change 2 for a stream (an IterableDataset, from build_datasets): this
    rank's share of it, cut as DistributedSampler and BatchSampler cut a map-style
    set (the stream shuffles itself, or not). Each pass is read in blocks of
    world_size x batch_size items, one step of every rank; a rank takes every
    world_size-th item of a block from its rank on, and its DataLoader worker w the
    blocks w, w + workers, ... So within a pass every item is used once, a global
    batch is the same items for any number of processes and workers, and every rank
    takes the same steps: where the last block leaves a rank nothing, it takes a
    stand-in step on other items that weighs nothing (lockstep, where every rank must
    take every step).

    Every reader (rank and worker) reads the whole stream and skips the items of the
    others: keep them cheap to read, and decode in the dataset's collate_fn, which
    runs on a reader's own items only. A resume starts a pass in the middle: a stream
    with state_dict() and load_state_dict() goes there at once, another is read up to
    there again."""

    def __init__(self, stream, batch_size, lockstep, keep_state=False):
        self.stream, self.batch_size, self.lockstep = stream, batch_size, lockstep
        self.keep_state = keep_state  # training: rank 0's batches carry the state
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.collate = getattr(stream, "collate_fn", None) or default_collate
        self.epoch, self.start, self.state = 0, 0, None

    def set_epoch(self, epoch, samples=0, state=None):
        """Pass `epoch`, after `samples` of its items, where the stream's
        state_dict() was `state` (if it has one)."""
        self.epoch, self.start, self.state = epoch, samples, state

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        # This reader reads the whole stream: hide the workers from a stream that
        # would split itself among them (as Hugging Face's does).
        torch.utils.data._utils.worker._worker_info = None
        stream, width = self.stream, self.world_size * self.batch_size
        if hasattr(stream, "set_epoch"):
            stream.set_epoch(self.epoch)
        if self.state is not None and hasattr(stream, "load_state_dict"):
            stream.load_state_dict(self.state)
            items = iter(stream)
        else:
            items = itertools.islice(stream, self.start, None)  # read up to there
        # Rank 0's batches carry the state a checkpoint after them keeps.
        keep = self.keep_state and self.rank == 0 and hasattr(stream, "state_dict")
        position, pending = self.start, None
        for step in itertools.count():
            state = copy.deepcopy(stream.state_dict()) if keep and pending else None
            block = list(itertools.islice(items, width))
            if pending:  # the previous block's: now known to end the pass or not
                yield (*pending, not block, state) if self.lockstep else pending[0]
            if not block:
                return
            position += len(block)
            share = block[self.rank :: self.world_size]
            pending = None
            if step % workers == worker and (share or self.lockstep):
                # No share in the last block: a stand-in, other items of the block.
                batch = self.collate(share or block[: self.batch_size])
                pending = (batch, bool(share), position)


def loader_worker_init(worker_id):
    """DataLoader workers keep serving batches on SIGTERM and Ctrl-C: the training
    process stops at its next check, saves, and shuts them down itself. On Linux they
    also die with it: a forked worker holds copies of its sockets, and left alive it
    would keep the other ranks waiting for a rank that is gone."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=False)  # for the hang watch
    signal_when_parent_ends(signal.SIGKILL)


def signal_when_parent_ends(signum):
    """Linux: the kernel sends this process `signum` when the process that started
    it ends, however it ends (kill -9 too)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signum)  # PR_SET_PDEATHSIG


def to_device(batch, device):
    """Move every tensor of a batch (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):  # dict, or e.g. transformers' BatchEncoding
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


class LossSums:
    """This rank's training loss since the last evaluation, summed over units, and
    the units, on the device (no sync per step); the units of the update being
    accumulated; and the losses since the last check(), to name the step where one
    stopped being finite."""

    def __init__(self, device, args, carried=(0.0, 0.0)):
        self.loss = torch.tensor(carried[0], dtype=torch.float64, device=device)
        self.units = torch.tensor(carried[1], dtype=torch.float64, device=device)
        self.group = torch.zeros((), dtype=torch.float64, device=device)
        self.recent = torch.zeros(LOG_EVERY * args.grad_accum, device=device)
        self.count = 0  # losses in recent
        self.epoch = self.next_step = 0  # the pass and micro-batch of recent[0]

    def start_pass(self, at, batch_size):
        self.epoch = at.epoch
        self.next_step = at.samples // (batch_size * dist.get_world_size())

    def add(self, loss, n):
        loss = loss.detach()
        self.loss += loss.double() * n
        self.units += n
        self.group += n
        self.recent[self.count] = loss
        self.count += 1

    def take_group_units(self):
        units, self.group = self.group, torch.zeros_like(self.group)
        return units

    def totals(self, reset=False):
        """(loss sum, units) over all ranks; reset: start counting afresh."""
        totals = torch.stack([self.loss, self.units])
        dist.all_reduce(totals)
        if reset:
            self.loss.zero_()
            self.units.zero_()
        return tuple(totals.tolist())


def update(t, units):
{% if fsdp %}
    """One optimizer update, after the backward pass of the last micro-batch (whose
    reduce-scatter, DDP change 3, averaged the gradients over the ranks: each rank
    holds its shard of them, and updates its shard of the parameters)."""
{% else %}
    """One optimizer update, after the backward pass of the last micro-batch (whose
    all-reduce, DDP change 3, averaged the gradients over the ranks)."""
{% endif %}
    args = t.args
    # The gradients are of loss sums, averaged over ranks: divide them by the mean
    # units per rank, so that every update follows the mean loss over all units of
    # the global batch, for any number of processes and --grad-accum.
    dist.all_reduce(units)
    units.clamp_(min=1)  # an update of padding alone: zero gradients, not 0 / 0
    t.scaler.unscale_(t.optimizer)  # --amp fp16: the true gradients, for clipping
    grads = [p.grad for p in t.model.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, args.batch_size * dist.get_world_size() / units)
    if args.clip_grad_norm:
        nn.utils.clip_grad_norm_(t.model.parameters(), args.clip_grad_norm)
    t.scaler.step(t.optimizer)  # skipped when fp16 gradients overflowed
    t.scaler.update()
    t.optimizer.zero_grad(set_to_none=True)
    if t.scheduler:
        t.scheduler.step()


def check(t, reports):
    """The loop's one wait for the device, every LOG_EVERY updates and before every
    evaluation and save: every rank learns whether any rank got SIGTERM (returns
    True), or saw a loss or weights that are not finite (then the run stops, saving
    nothing)."""
    sums = t.sums
    recent = sums.recent[: sums.count]
{% if fsdp %}
    shards = (p.to_local() for p in t.model.parameters())  # each rank checks its own
    finite = torch.isfinite(recent).all() & all_finite(shards)
{% else %}
    finite = torch.isfinite(recent).all() & all_finite(t.model.parameters())
{% endif %}
    stopping = float(STOP_SIGNAL is not None)
    flags = torch.stack([finite.new_full((), stopping, dtype=torch.float64), ~finite])
    dist.all_reduce(flags)
    stop, diverged = flags.tolist()
    if diverged:
        raise diverged_failure(recent, sums.next_step, sums.epoch, t.device)
    if len(recent):
        reports.show_loss(recent.mean())
    sums.next_step += sums.count
    sums.count = 0
    return stop > 0


def all_finite(tensors):
    return torch.stack([tensor.isfinite().all() for tensor in tensors]).all()


def diverged_failure(recent, first_step, epoch, device):
    """The error for a loss or weights that stopped being finite: the first such step
    over all ranks, with its rank and value."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    bad = (~torch.isfinite(recent)).nonzero().flatten().tolist()
    first = (first_step + bad[0]) * world_size + rank if bad else math.inf
    first = torch.tensor(float(first), dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    if not math.isfinite(first.item()):
        where = f"the weights stopped being finite in epoch {epoch + 1}"
    else:
        step, bad_rank = divmod(int(first.item()), world_size)
        value = recent[step - first_step] if bad_rank == rank else torch.zeros(())
        value = value.to(device)
        dist.broadcast(value, src=bad_rank)
        where = (
            f"the loss is {value.item()} in epoch {epoch + 1} at batch {step + 1} "
            f"(rank {bad_rank})"
        )
    return failure(
        f"error: {where}; stopped without saving it. Try a lower --lr, "
        "--clip-grad-norm 1.0, or --amp bf16 instead of fp16"
    )


def stopped(last_path, at, batch_size):
    """After the checkpoint a stop signal asked for: one line, and the exit status."""
    # The signal this rank got; a rank stopped by another's signal reports SIGTERM.
    signum = STOP_SIGNAL or signal.SIGTERM
    word = "interrupted" if signum == signal.SIGINT else "preempted"
    print0(
        f"{word}: saved {last_path} {where(at, batch_size)}; run again to resume "
        "(--resume auto)"
    )
    return 128 + signum


def where(at, batch_size):
    """A position as the run's lines say it: "after epoch 2", "in epoch 3 after 20
    batches" (each process's batches, --batch-size each: with --grad-accum 2, two
    batches make an optimizer update)."""
    if not at.samples:
        return f"after epoch {at.epoch}"
    batches = at.samples // (batch_size * dist.get_world_size())
    return f"in epoch {at.epoch + 1} after {batches} batch{'es' * (batches != 1)}"


@torch.no_grad()
def evaluate(model, loader, device):
    """compute_metrics over the whole validation set, exact for any world size: each
    metric's sum and n are added up over batches and ranks, then divided."""
    model.eval()
    sums = {}  # name -> float64 [sum, n] on the device
{% if fsdp %}
    for batch, real in lockstep(loader):
        WATCH.beat()
        metrics = compute_metrics(model, to_device(batch, device))
        if not real:
            continue
        for name, (total, n) in metrics.items():
{% else %}
    for batch in loader:
        WATCH.beat()
        metrics = compute_metrics(model, to_device(batch, device))
        for name, (total, n) in metrics.items():
{% endif %}
            if name not in sums:
                sums[name] = torch.zeros(2, dtype=torch.float64, device=device)
            sums[name][0] += total
            sums[name][1] += n
    model.train()
    # Rank 0 has validation data unless there is none; a rank without any takes its
    # names.
    names = broadcast_bytes("\n".join(sums).encode(), device).decode().split("\n")
    if names == [""]:
        raise failure("error: build_datasets() returned an empty validation stream")
    if "loss" not in names:
        raise failure("error: compute_metrics must return a 'loss' entry")
    zero = torch.zeros(2, dtype=torch.float64, device=device)
    totals = torch.stack([sums.get(name, zero) for name in names])
    dist.all_reduce(totals)  # sum over ranks
    values = zip(names, totals.tolist(), strict=True)
    return {name: s / n if n else math.nan for name, (s, n) in values}


{% if fsdp %}
def lockstep(loader):
    """FSDP2: this rank's validation batches as (batch, real), where each forward
    gathers the parameters from every rank: so every rank takes as many as the rank
    with the most, the others padding with stand-ins (real False) that count nothing."""
    if isinstance(loader.dataset, StreamShard):  # a stream: it pads itself
        for batch, real, *_ in loader:
            yield batch, real
        return
    shard = loader.dataset  # every world_size-th sample of the set, from this rank's
    most = math.ceil(len(shard.dataset) / dist.get_world_size())  # rank 0's
    batch = None
    for batch in loader:
        yield batch, True
    if batch is None:  # fewer samples than ranks: this one has none
        batch = loader.collate_fn([shard.dataset[0]])
    for _ in range(math.ceil(most / loader.batch_size) - len(loader)):
        yield batch, False


{% endif %}
def evaluate_saved(args, device):
    """--evaluate PATH: the exact evaluation above, on every rank, of the weights in
    PATH (model_final.pt, or a checkpoint's); one line of metrics, nothing written."""
    path = Path(args.evaluate)
{% if fsdp %}
    torch.manual_seed(args.seed)  # the data build_datasets() makes for this seed
    _, val_set = datasets(args)
    model = build_model(args).to(device)
    shard(model, args)
    if path.is_dir():  # a checkpoint folder: its shards, resharded for this run
        load_shards(model, None, path, "evaluate")
    else:
        saved = load_shared(path, device, "evaluate")
        load_weights(model, saved["model"] if "optimizer" in saved else saved, path)
{% else %}
    saved = load_shared(path, device, "evaluate")
    torch.manual_seed(args.seed)  # the data build_datasets() makes for this seed
    _, val_set = datasets(args)
    model = build_model(args).to(device)
    load_weights(model, saved["model"] if "optimizer" in saved else saved, path)
{% endif %}
    metrics = evaluate(model, build_val_loader(val_set, args, device), device)
    print0(f"evaluate {path}  {one_line(metrics, 'val_')}")
    return 0


def one_line(values, prefix=""):
    """name value pairs as a run's lines show them: "val_loss 2.3  val_acc 0.1"."""
    return "  ".join(f"{prefix}{name} {value:.6g}" for name, value in values.items())


# --------------------------------------------------------------------------------------
# Checkpoints and resuming (rank 0 writes; every rank reads through rank 0)
# --------------------------------------------------------------------------------------
def snapshot(t, at):
    """Everything a resume needs: the state at `at`. (Every rank calls it: the loss
    sums since the last evaluation are added up over the ranks.)"""
    args, world_size = t.args, dist.get_world_size()
    sums = t.sums.totals()
    return {
{% if fsdp %}
        # The model's and the optimizer's tensors: every rank's shards, beside this.
        "optimizer": {"param_groups": t.optimizer.state_dict()["param_groups"]},
{% else %}
        # DDP change 4: the plain model (not the DDP wrapper, nor torch.compile's), so
        # the weights load without either and without a "module." prefix in keys.
        "model": t.model.state_dict(),
        "optimizer": t.optimizer.state_dict(),
{% endif %}
        "scheduler": t.scheduler.state_dict() if t.scheduler else None,
        "scaler": t.scaler.state_dict(),
        "epoch": at.epoch,  # passes done
        "epoch_samples": at.samples,  # of the pass under way, over all ranks
        "step": at.step,  # optimizer updates done
        "stream": at.stream,  # the training stream's state_dict() there, or None
        "train_sums": list(sums),  # loss sum and units since the last evaluation
        "global_batch": [world_size, args.batch_size, args.grad_accum],
        "total_updates": t.total_updates,
{% if strategy == "best" %}
        "best_val_loss": t.best_val_loss,
{% endif %}
        "args": {key: plain(value) for key, value in vars(args).items()},
    }


def plain(value):
    """A value weights_only=True loads: a Path (say, from a flag you add) as text."""
    simple = isinstance(value, (bool, int, float, str, type(None)))
    return value if simple else str(value)


def save_atomic(obj, path):
    """torch.save(obj) to `path`, whole or not at all (see replacing)."""
    with replacing(path, "wb") as f:
        torch.save(obj, f)


@contextlib.contextmanager
def replacing(path, mode):
    """A temporary file to write, renamed to `path` once complete: a crash or a
    failed write (a full disk) leaves `path` as it was; a failed write ends the run
    with one line."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open(mode, newline=None if "b" in mode else "") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch.save's failed writes: RuntimeError
        tmp.unlink(missing_ok=True)
        reason = getattr(err, "strerror", None) or str(err).strip().splitlines()[0]
        free = shutil.disk_usage(path.parent).free / 2**30
        raise failure(
            f"error: cannot write {path} ({reason}; {free:.1f} GB free there); "
            f"{path.name} is left as it was"
        ) from None


def by_rank_0(device, write, *args):
    """DDP change 4: rank 0 alone calls write(*args), which writes files. The others
    wait for it (as they would at the next collective), so that a write that fails
    there ends every rank together, with one line from rank 0."""
    failed = torch.zeros((), device=device)
    if dist.get_rank() == 0:
        try:
            write(*args)
        except SystemExit:  # a file's write failed, and replacing() said so
            failed.fill_(1)
        except OSError as err:  # a folder that cannot be made, copied or moved
            failure(f"error: cannot write {err.filename}: {err.strerror or err}")
            failed.fill_(1)
    dist.broadcast(failed, src=0)
    if failed.item():
        raise SystemExit(1)


{% if fsdp %}
def load_checkpoint(resume, last_path, device):
    """Return the checkpoint to resume from (its train_state.pt, and the folder's
    path for the shards), or None to start fresh. Every rank reads the same folder:
    FSDP2's checkpoints need a disk that every machine sees."""
    path = last_path if resume == "auto" else Path(resume)
    moved_aside = path.with_name(path.name + ".old")  # see replace_folder()
    if resume == "auto" and not path.exists() and moved_aside.exists():
        path = moved_aside
    wanted = resume != "never" and (resume != "auto" or path.exists())
    state = path / "train_state.pt"
    checkpoint = load_shared(state if wanted else None, device, "resume from")
    if checkpoint is None:
        return None
    if not {"optimizer", "epoch", "global_batch"} <= set(checkpoint):
        raise failure(
            f"error: cannot resume from {path}: not a checkpoint of this project (no "
            "optimizer, epoch and global_batch keys)"
        )
    return checkpoint | {"path": str(path)}


def load_shards(model, optimizer, path, verb, advice=""):
    """FSDP2: the model's (and the optimizer's, if given) shards from a checkpoint
    folder, resharded for this run's number of ranks; one line if they do not fit."""
    if optimizer is None:
        shards = {"model": get_model_state_dict(model)}
    else:
        shards = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
    try:
        dcp.load(shards, checkpoint_id=path)
    except Exception as err:  # DCP wraps every rank's error in one
        reason = [line for line in str(err).splitlines() if "Error" in line]
        reason = (reason or [repr(err)])[-1].split("Error: ")[-1].strip()
        raise failure(
            f"error: cannot {verb} {path}: it does not fit the model build_model() "
            f"makes ({reason}){advice}"
        ) from err
    if optimizer is None:
        set_model_state_dict(model, shards["model"])
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=shards["model"],
            optim_state_dict=shards["optimizer"],
        )
{% else %}
def load_checkpoint(resume, last_path, device):
    """Return the checkpoint to resume from, or None to start fresh."""
    path = last_path if resume == "auto" else Path(resume)
    wanted = resume != "never" and (resume != "auto" or path.exists())
    checkpoint = load_shared(path if wanted else None, device, "resume from")
    if checkpoint is None:
        return None
    if not {"model", "optimizer", "epoch", "global_batch"} <= set(checkpoint):
        raise failure(
            f"error: cannot resume from {path}: not a checkpoint (no model, optimizer, "
            "epoch and global_batch keys)"
        )
    return checkpoint | {"path": str(path)}
{% endif %}


def load_shared(path, device, verb):
    """The dict saved in `path` (None for no path), on every rank. Rank 0 reads the
    file and sends its bytes to the others, so machines need not share a disk; each
    rank loads them with weights_only=True. A file that cannot be read or loaded:
    one line, "error: cannot <verb> <path>: <why>"."""
    data, error = None, None
    if dist.get_rank() == 0 and path is not None:
        try:
            data = path.read_bytes()
        except OSError as err:
            error = f"error: cannot {verb} {path}: {err.strerror or err}"
    failed = torch.tensor(float(error is not None), device=device)
    dist.broadcast(failed, src=0)
    if failed.item():
        raise failure(error)
    data = broadcast_bytes(data, device)
    if data is None:
        return None
    try:
        # weights_only=True: a checkpoint is data; never run code from a pickle.
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if not isinstance(loaded, dict):
            raise TypeError(f"it holds a {type(loaded).__name__}, not a dict")
    except Exception as err:  # torch.load raises many kinds on a corrupt file
        lines = [line for line in str(err).splitlines() if line.strip()] or [repr(err)]
        # weights_only says why in one of its lines: "unsupported GLOBAL posix.system"
        # (a pickle that would run code: refused), or "Unsupported operand" (no pickle).
        says = ("GLOBAL" in line or line.startswith("Unsupported") for line in lines)
        cause = next((line for line, why in zip(lines, says) if why), lines[0])
        if "GLOBAL" in cause:
            message = f"refused by weights_only=True ({cause.rstrip('.')})"
        else:
            message = f"not a checkpoint ({cause.rstrip('.')})"
        raise failure(f"error: cannot {verb} {path}: {message}") from err
    return loaded


def load_weights(model, weights, path, advice=""):
    """Load a state_dict into the model build_model() made, or say in one line why
    it does not fit (build_model() changed since it was saved, another project's)."""
    try:
{% if fsdp %}
        missing = sorted(set(model.state_dict()) - set(weights))
        if missing:  # set_model_state_dict() would keep the model's own values
            raise RuntimeError(f"Missing key(s) in state_dict: {', '.join(missing)}")
        options = StateDictOptions(full_state_dict=True)  # into the shards
        set_model_state_dict(model, weights, options=options)
{% else %}
        model.load_state_dict(weights)
{% endif %}
    except (RuntimeError, TypeError) as err:
        reason = str(err).strip().splitlines()[-1].strip()
        raise failure(
            f"error: {path} does not fit the model build_model() makes ({reason})"
            + advice
        ) from err


def broadcast_bytes(data, device):
    """Rank 0's bytes, on every rank, as a bytearray (None where rank 0 has None): a
    size, then the bytes as a uint8 tensor. (all_gather_object and friends would need
    NumPy.)"""
    size = torch.tensor(-1 if data is None else len(data), device=device)
    dist.broadcast(size, src=0)
    if size.item() < 0:
        return None
    buffer = bytearray(data) if dist.get_rank() == 0 else bytearray(size.item())
    if buffer:
        received = torch.frombuffer(buffer, dtype=torch.uint8).to(device)
        dist.broadcast(received, src=0)
        torch.frombuffer(buffer, dtype=torch.uint8).copy_(received)
    return buffer


def settle_global_batch(args, checkpoint, world_size):
    """Set args.grad_accum. A resumed run keeps the checkpoint's global batch (processes
    x batch x grad-accum), whatever its number of processes: then every update trains
    on the same samples as before, in the same order. It derives the grad-accum that
    does so, or refuses in one line unless --allow-batch-change."""
    if checkpoint is None:
        args.grad_accum = args.grad_accum or 1
        return
    old = checkpoint["global_batch"]  # [processes, batch, grad-accum]
    target, per_update = math.prod(old), world_size * args.batch_size
    if args.grad_accum is None:
        args.grad_accum = max(1, target // per_update)
    new = [world_size, args.batch_size, args.grad_accum]
    if math.prod(new) != target and not args.allow_batch_change:
        if target % world_size:
            hint = f"use a number of processes that divides {target}"
        else:
            hint = f"e.g. --batch-size {target // world_size} --grad-accum 1"
        raise failure(
            f"error: the checkpoint's global batch is {target} ({describe(old)}); "
            f"{describe(new)} make {math.prod(new)}: {hint}, or pass "
            f"--allow-batch-change to go on with {math.prod(new)}",
            status=2,
        )
    if new != old:
        kept = "kept" if math.prod(new) == target else f"changed from {target}"
        print0(
            f"resume: global batch {math.prod(new)} {kept}: {describe(new)} "
            f"(the checkpoint had {describe(old)})"
        )


def describe(global_batch):
    processes, batch, accum = global_batch
    noun = "process" if processes == 1 else "processes"
    return f"{processes} {noun} x batch {batch} x grad-accum {accum}"


def resume(t, checkpoint, out_dir):
    """Restore the state a checkpoint holds, trim metrics.csv to its updates, and
    return the Position training goes on from."""
    at, carried = Position(), (0.0, 0.0)
    if checkpoint is not None:
        advice = "; start afresh with --resume never or another --output-dir"
        if not same_optimizer(t, checkpoint):  # build_optimizer() changed since
            raise failure(
                f"error: {checkpoint['path']} holds another optimizer or LR schedule "
                f"than build_optimizer() makes{advice}"
            )
        # This run's optimizer settings, before the checkpoint's replace them.
        fresh = [
            {key: value for key, value in group.items() if key != "params"}
            for group in t.optimizer.param_groups
        ]
{% if fsdp %}
        load_shards(t.model, t.optimizer, checkpoint["path"], "resume from", advice)
{% else %}
        load_weights(t.model, checkpoint["model"], checkpoint["path"], advice)
        t.optimizer.load_state_dict(checkpoint["optimizer"])
{% endif %}
        if checkpoint["scaler"]:  # empty when it was saved without --amp fp16
            t.scaler.load_state_dict(checkpoint["scaler"])
        at = Position(
            checkpoint["epoch"],
            checkpoint["epoch_samples"],
            checkpoint["step"],
            checkpoint["stream"],
        )
        carried = tuple(checkpoint["train_sums"])  # over all ranks: rank 0 adds them
{% if strategy == "best" %}
        t.best_val_loss = checkpoint.get("best_val_loss", math.inf)
{% endif %}
        resume_position(t, at, math.prod(checkpoint["global_batch"]))
        restore_schedule(t, checkpoint, at.step, fresh)
        print0(f"resumed from {checkpoint['path']} {where(at, t.args.batch_size)}")
        if finished(t, at):
            length = "--max-steps" if t.args.max_steps else "--epochs"
            print0(
                f"resume: the run is done ({at.step} updates, {at.epoch} passes), "
                f"nothing to train; a larger {length} goes on, --resume never starts "
                "afresh"
            )
    t.sums = LossSums(t.device, t.args, carried if dist.get_rank() == 0 else (0, 0))
    saved_step = checkpoint["step"] if checkpoint else 0  # the rows' counting
    by_rank_0(t.device, start_metrics, out_dir, saved_step)
    return at


def resume_position(t, at, saved_batch):
    """The checkpoint's position as this run reads it. A sampler starts at a whole
    step, and a stream without a saved state is read up to it. After a change of the
    global batch (--allow-batch-change), the samples of a step begun are trained
    again, and the updates done are counted in updates of the new global batch."""
    args, world_size = t.args, dist.get_world_size()
    if isinstance(t.train_data, StreamShard):
        if at.samples and at.stream is None:
            print0(
                f"resume: the training stream has no state_dict(), so every reader "
                f"reads its first {at.samples} items again to get there"
            )
    elif again := at.samples % (args.batch_size * world_size):
        print0(f"resume: {again} samples of this pass are trained again")
        at.samples -= again
    global_batch = world_size * args.batch_size * args.grad_accum
    if global_batch != saved_batch and t.steps_per_pass:
        per_pass = math.ceil(t.steps_per_pass / args.grad_accum)
        at.step = at.epoch * per_pass + at.samples // global_batch
    elif global_batch != saved_batch:  # a stream of unknown length: by samples
        at.step = at.step * saved_batch // global_batch


def restore_schedule(t, checkpoint, done, fresh):
    """The LR schedule. A run whose length (--epochs, --max-steps), --lr or global
    batch changed gets the schedule a run with its arguments would have followed from
    the start, at the update it has reached (`done`), and one line saying so; its
    optimizer keeps the checkpoint's statistics and takes this run's settings
    (`fresh`)."""
    args, saved = t.args, checkpoint["args"]
    # A schedule counts updates: its length and the samples per update (the global
    # batch) place a run on it. Without a scheduler, only the LR matters.
    global_batch = dist.get_world_size() * args.batch_size * args.grad_accum
    was = checkpoint["total_updates"], math.prod(checkpoint["global_batch"])
    same_length = was == (t.total_updates, global_batch)
    if saved["lr"] == args.lr and (same_length or not t.scheduler):
        if t.scheduler:
            t.scheduler.load_state_dict(checkpoint["scheduler"])
        return
    # Keep the optimizer's statistics (momentum, Adam moments); take the new settings.
    for group, settings in zip(t.optimizer.param_groups, fresh, strict=True):
        group.update(settings)
    if t.scheduler:
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore")
            for _ in range(min(done, t.total_updates)):
                t.scheduler.step()
    lr = t.optimizer.param_groups[0]["lr"]
    print0(
        f"resume: the LR schedule is rebuilt for --lr {args.lr}, {t.total_updates} "
        f"updates of {global_batch} samples (the checkpoint's: --lr {saved['lr']}, "
        f"{was[0]} updates of {was[1]}); continuing at update {done}, LR {lr:.6g}"
    )


def same_optimizer(t, checkpoint):
    """Whether the checkpoint's optimizer and scheduler are of the kinds
    build_optimizer() makes: the same settings, parameter groups and state names."""

    def shape(groups):
        return [(sorted(group), len(group["params"])) for group in groups]

    saved = checkpoint["optimizer"]["param_groups"]
    if shape(saved) != shape(t.optimizer.state_dict()["param_groups"]):
        return False
    if t.scheduler is None or checkpoint["scheduler"] is None:
        return t.scheduler is None and checkpoint["scheduler"] is None
    return sorted(checkpoint["scheduler"]) == sorted(t.scheduler.state_dict())


# --------------------------------------------------------------------------------------
# Reports: progress, metrics.csv, the time per epoch, plots, preflight
# --------------------------------------------------------------------------------------
class Reports:
    """Everything a run reports besides the training itself: the progress bar, where
    the time goes, the profiler, metrics.csv, TensorBoard and the line per
    evaluation. Every rank times its own steps; rank 0 alone shows and writes."""

    def __init__(self, t, out_dir):
        self.t, self.out_dir = t, out_dir
        self.is_main = dist.get_rank() == 0
        self.progress = self.profiler = self.writer = None
        self.start_interval()
        if t.args.tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401 (optional: imported here)
            except ImportError as err:
                raise failure(
                    "error: --tensorboard needs TensorBoard: pip install tensorboard"
                ) from err

        # Optimizer steps are timed by hooks, so the loop carries no timing code.
        def begin(*_):
            self.began = self.mark()

        def end(*_):
            self.updates.append((self.began, self.mark()))

        self.hooks = [
            t.optimizer.register_step_pre_hook(begin),
            t.optimizer.register_step_post_hook(end),
        ]
{% if fsdp %}
        self.memory_shown = False
        self.hooks.append(t.optimizer.register_step_post_hook(self.show_memory))

    def show_memory(self, optimizer, *_):
        """FSDP2, after the first update (the optimizer's state exists from then on):
        the memory this rank holds, about 1/world_size of a whole copy's."""
        if self.memory_shown:
            return
        self.memory_shown = True
        params = list(self.t.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        state = [s for group in optimizer.state.values() for s in group.values()]
        sizes = [mib(params), mib(grads), mib(state)]
        print0(
            "memory per rank: parameters {:.2f} MiB, gradients {:.2f} MiB, optimizer "
            "state {:.2f} MiB".format(*sizes)
        )
{% endif %}

    def __enter__(self):
        args = self.t.args
        if self.is_main and args.profile_steps:
            self.profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=1, warmup=1, active=args.profile_steps, repeat=1
                ),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    str(self.out_dir / "profile")
                ),
            )
            self.profiler.start()
        if self.is_main and args.tensorboard:
            self.writer = torch.utils.tensorboard.SummaryWriter(
                self.out_dir / "tensorboard"
            )
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:  # they refer to self: let the training state go
            hook.remove()
        if self.profiler:
            self.profiler.stop()  # writes the trace if the run had fewer steps
        if self.writer:
            self.writer.close()

    def mark(self):
        """A point in time; on GPU, an event queued on the stream: no wait for it."""
        if self.t.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_interval(self):
        """From here on the next row's numbers: time, samples, steps, updates."""
        self.since, self.data_s, self.samples = time.perf_counter(), 0.0, 0
        self.steps, self.updates, self.step = [], [], None
        self.trained, self.aside_s = self.since, 0.0

    def step_done(self):
        """The step under way, if any, ends here: time it, and note when training
        stopped for the row."""
        if self.step is not None:
            self.steps.append((self.step, self.mark()))
            self.step = None
            self.trained = time.perf_counter()

    @contextlib.contextmanager
    def aside(self):
        """Work between steps that is not training (a save): in epoch_s, but kept out
        of the steps' times and samples_per_s."""
        tick = time.perf_counter()
        yield
        self.aside_s += time.perf_counter() - tick

    def batches(self, data, at):
        """The pass's (batch, ...) tuples from `data`, timed: the wait for each
        batch, and each step from its batch to the next request; and counted."""
        args, per_step = self.t.args, self.t.args.batch_size * dist.get_world_size()
        of = "" if args.max_steps else f"/{args.epochs}"
        self.progress = tqdm(
            total=self.t.steps_per_pass,
            initial=at.samples // per_step,
            desc=f"epoch {at.epoch + 1}{of}",
            leave=False,
            disable=not (self.is_main and sys.stderr.isatty()),
        )
        done = at.samples  # samples of the pass done, over all ranks
        try:
            while True:
                tick = time.perf_counter()
                item = next(data, None)
                self.data_s += time.perf_counter() - tick
                if item is None:
                    break
                self.step = self.mark()
                WATCH.beat()
                self.samples, done = self.samples + item[2] - done, item[2]
                yield item
                self.step_done()
                self.progress.update()
                if self.profiler:
                    self.profiler.step()
        finally:  # also when the loop stops early (a stop signal, an error)
            self.progress.close()

    def show_loss(self, loss):
        if not self.progress.disable:
            self.progress.set_postfix(loss=f"{loss.item():.4f}")

    def row(self, at, metrics):
        """An evaluation's row in metrics.csv (and TensorBoard), and its line: the
        training since the previous row (its steps; saves left out), then the
        validation metrics. Every rank calls it (the loss is summed over ranks)."""
        loss_sum, units = self.t.sums.totals(reset=True)
        row = None
        if self.is_main:
            if self.t.device.type == "cuda":
                torch.cuda.synchronize()  # the events above have all happened
            step_s = sum(seconds(a, b) for a, b in self.steps)
            optimizer_s = sum(seconds(a, b) for a, b in self.updates)
            trained_s = self.trained - self.since - self.aside_s  # saves left out
            epoch = at.epoch if not at.samples else at.epoch + 1  # done, or under way
            row = {"epoch": epoch, "step": at.step}
            row["train_loss"] = loss_sum / units if units else math.nan
            row |= {f"val_{name}": value for name, value in metrics.items()}
            row |= {
                "lr": self.t.optimizer.param_groups[0]["lr"],
                "samples_per_s": self.samples / trained_s,
                "epoch_s": time.perf_counter() - self.since,
                "data_s": self.data_s,
                "compute_s": step_s - optimizer_s,
                "optimizer_s": optimizer_s,
            }
        by_rank_0(self.t.device, self.write, row)
        self.start_interval()

    def write(self, row):
        """Rank 0: the row into metrics.csv and TensorBoard, and as a line."""
        append_metrics(self.out_dir / "metrics.csv", row)
        if self.writer:
            for key, value in row.items():
                self.writer.add_scalar(key, value, row["step"])
        args = self.t.args
        epoch, step = row.pop("epoch"), row.pop("step")
        if args.max_steps:
            head = f"step {step}/{args.max_steps}  epoch {epoch}"
        else:
            head = f"epoch {epoch}/{args.epochs}  step {step}"
        print(f"{head}  {one_line(row)}", flush=True)


{% if fsdp %}
def mib(tensors):
    """MiB of this rank's shards of these tensors (DTensors, or plain ones)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    sizes = [t.numel() * t.element_size() for t in local if torch.is_tensor(t)]
    return sum(sizes) / 2**20


{% endif %}
def seconds(begin, end):
    if isinstance(begin, float):
        return end - begin
    return begin.elapsed_time(end) / 1000  # call after torch.cuda.synchronize()


def start_metrics(out_dir, done):
    """Make the output folder; keep metrics.csv's rows of the updates already done
    (none on a fresh start), drop the rest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "metrics.csv"
    rows = read_metrics(path) if done else []
    write_metrics(path, [row for row in rows if int(row["step"]) <= done])


def append_metrics(path, row):
    """Add a row; a column new in it (a metric added on resume) joins the header."""
    write_metrics(path, [*read_metrics(path), row])


def read_metrics(path):
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_metrics(path, rows):
    """Rewrite metrics.csv whole (a row per evaluation: small), atomically."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with replacing(path, "w") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: text(value) for key, value in row.items()})


def text(value):
    return f"{value:.8g}" if isinstance(value, float) else str(value)


def plot_losses(metrics_path, png_path):
    """Train and validation loss at each evaluation; False without matplotlib."""
    try:  # optional; a Figure without pyplot draws off-screen and loads faster
        from matplotlib.figure import Figure
    except ImportError:
        return False
    rows = read_metrics(metrics_path)
    steps = [int(row["step"]) for row in rows]
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for key in ("train_loss", "val_loss"):
        axes.plot(steps, [float(row[key]) for row in rows], marker="o", label=key)
    axes.set_xlabel("optimizer updates")
    axes.set_ylabel("loss")
    axes.legend()
    figure.tight_layout()
    with replacing(png_path, "wb") as f:
        figure.savefig(f, format="png")
    return True


def report_outputs(out_dir, plotted, tensorboard):
    """One line at the end: where the results are, and how to look at them."""
    parts = [f"weights {out_dir / 'model_final.pt'}"]
    parts.append(f"metrics {out_dir / 'metrics.csv'}")
    if plotted:
        parts.append(f"plot {out_dir / 'loss.png'}")
    else:
        parts[-1] += " (pip install matplotlib for a plot)"
    if tensorboard:
        parts.append(f"view: tensorboard --logdir {out_dir / 'tensorboard'}")
    print("done: " + ", ".join(parts), flush=True)


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
    each = (time.perf_counter() - start) / repeats
    # Bus bandwidth, as nccl-tests reports it: what each link carries in a ring.
    gb_per_s = payload.numel() * 4 * 2 * (world_size - 1) / world_size / each / 1e9
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


# --------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------
def parse_args(argv=None):
    """The command line. A value that cannot work stops the run here, before anything
    starts: one line, exit status 2."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=ShowDefaults)
    parser.error = usage_error
    add_training_arguments(parser.add_argument_group("training"))
    add_long_run_arguments(parser.add_argument_group("long runs"))
    add_speed_arguments(parser.add_argument_group("speed and insight"))
    add_running_arguments(parser.add_argument_group("processes and machines"))
    args = parser.parse_args(argv)
    if not (args.evaluate or args.preflight):  # the modes that write nothing
        check_output_dir(args.output_dir)
{% if spawn and multi %}
    if args.node_rank >= args.nnodes:
        usage_error(f"argument --node-rank: must be below --nnodes {args.nnodes}")
{% endif %}
    return args


class ShowDefaults(argparse.HelpFormatter):
    """--help: each flag's meaning, then its default ("off" for a switch or an
    option that is unset unless given)."""

    def _get_help_string(self, action):
        meaning = action.help or ""
        if "default" in meaning or action.default == argparse.SUPPRESS:
            return meaning  # it says its default in its own words
        unset = action.default is None or action.default is False
        default = "off" if unset else "%(default)s"
        return f"{meaning} (default: {default})"


def check_output_dir(folder):
    """Refuse a --output-dir that rank 0 could not make or write in, before anything
    starts (this only looks: the folder is made when training starts)."""
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        usage_error(f"argument --output-dir: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        usage_error(f"argument --output-dir: no permission to write in {existing}")


def usage_error(message):
    """argparse's errors and ours: one line (rank 0), exit 2, before anything starts."""
    raise failure(f"error: {message} (see --help)", status=2)


def at_least(least, most=math.inf):
    """An argparse type: a whole number from `least` (to `most`)."""

    def number(text):
        value = int(text)
        if not least <= value <= most:
            top = "" if most == math.inf else f" and at most {most}"
            message = f"must be at least {least}{top}, not {value}"
            raise argparse.ArgumentTypeError(message)
        return value

    number.__name__ = "int"  # argparse: "invalid int value: ..."
    return number


def positive(text):
    """An argparse type: a number above 0 (and finite)."""
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def not_negative(text):
    """An argparse type: a number of at least 0 (and finite)."""
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {text}")
    return value


positive.__name__ = not_negative.__name__ = "float"  # "invalid float value: ..."


def add_training_arguments(parser):
    number = {"metavar": "N", "type": at_least(1)}  # a count of at least 1
    parser.add_argument(
        "--epochs", **number, default=10, help="passes over the training set"
    )
    parser.add_argument(
        "--batch-size",
        **number,
        default=32,
        help="samples per process and step: the global batch is N x processes x "
        "--grad-accum",
    )
    parser.add_argument(
        "--lr",
        type=not_negative,
        default=0.1,
        metavar="F",
        help="learning rate (0 trains nothing: a probe of data, evaluation, speed)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="initial weights and data order, the same on every rank",
    )
    parser.add_argument(
        "--num-workers",
        type=at_least(0),
        default=2,
        metavar="N",
        help="DataLoader worker processes per training process",
    )
    parser.add_argument(
        "--train-size", **number, default=2048, help="samples of the built-in data"
    )
    parser.add_argument(
        "--val-size", **number, default=512, help="validation samples of the same"
    )
    parser.add_argument(
        "--output-dir",
        default="outputs",
        metavar="DIR",
        help="where checkpoints, final weights, metrics and plots go",
    )
    parser.add_argument(
        "--resume",
        default="auto",
        metavar="{auto,never,PATH}",
        help="auto: continue from DIR/checkpoint_last.pt when it exists",
    )
    parser.add_argument(
        "--evaluate",
        metavar="PATH",
        help="only evaluate the weights in PATH (model_final.pt or a checkpoint) on "
        "the validation set and print the metrics; writes nothing",
    )
    parser.add_argument(
        "--grad-accum",
        type=at_least(1),
        metavar="N",
        help="micro-batches per optimizer update (default 1; when resuming, what "
        "keeps the checkpoint's global batch of processes x batch x N)",
    )
    parser.add_argument(
        "--allow-batch-change",
        action="store_true",
        help="resume with a global batch other than the checkpoint's",
    )
    parser.add_argument(
        "--clip-grad-norm",
        type=positive,
        metavar="F",
        help="clip the gradients' norm to F before each update",
    )


def add_long_run_arguments(parser):
    parser.add_argument(
        "--max-steps",
        type=at_least(1),
        metavar="N",
        help="the run's length in optimizer updates, instead of --epochs: the data "
        "repeats, with a new shuffle each pass, as often as it takes",
    )
    parser.add_argument(
        "--save-every",
        type=at_least(0),
{% if strategy == "final_only" %}
        default=0,
        metavar="N",
        help="also write checkpoint_last.pt every N optimizer updates, so that a "
        "crash without a signal loses at most N (0: never; final_only removes it at "
        "the end)",
{% else %}
        default=1000,
        metavar="N",
        help="also replace checkpoint_last.pt every N optimizer updates, so that a "
        "crash without a signal loses at most N (0: at the end of each pass only)",
{% endif %}
    )
    parser.add_argument(
        "--eval-every",
        type=at_least(1),
        metavar="N",
        help="also evaluate every N optimizer updates (a row of metrics.csv each; "
        "default: at the end of each pass and of the run)",
    )


def add_speed_arguments(parser):
    parser.add_argument(
        "--amp",
        choices=tuple(AMP_DTYPES),
        default="none",
        help="mixed precision: autocast to bfloat16 or float16 (with loss scaling)",
    )
{% if fsdp %}
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the sharded model"
    )
{% else %}
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the model inside DDP"
    )
{% endif %}
    parser.add_argument(
        "--profile-steps",
        type=at_least(0),
        default=0,
        metavar="N",
        help="write a torch.profiler trace of N steps of rank 0 to DIR/profile",
    )
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="also log metrics to DIR/tensorboard (needs tensorboard)",
    )


def add_running_arguments(parser):
    parser.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: nccl when CUDA is usable, else gloo",
    )
    parser.add_argument(
        "--dist-timeout",
        type=positive,
        metavar="S",
        default=os.environ.get("DIST_TIMEOUT", "600"),
        help="seconds to wait for the other processes at start-up, and that a process "
        "may go without progress before the job ends with a report of where each "
        "one was (default: $DIST_TIMEOUT, else 600)",
    )
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="check every rank and the network, print a table, exit without training",
    )
{% if spawn %}
    parser.add_argument(
        "--nproc-per-node",
        type=at_least(1),
        metavar="N",
        default=torch.cuda.device_count() or 2,
        help="processes on this machine (default: one per GPU, or 2 on CPU)",
    )
{% if multi %}
    parser.add_argument(
        "--nnodes",
        type=at_least(1),
        default=1,
        metavar="N",
        help="machines taking part",
    )
    parser.add_argument(
        "--node-rank",
        type=at_least(0),
        default=0,
        metavar="N",
        help="this machine's number, 0 to nnodes - 1",
    )
    parser.add_argument(
        "--master-addr", default="127.0.0.1", metavar="A", help="machine 0's address"
    )
    parser.add_argument(
        "--master-port",
        type=at_least(1, 65535),
        metavar="P",
        help="port on machine 0 (default: a free port; 29500 when nnodes > 1)",
    )
{% else %}
    parser.add_argument(
        "--master-port",
        type=at_least(1, 65535),
        metavar="P",
        help="the rendezvous port (default: a free port)",
    )
{% endif %}
    # Accepted for torch.distributed.launch compatibility and ignored: workers get their
    # rank from mp.spawn.
{% else %}
    parser.add_argument(
        "--torchrun",
        metavar="OPTIONS",
        help="run torchrun with these options in this process, to start the workers "
        "(as the run scripts do)",
    )
    # DDP change 1: torch.distributed.launch passes --local-rank=N; LOCAL_RANK from the
    # environment (set by torchrun and by torch.distributed.launch) is what counts.
{% endif %}
    parser.add_argument("--local-rank", "--local_rank", help=argparse.SUPPRESS)


# --------------------------------------------------------------------------------------
# Stops, failures and hangs: say which rank, and where
# --------------------------------------------------------------------------------------
COLLECTIVE_GRACE = 30  # seconds a collective may wait beyond --dist-timeout
STOP_SIGNAL = None  # the first SIGTERM or SIGINT received: stop, save, exit 128 + it


def failure(message, status=1):
    """The exit for a clear error: rank 0 alone prints why, once, and every rank exits
    with `status` (2: an argument that cannot work)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    return SystemExit(status)


def on_stop_signal(signum, frame):
    """SIGTERM (how Slurm and Kubernetes preempt) or Ctrl-C (SIGINT): training stops
    at the next check, saves a checkpoint, and exits with 128 + the signal's number.
    A second Ctrl-C stops at once, saving nothing."""
    global STOP_SIGNAL
    if STOP_SIGNAL is None:
        STOP_SIGNAL = signum
    elif signum == signal.SIGINT:
        stop_now(128 + signum)


def leave(status):
    """End this worker process with `status` as a normal exit would (threads that are
    not daemons waited for, atexit handlers run: logging's flush, a user's), but
    without the interpreter's teardown.

    A gloo thread may still hold the last collective's tensors, and letting go of one
    that Python has dropped takes the GIL. CPython ends a thread that waits for the
    GIL while the interpreter tears down, and ending a C++ thread that way aborts the
    process ("terminate called without an active exception"): now and then, a rank
    died by SIGABRT after a run that had finished and saved.
    """
    # What Python's own exit does before the teardown: stop the executors' threads,
    # wait for the threads that are not daemons, run the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def stop_now(status):
    """Exit at once (from any thread), with this process's DataLoader workers."""
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(status)


def stop_loader_workers():
    """This process's DataLoader workers ignore SIGTERM (see loader_worker_init), so
    they are killed here rather than left to Python's exit, which would wait for them
    forever after SIGTERM-ing them."""
    # Else torch's SIGCHLD handler reports each of these deaths as an error.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        child.kill()


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


def spare_the_garbage_collector():
    """Take the objects made so far (some 170,000, nearly all torch's) out of the
    garbage collector's view, and at exit all the others too.

    They live as long as the process, yet every full collection walks them all: the
    ones while torch imports more of itself on first use (torch._dynamo, another
    120,000) and the last one at exit, about 0.8 s of CPU in each process.
    gc.freeze() exempts the objects that exist when it is called.
    """
    gc.freeze()
    atexit.register(gc.freeze)


# What each rank is doing when the job stalls, as the summary says it.
WAITS = "waits for the other ranks"
LOADER = "waits for its DataLoader workers"
{% if fsdp %}
# Where in torch a stack waits for the other ranks: collectives (FSDP2's all-gathers
# and reduce-scatters among them) and the backward pass (which reduce-scatters).
COLLECTIVES = ("torch/distributed/", "torch/autograd/")
{% else %}
# Where in torch a stack waits for the other ranks: collectives, DDP's forward (it
# broadcasts buffers) and the backward pass (whose hooks all-reduce gradients).
COLLECTIVES = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")
{% endif %}
# This file's functions that wait for the GPU (.item(), .tolist()) right after a
# collective: with NCCL, a rank waiting for the others stops there.
HOST_SYNCS = {
    "check",
    "totals",
    "diverged_failure",
    "evaluate",
    "load_shared",
    "by_rank_0",
    "broadcast_bytes",
    "preflight",
}
# How gloo says that another rank went away (in plain RuntimeErrors).
LOST = ("closed by peer", "reset by peer", "Timed out waiting", "caused pair closure")


class HangWatch:
    """A thread in every process that ends the job once the process has made no
    progress for --dist-timeout seconds, instead of letting the others wait in a
    collective until they time out with an error that names only themselves. Every
    rank then prints its stack (all threads, and its DataLoader workers'), each line
    starting with [rank N]; one rank prints where each rank stood; all exit 1.

    Progress is a training or evaluation step (beat), or, between steps (a first
    step's torch.compile, a save), a change of the main thread's line. A rank that
    waits longer than the timeout for another's slow work (rank 0 saving a huge
    checkpoint) counts as stuck too: raise --dist-timeout for such jobs. The ranks
    agree through the rendezvous store, with no collective: theirs may be stuck.
    """

    def __init__(self):
        self.beats, self.done, self.reporting = 0, threading.Event(), False

    def beat(self):
        self.beats += 1

    def start(self, store, timeout):
        self.store, self.timeout = store, timeout
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # fresh keys
        self.prefix = f"hang/{restart}/"
        self.thread = threading.Thread(target=self.watch, name="hang watch")
        self.thread.daemon = True
        self.thread.start()

    def key(self, name):
        return self.prefix + name

    def stop(self):
        self.done.set()
        self.thread.join()
        faulthandler.cancel_dump_traceback_later()

    def watch(self):
        try:
            self.poll()
        except dist.DistError:  # the store went with its host (rank 0, a launcher),
            faulthandler.cancel_dump_traceback_later()  # which ends this rank too

    def poll(self):
        last, since = None, time.monotonic()
        while not self.done.wait(1.0):
            # If this thread cannot run (a C call holding the GIL), faulthandler
            # prints every thread's stack and ends the process in its place.
            faulthandler.dump_traceback_later(self.timeout + 30, exit=True)
            now = (self.beats, main_line())
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > self.timeout:
                self.store.set(self.key("declared"), str(self.rank))
            if self.store.check([self.key("declared")]):
                return self.report()

    def report(self):
        """Print this rank's stack, say where it stands, and end the job. Rank 0
        summarizes, and leaves last: it may hold the store the others use."""
        self.reporting = True
        where, kind = locate(main_frame())
        print_stacks(self.rank, loader_workers=kind == LOADER)
        try:
            self.store.set(self.key(f"where/{self.rank}"), f"{kind}\t{where}")
            self.count("reported", 1)
            if self.rank == 0:
                self.wait_for(lambda: self.count("reported") == self.world_size)
                self.summarize()
                self.store.set(self.key("summarized"), "1")
                self.wait_for(lambda: self.count("left") == self.world_size - 1, 5)
            else:
                self.wait_for(lambda: self.store.check([self.key("summarized")]), 15)
                self.count("left", 1)
        finally:
            stop_now(1)

    def count(self, name, add=0):
        return self.store.add(self.key(name), add)

    def wait_for(self, done, seconds=10):
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            time.sleep(0.1)

    def summarize(self):
        """Where each rank stood, and which one the others are waiting for."""
        lines, stuck = [], []
        for rank in range(self.world_size):
            key = self.key(f"where/{rank}")
            if not self.store.check([key]):
                lines.append(f"  rank {rank}: no answer (its Python is blocked)")
                continue
            kind, where = self.store.get(key).decode().split("\t")
            lines.append(f"  rank {rank}: {where}  ({kind})")
            if kind != WAITS:
                stuck.append(str(rank))
        if stuck:
            who = ("rank " if len(stuck) == 1 else "ranks ") + ", ".join(stuck)
            verdict = (
                f"{who}: no progress outside a collective, while the others wait; "
                f"see the lines above that start with [rank {stuck[0]}]."
            )
        else:
            verdict = (
                "every rank waits in a collective: not all in the same one (a rank "
                "skipped or added one), or the network between them stalled."
            )
        print(
            f"hang: no progress for {self.timeout:g} s (--dist-timeout); where each "
            "rank stood:",
            *lines,
            verdict,
            sep="\n",
            file=sys.stderr,
            flush=True,
        )


WATCH = HangWatch()


def main_frame():
    """The main thread's innermost frame, seen from another thread."""
    return sys._current_frames()[threading.main_thread().ident]


def main_line():
    """The main thread's innermost line: the same one, for long, means no progress."""
    frame = main_frame()
    return frame.f_code, frame.f_lineno


def locate(frame):
    """Where a stack stands: its innermost line in this file, and what it waits for."""
    stack = traceback.extract_stack(frame)
    ours = [entry for entry in stack if in_this_file(entry)]
    inner = ours[-1] if ours else stack[-1]
    below = " ".join(entry.filename for entry in stack[stack.index(inner) + 1 :])
    if "torch/utils/data" in below:
        kind = LOADER
    elif any(part in below for part in COLLECTIVES):
        kind = WAITS  # a collective, DDP's forward, or the gradient all-reduce
    elif not below and inner.name in HOST_SYNCS:
        kind = WAITS  # on GPUs: a wait (.item()) for a collective queued before
    else:
        kind = "busy outside any collective"
    return f"{inner.name}, line {inner.lineno}: {inner.line}", kind


def in_this_file(entry):
    return os.path.realpath(entry.filename) == os.path.realpath(__file__)


def print_stacks(rank, main_traceback=None, loader_workers=False):
    """Every thread's stack, each line starting with [rank N] (the main thread's as
    main_traceback has it, if given); then, if asked, the DataLoader workers'."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    main = threading.main_thread().ident
    frames = {main: frames.pop(main), **frames}  # the main thread first
    lines = []
    for ident, frame in frames.items():
        if names.get(ident) == WATCH.thread.name:
            continue  # it only reports
        if main_traceback and ident == main:
            stack = traceback.format_tb(main_traceback)
        else:
            stack = traceback.format_stack(frame)
        lines.append(f"thread {names.get(ident, ident)} (most recent call last):")
        lines += "".join(stack).rstrip().splitlines()
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
    sys.stderr.flush()
    for child in multiprocessing.active_children() if loader_workers else ():
        head = f"[rank {rank}] DataLoader worker {child.pid}:"
        if not handles(child.pid, signal.SIGUSR1):  # the signal would end it
            print(head, "stuck before its first line (no stack)", file=sys.stderr)
            continue
        print(head, file=sys.stderr)
        sys.stderr.flush()
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(child.pid, signal.SIGUSR1)  # faulthandler prints its stack
        time.sleep(0.5)  # before the next one, and before they are stopped


def handles(pid, signum):
    """Whether process pid has a handler for signum, as Linux tells (elsewhere:
    assumed). A DataLoader worker gets its own in loader_worker_init()."""
    if sys.platform != "linux":
        return True
    with contextlib.suppress(OSError):  # gone
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def lost_peer(err):
    """A collective failed: another rank is gone, or timed out. (gloo says so in plain
    RuntimeErrors; NCCL and the store raise DistErrors.)"""
    return isinstance(err, dist.DistError) or any(text in str(err) for text in LOST)


def report_lost_peer(err):
    """This rank's stack, and one line: where it was, and what broke."""
    rank = dist.get_rank()
    print_stacks(rank, err.__traceback__)
    frames = traceback.extract_tb(err.__traceback__)
    ours = [entry for entry in frames if in_this_file(entry)]
    where = f"{ours[-1].name}, line {ours[-1].lineno}" if ours else "a collective"
    reason = str(err).strip().splitlines()[0].split("] ")[-1].split(". ")[0]
    print(
        f"[rank {rank}] error: a collective failed in {where} ({reason}); if another "
        "rank ended, the launcher's line names it",
        file=sys.stderr,
        flush=True,
    )


def quiet_torch_logs(logger, messages):
    """Drop torch's log lines that repeat what this script says in its own words."""
    for handler in logging.getLogger(logger).handlers:
        handler.addFilter(lambda record: record.msg not in messages)


def died(rank, signal_name):
    print(
        f"error: rank {rank} died ({signal_name}); the other workers were stopped",
        file=sys.stderr,
        flush=True,
    )


def abort_line():
    """A second Ctrl-C: the workers were killed; say so and exit at once."""
    print("aborted: a second Ctrl-C stopped the workers at once", file=sys.stderr)
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


# --------------------------------------------------------------------------------------
# Launching: one worker process per GPU (or 2 on a CPU)
# --------------------------------------------------------------------------------------
{% if spawn %}
def hold_free_port(sock):
    """Bind sock to a free port and return the port. Keep sock open while the workers
    run: bound with address reuse and not listening, it lets rank 0's store (which
    binds with reuse too) listen there, but no other program can take the port first,
    as it could one picked and let go."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
    # Were the launcher killed (kill -9, out of memory), torch's spawn would send
    # SIGINT, once per launcher thread, and a second SIGINT is a second Ctrl-C (stop
    # at once, saving nothing). SIGTERM instead: this rank saves and stops.
    signal_when_parent_ends(signal.SIGTERM)
    if sys.platform == "linux":
        # This process was started by spawn, so by default its children are too, and
        # each would import this script again; DataLoader workers fork as usual on
        # Linux instead: quick to start, with this process's signal handlers.
        multiprocessing.set_start_method("fork", force=True)
    leave(run(args))


# torch's log line for each worker it stops after another one failed.
SPAWN_CHATTER = {"Terminating process %s via signal SIGTERM"}


def main():
    """Check the arguments, start one worker per GPU (DDP change 1), wait for them.

    Returns the exit status: the workers' (128 + a signal that stopped them).
    """
    args = parse_args()
    spare_the_garbage_collector()
    problem = cuda_problem(args.backend, args.nproc_per_node)
    if problem:
        raise failure(problem)
    held = socket.socket()  # closed as main() returns: see hold_free_port()
{% if multi %}
    master_port = args.master_port or (
        29500 if args.nnodes > 1 else hold_free_port(held)
    )
    first_rank = args.node_rank * args.nproc_per_node
{% else %}
    master_port = args.master_port or hold_free_port(held)
    first_rank = 0
{% endif %}
    processes, stops = [], []  # the workers; the signals received

    def on_signal(signum, frame):
        # Ctrl-C reaches the workers too; a SIGTERM sent here alone is passed on.
        stops.append(signum)
        if len(stops) > 1 and signum == signal.SIGINT:
            for process in processes:
                process.kill()
            abort_line()
        for process in processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: each worker saves, then exits

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)  # before they start: the workers reset it
    quiet_torch_logs("torch", SPAWN_CHATTER)
    workers = mp.start_processes(
        worker, args=(args, master_port), nprocs=args.nproc_per_node, join=False
    )
    processes += workers.processes
    try:
        while not workers.join():
            pass
    except mp.ProcessRaisedException as error:
        print(error, file=sys.stderr)
        rank = first_rank + error.error_index
        print(
            f"error: rank {rank} failed; the other workers were stopped",
            file=sys.stderr,
        )
        return 1
    except mp.ProcessExitedException as error:
        if error.exit_code < 0:
            rank = first_rank + error.error_index
            died(rank, error.signal_name)
            return 1
        return error.exit_code  # the worker said why (130 or 143: it saved first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
{% else %}
# torchrun's log lines that repeat what the workers or launch() say themselves.
TORCHRUN_CHATTER = {
    "Received %s death signal, shutting down workers",
    "Sending process %s closing signal %s",
    "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
}


def launch(options, timeout, backend):
    """DDP change 1, as the run scripts start it: torchrun, with these options, starts
    one worker per GPU (and restarts them all after a failure, with MAX_RESTARTS). It
    runs inside this process, not as the torchrun command, so that a failure, Ctrl-C
    or SIGTERM ends in one line and the exit status the README gives: the workers', or
    128 + the signal that stopped them. After a signal, torchrun gives the workers
    `timeout` seconds (--dist-timeout) to save and stop before it kills them. A
    `backend` (--backend) that cannot serve the workers stops it before they start.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it, silently
    spare_the_garbage_collector()
    quiet_torch_logs("torch.distributed", TORCHRUN_CHATTER)
    stops = []  # signals received

    def on_signal(signum, frame):
        stops.append(signum)
        if len(stops) == 1:  # torchrun passes it to the workers, which save and stop
            name = signal.Signals(signum)
            raise SignalException(f"got {name.name}", sigval=name)
        if signum == signal.SIGINT:  # a second Ctrl-C: stop the workers at once
            for pid in children():
                with contextlib.suppress(ProcessLookupError):  # it ended already
                    os.killpg(pid, signal.SIGKILL)
            abort_line()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    # The workers run this file with the same arguments; torchrun leaves SIGTERM and
    # SIGINT to the handler above.
    command = [*shlex.split(options), "--signals-to-handle=SIGHUP,SIGQUIT"]
    command.append(f"--shutdown-timeout={math.ceil(timeout)}")
    parsed = get_args_parser().parse_args([*command, __file__])
    nproc = parsed.nproc_per_node
    problem = cuda_problem(backend, int(nproc) if nproc.isdigit() else 1)
    if problem:
        raise failure(problem)
    try:
        torchrun([*command, __file__, *sys.argv[1:]])
    except SignalException:
        return 128 + stops[0]
    except (RendezvousError, dist.DistError) as err:
        print(rendezvous_failed(err, endpoint(parsed)), file=sys.stderr, flush=True)
        return 1
    except ChildFailedError as error:
        rank, failed = min(error.failures.items(), key=lambda item: blame(item[1]))
        if failed.exitcode < 0:
            died(rank, failed.signal_name())
            return 1
        return failed.exitcode  # the worker said why
    return 0


def endpoint(options):
    """host:port of the rendezvous that torchrun's (parsed) options name."""
    if options.standalone:  # torchrun picks a free local port
        return "localhost"
    return options.rdzv_endpoint or f"{options.master_addr}:{options.master_port}"


def blame(failed):
    """Sort key for a failed worker, the cause first: killed by a signal; exited (and
    said why); killed by SIGTERM, which is torchrun stopping the others."""
    return failed.exitcode == -signal.SIGTERM, failed.exitcode >= 0


def children():
    """This process's child processes (the workers), from /proc: Linux only, like a
    second Ctrl-C's stopping them at once (elsewhere torchrun stops them after
    --dist-timeout)."""
    pids = []
    for task in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(pid) for pid in task.read_text().split()]
    return pids


if __name__ == "__main__":
    args = parse_args()
    if args.torchrun and "RANK" not in os.environ:
        sys.exit(launch(args.torchrun, args.dist_timeout, args.backend))
    leave(run(args))
{% endif %}
