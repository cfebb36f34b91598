"""Contender 3: the same training with Hugging Face Accelerate.

Launched with torchrun like the others: the Accelerator reads the same RANK and
WORLD_SIZE (`accelerate launch` is a front end to the same elastic launcher). It picks
the backend (gloo on CPU, nccl on CUDA), shards the DataLoader, moves batches to the
device and wraps the model in DDP.
"""

import torch
from accelerate import Accelerator

import common
import steptimer


def main():
    args = common.parse_args()
    steptimer.install("accelerate")
    # cpu=True without a GPU, as `accelerate launch --cpu` would set. Without
    # it Accelerate 1.15 under torchrun on CPU silently runs each process alone (no
    # process group, no DDP, every process on the whole dataset).
    if args.compile or args.no_ddp:
        raise SystemExit("--compile and --no-ddp: hand-written loop only")
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision="bf16" if args.amp == "bf16" else "no",
    )

    torch.manual_seed(args.seed)
    project, train_set = common.load_project(args)
    loader = common.shuffled_loader(train_set, args, accelerator.device.type == "cuda")
    model = common.gpu_settings(project.build_model(args), accelerator.device)
    optimizer = common.sgd(model, args)
    # Accelerate steps a prepared scheduler once per process for every optimizer step,
    # so the same warm-up is written in batches of the whole (unsharded) loader.
    warmup = len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
    )
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, loader, scheduler
    )

    model.train()
    for images, targets in loader:  # already on accelerator.device
        loss, _ = project.compute_loss(model, (images, targets))
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()

    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
