"""The other ways to start the script: the old launcher, no launcher, --preflight,
and the one-line errors for a bad --resume or --backend."""

import csv
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, TINY, bake, error_lines, run_job

ENV = {"NPROC_PER_NODE": "2"}
PWNED = Path(tempfile.gettempdir()) / "ddp_template_pwned"


@pytest.fixture(scope="module")
def torchrun_project(tmp_path_factory):
    return bake(tmp_path_factory.mktemp("torchrun"), launcher="torchrun")


@pytest.fixture(scope="module")
def spawn_project(tmp_path_factory):
    return bake(tmp_path_factory.mktemp("spawn"), launcher="spawn", nodes="multi")


def test_old_torch_distributed_launch(torchrun_project, tmp_path):
    # It passes --local-rank=N in argv; the script must accept and ignore it.
    command = [PYTHON, "-m", "torch.distributed.launch", "--nproc-per-node", "2"]
    command += ["main_multi_gpu.py", *TINY, "--output-dir", str(tmp_path)]
    code, output = run_job(command, torchrun_project)
    assert code == 0, output
    assert "--local-rank=1" not in output
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [row["epoch"] for row in rows] == ["1", "2"]


def test_without_a_launcher_is_a_group_of_one(torchrun_project, tmp_path):
    command = [PYTHON, "main_multi_gpu.py", *TINY, "--output-dir", str(tmp_path)]
    code, output = run_job(command, torchrun_project)
    assert code == 0, output
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    # 64 samples, batch 8, one process: all samples seen once per epoch.
    assert len(rows) == 2
    assert torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["epoch"] == 2


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_preflight_prints_one_table_and_trains_nothing(request, launcher, tmp_path):
    project = request.getfixturevalue(f"{launcher}_project")
    command = ["./run_single.sh", "--preflight", "--output-dir", str(tmp_path / "o")]
    code, output = run_job(command, project, ENV)
    assert code == 0, output
    assert output.count("preflight: 2 ranks, backend gloo, all-reduce ok") == 1
    rows = re.findall(
        r"^\s+(\d)\s+(\S+)\s+(\d)\s+cpu\s+([\d.]+)$", output, re.MULTILINE
    )
    assert sorted(row[0] for row in rows) == ["0", "1"]
    assert sorted(row[2] for row in rows) == ["0", "1"]
    assert all(float(row[3]) > 0 for row in rows)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("launcher", "case"), [("torchrun", "missing"), ("spawn", "corrupt")]
)
def test_missing_or_corrupt_resume_is_one_clear_line(request, launcher, case, tmp_path):
    project = request.getfixturevalue(f"{launcher}_project")
    path = tmp_path / f"{case}.pt"
    if case == "corrupt":
        path.write_bytes(b"not a checkpoint")
    command = ["./run_single.sh", *TINY, "--resume", str(path)]
    code, output = run_job(command, project, ENV)
    assert code == 1, output
    errors = error_lines(output)
    reason = {
        "missing": "No such file or directory",
        "corrupt": "not a checkpoint (Unsupported operand 110)",
    }
    assert errors == [
        f"error: cannot resume from {path}: " + errors[0].split(": ", 2)[2]
    ]
    assert reason[case] in errors[0]
    assert "Traceback" not in output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_nccl_without_a_gpu_is_a_clear_error(request, launcher):
    project = request.getfixturevalue(f"{launcher}_project")
    command = ["./run_single.sh", *TINY, "--backend", "nccl"]
    code, output = run_job(command, project, ENV)
    assert code == 1, output
    # The launcher says why, before it starts any worker (so no rank that stops
    # first can take the line with it): that line alone.
    assert output == "error: --backend nccl needs a CUDA GPU; none is visible\n"


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_malicious_checkpoint_is_refused(request, launcher, tmp_path):
    project = request.getfixturevalue(f"{launcher}_project")
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "optimizer": {}, "epoch": 1, "x": Payload()}, evil)
    code, output = run_job(
        ["./run_single.sh", *TINY, "--resume", str(evil)], project, ENV
    )
    assert code == 1, output
    assert (
        output.count(f"error: cannot resume from {evil}: refused by weights_only=True")
        == 1
    )
    assert "Traceback" not in output
    assert not PWNED.exists()
