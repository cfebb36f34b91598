# --------------------------------------------------------------------------------------
# EDIT HERE: the five functions that make this project yours. Replace their bodies with
# your data, model, optimizer, loss and metrics; the rest of the file works unchanged.
# Your imports go right under this banner: ruff and isort take them as a block of their
# own (the next line), after the template's.
# --------------------------------------------------------------------------------------
# isort: split
NUM_CLASSES = 10
# Recipes (the README's "Recipes" shows each): switch these on where yours needs them.
FIND_UNUSED_PARAMETERS = False  # True: a step may leave parameters out (DDP only)
ALTERNATE = False  # True: build_optimizer's optimizers take turns, each on its own loss
DROP_LAST = False  # True: no short last batch in a pass (Mixup's, which pairs samples)


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
{{ par.build_model_doc() }}
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
    """Return (optimizer, scheduler or None), or {name: (optimizer, scheduler or
    None)} for several: all step after each backward pass of compute_loss's loss
    (with ALTERNATE, each in its turn, on its own loss). A scheduler is stepped once
    per update; total_updates counts the updates of the whole run (all --epochs, or
    --max-steps). State of your own that a resume needs (an EMA): keep() it here.

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
{{ par.compute_loss_doc() }}
    With ALTERNATE, a third argument names the optimizer whose turn it is.
    """
    images, labels = batch
    return F.cross_entropy(model(images), labels), len(labels)


def compute_metrics(model, batch):
    """Return {name: (sum, n)} for one validation batch; each metric is summed over all
    batches and ranks and reported as val_<name> = sum / n (nan where n sums to 0).
    Return the same names for every batch; "loss" is required: it is val_loss.
{{ par.compute_metrics_doc() }}
    """
    images, labels = batch
    logits = model(images)
    n = len(labels)
    return {
        "loss": (F.cross_entropy(logits, labels, reduction="sum"), n),
        "acc": ((logits.argmax(dim=1) == labels).sum(), n),
    }


def add_arguments(parser):
    """Flags of your own, for the functions above (a model name, a mixup strength):
    parser.add_argument("--mixup", type=float, default=0.2, help="...") shows in
    --help among "this project's", reaches build_* as args.mixup, and is kept in
    checkpoints and trackers like every flag (a resume takes the command line's).
    Here the built-in data's sizes: once build_datasets is yours, replace them."""
    parser.add_argument("--train-size", **count(2048), help="built-in training samples")
    parser.add_argument("--val-size", **count(512), help="built-in validation samples")


