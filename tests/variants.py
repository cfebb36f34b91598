"""Render every prompt combination the template accepts and print one line per
generated file: its SHA-256, the combination and the file's name.

A maintainer's check that a change to the template changes only what it means to:

    python tests/variants.py > /tmp/before.txt    # on the commit before
    python tests/variants.py > /tmp/after.txt     # with the change
    diff /tmp/before.txt /tmp/after.txt           # the variants whose output moved

`--keep DIR` also leaves the generated projects in DIR, one folder per combination,
to diff their files by hand.
"""

import argparse
import hashlib
import itertools
import sys
import tempfile
from pathlib import Path

from cookiecutter.main import cookiecutter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from combinations import TEMPLATE, case_id, choices, refused


def every_combination():
    """The full product of every choice and boolean prompt, refused ones left out."""
    options = choices()
    for values in itertools.product(*options.values()):
        row = dict(zip(options, values, strict=True))
        if not refused(row):
            yield row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="leave the projects in this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        for row in every_combination():
            out = root / case_id(row)
            project = Path(
                cookiecutter(
                    str(TEMPLATE), no_input=True, output_dir=str(out), extra_context=row
                )
            )
            for path in sorted(project.iterdir()):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                mode = "x" if path.stat().st_mode & 0o100 else "-"
                print(f"{digest} {mode} {case_id(row)} {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
