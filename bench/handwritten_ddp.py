"""Contender 2: the plain DDP loop, written the way the PyTorch tutorials teach it.

Launched with torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE. No checkpoints, no
metrics, no evaluation: the least a DDP training loop can be.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import common
import steptimer


def main():
    args = common.parse_args()
    steptimer.install("handwritten")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")

    torch.manual_seed(args.seed)
    project, train_set = common.load_project(args)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=device.type == "cuda",
    )
    model = common.gpu_settings(project.build_model(args).to(device), device)
    if args.compile:  # inside DDP, as the generated project does
        model = torch.compile(model)
    if args.no_ddp:  # the same loop without the wrapper (one process)
        if dist.get_world_size() != 1:
            raise SystemExit("--no-ddp: one process only")
    else:
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = common.sgd(model, args)
    warmup = len(loader)  # the generated project's warm-up schedule, for equal maths
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
    )

    sampler.set_epoch(0)
    model.train()
    for images, targets in loader:
        images, targets = images.to(device), targets.to(device)
        with common.autocast(args, device):
            loss, _ = project.compute_loss(model, (images, targets))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
