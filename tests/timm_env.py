"""The virtual environment the timm recipe's test runs a project in: the pins of
requirements-timm.txt, made once per machine (about 1.5 minutes and 5.5 GB on
x86_64, from pip's usual sources), then reused while the pins are the same. Beside
the torch range check's environments: $TORCH_RANGE_VENVS, else ~/.cache/ddp-template.

Run as a program (as .ci/run does, before the suite), it makes the environment and
prints its folder."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

PINS = Path(__file__).with_name("requirements-timm.txt")


def timm_env():
    """The environment's folder, made first if it is missing or has other pins."""
    root = Path(
        os.environ.get("TORCH_RANGE_VENVS", Path.home() / ".cache/ddp-template")
    )
    path, pins = root / "timm", PINS.read_text()
    stamp = path / "requirements-timm.txt"  # what it was made with, once complete
    if stamp.exists() and stamp.read_text() == pins:
        return path
    shutil.rmtree(path, ignore_errors=True)
    print(f"timm: installing {PINS.name} into {path}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-r", str(PINS)], check=True)
    stamp.write_text(pins)
    return path


if __name__ == "__main__":
    print(timm_env())
