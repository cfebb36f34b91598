"""Elastic membership for real: run_multi.sh with NNODES=2:3 on three network
namespaces joined by a bridge, as three hosts, one process each. A host lost mid-run
(every process on it killed), a host that joins mid-run, and the host of the
rendezvous lost (with RDZV_FILE, the way out): each run ends with the weights of a
straight run on three processes, which never lost anything. Models without BatchNorm,
whose statistics would depend on the split."""

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time

import pytest
from test_shards import SHARDS

from conftest import (
    act_after_step,
    bake,
    free_port,
    ip,
    kill_namespace,
    load_weights,
    max_difference,
    needs_netns,
    replace_user_functions,
    run_warm,
    without_batchnorm,
)

pytestmark = pytest.mark.xdist_group("elastic_hosts")  # one project, one reference
SUBNET = "10.232.0"
_names = itertools.count()

# 96 samples: 3 processes x batch 8 take 4 updates a pass, as 2 x 6 x grad-accum 2.
ARGS = ["--epochs", "4", "--batch-size", "8", "--train-size", "96", "--val-size", "37"]
ARGS += ["--num-workers", "0", "--lr", "0.02", "--save-every", "2"]
ARGS += ["--dist-timeout", "30"]
KEPT = (
    "resume: global batch 24 kept: 2 processes x batch 6 x grad-accum 2 (the "
    "checkpoint had 3 processes x batch 8 x grad-accum 1)"
)
BATCH_12 = ("--batch-size", "12")  # 2 x 12 = 24 = 3 x 8


@contextlib.contextmanager
def hosts(count):
    """`count` network namespaces, each with `lo` up and one end of a veth pair whose
    other end is on a bridge (in a namespace of its own): yields [(namespace,
    address)]. Afterwards every process inside them is killed and they are deleted."""
    tag = f"el{os.getpid()}x{next(_names)}"
    switch = f"{tag}sw"
    made = [switch]
    try:
        ip("netns", "add", switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        found = []
        for i in range(count):
            namespace, address = f"{tag}h{i}", f"{SUBNET}.{i + 1}"
            ip("netns", "add", namespace)
            made.append(namespace)
            peer = ["type", "veth", "peer", "name", f"p{i}", "netns", switch]
            ip("link", "add", "eth0", "netns", namespace, *peer)
            ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", namespace, "link", "set", "lo", "up")
            ip("-n", namespace, "link", "set", "eth0", "up")
            found.append((namespace, address))
        yield found
    finally:
        for namespace in made:
            kill_namespace(namespace)
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


class Job:
    """run_multi.sh on some hosts, elastic, each with its own log."""

    def __init__(self, project, out, hosts, env=None):
        self.project, self.out, self.hosts = project, out, hosts
        self.port, self.env = str(free_port()), env or {}
        self.running = {}

    def start(self, index, *args, **env):
        namespace, _ = self.hosts[index]
        log = (self.out.parent / f"host{index}.log").open("w")
        environment = {**os.environ, "NNODES": "2:3", "NPROC_PER_NODE": "1"}
        environment |= {"MASTER_ADDR": self.hosts[0][1], "MASTER_PORT": self.port}
        environment |= {**self.env, **env}
        command = ["ip", "netns", "exec", namespace, "./run_multi.sh", *ARGS, *args]
        command += ["--output-dir", str(self.out)]
        self.running[index] = subprocess.Popen(
            command,
            cwd=self.project,
            env=environment,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )

    def wait(self, index, timeout=90):
        try:
            return self.running[index].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def log(self, index):
        return (self.out.parent / f"host{index}.log").read_text()

    def logs(self):
        return "\n".join(f"--- host {i}\n{self.log(i)}" for i in self.running)


def wait_for(path, job, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, (
            f"no {path.name} after {timeout} s\n{job.logs()}"
        )
        time.sleep(0.1)
    return time.monotonic()


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    made = bake(tmp_path_factory.mktemp("elastic_hosts"), nodes="multi")
    without_batchnorm(made)
    act_after_step(made)
    return made


@pytest.fixture(scope="module")
def straight(project, tmp_path_factory):
    """The final weights of runs that lost nothing, by number of processes."""
    root = tmp_path_factory.mktemp("straight")
    cache = {}

    def weights(nproc, *args):
        if (nproc, args) not in cache:
            out = root / f"run{len(cache)}"
            run_warm(project, out, nproc, *ARGS, *args)
            cache[nproc, args] = load_weights(out / "model_final.pt")
        return cache[nproc, args]

    return weights


def assert_same_end(out, expected):
    assert max_difference(load_weights(out / "model_final.pt"), expected) < 1e-5


def seconds_to_train_again(job, since, timeout=60):
    """From `since` (a loss, a join) to the line that says the job resumed."""
    deadline = since + timeout
    while "resumed from" not in job.logs():
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.1)
    return time.monotonic() - since


def lose_host_mid_run(
    job, three, lost_host, marker, how="killed", *args, at="1:0", stop=None
):
    """Start the three hosts; when the rank on `lost_host` (its rank too) has done
    update 5 (`at`, pass:step, says another; the last save: update 4), kill every
    process there, or cut its network (its link down: the others get no word of it);
    host `stop`, if given, is stopped (SIGSTOP) just before, for the caller to
    continue. Returns when."""
    action = f"open({str(marker)!r}, 'w').close(); time.sleep(60)"
    for index in range(3):
        here = f"{lost_host}:{at}"
        job.start(index, *args, TEST_ACT_AT=here, TEST_ACTION=action)
    wait_for(marker, job)
    if stop is not None:
        signal_host(three[stop][0], signal.SIGSTOP)
    namespace = three[lost_host][0]
    if how == "killed":
        kill_namespace(namespace)
    else:
        ip("-n", namespace, "link", "set", "eth0", "down")
    return time.monotonic()


def survivors_go_on(job, three, lost_host, marker, how="killed", *args):
    """Lose `lost_host` mid-run (lose_host_mid_run), then wait for the other two to
    train again and to finish: (seconds to training again, their exit statuses, all
    the hosts' output)."""
    took = seconds_to_train_again(
        job, lose_host_mid_run(job, three, lost_host, marker, how, *args)
    )
    codes = [job.wait(index) for index in range(3) if index != lost_host]
    return took, codes, job.logs()


@needs_netns
@pytest.mark.parametrize("how", ["killed", "cut"])
def test_a_lost_host_leaves_the_others_training_to_the_same_end(
    project, straight, tmp_path, how
):
    """Host 2 lost after update 5: hosts 0 and 1 notice (killed: its sockets close,
    and each says so in one line; cut: nothing closes, and the hang watch ends the
    wait after --dist-timeout, 10 s here, naming rank 2), go on by themselves from
    update 4 with the global batch of 24 (2 x 6 x 2), and end as the straight run on
    three processes."""
    out = tmp_path / "out"
    timeout = ("--dist-timeout", "10") if how == "cut" else ()
    with hosts(3) as three:
        job = Job(project, out, three)
        took, codes, output = survivors_go_on(
            job, three, 2, tmp_path / "lost", how, *timeout
        )
    assert codes == [0, 0], output
    assert_same_end(out, straight(3))
    assert output.count(KEPT) == 1, output
    assert "resumed from" in output and "after epoch 1" in output, output
    assert "Traceback" not in output
    if how == "killed":
        for rank in (0, 1):
            line = f"[rank {rank}] elastic: lost a peer in backward, line "
            assert output.count(line) == 1, output
        # The killed host's sockets close ("Connection closed by peer [ADDRESS]:PORT"),
        # or are reset where data it had not read was waiting ("Read error
        # [ADDRESS]:PORT: Connection reset by peer", seen under load): a line names it.
        said = [x for x in output.splitlines() if "elastic: lost a peer in" in x]
        lost = f"[{three[2][1]}]:"
        assert any(lost in x and "by peer" in x for x in said), said
        assert "[rank 0] thread" not in output  # no stacks
    else:
        assert "hang: no progress for 10 s (--dist-timeout)" in output, output
        assert "  rank 2: no answer (its Python is blocked)" in output, output
    print(f"host 2 {how}: training again after {took:.1f} s")
    assert took < (30 if how == "killed" else 60)  # cut: the hang watch, 10 s, first


@contextlib.contextmanager
def busy(per_core=3):
    """Processes that keep every core busy, `per_core` of them a core, as a machine
    whose DataLoader workers and other jobs share its CPU several times over."""
    count = per_core * (os.cpu_count() or 1)
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@needs_netns
def test_a_busy_machine_is_not_a_lost_one(project, straight, tmp_path):
    """Host 2 killed after update 5, with three busy processes a core beside the job:
    hosts 0 and 1, slowed down, are neither lost nor take the other for lost; they
    go on from update 4 and end as the straight run on three processes."""
    out = tmp_path / "out"
    with hosts(3) as three, busy():
        job = Job(project, out, three)
        took, codes, output = survivors_go_on(job, three, 2, tmp_path / "lost")
    assert codes == [0, 0], output
    assert_same_end(out, straight(3))
    assert output.count(KEPT) == 1 and "lost the rendezvous" not in output, output
    assert "Traceback" not in output
    print(f"host 2 killed, CPU busy: training again after {took:.1f} s")
    assert took < 45


def freeze(namespace, seconds):
    """Stop every process of a host for `seconds` (SIGSTOP, then SIGCONT): a machine
    whose CPU its other work takes for that long, torchrun's heartbeat thread too."""
    signal_host(namespace, signal.SIGSTOP)
    time.sleep(seconds)
    signal_host(namespace, signal.SIGCONT)


def signal_host(namespace, signum):
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True)
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signum)


@needs_netns
def test_a_machine_that_stalls_for_seconds_is_not_a_lost_one(
    project, straight, tmp_path
):
    """Host 2 killed after update 5 and, at that moment, host 1 frozen for 8 s (every
    process there stopped, torchrun's heartbeats too: a machine whose CPU is taken,
    at the extreme): hosts 0 and 1 form the next round together and end as the
    straight run on three processes."""
    out = tmp_path / "out"
    with hosts(3) as three:
        job = Job(project, out, three)
        lose_host_mid_run(job, three, 2, tmp_path / "lost")
        freeze(three[1][0], 8)
        codes = [job.wait(0), job.wait(1)]
        output = job.logs()
    assert codes == [0, 0], output
    assert_same_end(out, straight(3))
    assert output.count(KEPT) == 1 and "lost the rendezvous" not in output, output


@needs_netns
def test_a_machine_stalled_past_dist_timeout_is_not_called_the_host_lost(
    project, tmp_path
):
    """As above, with DIST_TIMEOUT=5 and host 1 frozen for 15 s, from just before
    host 2 is lost (frozen after, it could have joined the next round already, which
    then forms when it wakes): host 0, which hosts the rendezvous, forms no round
    within 5 s and ends in one line that says so (it said "lost the rendezvous ...
    with the machine that hosts it": itself, alive). Host 1, woken, finds host 0 gone
    and says that."""
    out = tmp_path / "out"
    with hosts(3) as three:
        job = Job(project, out, three, env={"DIST_TIMEOUT": "5"})
        lose_host_mid_run(job, three, 2, tmp_path / "lost", stop=1)
        time.sleep(15)
        signal_host(three[1][0], signal.SIGCONT)
        codes = [job.wait(0), job.wait(1)]
        host0, host1 = job.log(0), job.log(1)
        at = f"{three[0][1]}:{job.port}"
    assert codes == [1, 1], job.logs()
    line = (
        f"error: no round of the rendezvous at {at} within 5 s (DIST_TIMEOUT): "
        "fewer than 2 machines (NNODES) joined; start the missing ones, or give a slow "
        "one longer with DIST_TIMEOUT"
    )
    assert host0.count(line) == 1 and "lost the rendezvous" not in host0, host0
    lost = f"error: lost the rendezvous at {at}, with the machine that hosts it"
    assert host1.count(lost) == 1 and "Traceback" not in host0 + host1, host1


@needs_netns
def test_a_host_that_joins_mid_run_grows_the_job_to_the_same_end(
    project, straight, tmp_path
):
    """Hosts 0 and 1 start (2 x batch 12); host 2 joins after update 3: the two save
    (torchrun stops them with SIGTERM), and all three go on from there with the
    global batch of 24 (3 x 8 x 1), to the end of the straight run on two."""
    out = tmp_path / "out"
    joined = tmp_path / "joined"
    with hosts(3) as three:
        job = Job(project, out, three)
        # rank 0, after update 3: waits (in Python) for torchrun's SIGTERM.
        action = f"open({str(joined)!r}, 'w').close()\n"
        action += "while STOP_SIGNAL is None:\n    time.sleep(0.1)"
        for index in (0, 1):
            job.start(index, *BATCH_12, TEST_ACT_AT="0:0:2", TEST_ACTION=action)
        wait_for(joined, job)
        job.start(2, *BATCH_12)
        since = time.monotonic()
        took = seconds_to_train_again(job, since)
        codes = [job.wait(index) for index in range(3)]
        output = job.logs()
    assert codes == [0, 0, 0], output
    assert_same_end(out, straight(2, *BATCH_12))
    grown = (
        "resume: global batch 24 kept: 3 processes x batch 8 x grad-accum 1 (the "
        "checkpoint had 2 processes x batch 12 x grad-accum 1)"
    )
    assert output.count(grown) == 1, output
    saved = "; the next elastic round resumes from it, or the same command again\n"
    assert output.count(saved) == 1, output  # by rank 0, as the round grows
    assert "Traceback" not in output
    print(f"host 2 joined: training again after {took:.1f} s")


@needs_netns
def test_the_rendezvous_host_lost_ends_the_job_in_one_line(project, tmp_path):
    """Without RDZV_FILE the rendezvous lives on host 0 (MASTER_ADDR): lost, the
    others cannot go on, and say why and what to use instead."""
    out = tmp_path / "out"
    with hosts(3) as three:
        job = Job(project, out, three)
        lose_host_mid_run(job, three, 0, tmp_path / "lost")
        codes = [job.wait(1), job.wait(2)]
        output = job.logs()
    assert codes == [1, 1], output
    line = (
        f"error: lost the rendezvous at {three[0][1]}:{job.port}, with the machine that "
        "hosts it (MASTER_ADDR): the others cannot go on without it; RDZV_FILE on a "
        "disk every machine shares lets any machine go"
    )
    assert output.count(line) == 2, output
    assert "Traceback" not in output and "has failed to" not in output


@needs_netns
def test_with_rdzv_file_the_rendezvous_host_may_go(project, straight, tmp_path):
    """With RDZV_FILE on a disk all hosts share, host 0 (MASTER_ADDR, rank 0) lost
    after update 5 leaves hosts 1 and 2 to the end of the straight run."""
    out = tmp_path / "out"
    with hosts(3) as three:
        job = Job(project, out, three, env={"RDZV_FILE": str(tmp_path / "rdzv")})
        took, codes, output = survivors_go_on(job, three, 0, tmp_path / "lost")
    assert codes == [0, 0], output
    assert_same_end(out, straight(3))
    assert output.count(KEPT) == 1, output
    print(f"lost host 0 (RDZV_FILE): training again after {took:.1f} s")


@needs_netns
def test_a_lost_host_on_a_stream_read_by_shard_ends_as_a_straight_run(tmp_path):
    """The 16 uneven shards of test_shards.py, one pass (168 rows in 288 places: 12
    updates of 24); host 2 killed after update 7 (the last save: update 6, mid-pass).
    Hosts 0 and 1 go on as 2 x 6 x grad-accum 2, each shard's reader now one of
    theirs, which reads it up to there (the shards have no state_dict()), and end as
    the straight run on three processes."""
    project = bake(tmp_path / "shards", nodes="multi")
    replace_user_functions(project, SHARDS)
    act_after_step(project)
    args = ("--max-steps", "12")
    run_warm(project, tmp_path / "straight", 3, *ARGS, *args)
    out = tmp_path / "out"
    with hosts(3) as three:
        job = Job(project, out, three)
        lost = lose_host_mid_run(
            job, three, 2, tmp_path / "lost", "killed", *args, at="0:6"
        )
        seconds_to_train_again(job, lost)
        codes = [job.wait(index) for index in (0, 1)]
        output = job.logs()
    assert codes == [0, 0], output
    assert_same_end(out, load_weights(tmp_path / "straight" / "model_final.pt"))
    assert output.count(KEPT) == 1, output
    again = "so each of its 16 shards is read again, by one reader, to get there"
    assert output.count(again) == 1 and "in epoch 1 after 12 batches" in output, output
