"""What DataLoader workers cost per pass: the default project's data wait (metrics.csv's
data_s) with 2 workers a process, and the same with a module that takes some seconds
to import at the top of the edit zone (as transformers or timm do), for a template
given as a folder or a git commit of this repository.

    python bench/worker_imports.py                      # this working tree
    python bench/worker_imports.py --template 4ab4fbd   # a commit (a git worktree)
    python bench/worker_imports.py --import-seconds 3 --epochs 3

Prints, for each run, the data wait of each pass and how many times the slow module
was imported (by every process: launcher, training processes, fork servers, workers),
and writes them as JSON (--results)."""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SLOW = """import os
import time

time.sleep(float(os.environ["SLOW_IMPORT_SECONDS"]))
with open(os.environ["SLOW_IMPORT_LOG"], "a") as log:
    log.write(f"{os.getpid()}\\n")
"""


def template_folder(template, scratch):
    """The template as a folder: this tree, a folder, or a commit checked out."""
    if template is None:
        return REPO
    if Path(template).is_dir():
        return Path(template)
    folder = scratch / "template"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), template],
        check=True,
        capture_output=True,
    )
    return folder


def run(template, scratch, seconds, epochs, nproc, workers):
    out = scratch / f"project-{seconds}"
    subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", "-f", "-o", str(out)]
        + [str(template)],
        check=True,
        capture_output=True,
    )
    (project,) = out.iterdir()
    (project / "slow_import.py").write_text(SLOW)
    script = project / "main_multi_gpu.py"
    code = script.read_text()
    script.write_text(
        code.replace(
            "NUM_CLASSES = 10\n", "import slow_import  # noqa\n\nNUM_CLASSES = 10\n", 1
        )
    )
    log = scratch / f"imports-{seconds}.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "NPROC_PER_NODE": str(nproc)}
    env |= {"SLOW_IMPORT_SECONDS": str(seconds), "SLOW_IMPORT_LOG": str(log)}
    args = ["--epochs", str(epochs), "--num-workers", str(workers)]
    args += ["--output-dir", str(scratch / f"out-{seconds}"), "--resume", "never"]
    start = time.monotonic()
    subprocess.run(
        ["./run_single.sh", *args],
        cwd=project,
        env=env,
        check=True,
        capture_output=True,
    )
    wall = time.monotonic() - start
    with (scratch / f"out-{seconds}" / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    return {
        "import_seconds": seconds,
        "data_s": [round(float(row["data_s"]), 3) for row in rows],
        "epoch_s": [round(float(row["epoch_s"]), 3) for row in rows],
        "imports": len(log.read_text().split()),
        "wall_s": round(wall, 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", help="a folder, or a commit of this repository")
    parser.add_argument("--import-seconds", type=float, nargs="+", default=[0, 3])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        template = template_folder(args.template, scratch)
        try:
            runs = [
                run(template, scratch, s, args.epochs, args.nproc, args.num_workers)
                for s in args.import_seconds
            ]
        finally:
            if template != REPO and not Path(args.template).is_dir():
                subprocess.run(
                    [
                        "git",
                        "-C",
                        str(REPO),
                        "worktree",
                        "remove",
                        "--force",
                        str(template),
                    ],
                    check=False,
                )
    result = {"template": args.template or "working tree", "runs": runs}
    for each in runs:
        print(json.dumps(each))
    if args.results:
        args.results.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
