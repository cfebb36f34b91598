"""run_slurm.sbatch, submitted with sbatch to a real one-node Slurm cluster.

The cluster (tests/slurm_cluster.py) has one node with 2 CPUs and no GPUs, so every job
is submitted as a user of a small CPU partition would submit it: options on the sbatch
command line override the script's requests for nodes, GPUs and CPUs, and
NPROC_PER_NODE=2 makes two gloo workers.
"""

import csv
import shutil
from pathlib import Path

import pytest
import torch

import slurm_cluster
from conftest import TINY, bake, edit, free_port, run_warm

UNAVAILABLE = slurm_cluster.unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE)),
    pytest.mark.xdist_group("slurm"),  # one test worker: one cluster
]
OVERRIDES = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2"]
ENV = {"NPROC_PER_NODE": "2", "PYTHONUNBUFFERED": "1"}
# 3 epochs of 32 steps of at least 0.1 s each (see slow_steps): a SIGTERM sent when
# epoch 1 ends arrives mid-run.
LONG = ["--epochs", "3", "--batch-size", "8", "--train-size", "512"]
LONG += ["--val-size", "37", "--num-workers", "0"]


def slow_steps(project):
    """Until the job is requeued, each training step waits 0.1 s first: long epochs
    that cost little CPU, for the SIGTERM to find the job running."""
    restarts = 'os.environ.get("SLURM_RESTART_COUNT", "0")'
    wait = f'    if {restarts} == "0":\n        time.sleep(0.1)\n'
    edit(
        project,
        "    images, labels = batch\n    return F.cross_entropy(",
        f"{wait}    images, labels = batch\n    return F.cross_entropy(",
    )


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with slurm_cluster.running(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def cluster(slurm):
    """The module's cluster, left without jobs by each test, even a failed one."""
    yield slurm
    slurm.cancel_all()


def epochs_done(project):
    """Epochs in metrics.csv so far (read while the job may be writing it)."""
    metrics = project / "outputs" / "metrics.csv"
    try:
        with metrics.open(newline="") as file:
            return [int(row["epoch"]) for row in csv.DictReader(file)]
    except (OSError, KeyError, ValueError, TypeError):
        return []


def run_slurm_job(cluster, project, args, preempt=False):
    """Submit run_slurm.sbatch with args, optionally SIGTERM it (as Slurm does before
    a time limit) once epoch 1 is done, and wait for the end: (job, output)."""
    shutil.rmtree(project / "outputs", ignore_errors=True)
    job_id = cluster.submit(
        project / "run_slurm.sbatch",
        *args,
        options=OVERRIDES,
        env={**ENV, "MASTER_PORT": str(free_port())},
        cwd=project,
    )
    if preempt:
        cluster.wait(
            job_id,
            until=lambda job: (
                job["JobState"] in slurm_cluster.FINAL_STATES or epochs_done(project)
            ),
            interval=0.1,
        )
        signal = ["scancel", "--signal=TERM", "--batch", str(job_id)]
        cluster.client(*signal, check=False)  # the job may have failed already
    job = cluster.wait(job_id)
    return job, Path(job["StdOut"]).read_text()


# These two and the preemption test's two run each of the four launch commands.
@pytest.mark.parametrize(
    ("launcher", "nodes"), [("torchrun", "multi"), ("spawn", "single")]
)
def test_job_trains_and_completes(cluster, tmp_path, launcher, nodes):
    project = bake(tmp_path, launcher=launcher, nodes=nodes, scheduler="slurm")
    job, output = run_slurm_job(cluster, project, TINY)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert job["Restarts"] == "0"
    assert "1 node(s) x 2 processes = world size 2" in output
    weights = torch.load(project / "outputs" / "model_final.pt", weights_only=True)
    assert weights and not any(key.startswith("module.") for key in weights)
    assert epochs_done(project) == [1, 2]


@pytest.mark.parametrize(
    ("launcher", "nodes", "save_strategy"),
    [("torchrun", "single", "last"), ("spawn", "multi", "final_only")],
)
def test_preempted_job_requeues_and_ends_with_the_same_weights(
    cluster, tmp_path, launcher, nodes, save_strategy
):
    project = bake(
        tmp_path,
        launcher=launcher,
        nodes=nodes,
        save_strategy=save_strategy,
        scheduler="slurm",
    )
    # The same training, uninterrupted and outside Slurm, on as many processes.
    run_warm(project, project / "reference", 2, *LONG)
    slow_steps(project)
    job, output = run_slurm_job(cluster, project, LONG, preempt=True)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert job["Restarts"] == "1", output
    assert "SIGTERM: stopping the training processes" in output
    assert "preempted: saved" in output  # by rank 0, before the requeue
    assert "preempted: requeueing job" in output
    assert "(restart 1)" in output and "resumed from" in output
    assert epochs_done(project) == [1, 2, 3]  # each once
    final = torch.load(project / "outputs" / "model_final.pt", weights_only=True)
    reference = torch.load(project / "reference" / "model_final.pt", weights_only=True)
    assert final.keys() == reference.keys()
    for key in final:
        torch.testing.assert_close(final[key], reference[key], rtol=0, atol=1e-6)


def test_a_flag_that_cannot_work_fails_the_job_in_one_line(cluster, tmp_path):
    project = bake(tmp_path, scheduler="slurm")
    job, output = run_slurm_job(cluster, project, [*TINY, "--batch-size", "0"])
    assert (job["JobState"], job["ExitCode"]) == ("FAILED", "2:0"), output
    # srun adds its own line about the task's exit status.
    ours = [line for line in output.splitlines() if not line.startswith("srun: ")]
    errors = [line for line in ours if "error" in line.lower()]
    assert errors == [
        "error: argument --batch-size: must be at least 1, not 0 (see --help)"
    ]
    assert "Traceback" not in output
