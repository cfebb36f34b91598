"""Contender 1: the generated project's main_multi_gpu.py, run unmodified.

torchrun starts this file with the project's own command line after "--":
  generated_entry.py PROJECT_DIR -- --epochs 1 --batch-size 32 ...
It installs the shared step hook, then runs main_multi_gpu.py as __main__ (runpy), so
the project's own argument parsing, set-up, loop, evaluation and saving all run as
they would under run_single.sh. Nothing in the project is patched.
"""

import os
import runpy
import sys

import steptimer


def main():
    project, separator, *project_args = sys.argv[1:]
    if separator != "--":
        raise SystemExit(f"usage: {sys.argv[0]} PROJECT_DIR -- ARGS...")
    script = os.path.join(os.path.abspath(project), "main_multi_gpu.py")
    steptimer.install("generated")
    sys.argv = [script, *project_args]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
