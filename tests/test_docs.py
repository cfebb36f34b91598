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


def script_help(project):
    result = subprocess.run(
        [sys.executable, "main_multi_gpu.py", "--help"],
        cwd=project,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout


def script_flags(text):
    """The long options a --help text lists."""
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z_-]*)", text))


def help_entries(text):
    """{flag: its entry in --help (the flag, its meaning and its default)}, from
    every group of options."""
    entries, current = {}, None
    for line in text.partition("\noptions:\n")[2].splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif line.startswith("    ") and current:
            entries[current] += line
        else:  # a blank line, or a group's heading
            current = None
    return {flag: " ".join(entry.split()) for flag, entry in entries.items()}


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
@pytest.mark.parametrize("nodes", ["single", "multi"])
def test_the_reference_lists_every_flag(tmp_path, launcher, nodes):
    project = bake(tmp_path, launcher=launcher, nodes=nodes)
    text = script_help(project)
    flags = script_flags(text) - {"--help"}
    # Accepted for the old torch.distributed.launch, and hidden from --help.
    documented = documented_flags() - {"--local-rank", "--local_rank"}
    assert flags <= documented, flags - documented
    spawn_only = {"--nproc-per-node", "--master-port"}
    multi_spawn_only = {"--nnodes", "--node-rank", "--master-addr"}
    expected = documented - (spawn_only if launcher == "torchrun" else {"--torchrun"})
    if not (launcher == "spawn" and nodes == "multi"):
        expected -= multi_spawn_only
    assert flags == expected

    # Every flag says what it does and what it is unless given.
    entries = help_entries(text)
    assert set(entries) - {"-h"} == flags
    for flag, entry in entries.items():
        meaning = entry.partition(flag)[2]
        assert flag == "-h" or re.search(r"[a-z]{3}.*default", meaning), entry
    for flag, default in {
        "--epochs": "(default: 10)",
        "--batch-size": "(default: 32)",
        "--lr": "(default: 0.1)",
        "--seed": "(default: 0)",
        "--num-workers": "(default: 2)",
        "--resume": "(default: auto)",
        "--compile": "(default: off)",
        "--dist-timeout": "(default: $DIST_TIMEOUT, else 600)",
    }.items():
        assert entries[flag].endswith(default), entries[flag]


@pytest.mark.parametrize(
    "answers",
    [{}, {"nodes": "multi", "scheduler": "slurm", "save_strategy": "final_only"}],
    ids=["default", "multi-slurm-final_only"],
)
def test_the_generated_readme_opens_with_the_commands_used_most(tmp_path, answers):
    """Its first screen (40 lines): train, resume, evaluate, several machines, --help,
    and where a user's own code goes."""
    first_screen = "\n".join(
        (bake(tmp_path, **answers) / "README.md").read_text().splitlines()[:40]
    )
    commands = ["./run_single.sh  ", "--evaluate outputs/model_final.pt", "--help"]
    if answers.get("nodes") == "multi":
        commands.append("NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_multi.sh")
        commands.append("NNODES=2:4 MASTER_ADDR=10.0.0.1 ./run_multi.sh")  # elastic
    if answers.get("scheduler") == "slurm":
        commands.append("sbatch run_slurm.sbatch")
    resume = "trains afresh" if answers else "resumes from outputs/checkpoint_last.pt"
    for text in [*commands, resume, "EDIT HERE", "`build_datasets`"]:
        assert text in first_screen, text


def test_the_generated_readme_says_where_the_outputs_are(tmp_path):
    readme = (bake(tmp_path, save_strategy="best") / "README.md").read_text()
    # The closing line test_run.py checks in every run, as a fresh install prints it.
    done = "done: weights outputs/model_final.pt, metrics outputs/metrics.csv"
    assert f"\n{done}\n" in readme
    assert "tensorboard --logdir outputs/tensorboard" in readme
    assert "checkpoint_best.pt" in readme


def test_both_readmes_show_the_range_checks_table(tmp_path):
    """The supported-torch table comes from a run of tests/torch_range.py --write: the
    same in this README and in a generated one, every release it names from the DDP
    floor to the newest, each cell a tick, but FSDP2 below its floor, refused."""
    table = (TEMPLATE / "templates" / "README" / "torch_range.md").read_text()
    readme = (TEMPLATE / "README.md").read_text()
    start, end = "<!-- torch-range:start -->\n", "<!-- torch-range:end -->\n"
    assert readme[readme.index(start) + len(start) : readme.index(end)] == table
    assert table in (bake(tmp_path) / "README.md").read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| 2.")]
    versions = [row[0].strip("| ") for row in rows]
    assert {"2.4.1", "2.7.1", "2.11.0", "2.14.1"} <= set(versions), versions
    for version, row in zip(versions, rows, strict=True):
        cells = [cell.strip(" |") for cell in row[1:]]
        fsdp2 = cells[4:8]  # the columns after DDP's four
        below = tuple(map(int, version.split("."))) < (2, 7)
        assert fsdp2 == ["refused: needs 2.7"] * 4 if below else fsdp2 == ["✓"] * 4
        assert cells[:4] + cells[8:] == ["✓"] * (len(cells) - 4), (version, cells)
