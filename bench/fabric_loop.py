"""Contender 4: the same training with Lightning Fabric.

Launched with torchrun like the others: Fabric sees the torchelastic environment and
joins the group torchrun describes (a script run alone would instead let fabric.launch()
start the processes). Fabric picks gloo on CPU and nccl on CUDA, replaces the sampler
with a DistributedSampler and wraps the model in DDP.
"""

import os

import torch
from lightning.fabric import Fabric

import common
import steptimer


def main():
    args = common.parse_args()
    steptimer.install("fabric")
    if args.compile or args.no_ddp:
        raise SystemExit("--compile and --no-ddp: hand-written loop only")
    fabric = Fabric(
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=1,
        strategy="ddp",
        precision="bf16-mixed" if args.amp == "bf16" else "32-true",
    )
    fabric.launch()

    fabric.seed_everything(args.seed)  # also the seed of Fabric's DistributedSampler
    project, train_set = common.load_project(args)
    loader = common.shuffled_loader(train_set, args, fabric.device.type == "cuda")
    loader = fabric.setup_dataloaders(loader)  # shards; moves batches to the device
    model = common.gpu_settings(project.build_model(args), fabric.device)
    optimizer = common.sgd(model, args)
    warmup = len(loader)  # steps per process: the generated project's schedule
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
    )
    model, optimizer = fabric.setup(model, optimizer)

    model.train()
    for images, targets in loader:
        loss, _ = project.compute_loss(model, (images, targets))
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        scheduler.step()

    fabric.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
