"""The repository stands alone: nothing in it points outside it, and the reference page
lists exactly the flags every variant's script accepts."""

import re
import subprocess
import sys

import pytest

from combinations import TEMPLATE
from conftest import bake

REFERENCE = TEMPLATE / "docs" / "reference.md"
OUTSIDE = re.compile(r"\.\./shared|shared/(contract|torch-facts|style|seeds)")


def tracked_files():
    """The repository's files: git's list in a clone; in a copy without .git (an
    unpacked archive), every file outside hidden folders and caches."""
    if not (TEMPLATE / ".git").exists():
        return [
            path
            for path in TEMPLATE.rglob("*")
            if path.is_file()
            and not any(
                part.startswith(".") or part == "__pycache__"
                for part in path.relative_to(TEMPLATE).parts[:-1]
            )
        ]
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=TEMPLATE, capture_output=True, check=True
    )
    return [TEMPLATE / name for name in listing.stdout.decode().split("\0") if name]


def test_no_file_points_outside_the_repository():
    files = tracked_files()
    assert TEMPLATE / "README.md" in files and len(files) > 20
    pointing = []
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # binary files, and files deleted but not yet committed
        if OUTSIDE.search(text):
            pointing.append(str(path.relative_to(TEMPLATE)))
    assert pointing == []


def test_the_readme_links_the_reference():
    readme = (TEMPLATE / "README.md").read_text()
    assert "](docs/reference.md)" in readme
    assert REFERENCE.read_text().startswith("# Reference\n")


def documented_flags():
    """The first column of the reference's flag table: every `--flag` named there."""
    table = REFERENCE.read_text().partition("## Command line")[2].partition("\n## ")[0]
    flags = set()
    for line in table.splitlines():
        if line.startswith("| `--"):
            flags |= set(re.findall(r"`(--[a-z_-]+)", line.split(" | ")[0]))
    return flags


def script_flags(project):
    """The long options the generated script's --help lists."""
    result = subprocess.run(
        [sys.executable, "main_multi_gpu.py", "--help"],
        cwd=project,
        capture_output=True,
        text=True,
        check=True,
    )
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z_-]*)", result.stdout))


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
@pytest.mark.parametrize("nodes", ["single", "multi"])
def test_the_reference_lists_every_flag(tmp_path, launcher, nodes):
    project = bake(tmp_path, launcher=launcher, nodes=nodes)
    flags = script_flags(project) - {"--help"}
    # Accepted for the old torch.distributed.launch, and hidden from --help.
    documented = documented_flags() - {"--local-rank", "--local_rank"}
    assert flags <= documented, flags - documented
    spawn_only = {"--nproc-per-node", "--master-port"}
    multi_spawn_only = {"--nnodes", "--node-rank", "--master-addr"}
    expected = documented - (spawn_only if launcher == "torchrun" else {"--torchrun"})
    if not (launcher == "spawn" and nodes == "multi"):
        expected -= multi_spawn_only
    assert flags == expected


def test_the_generated_readme_says_where_the_outputs_are(tmp_path):
    readme = (bake(tmp_path, save_strategy="best") / "README.md").read_text()
    # The closing line test_run.py checks in every run, as a user sees it.
    done = "done: weights outputs/model_final.pt, metrics outputs/metrics.csv, plot"
    assert f"\n{done} outputs/loss.png\n" in readme
    assert "tensorboard --logdir outputs/tensorboard" in readme
    assert "checkpoint_best.pt" in readme
