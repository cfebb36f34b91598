"""The numbers behind the contract's guarantees: W workers equal one with a W-times
batch, a resumed run equals an uninterrupted one, and evaluation is exact for any
world size. CPU and gloo; the SyncBatchNorm case needs a GPU."""

import re
import shutil

import pytest
import torch

from conftest import (
    bake,
    edit,
    load_module,
    load_weights,
    max_difference,
    metrics,
    run_warm,
    without_batchnorm,
)

SEED = 3
COMMON = ["--num-workers", "0", "--val-size", "37", "--seed", str(SEED)]
SAME = ("epoch", "train_loss", "val_loss", "val_acc", "lr")  # samples_per_s varies


def train(project, out_dir, nproc, *args):
    return run_warm(project, out_dir, nproc, *COMMON, *args)


def initial_weights(project):
    module = load_module(project)
    torch.manual_seed(SEED)  # as the script seeds before build_model()
    return module.build_model(module.parse_args([])).state_dict()


# -- 1. Equivalence ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    """1 worker with batch 16, no BatchNorm: the run every 2 x 8 variant must equal.
    (With one worker the data order is the same for every variant.)"""
    root = tmp_path_factory.mktemp("one_worker")
    project = bake(root, save_strategy="final_only")
    without_batchnorm(project)
    args = ["--epochs", "2", "--train-size", "64", "--batch-size", "16"]
    train(project, root / "w1", 1, *args)
    return load_weights(root / "w1" / "model_final.pt"), metrics(root / "w1")


@pytest.mark.xdist_group("guarantees_one_worker")
@pytest.mark.parametrize("use_batch_sampler", [True, False])
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_two_workers_equal_one_worker_with_twice_the_batch(
    tmp_path, one_worker, launcher, use_batch_sampler
):
    project = bake(
        tmp_path,
        launcher=launcher,
        use_batch_sampler=use_batch_sampler,
        save_strategy="final_only",
    )
    without_batchnorm(project)
    args = ["--epochs", "2", "--train-size", "64"]
    train(project, tmp_path / "w2", 2, *args, "--batch-size", "8")

    w2 = load_weights(tmp_path / "w2" / "model_final.pt")
    w1, rows1 = one_worker
    assert max_difference(w2, w1) < 1e-5
    # Both trained: the weights moved well away from where they started.
    assert max_difference(w1, initial_weights(project)) > 1e-2
    for row2, row1 in zip(metrics(tmp_path / "w2"), rows1, strict=True):
        for key in ("train_loss", "val_loss", "val_acc"):
            assert float(row2[key]) == pytest.approx(float(row1[key]), abs=2e-6)


# What W x B == 1 x WB holds to on a GPU: with --deterministic (no TF32), what it holds
# to on a CPU; with the defaults (TF32 matrix products and convolutions), what the
# generated README states for GPUs. The first GPU run: 1.6e-4 with TF32, two ranks
# sharing one H100 over gloo.
GPU_TOLERANCE = {"--deterministic": 1e-5, "defaults": 1e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(GPU_TOLERANCE))
def test_sync_batchnorm_two_workers_equal_one_worker_on_gpu(tmp_path, mode):
    """Real SyncBatchNorm (GPU only). NCCL wants one GPU per rank; with a single GPU,
    two ranks share it over gloo, which takes CUDA tensors."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    project = bake(tmp_path, sync_bn=True, save_strategy="final_only")
    args = ["--epochs", "2", "--train-size", "64", "--backend", backend]
    args += [mode] if mode.startswith("--") else []
    output = train(project, tmp_path / "w2", 2, *args, "--batch-size", "8")
    assert "SyncBatchNorm runs on GPUs only" not in output
    train(project, tmp_path / "w1", 1, *args, "--batch-size", "16")
    w2 = load_weights(tmp_path / "w2" / "model_final.pt")
    w1 = load_weights(tmp_path / "w1" / "model_final.pt")
    # Running statistics included: they are in the state_dict.
    assert max_difference(w2, w1) < GPU_TOLERANCE[mode]
    assert max_difference(w1, initial_weights(project)) > 1e-2


def test_the_readme_states_the_gpu_tolerances(tmp_path):
    readme = " ".join((bake(tmp_path) / "README.md").read_text().split())
    said = re.search(
        r"within ([\d.e-]+) with the defaults .*? within ([\d.e-]+), as on a CPU, "
        r"with `--deterministic`",
        readme,
    )
    assert said, readme
    assert list(map(float, said.groups())) == [
        GPU_TOLERANCE["defaults"],
        GPU_TOLERANCE["--deterministic"],
    ]


# -- 2. Resume ---------------------------------------------------------------------------
# ("last", "final_only" and torchrun resume in test_workbench.py, test_elastic.py,
# test_safety.py and test_faults.py; here the spawn launcher and the strategy with the
# most state.)

RESUMED = ["--train-size", "64", "--batch-size", "8"]


@pytest.fixture(scope="module")
def straight_and_cut(tmp_path_factory):
    """The default project (BatchNorm, spawn, best), 2 workers x batch 8: a run of 3
    epochs, and one stopped after epoch 1 (its folder is copied by each resume)."""
    root = tmp_path_factory.mktemp("straight_and_cut")
    project = bake(root, launcher="spawn", save_strategy="best")
    train(project, root / "full", 2, *RESUMED, "--epochs", "3")
    train(project, root / "cut", 2, *RESUMED, "--epochs", "1")
    return project, root / "full", root / "cut"


@pytest.mark.xdist_group("guarantees_straight_and_cut")
def test_resume_equals_no_interruption(tmp_path, straight_and_cut):
    project, full, stopped = straight_and_cut
    cut = tmp_path / "cut"
    shutil.copytree(stopped, cut)
    output = train(project, cut, 2, *RESUMED, "--epochs", "3")  # --resume auto
    assert f"resumed from {cut / 'checkpoint_last.pt'} after epoch 1" in output

    assert (
        max_difference(
            load_weights(full / "model_final.pt"), load_weights(cut / "model_final.pt")
        )
        < 1e-6
    )
    # The whole training state matches, not only the weights.
    a = load_weights(full / "checkpoint_last.pt")
    b = load_weights(cut / "checkpoint_last.pt")
    assert a["epoch"] == b["epoch"] == 3
    assert a["scheduler"] == b["scheduler"]
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    momentum = {k: v["momentum_buffer"] for k, v in a["optimizer"]["state"].items()}
    resumed = {k: v["momentum_buffer"] for k, v in b["optimizer"]["state"].items()}
    assert momentum.keys() == resumed.keys() and momentum
    assert max_difference(momentum, resumed) < 1e-6
    assert a["best_val_loss"] == b["best_val_loss"]
    best_a = load_weights(full / "checkpoint_best.pt")["epoch"]
    assert best_a == load_weights(cut / "checkpoint_best.pt")["epoch"]
    # metrics.csv continues: the same rows, none twice.
    assert [[r[k] for k in SAME] for r in metrics(full)] == [
        [r[k] for k in SAME] for r in metrics(cut)
    ]


@pytest.mark.xdist_group("guarantees_straight_and_cut")
def test_resume_with_a_restarted_data_order_differs(tmp_path, straight_and_cut):
    """The control for the test above: a resume that restarts the shuffle at epoch 0
    (a script calling set_epoch with its own loop counter) ends elsewhere."""
    original, full, stopped = straight_and_cut
    project = tmp_path / original.name
    shutil.copytree(original, project)
    cut = tmp_path / "cut"
    shutil.copytree(stopped, cut)
    edit(
        project, "NUM_CLASSES = 10\n", "NUM_CLASSES = 10\nPASSES = []  # of this run\n"
    )
    edit(
        project,
        "    t.train_data.set_epoch(at.epoch,",
        "    PASSES.append(at.epoch)\n    t.train_data.set_epoch(len(PASSES) - 1,",
    )
    train(project, cut, 2, *RESUMED, "--epochs", "3")
    assert (
        max_difference(
            load_weights(full / "model_final.pt"), load_weights(cut / "model_final.pt")
        )
        > 1e-4
    )


@pytest.mark.xdist_group("guarantees_straight_and_cut")
def test_plain_batchnorm_breaks_the_equivalence(tmp_path, straight_and_cut):
    """The control for the equivalence above: with per-rank BatchNorm statistics,
    2 x 8 is not 1 x 16, and the comparison sees it."""
    project, two, _ = straight_and_cut
    one = tmp_path / "one"
    train(project, one, 1, "--train-size", "64", "--batch-size", "16", "--epochs", "3")
    w2 = load_weights(two / "model_final.pt")
    w1 = load_weights(one / "model_final.pt")
    assert max_difference(w2, w1) > 1e-3


# -- 3. Exact evaluation -----------------------------------------------------------------


def test_evaluation_is_exact_for_world_sizes_1_2_3(tmp_path):
    """37 validation samples (divisible by neither 2 nor 3). Without BatchNorm, W
    workers with batch 24/W train the same weights, so the scores must agree, and
    agree with a plain evaluation of model_final.pt over the whole set."""
    project = bake(tmp_path, save_strategy="final_only")
    without_batchnorm(project)
    rows = {}
    for world in (1, 2, 3):
        out_dir = tmp_path / f"w{world}"
        args = ["--epochs", "1", "--train-size", "48", "--batch-size", str(24 // world)]
        train(project, out_dir, world, *args)
        (rows[world],) = metrics(out_dir)

    for world in (2, 3):
        val_loss, val_acc = (
            float(rows[world]["val_loss"]),
            float(rows[world]["val_acc"]),
        )
        assert val_loss == pytest.approx(float(rows[1]["val_loss"]), abs=1e-6)
        assert val_acc == pytest.approx(float(rows[1]["val_acc"]), abs=1e-6)

    # Ground truth: one process, the whole validation set at once, no DDP, and the
    # loss and accuracy written out here rather than taken from the script.
    module = load_module(project)
    data_args = module.parse_args(["--seed", str(SEED), "--train-size", "48"])
    data_args.val_size = 37
    _, val_set = module.build_datasets(data_args)
    model = module.build_model(data_args)
    model.load_state_dict(load_weights(tmp_path / "w3" / "model_final.pt"))
    model.eval()
    images, targets = val_set.tensors
    with torch.no_grad():
        outputs = model(images)
    true_loss = torch.nn.functional.cross_entropy(outputs, targets).item()
    true_acc = (outputs.argmax(dim=1) == targets).double().mean().item()
    for world in (1, 2, 3):
        assert float(rows[world]["val_loss"]) == pytest.approx(true_loss, abs=1e-6)
        assert float(rows[world]["val_acc"]) == pytest.approx(true_acc, abs=1e-6)
