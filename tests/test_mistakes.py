"""A mistake in the user's own code, on 2 processes: one traceback (the first failing
rank's, from the user's frame on) and one line naming the rank, the function and the
file line; a value one of the five functions returns that cannot work is one line
that says what was returned and what is expected, at the first batch; a global batch
larger than the training set is one warning line. And the generated README's snippet
for loading model_final.pt, run as written."""

import re
import subprocess
import sys

import pytest

from conftest import bake, error_lines, replace_user_functions, run_single, run_warm
from test_streams import readme_block

ARGS = ["--epochs", "1", "--train-size", "64", "--val-size", "32", "--num-workers", "0"]

FLOAT_LABELS = """
def compute_loss(model, batch):
    images, labels = batch
    return F.cross_entropy(model(images), labels.float()), len(labels)
"""

TOO_FEW_CLASSES = """
def build_model(args):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 2))
"""

LOSS_ALONE = """
def compute_loss(model, batch):
    images, labels = batch
    return F.cross_entropy(model(images), labels)
"""

METRICS_AS_FLOATS = """
def compute_metrics(model, batch):
    images, labels = batch
    return {"loss": F.cross_entropy(model(images), labels).item()}
"""


def mistaken(tmp_path, source, **answers):
    project = bake(tmp_path, **answers)
    replace_user_functions(project, source)
    return project


def line_of(project, text):
    """The line number of `text` in the generated script."""
    lines = (project / "main_multi_gpu.py").read_text().splitlines()
    (number,) = [i for i, line in enumerate(lines, 1) if text in line]
    return number


def one_traceback(output, error, function, line):
    """The output holds one traceback, from the user's function on, and ends with the
    line that names the rank, the function and the line."""
    assert output.count("Traceback (most recent call last):") == 1, output
    assert "[rank0]:" not in output and "[rank1]:" not in output, output
    traceback = output[output.index("Traceback") :]
    assert f", in {function}\n" in traceback, output
    assert ", in train_pass\n" not in traceback  # the project's frames trimmed
    last = output.rstrip().splitlines()[-1]
    pattern = (
        rf"\[rank [01]\] error: {error} in {function}, line {line}: .+ "
        r"\(the traceback above(; 2 of 2 ranks failed)?\)"
    )
    assert re.fullmatch(pattern, last), output
    assert error_lines(output)[-1] == last


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_an_error_in_compute_loss_is_one_traceback_and_one_line(tmp_path, launcher):
    project = mistaken(tmp_path, FLOAT_LABELS, launcher=launcher)
    output = run_single(project, tmp_path / "out", 2, *ARGS, expect=1)
    line = line_of(project, "labels.float()")
    one_traceback(output, "RuntimeError", "compute_loss", line)
    assert output.rstrip().endswith("2 of 2 ranks failed)"), output


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_an_index_error_in_the_loss_names_compute_loss(tmp_path, launcher):
    """A last layer too small for the labels: IndexError, raised inside torch's
    cross_entropy, named at compute_loss's line."""
    project = mistaken(tmp_path, TOO_FEW_CLASSES, launcher=launcher)
    output = run_single(project, tmp_path / "out", 2, *ARGS, expect=1)
    line = line_of(project, "return F.cross_entropy(model(images), labels), len(")
    one_traceback(output, "IndexError", "compute_loss", line)
    assert "Target" in output.rstrip().splitlines()[-1]


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_compute_loss_returning_the_loss_alone_is_one_line(tmp_path, launcher):
    project = mistaken(tmp_path, LOSS_ALONE, launcher=launcher)
    output = run_warm(project, tmp_path / "out", 2, *ARGS, expect=1)
    line = (
        "error: compute_loss returned a tensor of shape (); it must return (loss, n): "
        "the mean loss over n units, a tensor of shape ()"
    )
    assert error_lines(output) == [line], output
    assert "Traceback" not in output


def test_compute_metrics_returning_floats_is_one_line(tmp_path):
    project = mistaken(tmp_path, METRICS_AS_FLOATS)
    output = run_warm(project, tmp_path / "out", 2, *ARGS, expect=1)
    line = "error: compute_metrics returned {'loss': a float}; it must return "
    assert error_lines(output) == [line + "{'loss': (sum, n), ...}"], output


def test_a_global_batch_larger_than_the_training_set_is_one_warning(tmp_path):
    project = bake(tmp_path)
    out = tmp_path / "out"
    output = run_warm(project, out, 2, *ARGS, "--batch-size", "40")
    assert output.count("warning: the global batch") == 1, output
    assert (
        "warning: the global batch (80) is larger than the training set (64 samples): "
        "one update a pass"
    ) in output
    assert "step 1 " in output  # one update, as it says
    output = run_warm(project, tmp_path / "fine", 2, *ARGS, "--batch-size", "32")
    assert "warning" not in output


def test_the_readme_inference_snippet_loads_the_final_weights(tmp_path):
    """The README's snippet, run as a user's own script beside main_multi_gpu.py,
    predicts with the trained weights."""
    project = bake(tmp_path)
    run_warm(project, project / "outputs", 2, *ARGS)
    snippet = readme_block(project, "predictions = ")
    (project / "predict.py").write_text(snippet + "\nprint(predictions.shape)\n")
    done = subprocess.run(
        [sys.executable, "predict.py"], cwd=project, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "torch.Size([8])"
