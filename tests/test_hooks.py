"""Bad answers stop generation with a clear message and leave nothing behind;
tricky but valid ones make working projects."""

import os
import subprocess
import sys

import pytest
import torch

from combinations import TEMPLATE
from conftest import TINY, bake, default_model, run_job

REFUSED = [
    ("project_slug", "a/b", "project_slug 'a/b' is not a valid Python identifier"),
    ("project_slug", "../up", "project_slug '../up' is not a valid Python identifier"),
    ("project_slug", "..", "project_slug '..' is not a valid Python identifier"),
    ("project_slug", "", "project_slug '' is not a valid Python identifier"),
    (
        "project_slug",
        "my-net",
        "project_slug 'my-net' is not a valid Python identifier",
    ),
    (
        "project_slug",
        "my net",
        "project_slug 'my net' is not a valid Python identifier",
    ),
    (
        "project_name",
        "3D net",
        "project_slug '3d_net' is not a valid Python identifier",
    ),
    ("project_slug", "class", "project_slug 'class' is a Python keyword"),
    ("project_slug", "match", "project_slug 'match' is a Python keyword"),
    ("project_name", "two\nlines", "project_name 'two\\nlines' must be one line"),
    ("project_name", " ", "project_name is empty"),
    # Refused by cookiecutter itself, before the hook: still clear, still nothing left.
    ("nodes", "three", "three provided for choice variable nodes"),
    ("sync_bn", "maybe", "maybe provided for variable sync_bn could not be converted"),
]


@pytest.mark.parametrize(("key", "value", "message"), REFUSED, ids=lambda x: repr(x))
def test_refused_answers_leave_nothing(tmp_path, key, value, message):
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE)]
        + [f"{key}={value}", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert list(out.iterdir()) == []  # not even a parent folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_generation_leaves_nothing_in_the_temporary_folder(tmp_path):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE)]
        + ["--output-dir", str(tmp_path / "out")],
        env={**os.environ, "TMPDIR": str(temporary)},
    )
    assert result.returncode == 0
    assert (tmp_path / "out" / "ddp_trainer" / "main_multi_gpu.py").is_file()
    assert list(temporary.iterdir()) == []


def test_a_combination_that_cannot_work_is_refused_and_leaves_nothing(tmp_path):
    """SyncBatchNorm with FSDP2: each answer alone is fine, together refused."""
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(TEMPLATE)]
        + ["sync_bn=true", "parallelism=fsdp2", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    refusal = (
        "error: sync_bn true does not go with parallelism 'fsdp2': SyncBatchNorm "
        "under FSDP2 is not supported here; choose sync_bn=false (each rank keeps its "
        "own BatchNorm statistics) or parallelism=ddp"
    )
    assert errors == [refusal]
    assert list(out.iterdir()) == []


TRICKY_NAMES = [
    'He said "hi" \\ 训练器',
    "O'Brien's net",
    '"""); import os; os.system("touch pwned"); ("""',
    "$(touch pwned) `touch pwned`",
    "训练器",
]


@pytest.mark.parametrize("name", TRICKY_NAMES)
def test_tricky_names_make_valid_projects(tmp_path, name):
    project = bake(tmp_path, project_name=name, nodes="multi")
    assert project.name.isidentifier()
    assert (project / "main_multi_gpu.py").read_text().startswith(f"# {name}\n")
    assert f"# {name}\n" in (project / "README.md").read_text()
    compile((project / "main_multi_gpu.py").read_text(), "main_multi_gpu.py", "exec")
    for script in ("run_single.sh", "run_multi.sh"):
        check = subprocess.run(
            ["shellcheck", str(project / script)], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout
        syntax = subprocess.run(["bash", "-n", str(project / script)])
        assert syntax.returncode == 0
    assert not list(tmp_path.rglob("pwned"))


def test_tricky_name_project_trains(tmp_path):
    project = bake(tmp_path, project_name=TRICKY_NAMES[0], launcher="spawn")
    code, output = run_job(
        ["./run_single.sh", *TINY, "--output-dir", "out"],
        project,
        {"NPROC_PER_NODE": "2"},
    )
    assert code == 0, output
    weights = torch.load(project / "out" / "model_final.pt", weights_only=True)
    default_model(project).load_state_dict(weights)
