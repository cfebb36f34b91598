"""Failures: a dead worker stops the job (or torchrun restarts it), a kill while saving
keeps the previous checkpoint, SIGTERM saves and resumes exactly (so does a kill -9 of
the launcher), a missing peer or a busy port is one clear line, a worker's end never
aborts it. Every job runs in its own process group; each test also checks that
nothing of the job is left running once the launcher has exited."""

import os
import re
import signal
import socket
import time

import pytest
import torch.distributed as dist

from conftest import (
    act_after_step,
    bake,
    edit,
    error_lines,
    free_port,
    live_members,
    load_module,
    load_weights,
    marked,
    max_difference,
    nan_loss_on_rank_1,
    replace_user_functions,
    run_warm,
    started,
)

ARGS = ["--epochs", "3", "--batch-size", "8", "--num-workers", "0", "--val-size", "37"]
SHORT = [*ARGS, "--train-size", "64"]  # 4 steps per epoch and rank
LONG = [*ARGS, "--train-size", "512"]  # 32 steps an epoch: checks at updates 20, 40
KILL = "os.kill(os.getpid(), signal.SIGKILL)"


def watch(command, project, env, timeout=90):
    """Run a job (see conftest.started). Returns (exit code, output, seconds until the
    launcher exited, processes of the job still alive 5 s after that: of its process
    group, or with its mark, as torchrun's workers in their own sessions)."""
    with started([(command, env)], project) as (mark, [proc]):
        start = time.monotonic()
        code = proc.wait(timeout=timeout)
        seconds = time.monotonic() - start

        def job_left():
            return sorted(set(live_members(proc.pid)) | set(marked(mark)))

        deadline = time.monotonic() + 5
        while job_left() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = job_left()
    return code, proc.output, seconds, left


def single(out_dir, args, **env):
    command = ["./run_single.sh", *args, "--output-dir", str(out_dir)]
    return command, {"NPROC_PER_NODE": "2", **env}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of uninterrupted runs, by arguments (the same for both
    launchers and every save strategy), started warm: the faults are what each test
    launches as a user does."""
    root = tmp_path_factory.mktemp("reference")
    project = bake(root, save_strategy="final_only")
    cache = {}

    def weights(args):
        key = tuple(args)
        if key not in cache:
            out_dir = root / f"run{len(cache)}"
            run_warm(project, out_dir, 2, *args)
            cache[key] = load_weights(out_dir / "model_final.pt")
        return cache[key]

    return weights


# -- (a) a dead worker stops the whole job ---------------------------------------------


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_killed_worker_stops_the_job_and_is_named(tmp_path, launcher):
    project = bake(tmp_path, launcher=launcher)
    act_after_step(project)
    out_dir = tmp_path / "out"
    command, env = single(out_dir, SHORT, TEST_ACT_AT="1:1:2", TEST_ACTION=KILL)
    code, output, seconds, left = watch(command, project, env)
    assert code != 0, output
    assert seconds < 60, output
    assert left == [], output
    # Both launchers name the rank in one line.
    assert "error: rank 1 died (SIGKILL); the other workers were stopped" in output
    assert load_weights(out_dir / "checkpoint_last.pt")["epoch"] == 1


# -- (b) torchrun --max-restarts survives it ---------------------------------------------


@pytest.mark.xdist_group("faults_reference")
def test_torchrun_restarts_from_the_checkpoint_and_ends_the_same(tmp_path, reference):
    project = bake(tmp_path, launcher="torchrun", save_strategy="last")
    act_after_step(project)
    out_dir = tmp_path / "out"
    env = {"TEST_ACT_AT": "1:1:2", "TEST_ACTION": KILL, "MAX_RESTARTS": "1"}
    command, env = single(out_dir, SHORT, **env)
    code, output, _, left = watch(command, project, env)
    assert code == 0, output
    assert left == [], output
    assert output.count(f"resumed from {out_dir / 'checkpoint_last.pt'}") == 1
    assert "after epoch 1" in output
    final = load_weights(out_dir / "model_final.pt")
    assert max_difference(final, reference(SHORT)) < 1e-5


# -- (c) a kill while saving leaves the previous checkpoint ------------------------------


@pytest.mark.xdist_group("faults_reference")
def test_a_kill_while_saving_keeps_the_previous_checkpoint(tmp_path, reference):
    project = bake(tmp_path, save_strategy="last")
    # Write half of the second epoch's checkpoint_last.pt, then die.
    edit(
        project,
        '    with replacing(path, "wb") as f:\n',
        '    with replacing(path, "wb") as f:\n'
        '        if path.name == "checkpoint_last.pt" and obj["epoch"] == 2:\n'
        "            data = io.BytesIO()\n"
        "            torch.save(obj, data)\n"
        "            f.write(data.getvalue()[: data.tell() // 2])\n"
        "            f.flush()\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n",
    )
    out_dir = tmp_path / "out"
    command, env = single(out_dir, SHORT)
    code, output, seconds, left = watch(command, project, env)
    assert code != 0 and seconds < 60 and left == [], output
    partial = out_dir / "checkpoint_last.pt.tmp"
    assert partial.exists()
    with pytest.raises(RuntimeError):  # a truncated zip archive
        load_weights(partial)
    assert load_weights(out_dir / "checkpoint_last.pt")["epoch"] == 1

    edit(project, 'obj["epoch"] == 2', "False")
    output = run_warm(project, out_dir, 2, *SHORT)
    assert "after epoch 1" in output
    final = load_weights(out_dir / "model_final.pt")
    assert max_difference(final, reference(SHORT)) < 1e-5


# -- (d) SIGTERM: checkpoint, clean exit, exact resume ----------------------------------


@pytest.mark.parametrize(
    ("launcher", "strategy", "target"),
    # Ctrl-C, which stops the same way, runs final_only in test_safety.py.
    [("torchrun", "every_epoch", "job"), ("spawn", "best", "launcher")],
)
@pytest.mark.xdist_group("faults_reference")
def test_sigterm_saves_then_resume_ends_the_same(
    tmp_path, reference, launcher, strategy, target
):
    """SIGTERM to every process of the job (Slurm, Kubernetes) or to the launcher
    alone (kill PID): workers stop at the next check, rank 0 saves, all exit."""
    project = bake(tmp_path, launcher=launcher, save_strategy=strategy)
    act_after_step(project)
    action = {
        "job": "os.killpg(os.getpgrp(), signal.SIGTERM)",
        "launcher": "os.kill(os.getppid(), signal.SIGTERM)",
    }[target]
    out_dir = tmp_path / "out"
    command, env = single(out_dir, LONG, TEST_ACT_AT="0:1:5", TEST_ACTION=action)
    code, output, seconds, left = watch(command, project, env)
    # The launcher exits 143 like its workers, whoever got the signal first.
    assert code == 143, output
    assert "Traceback" not in output
    assert seconds < 60 and left == [], output
    last = out_dir / "checkpoint_last.pt"
    # The check after update 40, 8 steps into epoch 2 (of 32 steps).
    line = f"preempted: saved {last} in epoch 2 after 8 batches"
    assert output.count(line) == 1, output
    checkpoint = load_weights(last)
    # 8 steps of 2 ranks x 8 samples into epoch 2, in global samples.
    assert (checkpoint["epoch"], checkpoint["epoch_samples"]) == (1, 8 * 2 * 8)
    assert checkpoint["step"] == 40

    resume_ends_as_never_stopped(
        project, out_dir, reference, "in epoch 2 after 8 batches"
    )
    with (out_dir / "metrics.csv").open() as f:
        assert [line.split(",")[0] for line in f][1:] == ["1", "2", "3"]


def resume_ends_as_never_stopped(project, out_dir, reference, where):
    """The LONG run again (warm): it resumes from checkpoint_last.pt `where` ("in
    epoch 2 after 8 batches") and ends with the weights of a run never stopped."""
    output = run_warm(project, out_dir, 2, *LONG)
    assert f"resumed from {out_dir / 'checkpoint_last.pt'} {where}" in output
    final = load_weights(out_dir / "model_final.pt")
    assert max_difference(final, reference(LONG)) < 1e-5


# -- (d2) a launcher killed outright: its workers save and stop -------------------------


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
@pytest.mark.xdist_group("faults_reference")
def test_a_killed_launcher_leaves_no_worker_training(tmp_path, reference, launcher):
    """kill -9 of the launcher alone (the out-of-memory killer, a careless kill): the
    kernel sends each worker SIGTERM, so they save and stop instead of training on
    as orphans (torchrun's) or, now and then, stopping unsaved (spawn's: a second
    SIGINT reads as a second Ctrl-C). The same command again ends as if nothing had
    happened."""
    project = bake(tmp_path, launcher=launcher, save_strategy="last")
    act_after_step(project)
    action = "os.kill(os.getppid(), signal.SIGKILL)"  # rank 0's parent: the launcher
    out_dir = tmp_path / "out"
    command, env = single(out_dir, LONG, TEST_ACT_AT="0:1:5", TEST_ACTION=action)
    code, output, _, left = watch(command, project, env)
    assert code == -signal.SIGKILL and left == [], output
    last = out_dir / "checkpoint_last.pt"
    # The next check after the signal: in epoch 2, or at its end.
    said = rf"^preempted: saved {re.escape(str(last))} (.+); run again"
    where = re.findall(said, output, re.MULTILINE)
    assert len(where) == 1 and "Traceback" not in output, output
    assert re.fullmatch(r"in epoch 2 after \d+ batches|after epoch 2", where[0])
    resume_ends_as_never_stopped(project, out_dir, reference, where[0])


# -- (e) a peer that never arrives -------------------------------------------------------


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_missing_node_fails_within_dist_timeout(tmp_path, launcher):
    project = bake(tmp_path, launcher=launcher, nodes="multi")
    port = free_port()
    env = {"NNODES": "2", "NODE_RANK": "0", "NPROC_PER_NODE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DIST_TIMEOUT": "5"}
    out_dir = tmp_path / "out"
    command = ["./run_multi.sh", *SHORT, "--output-dir", str(out_dir)]
    code, output, seconds, left = watch(command, project, env)
    assert code != 0, output
    assert seconds < 45, output
    assert left == [], output
    assert "1/2 clients joined" in output
    assert f"error: rendezvous with 127.0.0.1:{port} failed (" in output
    if launcher == "spawn":
        assert f"error: rendezvous with 127.0.0.1:{port} failed (Timed out" in output


# -- (f) a busy port ---------------------------------------------------------------------


def test_a_busy_master_port_is_one_clear_line(tmp_path):
    project = bake(tmp_path, launcher="spawn")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = [*SHORT, "--master-port", str(port)]
        out_dir = tmp_path / "out"
        command, env = single(out_dir, args)
        code, output, seconds, left = watch(command, project, env)
    assert code == 1, output
    assert seconds < 30 and left == [], output
    errors = error_lines(output)
    assert errors == [
        f"error: port 127.0.0.1:{port} is in use; choose another --master-port"
    ]
    assert "Traceback" not in output


def test_spawn_keeps_the_free_port_it_picks_until_the_end(tmp_path):
    """No other program can take the port the spawn launcher picked, while rank 0's
    store can still listen there."""
    module = load_module(bake(tmp_path, launcher="spawn"))
    with socket.socket() as held:
        port = module.hold_free_port(held)
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("", port))
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
        store.set("rank 0", "listens")
        assert store.get("rank 0") == b"listens"


# Every Python process of the job loads this (a sitecustomize.py on PYTHONPATH):
# torchrun's pick of a free port for the workers' own store returns one that another
# program holds, as when one takes it between torchrun's pick and rank 0's listen.
PORT_TAKEN_AFTER_THE_PICK = """
import os

import torch.distributed.elastic.rendezvous.api as api

api.get_free_port = lambda: int(os.environ["TEST_TAKEN_PORT"])
"""


@pytest.mark.xdist_group("faults_reference")
@pytest.mark.parametrize("restarts", [0, 1])
def test_torchrun_workers_use_no_port_of_their_own(tmp_path, reference, restarts):
    """Guarantee 12: with or without restarts the workers share torchrun's store,
    listening before they start: a port taken after torchrun's pick of a free one
    does not matter, the job trains (before, with restarts, it ended in one line:
    "port ... is in use")."""
    project = bake(tmp_path, launcher="torchrun", save_strategy="final_only")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PORT_TAKEN_AFTER_THE_PICK)
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        paths = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        env = {"MAX_RESTARTS": str(restarts), "TEST_TAKEN_PORT": str(port)}
        command, env = single(tmp_path / "out", SHORT, PYTHONPATH=paths, **env)
        code, output, _, left = watch(command, project, env)
    assert left == [], output
    assert code == 0, output
    final = load_weights(tmp_path / "out" / "model_final.pt")
    assert max_difference(final, reference(SHORT)) < 1e-5


# -- (g) a worker's end never aborts it --------------------------------------------------

# At each rank's exit, as its atexit handlers run, a gloo thread finishes a collective
# whose tensor Python has already dropped, and waits for the GIL to let go of it; the
# main thread keeps the GIL (it checks for waiting threads every 1000 s) until it
# releases it for good, in the interpreter's teardown. This is the rare timing in which
# torch 2.13 aborted a rank after a run that had finished and saved, made certain.
GLOO_THREAD_WAITS_FOR_THE_GIL_AT_EXIT = """
def build_model(args):
    if not hasattr(torch, "test_group"):
        import atexit

        store = dist.PrefixStore("test", dist.distributed_c10d._get_default_store())
        rank, size = dist.get_rank(), dist.get_world_size()
        torch.test_group = dist.ProcessGroupGloo(store, rank, size, timedelta(minutes=1))

        def finish_a_collective_keeping_the_gil():
            print(f"rank {rank}: atexit handler", flush=True)
            sys.setswitchinterval(1000)
            torch.test_group.allreduce([torch.ones(1)])
            end = time.monotonic() + 2
            while time.monotonic() < end:
                pass

        atexit.register(finish_a_collective_keeping_the_gil)

        def a_thread_of_the_users():
            time.sleep(3)  # the run is over by then
            print(f"rank {rank}: thread done", flush=True)

        threading.Thread(target=a_thread_of_the_users).start()
"""


@pytest.mark.parametrize(
    ("launcher", "ending"), [("torchrun", "finished"), ("spawn", "a clear error")]
)
def test_a_worker_ends_after_its_atexit_handlers_without_aborting(
    tmp_path, launcher, ending
):
    """Each rank waits for its threads, runs its atexit handlers and ends with the
    run's status: never "terminate called without an active exception" and SIGABRT."""
    project = bake(tmp_path, launcher=launcher)
    edit(project, "\ndef build_model(args):\n", GLOO_THREAD_WAITS_FOR_THE_GIL_AT_EXIT)
    if ending == "a clear error":
        replace_user_functions(project, nan_loss_on_rank_1(3))  # epoch 1, batch 3
    command, env = single(tmp_path / "out", SHORT)
    code, output, _, left = watch(command, project, env)
    assert "terminate called" not in output and "SIGABRT" not in output, output
    assert code == (0 if ending == "finished" else 1), output
    assert left == [], output
    # As in a normal exit: the threads that are not daemons end, then atexit runs.
    for rank in (0, 1):
        ends = [f"rank {rank}: thread done", f"rank {rank}: atexit handler"]
        assert [output.count(end) for end in ends] == [1, 1], output
        assert output.index(ends[0]) < output.index(ends[1]), output
    if ending == "a clear error":
        assert "error: the loss is nan in epoch 1 at batch 3 (rank 1);" in output
