"""The libraries users bring: imported once, their randomness repeated.

- A module imported at the top of the edit zone is imported once per training process
  and once per DataLoader fork server, whatever the number of passes: its workers are
  forks of a fork server that imported the file, never a fresh import each.
- Randomness drawn from torch's, numpy's global and Python's `random` generator, in
  compute_loss (a mixup weight, a coin) and in a dataset's __getitem__ read by
  DataLoader workers (augmentation), repeats run to run, across a SIGTERM or kill -9
  resume in the middle of a pass, and 2 processes x B train as 1 x 2B.
- A map-style training set's own set_epoch() is called before each pass, on resume
  with the right pass: a curriculum trains every batch on its own pass's items.
"""

import re

import pytest
from test_recipes import SIGTERM

from conftest import (
    act_after_step,
    bake,
    edit,
    load_weights,
    max_difference,
    replace_user_functions,
    run_single,
    run_warm,
)

# A module of the project's folder, imported at the top of the edit zone: each import
# writes a line (its process) to COUNTED_LOG.
COUNTED = """import os

with open(os.environ["COUNTED_LOG"], "a") as log:
    log.write(f"{os.getpid()}\\n")
"""


def test_an_edit_zone_import_is_imported_once_per_process(tmp_path):
    """A module of the project's folder imported at the top of the edit zone, with
    ./run_single.sh (torchrun): 2 workers, 2 then 4 passes: the launcher, the
    training process and its fork server import it (3), never a worker (before, 2
    processes: 19 and 35)."""
    project = bake(tmp_path / "project")
    (project / "counted.py").write_text(COUNTED)
    import_line = "import counted  # noqa: F401\n\nNUM_CLASSES = 10\n"
    edit(project, "NUM_CLASSES = 10\n", import_line)
    assert counts(tmp_path, project, run_single) == [3, 3]


def test_the_file_is_run_once_per_process_under_spawn(tmp_path):
    """The spawn launcher's process, started as mp.spawn starts it (warm): it runs the
    file once, and so does its fork server (2), whatever the passes: its DataLoader
    workers, forks of the fork server, run none of it."""
    project = bake(tmp_path / "project", launcher="spawn")
    count = 'with open(os.environ["COUNTED_LOG"], "a") as log:\n'
    count += '    log.write(f"{os.getpid()}\\n")\n'
    edit(project, "NUM_CLASSES = 10\n", "NUM_CLASSES = 10\n" + count)
    assert counts(tmp_path, project, run_warm) == [2, 2]


def counts(tmp_path, project, run):
    """How many processes wrote COUNTED_LOG in a run of 2 passes, and of 4 (one
    training process)."""
    found = []
    for epochs in (2, 4):
        log = tmp_path / f"imports-{epochs}.log"
        args = ["--epochs", str(epochs), "--train-size", "32", "--val-size", "16"]
        args += ["--batch-size", "8", "--num-workers", "2"]
        env = {"COUNTED_LOG": str(log)}
        output = run(project, tmp_path / f"out-{epochs}", 1, *args, env=env)
        assert output.count("val_loss") == epochs, output
        found.append(len(log.read_text().split()))
    return found


# A dataset that augments each item with all three generators, as image pipelines do
# (noise from torch's, as torchvision's transforms draw; a flip from Python's random;
# a scale from numpy's), and a loss with a numpy mixup weight and a random coin.
AUGMENTED = """
import random

import numpy as np


class Augmented(torch.utils.data.Dataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index] + 0.5 * torch.randn(3, 16, 16)
        if random.random() < 0.5:
            image = image.flip(-1)
        return image * float(np.random.uniform(0.5, 1.5)), self.labels[index]


def build_datasets(args):
    generator = torch.Generator().manual_seed(args.seed)
    n = args.train_size + args.val_size
    images = torch.randn(n, 3, 16, 16, generator=generator)
    labels = torch.randint(10, (n,), generator=generator)
    cut = args.train_size
    return Augmented(images[:cut], labels[:cut]), Augmented(images[cut:], labels[cut:])


def build_model(args):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))


def compute_loss(model, batch):
    images, labels = batch
    weight = float(np.random.beta(0.4, 0.4))  # mixup with the image upside down
    images = weight * images + (1 - weight) * images.flip(-2)
    if random.random() < 0.5:
        images = -images
    return F.cross_entropy(model(images), labels), len(labels)
"""
ARGS = ["--epochs", "2", "--train-size", "96", "--val-size", "37", "--lr", "0.05"]
ARGS += ["--num-workers", "2"]
PER_ITEM = "            seed_draws(mixed(self.seed, self.epoch, index))\n"


def augmented(tmp_path):
    project = bake(tmp_path / "project")
    replace_user_functions(project, AUGMENTED)
    act_after_step(project)
    return project


def final(out_dir):
    return load_weights(out_dir / "model_final.pt")


def test_augmentation_in_workers_repeats_scales_and_resumes_mid_pass(tmp_path):
    """The same command twice: the same weights, to the bit; 2 x 8 as 1 x 16; a
    SIGTERM after update 2 of pass 1 (saved at update 3's check, --save-every 3),
    then the same command: the weights of a run never stopped. The control: without
    each item's seeding, 2 x 8 and 1 x 16 differ."""
    project = augmented(tmp_path)
    args = [*ARGS, "--save-every", "3"]
    two, again, one = tmp_path / "two", tmp_path / "again", tmp_path / "one"
    run_warm(project, two, 2, *args, "--batch-size", "8")
    run_warm(project, again, 2, *args, "--batch-size", "8")
    run_warm(project, one, 1, *args, "--batch-size", "16")
    assert max_difference(final(two), final(again)) == 0
    assert max_difference(final(two), final(one)) < 1e-5

    cut = tmp_path / "cut"
    stop = {"TEST_ACT_AT": "0:0:1", "TEST_ACTION": SIGTERM}
    run_warm(project, cut, 2, *args, "--batch-size", "8", env=stop, expect=143)
    output = run_warm(project, cut, 2, *args, "--batch-size", "8")
    assert "in epoch 1 after 3 batches" in output, output
    assert max_difference(final(cut), final(two)) < 1e-6

    edit(project, PER_ITEM, "            pass\n")
    run_warm(project, tmp_path / "control", 1, *args, "--batch-size", "16")
    assert max_difference(final(two), final(tmp_path / "control")) > 1e-3


# A curriculum as users write it: a map-style dataset whose items change with its
# set_epoch(epoch) (here each item carries its pass), and a loss that logs the passes
# of each batch's items (TEST_LOG) and weighs later passes more.
CURRICULUM = """
class Curriculum(torch.utils.data.Dataset):
    def __init__(self, size, seed):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 12, generator=generator)
        self.y = torch.randint(3, (size,), generator=generator)
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index] * (1 + self.epoch), self.y[index], self.epoch


def build_datasets(args):
    return Curriculum(args.train_size, args.seed), Curriculum(args.val_size, 1)


def build_model(args):
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def build_optimizer(model, args, total_updates):
    return torch.optim.SGD(model.parameters(), lr=args.lr), None


def compute_loss(model, batch):
    x, y, epochs = batch
    with open(os.environ["TEST_LOG"], "a") as log:
        log.write(f"{dist.get_rank()} {sorted(set(epochs.tolist()))}\\n")
    return F.cross_entropy(model(x), y), len(y)


def compute_metrics(model, batch):
    x, y, _ = batch
    return {"loss": (F.cross_entropy(model(x), y, reduction="sum"), len(y))}
"""


@pytest.mark.parametrize(
    "answers",
    [{}, {"parallelism": "fsdp2", "use_batch_sampler": False, "workers": "0"}],
    ids=["ddp", "fsdp2-no-batch-sampler"],
)
def test_a_curriculum_gets_set_epoch_before_each_pass(tmp_path, answers):
    """3 passes straight, each batch of its own pass's items (4 updates a pass, on
    each of 2 ranks); 1 pass, then --resume auto to 3: the same batches, the same
    weights."""
    project = bake(
        tmp_path / "project", **{k: answers[k] for k in answers if k != "workers"}
    )
    replace_user_functions(project, CURRICULUM)
    args = ["--train-size", "64", "--val-size", "20", "--batch-size", "8"]
    args += ["--num-workers", answers.get("workers", "2"), "--lr", "0.05"]

    def passes(log):
        rows = [line.split(" ", 1) for line in log.read_text().splitlines()]
        return [[row[1] for row in rows if row[0] == rank] for rank in "01"]

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    env = {"TEST_LOG": str(tmp_path / "straight.log")}
    run_warm(project, straight, 2, *args, "--epochs", "3", env=env)
    expected = ["[0]"] * 4 + ["[1]"] * 4 + ["[2]"] * 4
    assert passes(tmp_path / "straight.log") == [expected, expected]

    env = {"TEST_LOG": str(tmp_path / "cut.log")}
    run_warm(project, cut, 2, *args, "--epochs", "1", env=env)
    output = run_warm(project, cut, 2, *args, "--epochs", "3", env=env)
    assert "resumed from" in output, output
    assert passes(tmp_path / "cut.log") == [expected, expected]
    assert max_difference(final(cut), final(straight)) < 1e-6


# A small transformer (attention's key bias among its parameters: a shift of every
# key changes no softmax, so its true gradient is zero) on sequences of 6 vectors.
TRANSFORMER = """
def build_datasets(args):
    generator = torch.Generator().manual_seed(args.seed)
    n = args.train_size + args.val_size
    x = torch.randn(n, 6, 16, generator=generator)
    y = torch.randint(3, (n,), generator=generator)
    cut = args.train_size
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def build_model(args):
    return nn.Sequential(
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
        nn.Flatten(),
        nn.Linear(6 * 16, 3),
    )


def build_optimizer(model, args, total_updates):
    if os.environ["TEST_OPTIMIZER"] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), None
    return torch.optim.AdamW(model.parameters(), lr=args.lr), None


def compute_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y), len(y)


def compute_metrics(model, batch):
    x, y = batch
    return {"loss": (F.cross_entropy(model(x), y, reduction="sum"), len(y))}
"""


def test_the_readme_states_the_tolerance_of_each_optimizer(tmp_path):
    """2 x 8 against 1 x 16, 32 updates of a small transformer: with SGD within the
    README's bound for SGD; with AdamW, which amplifies the rounding where a gradient
    is near zero, within its looser bound, and over 100 times SGD's gap. The bounds
    are read from the README's sentence, so the text follows what is measured."""
    project = bake(tmp_path / "project")
    replace_user_functions(project, TRANSFORMER)
    text = " ".join((project / "README.md").read_text().split())
    found = re.search(
        r"with SGD within ([0-9.e-]+), with AdamW within ([0-9.e-]+)", text
    )
    assert found, "the README states no tolerance per optimizer"
    bounds = {"sgd": float(found[1]), "adamw": float(found[2])}
    args = ["--epochs", "4", "--train-size", "128", "--val-size", "16"]
    args += ["--num-workers", "0"]
    gaps = {}
    for name, lr in (("sgd", "0.05"), ("adamw", "0.003")):
        env = {"TEST_OPTIMIZER": name}
        two, one = tmp_path / f"{name}-2", tmp_path / f"{name}-1"
        run_warm(project, two, 2, *args, "--lr", lr, "--batch-size", "8", env=env)
        run_warm(project, one, 1, *args, "--lr", lr, "--batch-size", "16", env=env)
        gaps[name] = max_difference(final(two), final(one))
    assert gaps["sgd"] < bounds["sgd"] and gaps["adamw"] < bounds["adamw"], gaps
    assert gaps["adamw"] > 100 * gaps["sgd"], gaps  # AdamW's gap is no accident
