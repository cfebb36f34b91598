"""Projects made with cruft, and updated by it (the generated README's "Updating this
project"), offline: a temporary git repository of this template at one commit, and a
later commit of it with a new version and a real change to the machinery.

- `cruft create` writes what cookiecutter writes, plus `.cruft.json` (the hooks, the
  answers' checks and --no-input answers included), and the header names the version;
- a project whose user replaced the edit zone (an MLP on another dataset, an EMA kept
  with keep(), FIND_UNUSED_PARAMETERS) and committed it updates with no conflict: the
  edit zone byte for byte the user's, the rest byte for byte a fresh project of the
  later commit, which shows the later version; it trains, and the checkpoint saved
  before the update resumes to the weights of a run never interrupted;
- a user's change to the machinery that the later commit changes too: one conflict,
  in that place alone;
- a project made with plain cookiecutter joins with `cruft link`; `cruft check` says
  it is behind, then up to date;
- a checkpoint without a field that resume reads: one line naming it, no traceback.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from cookiecutter.main import cookiecutter

from combinations import TEMPLATE
from conftest import (
    bake,
    edit,
    error_lines,
    load_weights,
    max_difference,
    metrics,
    replace_user_functions,
    run_warm,
)

pytest.importorskip("cruft", reason="cruft is in requirements-dev.txt")
pytestmark = pytest.mark.xdist_group("cruft")  # one test worker: the template once

# What a template repository holds (the tests and the rest are not the template's).
TEMPLATE_PARTS = (
    "cookiecutter.json",
    "hooks",
    "templates",
    "{{cookiecutter.project_slug}}",
)
VERSION_FILE = "templates/version.jinja"
LATER_VERSION = "99.0.0"
# The later commit's change to the machinery: the line a resume prints.
RESUMED = (
    "print0(f\"resumed from {checkpoint['path']} {where(at, t.args.batch_size)}\")"
)
RESUMED_LATER = RESUMED.replace("resumed from", "went on from")
RESUMED_BY_USER = RESUMED.replace("resumed from", "picked up")
TINY = ["--batch-size", "8", "--train-size", "64", "--val-size", "37"]
TINY += ["--num-workers", "0"]
GIT = {
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull,  # no user's settings (a default branch, hooks)
}

# A user's edit zone: an MLP on three spirals in the plane, an EMA of its weights kept
# with keep() (the README's recipe), and a head not trained yet.
USER_SOURCE = '''
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class MLP(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh()
        )
        self.head = nn.Linear(width, NUM_CLASSES)
        self.extra = nn.Linear(width, 1)  # a second head, not trained yet

    def forward(self, points):
        return self.head(self.body(points))


def build_datasets(args):
    """Three interleaved spirals: points (x, y), labelled by their arm."""

    def spirals(size, part):
        generator = torch.Generator().manual_seed(1000 * args.seed + part)
        labels = torch.randint(NUM_CLASSES, (size,), generator=generator)
        radius = torch.rand(size, generator=generator)
        angle = 3 * radius + labels * (2 * math.pi / NUM_CLASSES)
        points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
        noise = 0.02 * torch.randn(size, 2, generator=generator)
        return TensorDataset(points + noise, labels)

    return spirals(args.train_size, 1), spirals(args.val_size, 2)


def build_model(args):
    return MLP()


def build_optimizer(model, args, total_updates):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr / 10)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizer.register_step_post_hook(lambda *_: ema.update_parameters(model))
    keep("ema", ema, evaluate=ema.module)
    return optimizer, None


def compute_loss(model, batch):
    points, labels = batch
    return F.cross_entropy(model(points), labels), len(labels)


def compute_metrics(model, batch):
    points, labels = batch
    logits = model(points)
    n = len(labels)
    return {
        "loss": (F.cross_entropy(logits, labels, reduction="sum"), n),
        "error": ((logits.argmax(dim=1) != labels).sum(), n),
    }
'''


def make_it_mine(project):
    """The user's changes, all in the edit zone."""
    replace_user_functions(project, USER_SOURCE)
    edit(project, "NUM_CLASSES = 10\n", "NUM_CLASSES = 3\n")
    edit(project, "FIND_UNUSED_PARAMETERS = False", "FIND_UNUSED_PARAMETERS = True")


def git(cwd, *args, check=True):
    result = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env={**os.environ, **GIT},
        capture_output=True,
        text=True,
    )
    assert not check or result.returncode == 0, result.stderr
    return result


def cruft(cwd, *args):
    """The cruft command, as a user runs it: (exit status, stdout + stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", "cruft", *args],
        cwd=cwd,
        env={**os.environ, **GIT},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    return result.returncode, result.stdout + result.stderr


def commit_all(cwd, message):
    git(cwd, "add", "-A")
    git(cwd, "commit", "-q", "-m", message)
    return git(cwd, "rev-parse", "HEAD").stdout.strip()


def version_of(tree):
    (version,) = re.findall(
        r'set version = "([^"]+)"', (tree / VERSION_FILE).read_text()
    )
    return version


def change(path, old, new):
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} in {path}"
    path.write_text(text.replace(old, new))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A git repository of this template: its first commit as the template is now, a
    second with a later version and a changed machinery line. Returns (repository,
    a copy of the first commit's files, first commit, second commit)."""
    root = tmp_path_factory.mktemp("template")
    repo, first_files = root / "repo", root / "first"
    repo.mkdir()
    for part in TEMPLATE_PARTS:
        source, ignore = TEMPLATE / part, shutil.ignore_patterns("__pycache__")
        if source.is_dir():
            shutil.copytree(source, repo / part, ignore=ignore)
        else:
            shutil.copy2(source, repo / part)
    git(repo, "init", "-q", "-b", "main")
    first = commit_all(repo, "the template as it is")
    shutil.copytree(repo, first_files, ignore=shutil.ignore_patterns(".git"))
    change(repo / VERSION_FILE, f'"{version_of(repo)}"', f'"{LATER_VERSION}"')
    change(repo / "templates/main_multi_gpu/checkpoints.py", RESUMED, RESUMED_LATER)
    second = commit_all(repo, "a later version: a resume says it went on")
    return repo, first_files, first, second


def created(template, out, *args):
    """`cruft create --no-input` of the template's first commit into `out`, committed
    as generated (the README's commands), and its folder."""
    repo, _, first, _ = template
    code, output = cruft(out, "create", "-y", "--checkout", first, *args, str(repo))
    assert code == 0, output
    (project,) = [path for path in out.iterdir() if path.is_dir()]
    (project / ".gitignore").write_text("outputs/\n__pycache__/\n")
    git(project, "init", "-q", "-b", "main")
    commit_all(project, "As generated")
    return project


def fresh(tree, out, **answers):
    """What cookiecutter makes of a template folder (a commit's files)."""
    made = cookiecutter(
        str(tree), no_input=True, output_dir=str(out), extra_context=answers
    )
    return out / os.path.basename(made)


def files(project):
    """{relative path: bytes} of a project, its git folder left out."""
    return {
        str(path.relative_to(project)): path.read_bytes()
        for path in sorted(project.rglob("*"))
        if path.is_file() and ".git" not in path.relative_to(project).parts[:1]
    }


def zones(code):
    """(the edit zone, the rest) of a main_multi_gpu.py: the zone runs from the line
    after the EDIT HERE banner to the banner that follows it."""
    lines = code.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("# EDIT HERE"))
    banners = [i for i, line in enumerate(lines) if line.startswith("# ----")]
    after = [i for i in banners if i > start]
    first, last = after[0] + 1, after[1]
    return "".join(lines[first:last]), "".join(lines[:first] + lines[last:])


def status(project):
    """git status --porcelain, as {path: its two status letters}."""
    lines = git(project, "status", "--porcelain").stdout.splitlines()
    return {line[3:]: line[:2] for line in lines}


# Generation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answers",
    [
        {},
        {"nodes": "multi", "launcher": "spawn", "scheduler": "slurm", "sync_bn": True},
    ],
    ids=["defaults", "multi-spawn-slurm"],
)
def test_cruft_create_writes_what_cookiecutter_writes(tmp_path, template, answers):
    repo, first_files, first, _ = template
    (tmp_path / "cruft").mkdir()
    args = ["--extra-context", json.dumps(answers)] if answers else []
    code, output = cruft(
        tmp_path / "cruft", "create", "-y", "--checkout", first, *args, str(repo)
    )
    assert code == 0, output
    (made,) = (tmp_path / "cruft").iterdir()
    ours = files(made)
    theirs = files(fresh(first_files, tmp_path / "cookiecutter", **answers))
    record = json.loads(ours.pop(".cruft.json"))
    assert ours == theirs  # the hooks removed the same files, every byte the same
    assert record["commit"] == first and record["template"] == str(repo)
    for key, value in answers.items():
        assert record["context"]["cookiecutter"][key] == value
    second_line = ours["main_multi_gpu.py"].decode().splitlines()[1]
    version = version_of(first_files)
    assert second_line == (
        f"# From the DDP template, version {version}; with cruft, .cruft.json names "
        "the commit"
    )
    assert (
        f"made from the DDP template, version {version}" in ours["README.md"].decode()
    )


def test_cruft_create_refuses_what_cookiecutter_refuses(tmp_path, template):
    repo = template[0]
    answers = json.dumps({"project_slug": "a/b"})
    code, output = cruft(
        tmp_path, "create", "-y", "--extra-context", answers, str(repo)
    )
    assert code != 0
    assert "error: project_slug 'a/b' is not a valid Python identifier" in output
    assert list(tmp_path.iterdir()) == []


def test_the_readme_keeps_the_template_version():
    """The README's "Versions" table opens with the version the header shows."""
    readme = (TEMPLATE / "README.md").read_text()
    table = readme.partition("\n## Versions\n")[2].partition("\n## ")[0]
    rows = re.findall(r"^\| (\d+\.\d+\.\d+) \|", table, re.MULTILINE)
    assert rows and rows[0] == version_of(TEMPLATE), rows
    assert len(set(rows)) == len(rows)


# Updates ----------------------------------------------------------------------------


def test_an_update_keeps_the_edit_zone_and_the_run(tmp_path, template):
    repo, _, _, second = template
    (tmp_path / "made").mkdir()
    project = created(template, tmp_path / "made")
    make_it_mine(project)
    commit_all(project, "My MLP")
    mine = (project / "main_multi_gpu.py").read_text()
    out = tmp_path / "out"
    run_warm(project, out, 2, *TINY, "--epochs", "1")
    before = metrics(out)

    assert cruft(project, "check")[0] == 1  # behind the template
    code, output = cruft(project, "update", "-y")
    assert code == 0 and "conflict" not in output, output
    changed = status(project)
    assert changed == {
        "main_multi_gpu.py": "M ",
        "README.md": "M ",
        ".cruft.json": " M",
    }, output
    assert json.loads((project / ".cruft.json").read_text())["commit"] == second
    commit_all(project, "DDP template updated")
    assert cruft(project, "check")[0] == 0

    updated = (project / "main_multi_gpu.py").read_text()
    (tmp_path / "later").mkdir()
    code, output = cruft(tmp_path / "later", "create", "-y", str(repo))
    assert code == 0, output
    (later,) = (tmp_path / "later").iterdir()
    assert zones(updated)[0] == zones(mine)[0]  # the user's, byte for byte
    later_code = (later / "main_multi_gpu.py").read_text()
    assert zones(updated)[1] == zones(later_code)[1]  # the later commit's
    assert updated.splitlines()[1].startswith(
        f"# From the DDP template, version {LATER_VERSION};"
    )
    make_it_mine(later)  # the same edits on a fresh project: the same file, whole
    assert files(project) == {
        **files(later),
        ".gitignore": b"outputs/\n__pycache__/\n",
    }

    # The checkpoint saved before the update resumes, by the later machinery, to the
    # weights of a run never interrupted; the first epoch's row stays as it was.
    output = run_warm(project, out, 2, *TINY, "--epochs", "2")
    assert f"went on from {out / 'checkpoint_last.pt'} after epoch 1" in output
    rows = metrics(out)
    assert rows[0] == before[0] and [row["step"] for row in rows] == ["4", "8"]
    assert 0 <= float(rows[1]["val_error"]) <= 1
    straight = tmp_path / "straight"
    run_warm(project, straight, 2, *TINY, "--epochs", "2")
    kept = ("epoch", "step", "train_loss", "val_loss", "val_error", "lr")
    assert [[row[k] for k in kept] for row in metrics(straight)] == [
        [row[k] for k in kept] for row in rows
    ]
    for name in ("model_final.pt", "model_final_ema.pt"):
        assert (
            max_difference(load_weights(out / name), load_weights(straight / name)) == 0
        )


def test_a_machinery_edit_conflicts_in_its_place_alone(tmp_path, template):
    repo = template[0]
    (tmp_path / "made").mkdir()
    project = created(template, tmp_path / "made")
    make_it_mine(project)
    edit(project, RESUMED, RESUMED_BY_USER)  # the line the later commit changes too
    commit_all(project, "My MLP, and my resume line")

    code, output = cruft(project, "update", "-y")
    assert code == 0 and "Applied patch to 'main_multi_gpu.py' with conflicts" in output
    assert status(project) == {
        "main_multi_gpu.py": "UU",
        "README.md": "M ",
        ".cruft.json": " M",
    }
    merged = (project / "main_multi_gpu.py").read_text()
    (block,) = re.findall(
        r"^<<<<<<< ours\n.*?^>>>>>>> theirs\n", merged, re.MULTILINE | re.DOTALL
    )
    indent = " " * 8
    assert block == (
        f"<<<<<<< ours\n{indent}{RESUMED_BY_USER}\n=======\n"
        f"{indent}{RESUMED_LATER}\n>>>>>>> theirs\n"
    )
    # Everything else merged: with the template's side taken, the file is a fresh
    # project of the later commit with the user's edit zone.
    (tmp_path / "later").mkdir()
    assert cruft(tmp_path / "later", "create", "-y", str(repo))[0] == 0
    (later,) = (tmp_path / "later").iterdir()
    make_it_mine(later)
    resolved = merged.replace(block, f"{indent}{RESUMED_LATER}\n")
    assert resolved == (later / "main_multi_gpu.py").read_text()


def test_a_cookiecutter_project_links_and_updates(tmp_path, template):
    repo, first_files, first, second = template
    project = fresh(first_files, tmp_path, launcher="spawn")
    git(project, "init", "-q", "-b", "main")
    make_it_mine(project)
    commit_all(project, "Generated with cookiecutter, and mine")

    answers = json.dumps({"launcher": "spawn"})
    link = ["link", "-y", "--checkout", first, "--extra-context", answers, str(repo)]
    code, output = cruft(project, *link)
    assert code == 0, output
    code, output = cruft(project, "diff", "--exit-code")
    assert code == 1 and "+NUM_CLASSES = 10" in output  # the user's edits
    assert "DDP template, version" not in output  # the header: the same version
    assert cruft(project, "check")[0] == 1
    commit_all(project, "Linked to the DDP template")

    code, output = cruft(project, "update", "-y")
    assert code == 0 and "conflict" not in output, output
    assert cruft(project, "check")[0] == 0
    (tmp_path / "later").mkdir()
    answers_later = ["--extra-context", answers]
    assert cruft(tmp_path / "later", "create", "-y", *answers_later, str(repo))[0] == 0
    (later,) = (tmp_path / "later").iterdir()
    make_it_mine(later)
    record = json.loads((project / ".cruft.json").read_text())
    assert record["commit"] == second
    assert files(project) == files(later) | {
        ".cruft.json": files(project)[".cruft.json"]
    }


# Checkpoints ------------------------------------------------------------------------


def test_a_checkpoint_without_a_field_resume_reads_is_one_line(tmp_path):
    project = bake(tmp_path)
    out = tmp_path / "out"
    run_warm(project, out, 2, *TINY, "--epochs", "1")
    path = out / "checkpoint_last.pt"
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["train_sums"]  # as a checkpoint of a version that never saved it
    torch.save(checkpoint, path)
    output = run_warm(project, out, 2, *TINY, "--epochs", "2", expect=1)
    assert "Traceback" not in output
    line = f"error: cannot resume from {path}: not a checkpoint (it lacks train_sums: "
    assert error_lines(output) == [line + "another version's?)"], output
    assert len(metrics(out)) == 1  # nothing trained, nothing written
