"""--evaluate PATH: saved weights (model_final.pt or a checkpoint) scored by the exact
distributed evaluation on any number of processes, printed like a training epoch's
line, with nothing written; a file that is missing or does not fit is one line."""

import shutil

import pytest
import torch

from conftest import bake, error_lines, metrics, run_warm

ARGS = ["--num-workers", "0", "--val-size", "37", "--batch-size", "8"]


def folder_state(folder):
    """Every file under a folder: its bytes and its modification time."""
    return {
        path: (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def printed(output, path):
    """{name: value} from the one "evaluate PATH  val_loss X  val_acc Y" line."""
    (line,) = [x for x in output.splitlines() if x.startswith("evaluate ")]
    head, _, values = line.partition("  ")
    assert head == f"evaluate {path}", line
    pairs = [pair.split(" ") for pair in values.split("  ")]
    return {name: float(value) for name, value in pairs}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The output folder of the default project's run on 2 processes, 2 epochs."""
    root = tmp_path_factory.mktemp("trained")
    project = bake(root, save_strategy="last")
    run_warm(project, root / "out", 2, *ARGS, "--epochs", "2", "--train-size", "64")
    return root / "out"


@pytest.mark.xdist_group("evaluate_trained")
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_evaluate_equals_the_last_epoch_on_one_and_two_processes(
    tmp_path, trained, launcher
):
    """Each launcher's project scores the same run's files (their format is the
    same: the launcher only starts the processes)."""
    project = bake(tmp_path, launcher=launcher, save_strategy="last")
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    last = metrics(out)[-1]
    before = folder_state(out)
    # The default --train-size this time: the validation set does not depend on it.
    for nproc, name in ((1, "model_final.pt"), (2, "checkpoint_last.pt")):
        output = run_warm(project, out, nproc, *ARGS, "--evaluate", str(out / name))
        scores = printed(output, out / name)
        assert list(scores) == ["val_loss", "val_acc"]
        for key, value in scores.items():
            assert value == pytest.approx(float(last[key]), rel=1e-5), (nproc, key)
        assert "epoch " not in output and "done:" not in output
    assert folder_state(out) == before  # nothing written, nothing touched


def test_a_missing_or_unfitting_file_is_one_line(tmp_path):
    project = bake(tmp_path, launcher="spawn")
    other = tmp_path / "other.pt"
    torch.save({"weight": torch.zeros(3)}, other)  # another model's weights
    cases = {
        tmp_path / "missing.pt": "error: cannot evaluate {}: No such file or directory",
        other: "error: {} does not fit the model build_model() makes (Unexpected key",
    }
    for path, message in cases.items():
        output = run_warm(
            project, tmp_path / "out", 2, *ARGS, "--evaluate", str(path), expect=1
        )
        errors = error_lines(output)
        assert len(errors) == 1 and errors[0].startswith(message.format(path)), output
        assert "Traceback" not in output
    assert not (tmp_path / "out").exists()
