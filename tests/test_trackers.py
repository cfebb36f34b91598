"""Experiment trackers (--tracker): one tracker run per output folder, whatever stops
the job. MLflow is read back with its own client from the SQLite file the run writes
by default; W&B runs offline (WANDB_MODE=offline), as it would on a compute node
without a network.
- MLflow: a SIGTERM and the same command, and a kill -9 and the same command, each
  end in one run whose every step is logged once, with a straight run's values, its
  configuration logged once (a resume's new flag beside it), and the right status
  after each attempt: KILLED, FAILED, FINISHED; --resume never starts a new run.
- W&B offline: the same run id across a restart, its folders where the README says.
- A tracker not installed, or not known: one line before anything starts.
- A tracker that fails (cannot start, a server not there or failing mid-run, a
  client that raises): one warning line, training goes on at full speed to its end,
  every row in metrics.csv, the done line names it dropped, and it is ended all the
  same; the trackers beside it log every row."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_features import without_modules
from test_recipes import COMMON, killed_and_rerun, stopped, train

from conftest import act_after_step, bake, error_lines, free_port, metrics, run_single

# 2 processes x 8 samples, 64 samples: 4 updates a pass, an evaluation after each.
ARGS = ["--epochs", "2", "--batch-size", "8", "--eval-every", "1"]
STEPS = list(range(1, 9))


def needs(package):
    """Skip a test (visibly) where its tracker's package is not installed: a GPU
    machine's environment may lack it; CI installs both."""
    missing = importlib.util.find_spec(package) is None
    return pytest.mark.skipif(
        missing, reason=f"needs {package} (pip install {package})"
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    project = bake(tmp_path_factory.mktemp("trackers"), save_strategy="last")
    act_after_step(project)
    return project


def mlflow_runs(out_dir):
    """The runs of the default experiment in the output folder's MLflow file, oldest
    first, each as (run, {metric: [(step, value)]}, params)."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{out_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ddp_trainer")
    runs = client.search_runs([experiment.experiment_id], order_by=["start_time"])
    found = []
    for run in runs:
        history = {
            key: [
                (m.step, m.value)
                for m in client.get_metric_history(run.info.run_id, key)
            ]
            for key in run.data.metrics
        }
        found.append((run, history, run.data.params))
    return found


def steps_of(history, key="train_loss"):
    return sorted(step for step, _ in history[key])


@pytest.fixture(scope="module")
def straight(project, tmp_path_factory):
    """A run never stopped: its only MLflow run's metrics."""
    out_dir = tmp_path_factory.mktemp("straight")
    train(project, out_dir, 2, *ARGS, "--tracker", "mlflow")
    [(run, history, params)] = mlflow_runs(out_dir)
    assert run.info.status == "FINISHED"
    assert steps_of(history) == STEPS and steps_of(history, "val_loss") == STEPS
    assert params["lr"] == "0.1" and params["world_size"] == "2"
    assert params["global_batch"] == "16" and "nodes=single" in params["template"]
    # metrics.csv and MLflow hold the same values.
    rows = {int(row["step"]): float(row["val_loss"]) for row in metrics(out_dir)}
    assert dict(history["val_loss"]) == pytest.approx(rows, rel=1e-6)
    return history


def assert_same_history(history, straight):
    """Every step once, each training and validation value the straight run's."""
    for key in ("train_loss", "val_loss", "val_acc", "lr"):
        assert [step for step, _ in history[key]] == STEPS, key  # once each, in order
        assert dict(history[key]) == pytest.approx(dict(straight[key]), abs=1e-6), key


@needs("mlflow")
def test_mlflow_one_run_across_sigterm_and_resume(project, straight, tmp_path):
    out_dir = tmp_path / "out"
    stopped(project, out_dir, *ARGS, "--tracker", "mlflow")
    [(run, history, params)] = mlflow_runs(out_dir)
    assert run.info.status == "KILLED" and steps_of(history) == [1, 2]
    first = dict(params)

    # The same command, one flag changed (a harmless one): the change is recorded
    # beside the run's configuration, which stays as it was.
    train(project, out_dir, 2, *ARGS, "--tracker", "mlflow", "--dist-timeout", "90")
    [(run, history, params)] = mlflow_runs(out_dir)
    assert run.info.status == "FINISHED"
    assert_same_history(history, straight)
    assert params == first | {"dist_timeout from attempt 2 at step 2": "90.0"}
    ids = json.loads((out_dir / "trackers.json").read_text())
    assert ids["mlflow"] == run.info.run_id

    # --resume never: a new run, from step 1.
    train(project, out_dir, 2, *ARGS, "--tracker", "mlflow", "--resume", "never")
    [(old, _, _), (new, history, _)] = mlflow_runs(out_dir)
    assert old.info.run_id == run.info.run_id and new.info.run_id != old.info.run_id
    assert new.info.status == "FINISHED" and steps_of(history) == STEPS


@needs("mlflow")
def test_mlflow_kill_9_and_the_same_command(project, straight, tmp_path):
    """Rank 1 killed after update 6 (the checkpoint is update 4's): the run ends as
    FAILED; the same command repeats updates 5 and 6, which are not logged again."""
    out_dir = tmp_path / "out"
    killed_and_rerun(project, out_dir, *ARGS, "--tracker", "mlflow")
    [(run, history, params)] = mlflow_runs(out_dir)
    assert run.info.status == "FINISHED"
    assert_same_history(history, straight)
    # Its configuration once, unchanged (the warm rerun, started without run_single.sh,
    # lacks the launcher's own --torchrun: the one difference).
    changed = {key for key in params if "from attempt" in key}
    assert changed <= {"torchrun from attempt 2 at step 4"}, params
    assert params["epochs"] == "2"


@needs("mlflow")
def test_mlflow_failed_status_on_an_error(project, tmp_path):
    error = {"TEST_ACT_AT": "0:0:1", "TEST_ACTION": "raise ValueError('bad batch')"}
    output = train(
        project, tmp_path, 2, *ARGS, "--tracker", "mlflow", env=error, expect=1
    )
    assert "bad batch" in output
    [(run, history, _)] = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED" and steps_of(history) == [1]


@needs("mlflow")
def test_mlflow_failed_status_when_the_final_save_fails(project, tmp_path):
    """Every step trained and logged, then model_final.pt cannot be written (a folder
    stands where its temporary file goes): the run ends as FAILED, not FINISHED."""
    (tmp_path / "model_final.pt.tmp").mkdir()
    output = train(project, tmp_path, 2, *ARGS, "--tracker", "mlflow", expect=1)
    assert f"error: cannot write {tmp_path / 'model_final.pt'}" in output
    [(run, history, _)] = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED" and steps_of(history) == STEPS


@needs("wandb")
@needs("tensorboard")
def test_wandb_offline_keeps_its_run_id_across_a_restart(
    project, tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = [*ARGS, "--tracker", "wandb,tensorboard", "--num-workers", "2"]
    stopped(project, tmp_path, *args)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]
    output = train(project, tmp_path, 2, *args)
    assert json.loads((tmp_path / "trackers.json").read_text())["wandb"] == run_id
    # One folder per attempt, each with the same id: `wandb sync` makes them one run.
    folders = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f"-{run_id}" in name for name in folders)
    assert all(
        (tmp_path / "wandb" / name / f"run-{run_id}.wandb").exists() for name in folders
    )
    [done] = [line for line in output.splitlines() if line.startswith("done:")]
    assert done.endswith(f"metrics {tmp_path / 'metrics.csv'}")  # none dropped
    # The tracker's service ended before the process did: nothing after the line.
    assert "Traceback" not in output and "Exception ignored" not in output


@pytest.mark.parametrize(
    "value, line",
    [
        ("mlflow", "error: --tracker mlflow needs mlflow: pip install mlflow"),
        (
            "neptune",
            (
                "error: argument --tracker: 'neptune' is not one of tensorboard, "
                "wandb, mlflow (see --help)"
            ),
        ),
    ],
)
def test_a_tracker_not_installed_or_not_known(project, tmp_path, value, line):
    env = without_modules(tmp_path, "mlflow")
    output = run_single(
        project, tmp_path / "out", 2, "--tracker", value, env=env, expect=2
    )
    assert error_lines(output) == [line], output
    assert not (tmp_path / "out").exists()  # refused before anything started


@needs("mlflow")
def test_a_tracker_that_cannot_start_is_dropped_and_training_goes_on(project, tmp_path):
    """MLflow's store asked for under a file: one warning line names the tracker and
    what it said; training goes on to its end, every row in metrics.csv, and the done
    line says the tracker was dropped."""
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{blocked}/mlflow.db"}
    args = [*COMMON, *ARGS, "--tracker", "mlflow"]
    output = run_single(project, tmp_path / "out", 2, *args, env=env)
    [line] = warning_lines(output)
    assert (
        line.startswith("warning: --tracker mlflow failed (") and str(blocked) in line
    )
    assert line.endswith("): dropped")
    assert [int(row["step"]) for row in metrics(tmp_path / "out")] == STEPS
    [done] = [line for line in output.splitlines() if line.startswith("done: ")]
    assert done.endswith(")") and ", dropped: mlflow (" in done
    assert "Traceback" not in output


def warning_lines(output):
    return [line for line in output.splitlines() if line.startswith("warning: ")]


def test_a_missing_tracker_package_skips_its_tests_one_by_one(tmp_path):
    """Where MLflow is not installed (a GPU machine's environment), this file is still
    collected, its MLflow tests are skipped with the reason, the others run."""
    env = {**os.environ, **without_modules(tmp_path, "mlflow")}
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    command += ["-k", "mlflow and not not_installed", __file__]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^4 skipped", done.stdout, re.MULTILINE), done.stdout
    assert done.stdout.count("needs mlflow (pip install mlflow)") == 4, done.stdout


# -- a tracker that fails: dropped in one line, training goes on at full speed ----------


class MlflowServer(ThreadingHTTPServer):
    """A tracking server on this machine that answers MLflow's REST calls as a real
    one does, until it has taken `good` batches of metrics; from then on it refuses
    every call (400, "the server says no"), as a server that broke mid-run."""

    def __init__(self, good):
        super().__init__(("127.0.0.1", 0), MlflowReplies)
        self.good, self.metrics = good, []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def uri(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class MlflowReplies(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        size = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(size)) if size else {}
        if len(self.server.metrics) >= self.server.good:
            answer, status = (
                {"error_code": "BAD_REQUEST", "message": "server says no"},
                400,
            )
        elif "experiments/get-by-name" in self.path:
            answer, status = (
                {"experiment": {"experiment_id": "1", "lifecycle_stage": "active"}},
                200,
            )
        elif "runs/create" in self.path:
            info = {"run_id": "r1", "experiment_id": "1", "status": "RUNNING"}
            answer, status = {"run": {"info": info, "data": {}}}, 200
        else:
            answer, status = {}, 200
            self.server.metrics += [body["metrics"]] if "metrics" in body else []
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_PATCH = do_GET


def timed(project, out_dir, *args, env=None):
    """A fresh launch as a user's (run_single.sh, 2 processes): output, seconds."""
    start = time.monotonic()
    output = run_single(project, out_dir, 2, *COMMON, *ARGS, *args, env=env)
    return output, time.monotonic() - start


def assert_dropped(output, out_dir, name, said):
    """One warning line naming the tracker and what it said, every row in
    metrics.csv, the done line naming the tracker dropped, no traceback."""
    [line] = warning_lines(output)
    assert line.startswith(f"warning: --tracker {name} failed ("), output
    assert said in line and line.endswith("): dropped"), line
    assert [int(row["step"]) for row in metrics(out_dir)] == STEPS
    [done] = [line for line in output.splitlines() if line.startswith("done: ")]
    assert f", dropped: {name} (" in done and done.endswith(")"), done
    assert "Traceback" not in output, output


@pytest.fixture(scope="module")
def untracked(project, tmp_path_factory):
    """Seconds a fresh launch of the runs below takes without a tracker."""
    return timed(project, tmp_path_factory.mktemp("untracked"))[1]


@needs("mlflow")
def test_a_tracking_server_that_fails_mid_run_is_dropped(project, untracked, tmp_path):
    """The server takes 3 rows, then refuses: training goes on at full speed to its
    end, and the run ends within seconds of one without a tracker."""
    server = MlflowServer(good=3)
    env = {"MLFLOW_TRACKING_URI": server.uri}
    output, seconds = timed(project, tmp_path, "--tracker", "mlflow", env=env)
    assert_dropped(output, tmp_path, "mlflow", "server says no")
    steps = [
        [m["step"] for m in batch if m["key"] == "val_loss"] for batch in server.metrics
    ]
    assert steps == [[1], [2], [3]]  # what it took before it broke
    assert seconds < untracked + 8, (seconds, untracked)


@needs("mlflow")
def test_a_tracking_server_that_is_not_there_is_dropped(project, untracked, tmp_path):
    """Nothing listens at the port. With MLflow's retries off, the first call fails:
    the run ends within seconds of one without a tracker. With its retries on (the
    default: minutes of them), they run in the tracker's thread while training goes
    on, and the run's end waits for them at most TRACKER_GRACE (30 s) from their
    start."""
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}
    at_once = {**env, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    output, seconds = timed(project, tmp_path / "a", "--tracker", "mlflow", env=at_once)
    assert_dropped(output, tmp_path / "a", "mlflow", "Connection refused")
    assert seconds < untracked + 8, (seconds, untracked)

    output, seconds = timed(project, tmp_path / "b", "--tracker", "mlflow", env=env)
    assert_dropped(output, tmp_path / "b", "mlflow", "no answer within 30 s")
    assert seconds < 30 + untracked + 8, (seconds, untracked)


def wandb_shim(tmp_path, wait=0, log_raises=False):
    """A folder for PYTHONPATH whose sitecustomize makes W&B's Run.finish note its
    keyword arguments in a file, after `wait` seconds, and (log_raises) Run.log
    raise: (the folder, the file)."""
    shim, finished = tmp_path / "shim", tmp_path / "finished"
    shim.mkdir()
    lines = [
        "import time",
        "from wandb.sdk.wandb_run import Run",
        "finish = Run.finish",
        "def finished(self, *args, **kwargs):",
        f"    time.sleep({wait})",
        f"    open({str(finished)!r}, 'a').write(str(kwargs) + '\\n')",
        "    return finish(self, *args, **kwargs)",
        "Run.finish = finished",
    ]
    if log_raises:
        lines += [
            "def log(self, *args, **kwargs):",
            "    raise RuntimeError('W&B is down')",
            "Run.log = log",
        ]
    (shim / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    return shim, finished


@needs("mlflow")
@needs("wandb")
def test_the_trackers_end_side_by_side(project, untracked, tmp_path):
    """MLflow retrying a dead server (30 s at the end, then dropped) and, after it, a
    W&B whose finish takes 20 s: both are told to end at once, so the run ends about
    30 s after its training, not 50, with W&B finished."""
    shim, finished = wandb_shim(tmp_path, wait=20)
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}
    env |= {"WANDB_MODE": "offline", "PYTHONPATH": str(shim)}
    out = tmp_path / "out"
    output, seconds = timed(project, out, "--tracker", "mlflow,wandb", env=env)
    assert_dropped(output, out, "mlflow", "no answer within 30 s")
    assert finished.read_text() == "{'exit_code': 0}\n"
    assert seconds < 30 + untracked + 8, (seconds, untracked)


@needs("wandb")
@needs("tensorboard")
def test_a_tracker_that_raises_is_dropped_and_the_others_go_on(project, tmp_path):
    """W&B (offline) raises on every log: dropped in one line, and still finished;
    TensorBoard, beside it, gets every row."""
    shim, finished = wandb_shim(tmp_path, log_raises=True)
    env = {"WANDB_MODE": "offline", "PYTHONPATH": str(shim)}
    out = tmp_path / "out"
    output, _ = timed(project, out, "--tracker", "wandb,tensorboard", env=env)
    assert_dropped(output, out, "wandb", "W&B is down")
    assert finished.read_text() == "{'exit_code': 0}\n"  # ended all the same
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train_loss")] == STEPS
