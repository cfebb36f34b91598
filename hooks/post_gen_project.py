"""Remove the files the chosen variant does not use, and make the launch scripts executable."""

import json
import stat
import sys
from pathlib import Path

ANSWERS = json.loads({{ cookiecutter | tojson | tojson }})
UNUSED = {
    "run_multi.sh": ANSWERS["nodes"] != "multi",
    "run_slurm.sbatch": ANSWERS["scheduler"] != "slurm",
}


def main():
    project = Path.cwd()
    for name, unused in UNUSED.items():
        if unused:
            (project / name).unlink()
    for script in [*project.glob("*.sh"), *project.glob("*.sbatch")]:
        mode = script.stat().st_mode
        script.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    # Cookiecutter runs this hook from a rendered copy in the temporary folder, and
    # leaves the copy there: one file for every project made. Remove it.
    Path(__file__).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
