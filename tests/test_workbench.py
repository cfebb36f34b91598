"""The generated script is a workbench: a user's data, model, loss, metrics and
optimizer go into the five functions under "EDIT HERE", and nothing else changes.

Each adaptation below is written only by replacing those functions (as a user would),
then trained on 2 workers, resumed, and, where the model allows it, shown equal to
1 worker with the doubled batch:
- a tabular MLP with Dropout and LayerNorm (regression, an extra metric);
- a next-token model on dict batches of padded sequences, with a token-level loss and
  token accuracy (so batches hold different numbers of units);
- AdamW with warm-up and cosine, and gradient clipping (with --amp fp16 too);
- the default task with its batches as lists, and as dicts.
Also what a resume does when the schedule's arguments or the global batch change."""

import math
import shutil

import pytest
import torch

from conftest import (
    act_after_step,
    bake,
    edit,
    error_lines,
    load_module,
    load_weights,
    max_difference,
    metrics,
    replace_user_functions,
    run_warm,
    without_batchnorm,
)

COMMON = ["--num-workers", "0", "--val-size", "37", "--train-size", "64"]

# A regression's optimizer, loss and metrics (also test_streams.py's).
REGRESSION = """

def build_optimizer(model, args, total_updates):
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), None


def compute_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y), len(y)


def compute_metrics(model, batch):
    x, y = batch
    error = model(x) - y
    return {"loss": (error.pow(2).sum(), len(y)), "mae": (error.abs().sum(), len(y))}
"""

MLP = (
    '''
class Rows(torch.utils.data.Dataset):
    """Rows of 12 features and a target from a fixed linear rule plus noise."""

    def __init__(self, size, seed):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 12, generator=generator)
        weights = torch.randn(12, 1, generator=torch.Generator().manual_seed(0))
        self.y = self.x @ weights + 0.1 * torch.randn(size, 1, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def build_datasets(args):
    return Rows(args.train_size, args.seed), Rows(args.val_size, args.seed + 1)


def build_model(args):
    return nn.Sequential(
        nn.Linear(12, 32),
        nn.LayerNorm(32),
        nn.ReLU(),
        nn.Dropout(DROPOUT),
        nn.Linear(32, 1),
    )
'''
    + REGRESSION
)

TOKENS = '''
VOCAB, LENGTH = 16, 12


class Sequences(torch.utils.data.Dataset):
    """Sequences of 3 to 12 tokens, each one or two more than the last (mod VOCAB),
    padded to LENGTH; padding is labelled -100, so batches differ in real tokens."""

    def __init__(self, size, seed):
        generator = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(size):
            n = int(torch.randint(3, LENGTH + 1, (), generator=generator))
            steps = 1 + (torch.rand(n, generator=generator) < 0.3).long()
            first = torch.randint(VOCAB, (1,), generator=generator)
            tokens = (first + steps.cumsum(0)) % VOCAB
            input_ids = torch.zeros(LENGTH, dtype=torch.long)
            input_ids[:n] = tokens
            labels = torch.full((LENGTH,), -100)
            labels[: n - 1] = tokens[1:]
            self.items.append({"input_ids": input_ids, "labels": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


class NextToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids):
        return self.head(self.norm(self.embed(input_ids)))


def build_datasets(args):
    return Sequences(args.train_size, args.seed), Sequences(args.val_size, 1000)


def build_model(args):
    return NextToken()


def build_optimizer(model, args, total_updates):
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), None


def compute_loss(model, batch):
    logits, labels = model(batch["input_ids"]), batch["labels"]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return loss, (labels != -100).sum()


def compute_metrics(model, batch):
    logits, labels = model(batch["input_ids"]), batch["labels"]
    real = labels != -100
    loss = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    correct = ((logits.argmax(-1) == labels) & real).sum()
    return {"loss": (loss, real.sum()), "token_acc": (correct, real.sum())}
'''

ADAMW_COSINE = '''
def build_optimizer(model, args, total_updates):
    """AdamW; the LR warms up over the first quarter of the updates, then a cosine."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, total_updates // 4)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(
                optimizer, T_max=total_updates - warmup
            ),
        ],
        milestones=[warmup],
    )
    return optimizer, scheduler
'''

# The default data with each item as ITEM: build_datasets for the sources below.
DEFAULT_DATA_AS = '''
def build_datasets(args):
    """The default data, each item ITEM."""

    def stream(part):
        return torch.Generator().manual_seed(1000 * args.seed + part)

    prototypes = torch.randn(NUM_CLASSES, 3, 16, 16, generator=stream(0))

    def make(size, part):
        generator = stream(part)
        labels = torch.randint(NUM_CLASSES, (size,), generator=generator)
        noise = torch.randn(size, 3, 16, 16, generator=generator)
        images = prototypes[labels] + 2 * noise
        return [ITEM for image, label in zip(images, labels)]

    return make(args.train_size, 1), make(args.val_size, 2)
'''

AS_LIST = (
    DEFAULT_DATA_AS.replace("ITEM", "[image, label]")
    + """

def compute_loss(model, batch):
    assert isinstance(batch, list)
    images, labels = batch
    return F.cross_entropy(model(images), labels), len(labels)


def compute_metrics(model, batch):
    images, labels = batch
    logits = model(images)
    return {
        "loss": (F.cross_entropy(logits, labels, reduction="sum"), len(labels)),
        "acc": ((logits.argmax(dim=1) == labels).sum(), len(labels)),
    }
"""
)

AS_DICT = (
    DEFAULT_DATA_AS.replace("ITEM", '{"image": image, "label": label}')
    + """

def compute_loss(model, batch):
    return F.cross_entropy(model(batch["image"]), batch["label"]), len(batch["label"])


def compute_metrics(model, batch):
    logits, labels = model(batch["image"]), batch["label"]
    return {
        "loss": (F.cross_entropy(logits, labels, reduction="sum"), len(labels)),
        "acc": ((logits.argmax(dim=1) == labels).sum(), len(labels)),
    }
"""
)


def adapted(tmp_path, name, source, **answers):
    project = bake(tmp_path / name, **answers)
    replace_user_functions(project, source)
    return project


def train(project, out_dir, nproc, *args, expect=0, env=None):
    return run_warm(project, out_dir, nproc, *COMMON, *args, env=env, expect=expect)


def final(out_dir):
    return load_weights(out_dir / "model_final.pt")


def resumed_equals_uninterrupted(project, tmp_path, nproc, *args):
    """2 epochs, then a resume to 3, end like 3 epochs at once (weights and rows)."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(project, full, nproc, *args, "--epochs", "3")
    train(project, cut, nproc, *args, "--epochs", "2")
    output = train(project, cut, nproc, *args, "--epochs", "3")
    assert "resumed from" in output and "after epoch 2" in output
    assert max_difference(final(full), final(cut)) < 1e-6
    keep = [key for key in metrics(full)[0] if not key.endswith("_s")]
    assert [[r[k] for k in keep] for r in metrics(full)] == [
        [r[k] for k in keep] for r in metrics(cut)
    ]
    return full


# -- a tabular MLP with Dropout and LayerNorm --------------------------------------------


def test_tabular_mlp_with_dropout_trains_resumes_and_scales(tmp_path):
    project = adapted(tmp_path, "mlp", MLP.replace("DROPOUT", "0.1"))
    args = ["--lr", "0.01", "--batch-size", "8"]
    full = resumed_equals_uninterrupted(project, tmp_path, 2, *args)
    rows = metrics(full)
    assert list(rows[0])[:6] == [
        "epoch",
        "step",
        "train_loss",
        "val_loss",
        "val_mae",
        "lr",
    ]
    assert float(rows[-1]["val_loss"]) < 0.5 * float(rows[0]["val_loss"])  # learns

    # Dropout draws other numbers on 2 ranks than on 1, so the equivalence needs it
    # off; LayerNorm normalizes each sample alone and keeps it.
    exact = adapted(tmp_path, "exact", MLP.replace("DROPOUT", "0.0"))
    args = ["--lr", "0.01", "--epochs", "2"]
    train(exact, tmp_path / "w2", 2, *args, "--batch-size", "8")
    train(exact, tmp_path / "w1", 1, *args, "--batch-size", "16")
    assert max_difference(final(tmp_path / "w2"), final(tmp_path / "w1")) < 1e-5


# -- dict batches, a token-level loss, token accuracy --------------------------------------


def token_accuracy(project, out_dir):
    """Ground truth: the saved weights on the whole validation set, in one process."""
    module = load_module(project)
    args = module.parse_args([*COMMON])
    _, val_set = module.build_datasets(args)
    model = module.build_model(args)
    model.load_state_dict(final(out_dir))
    input_ids = torch.stack([item["input_ids"] for item in val_set])
    labels = torch.stack([item["labels"] for item in val_set])
    with torch.no_grad():
        predicted = model(input_ids).argmax(-1)
    real = labels != -100
    return ((predicted == labels) & real).sum().item() / real.sum().item()


def test_dict_batches_with_token_loss_and_token_accuracy(tmp_path):
    project = adapted(tmp_path, "tokens", TOKENS)
    # A metric no batch has units for (a token that never occurs) is nan, not an error.
    edit(
        project,
        '"token_acc": (correct, real.sum())}',
        '"token_acc": (correct, real.sum()), "acc_99": (correct, (labels == 99).sum())}',
    )
    full = resumed_equals_uninterrupted(project, tmp_path, 2, "--batch-size", "4")
    rows = metrics(full)
    assert "val_token_acc" in rows[0] and "val_acc" not in rows[0]
    assert all(math.isnan(float(row["val_acc_99"])) for row in rows)
    assert float(rows[-1]["val_token_acc"]) == pytest.approx(
        token_accuracy(project, full), abs=1e-6
    )
    assert 0.3 < float(rows[-1]["val_token_acc"]) <= 1

    # Batches hold different numbers of real tokens: the update weighs every token of
    # the global batch alike, so 2 x 4 sequences equal 1 x 8.
    train(project, tmp_path / "w1", 1, "--epochs", "3", "--batch-size", "8")
    assert max_difference(final(full), final(tmp_path / "w1")) < 1e-5


def test_fsdp2_weighs_every_token_of_the_global_batch_alike(tmp_path):
    """FSDP2's units travel with its reduce-scatter (UnitCounter, the root of the
    sharding): 2 x 4 sequences of different numbers of tokens equal 1 x 8."""
    project = adapted(tmp_path, "tokens", TOKENS, parallelism="fsdp2")
    args = ["--epochs", "2"]
    train(project, tmp_path / "w2", 2, *args, "--batch-size", "4")
    train(project, tmp_path / "w1", 1, *args, "--batch-size", "8")
    assert max_difference(final(tmp_path / "w2"), final(tmp_path / "w1")) < 1e-5


def test_token_weighting_is_what_makes_dict_batches_scale(tmp_path):
    """The control for the test above: averaging each rank's per-token mean instead
    (the usual DDP loop) makes 2 x 4 differ from 1 x 8."""
    project = adapted(tmp_path, "tokens", TOKENS)
    # Each micro-batch weighs 1, not n / batch size: the units' mean is 1 too.
    edit(project, "total = total * (n / args.batch_size)", "pass")
    args = ["--epochs", "2"]
    train(project, tmp_path / "w2", 2, *args, "--batch-size", "4")
    train(project, tmp_path / "w1", 1, *args, "--batch-size", "8")
    assert max_difference(final(tmp_path / "w2"), final(tmp_path / "w1")) > 1e-4


# -- AdamW, warm-up and cosine, gradient clipping -----------------------------------------


ADAMW = ["--epochs", "2", "--lr", "0.003", "--clip-grad-norm", "0.5"]


@pytest.fixture(scope="module")
def adamw(tmp_path_factory):
    """The project with ADAMW_COSINE and no BatchNorm, able to stop itself, and the
    output of its run on 2 workers x batch 8 with ADAMW's arguments."""
    root = tmp_path_factory.mktemp("adamw")
    project = adapted(root, "adamw", ADAMW_COSINE)
    without_batchnorm(project)
    act_after_step(project)
    train(project, root / "a", 2, *ADAMW, "--batch-size", "8")
    return project, root / "a"


@pytest.mark.xdist_group("workbench_adamw")
def test_adamw_cosine_and_clipping_scale_with_workers_and_accumulation(tmp_path, adamw):
    project, run_a = adamw
    args = ADAMW
    train(project, tmp_path / "b", 1, *args, "--batch-size", "8", "--grad-accum", "2")
    train(project, tmp_path / "c", 1, *args, "--batch-size", "16")
    a, b, c = final(run_a), final(tmp_path / "b"), final(tmp_path / "c")
    assert max_difference(a, b) < 1e-5
    assert max_difference(a, c) < 1e-5
    lrs = [float(row["lr"]) for row in metrics(run_a)]
    assert lrs[-1] == pytest.approx(0.0, abs=1e-9)  # the cosine ran to its end
    # The clipping bites: without it the same run ends elsewhere.
    train(project, tmp_path / "d", 2, *args[:-2], "--batch-size", "8")
    assert max_difference(a, final(tmp_path / "d")) > 1e-3

    # Stopped by SIGTERM in epoch 1 and resumed with the same arguments: AdamW's
    # moments and the cosine's position come back, and it ends like the run "a".
    stop = {
        "TEST_ACT_AT": "0:0:1",
        "TEST_ACTION": "os.killpg(os.getpgrp(), signal.SIGTERM)",
    }
    args = [*args, "--batch-size", "8"]
    output = train(project, tmp_path / "e", 2, *args, env=stop, expect=143)
    assert "preempted: saved" in output
    output = train(project, tmp_path / "e", 2, *args)
    assert "resumed from" in output and "resume: the LR" not in output
    assert max_difference(a, final(tmp_path / "e")) < 1e-6


def test_clipping_under_fp16_sees_the_true_gradients(tmp_path):
    """Clipping the still-scaled fp16 gradients (x 65536) would shrink every SGD
    update to nothing (Adam's normalization would hide it); unscaled first, fp16
    trains like bf16."""
    project = bake(tmp_path)
    args = ["--epochs", "2", "--batch-size", "8", "--clip-grad-norm", "1.0"]
    train(project, tmp_path / "fp16", 2, *args, "--amp", "fp16")
    train(project, tmp_path / "bf16", 2, *args, "--amp", "bf16")
    module = load_module(project)
    torch.manual_seed(0)
    start = module.build_model(module.parse_args([])).state_dict()
    fp16, bf16 = final(tmp_path / "fp16"), final(tmp_path / "bf16")
    moved = max_difference(fp16, start)
    assert moved > 0.5 * max_difference(bf16, start) > 0
    assert max_difference(fp16, bf16) < 0.25 * moved


@pytest.mark.xdist_group("workbench_adamw")
def test_a_longer_run_resumes_on_the_longer_schedule(tmp_path, adamw):
    """Resumed with more --epochs, a cosine is rebuilt for the new length (one line
    says so) instead of repeating the old one: from then on its LR is the LR of a
    4-epoch schedule, computed here from build_optimizer itself."""
    project, two_epochs = adamw
    shutil.copytree(two_epochs, tmp_path / "cut")
    args = [*ADAMW[2:], "--batch-size", "8"]
    output = train(project, tmp_path / "cut", 2, *args, "--epochs", "4")
    line = (
        "resume: the LR schedule is rebuilt for --lr 0.003, 16 updates of 16 samples "
        "(the checkpoint's: --lr 0.003, 8 updates of 16); continuing at update 8, LR "
    )
    assert output.count(line) == 1, output

    module = load_module(project)
    optimizer, scheduler = module.build_optimizer(
        torch.nn.Linear(1, 1), module.parse_args(args), total_updates=16
    )
    four_epochs = []
    for _ in range(4):  # 64 samples, 2 x 8 a step: 4 updates an epoch
        for _ in range(4):
            optimizer.step()
            scheduler.step()
        four_epochs.append(optimizer.param_groups[0]["lr"])
    rows = metrics(tmp_path / "cut")
    assert [float(row["lr"]) for row in rows[2:]] == pytest.approx(four_epochs[2:])
    assert float(rows[1]["lr"]) == pytest.approx(0.0, abs=1e-9)  # the old one's end
    assert four_epochs[1] > 1e-4  # which the new one is not at


# -- batches as lists and as dicts ---------------------------------------------------------


@pytest.fixture(scope="module")
def as_tuples(tmp_path_factory):
    """The default project's run, whose batches are tuples (images, labels)."""
    root = tmp_path_factory.mktemp("tuples")
    project = bake(root, save_strategy="final_only")
    train(project, root / "out", 2, "--epochs", "2", "--batch-size", "8")
    return root / "out"


@pytest.mark.xdist_group("workbench_tuples")
@pytest.mark.parametrize("source", [AS_LIST, AS_DICT], ids=["list", "dict"])
def test_batches_as_lists_and_dicts_train_like_tuples(tmp_path, as_tuples, source):
    project = adapted(tmp_path, "other", source, save_strategy="final_only")
    train(project, tmp_path / "out", 2, "--epochs", "2", "--batch-size", "8")
    assert max_difference(final(tmp_path / "out"), final(as_tuples)) == 0
    accuracy = [metrics(out)[-1]["val_acc"] for out in (tmp_path / "out", as_tuples)]
    assert accuracy[0] == accuracy[1]


# -- resuming with other arguments ---------------------------------------------------------


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """The default project (spawn launcher) and the output of its first epoch on 2
    workers x batch 8, from which the tests below resume (each in a copy)."""
    root = tmp_path_factory.mktemp("one_epoch")
    project = bake(root, launcher="spawn")
    train(project, root / "out", 2, "--batch-size", "8", "--epochs", "1")
    return project, root / "out"


@pytest.mark.xdist_group("workbench_one_epoch")
def test_a_resume_that_cannot_keep_the_global_batch_is_refused(tmp_path, one_epoch):
    project, first = one_epoch
    out = tmp_path / "out"
    shutil.copytree(first, out)
    before = (out / "checkpoint_last.pt").read_bytes()
    output = train(project, out, 2, "--batch-size", "16", "--epochs", "2", expect=2)
    errors = error_lines(output)
    refusal = (
        "error: the checkpoint's global batch is 16 (2 processes x batch 8 x "
        "grad-accum 1); 2 processes x batch 16 x grad-accum 1 make 32: e.g. "
        "--batch-size 8 --grad-accum 1, or pass --allow-batch-change to go on with 32"
    )
    assert errors == [refusal]
    assert "Traceback" not in output
    assert (out / "checkpoint_last.pt").read_bytes() == before

    # Allowed, with a new --lr too: one line for the batch, one for the schedule.
    allowed = ["--batch-size", "16", "--allow-batch-change", "--lr", "0.05"]
    output = train(project, out, 2, "--epochs", "2", *allowed)
    assert "resume: global batch 32 changed from 16" in output
    line = (
        "rebuilt for --lr 0.05, 4 updates of 32 samples (the checkpoint's: --lr 0.1, "
    )
    assert output.count(f"{line}4 updates of 16); continuing at update 2, LR 0.05") == 1
    assert [row["lr"] for row in metrics(out)] == ["0.1", "0.05"]


@pytest.mark.xdist_group("workbench_one_epoch")
def test_a_resume_with_fp16_goes_on_and_one_after_a_new_optimizer_is_refused(
    tmp_path, one_epoch
):
    """--amp fp16 from a checkpoint saved without it starts a fresh loss scaler;
    build_optimizer() changed (SGD -> AdamW) refuses in one line, writing nothing."""
    original, first = one_epoch
    project = tmp_path / original.name  # edited below
    shutil.copytree(original, project)
    out = tmp_path / "out"
    shutil.copytree(first, out)
    output = train(
        project, out, 2, "--batch-size", "8", "--epochs", "2", "--amp", "fp16"
    )
    assert "resumed from" in output and "after epoch 1" in output
    assert [row["epoch"] for row in metrics(out)] == ["1", "2"]

    replace_user_functions(project, ADAMW_COSINE)
    before = (out / "checkpoint_last.pt").read_bytes()
    output = train(project, out, 2, "--batch-size", "8", "--epochs", "3", expect=1)
    errors = error_lines(output)
    refusal = (
        f"error: {out / 'checkpoint_last.pt'} holds another optimizer or LR schedule "
        "than build_optimizer() makes; start afresh with --resume never or another "
        "--output-dir"
    )
    assert errors == [refusal], output
    assert "Traceback" not in output
    assert (out / "checkpoint_last.pt").read_bytes() == before


NO_VALIDATION = '''
def build_datasets(args):
    """A validation split that came out empty (say, a wrong path or filter)."""
    images, labels = torch.randn(64, 3, 16, 16), torch.randint(NUM_CLASSES, (64,))
    return TensorDataset(images, labels), TensorDataset(images[:0], labels[:0])
'''


def test_an_empty_dataset_is_one_line(tmp_path):
    project = adapted(tmp_path, "empty", NO_VALIDATION)
    output = train(project, tmp_path / "out", 2, "--epochs", "1", expect=1)
    errors = error_lines(output)
    assert errors == ["error: build_datasets() returned an empty validation set"]
    assert "Traceback" not in output


# 50 samples: on 2 processes 25 each, 3 batches of 8 and one of 1, which DROP_LAST
# leaves out; on 1 process, 3 batches of 16 and one of 2, left out: the same 48.
DROPPING = ["--num-workers", "0", "--val-size", "37", "--train-size", "50"]
DROPPING += ["--epochs", "2", "--lr", "0.05", "--save-every", "4"]


@pytest.mark.parametrize("batch_sampler", [True, False], ids=["batch_sampler", "plain"])
def test_drop_last_leaves_out_a_short_last_batch_and_resumes(tmp_path, batch_sampler):
    """DROP_LAST = True: 3 updates a pass (not 4); 2 x 8 trains as 1 x 16; a SIGTERM
    after the first update of pass 2, then the same command: the weights of a run never
    stopped; a process's share smaller than --batch-size: refused in one line. With
    the DistributedSampler in a BatchSampler, and given to the DataLoader itself."""
    project = bake(tmp_path / "project", use_batch_sampler=batch_sampler)
    without_batchnorm(project)
    edit(project, "DROP_LAST = False", "DROP_LAST = True")
    act_after_step(project)
    two, one, cut = tmp_path / "two", tmp_path / "one", tmp_path / "cut"
    run_warm(project, two, 2, *DROPPING, "--batch-size", "8")
    run_warm(project, one, 1, *DROPPING, "--batch-size", "16")
    assert [row["step"] for row in metrics(two)] == ["3", "6"]
    assert max_difference(final(two), final(one)) < 1e-5

    sigterm = "os.killpg(os.getpgrp(), signal.SIGTERM)"
    stop = {"TEST_ACT_AT": "0:1:0", "TEST_ACTION": sigterm}
    run_warm(project, cut, 2, *DROPPING, "--batch-size", "8", env=stop, expect=143)
    output = run_warm(project, cut, 2, *DROPPING, "--batch-size", "8")
    assert "in epoch 2 after 1 batch" in output, output
    assert max_difference(final(cut), final(two)) < 1e-6

    big = ["--batch-size", "32"]
    output = run_warm(project, tmp_path / "big", 2, *DROPPING, *big, expect=2)
    share = "(25 samples a process): lower --batch-size"
    assert error_lines(output) == [f"error: DROP_LAST leaves no batch {share}"], output


# Two parameters that do not train: one never changes, the other counts the
# optimizer's updates (as a buffer of one's own, or an EMA's weights, would change).
FROZEN = """
def build_optimizer(model, args, total_updates):
    model.register_parameter("still", nn.Parameter(torch.ones(3), requires_grad=False))
    model.register_parameter("count", nn.Parameter(torch.zeros(()), requires_grad=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    optimizer.register_step_post_hook(lambda *_: model.count.add_(1))
    return optimizer, None
"""


def test_a_checkpoint_leaves_out_a_frozen_parameter_only_as_built(tmp_path):
    """A checkpoint leaves out a frozen parameter still as build_model() (and
    build_optimizer) made it, and saves one that changed since: resumed after the
    first pass's 4 updates, the count goes on to 8."""
    project = bake(tmp_path / "project")
    replace_user_functions(project, FROZEN)
    out = tmp_path / "out"
    run_warm(project, out, 1, *COMMON, "--batch-size", "16", "--epochs", "1")
    checkpoint = load_weights(out / "checkpoint_last.pt")
    assert "still" not in checkpoint["model"] and "still" in checkpoint["frozen"]
    assert (
        checkpoint["model"]["count"].item() == 4 and "count" not in checkpoint["frozen"]
    )
    run_warm(project, out, 1, *COMMON, "--batch-size", "16", "--epochs", "2")
    assert final(out)["count"].item() == 8
    assert final(out)["still"].tolist() == [1, 1, 1]
