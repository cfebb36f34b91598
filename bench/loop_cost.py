"""The generated loop's own CPU cost per step, against the hand-written loop, in one
process: steady enough to see a change of 10 µs a step, where run.py's launches
vary by several percent.

    python3 bench/loop_cost.py [--tiny] [NAME=PROJECT_DIR ...]   # default: generate one

World size 1 (gloo), no DataLoader workers. Each round runs one pass of --steps
steps with the hand-written loop (`handwritten_ddp.py`'s: DDP, zero_grad, backward,
step, scheduler step) and one pass of each project's own `train_pass()`, all in this
process, the order reversed every round. Before each pass the weights and the
optimizer state are put back to where they started, so that every round computes the
same numbers (a model that trains on for thousands of passes reaches denormal floats,
which slow a step by far more than the loop's cost), and denormals are flushed to
zero. The hand-written loop's DDP does not broadcast buffers, as the project's does
not at world size 1. A step's CPU time is taken between optimizer steps (a global
step hook), from the fifth step of a pass on; the table shows the median over rounds
and, per project, the median of its difference from the hand-written loop within
each round.

--tiny replaces build_model() with one linear layer: the step's own work shrinks to a
fraction of a millisecond, so what is left is mostly the loop's.
"""

import argparse
import contextlib
import copy
import gc
import importlib.util
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("projects", nargs="*", metavar="NAME=DIR")
    parser.add_argument("--steps", type=int, default=30, help="steps a pass")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--tiny", action="store_true", help="a one-layer model")
    parser.add_argument(
        "--no-ddp",
        action="store_true",
        help="the hand-written loop without DDP (as the project trains one process)",
    )
    return parser.parse_args()


def generated():
    """The default project of this repository, generated into a temporary folder."""
    out = Path(tempfile.mkdtemp())
    command = ["cookiecutter", "--no-input", "-o", str(out), str(BENCH.parent)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return next(out.iterdir())


def load(name, folder):
    path = Path(folder) / "main_multi_gpu.py"
    spec = importlib.util.spec_from_file_location(f"project_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def project_pass(module, args, torch, tiny):
    """A function that runs one pass of the project's train_pass(), from the start."""
    if tiny:
        nn = torch.nn
        module.build_model = lambda args: nn.Sequential(
            nn.Flatten(), nn.Linear(768, 10)
        )
    out = Path(tempfile.mkdtemp())
    cli = ["--epochs", "1000000", "--train-size", str(args.steps * 32)]
    cli += ["--val-size", "32", "--num-workers", "0", "--output-dir", str(out)]
    project_args = module.parse_args([*cli, "--resume", "never"])
    t = module.build_training(project_args, torch.device("cpu"), None)
    at = module.resume(t, None, out)
    reports = module.Reports(t, at, out).__enter__()
    start = copy.deepcopy(
        (t.model.state_dict(), {k: o.state_dict() for k, o in t.optimizers.items()})
    )

    def one_pass():
        at.epoch = at.step = at.epoch_samples = 0
        t.model.load_state_dict(start[0])
        for name, optimizer in t.optimizers.items():
            optimizer.load_state_dict(start[1][name])
        with contextlib.redirect_stdout(io.StringIO()):  # its line per evaluation
            module.train_pass(t, at, reports)

    return one_pass, t


def handwritten_pass(module, t, torch, ddp=True):
    """The hand-written loop on the project's data, model and loss (in DDP, or not)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = module.build_model(t.args)
    if ddp:
        model = DDP(model)
        model.broadcast_buffers = False  # as the project at world size 1 did
    optimizer = torch.optim.SGD(
        model.parameters(), lr=t.args.lr, momentum=0.9, weight_decay=5e-4
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    plain = getattr(model, "module", model)
    start = copy.deepcopy((plain.state_dict(), optimizer.state_dict()))

    def one_pass():
        plain.load_state_dict(start[0])
        optimizer.load_state_dict(start[1])
        t.train_data.set_epoch(0)
        model.train()
        for images, targets in t.train_loader:
            with torch.autocast("cpu", torch.bfloat16, enabled=False):
                loss, _ = module.compute_loss(model, (images, targets))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()

    return one_pass


def main():
    args = parse_args()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 500)
    )
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo")
    projects = dict(p.split("=", 1) for p in args.projects) or {
        "generated": generated()
    }
    marks = []
    register_optimizer_step_post_hook(lambda *_: marks.append(time.process_time()))
    passes = {}
    for name, folder in projects.items():
        module = load(name, folder)
        module.keep_freed_memory()  # the project's malloc settings, for both loops
        passes[name], t = project_pass(module, args, torch, args.tiny)
    loop = handwritten_pass(module, t, torch, ddp=not args.no_ddp)
    passes = {"handwritten": loop, **passes}
    gc.freeze()
    names, per_step = list(passes), {name: [] for name in passes}
    for round_ in range(args.rounds + 1):  # round 0: warm-up, not counted
        for name in names if round_ % 2 else names[::-1]:
            marks.clear()
            passes[name]()
            if round_:
                per_step[name].append((marks[-1] - marks[4]) / (len(marks) - 5) * 1e6)
    model = "one linear layer (--tiny)" if args.tiny else "the project's build_model()"
    model += ", the hand-written loop without DDP" if args.no_ddp else ""
    print(f"CPU µs a step, {args.rounds} rounds of {args.steps} steps, {model}:")
    for name in names:
        runs = per_step[name]
        line = f"  {name:12s} {statistics.median(runs):8.0f}"
        if name != "handwritten":
            pairs = zip(runs, per_step["handwritten"], strict=True)
            differences = sorted(mine - theirs for mine, theirs in pairs)
            q = len(differences) // 4
            line += f"   {statistics.median(differences):+5.0f} over handwritten"
            line += (
                f" (middle half {differences[q]:+.0f} to {differences[-q - 1]:+.0f})"
            )
        print(line)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
