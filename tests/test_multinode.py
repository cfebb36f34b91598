"""Two machines for real: run_multi.sh once in each of two network namespaces joined by
a veth pair, each with its own address, as on two hosts. Nobody sets an interface
variable: the script must find the interface that reaches MASTER_ADDR, since the host
name resolves the same in both namespaces (same /etc/hosts), to an address the other
host cannot reach. Also the mistakes users meet first: a wrong MASTER_ADDR, and a
MASTER_PORT already in use."""

import contextlib
import itertools
import os
import re
import shutil
import socket
import subprocess
import time

import pytest
import torch

from conftest import (
    TINY,
    bake,
    free_port,
    ip,
    kill_namespace,
    needs_netns,
    run_jobs,
    run_warm,
)

LAUNCHERS = ["torchrun", "spawn"]
# One test worker runs the module: the projects and the one-machine run are made once.
pytestmark = pytest.mark.xdist_group("multinode")
# Each pair of namespaces is a network of its own: tests running at once never clash.
SUBNET = "10.231.0"
NOBODY = f"{SUBNET}.99"  # on the subnet, but no host has it
_names = itertools.count()


@contextlib.contextmanager
def two_hosts():
    """Two network namespaces, each with `lo` up and one end of a veth pair: yields
    [(namespace, interface, address)] for host 0 and host 1. Afterwards every process
    still inside them is killed (torchrun's workers run in sessions of their own) and
    the namespaces are deleted."""
    tag = f"ddp{os.getpid()}x{next(_names)}"
    hosts = [(f"{tag}h{i}", f"ddp{i}", f"{SUBNET}.{i + 1}") for i in (0, 1)]
    try:
        for namespace, _, _ in hosts:
            ip("netns", "add", namespace)
        (ns0, if0, _), (ns1, if1, _) = hosts
        # Created inside the namespaces, so the interface names never meet.
        veth = ["type", "veth", "peer", "name", if1, "netns", ns1]
        ip("link", "add", if0, "netns", ns0, *veth)
        for namespace, interface, address in hosts:
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            ip("-n", namespace, "link", "set", "lo", "up")
            ip("-n", namespace, "link", "set", interface, "up")
        yield hosts
    finally:
        for namespace, _, _ in hosts:
            kill_namespace(namespace)
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def on_hosts(hosts, args, env_by_node, **kw):
    """Run run_multi.sh on host 0 and host 1 at once, one process each (gloo on CPU)."""
    port = str(free_port())
    commands = []
    for rank, (namespace, _, _) in enumerate(hosts):
        env = {"NNODES": "2", "NODE_RANK": str(rank), "NPROC_PER_NODE": "1"}
        env |= {"MASTER_ADDR": hosts[0][2], "MASTER_PORT": port, **env_by_node[rank]}
        command = ["ip", "netns", "exec", namespace, "./run_multi.sh", *args]
        commands.append((command, env))
    return run_jobs(commands, **kw)


@pytest.fixture(scope="module", params=LAUNCHERS)
def launcher(request):
    return request.param


@pytest.fixture(scope="module")
def project(launcher, tmp_path_factory):
    return bake(tmp_path_factory.mktemp(launcher), nodes="multi", launcher=launcher)


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory):
    """The final weights of the default multi-node project's run on one machine, 2
    processes (the launcher only starts processes: the same for both)."""
    root = tmp_path_factory.mktemp("one_machine")
    project = bake(root, nodes="multi")
    run_warm(project, project / "out", 2, *TINY, "--backend", "gloo")
    return torch.load(project / "out" / "model_final.pt", weights_only=True)


@needs_netns
def test_two_hosts_train_like_one_machine(project, one_machine, tmp_path):
    args = [*TINY, "--backend", "gloo"]
    out = tmp_path / "two_hosts"
    with two_hosts() as hosts:
        results = on_hosts(
            hosts, [*args, "--output-dir", str(out)], [{}, {}], cwd=project
        )
    for (code, output), (_, interface, _) in zip(results, hosts, strict=True):
        assert code == 0, output
        # The interface that reaches host 0's address, chosen by the script.
        chosen = f"GLOO_SOCKET_IFNAME={interface} (reaches {hosts[0][2]})"
        assert chosen in output, output
    assert {"model_final.pt", "metrics.csv"} <= {p.name for p in out.iterdir()}
    assert results[0][1].count("done: weights ") == 1

    final = torch.load(out / "model_final.pt", weights_only=True)
    assert final.keys() == one_machine.keys()
    for key, value in one_machine.items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=1e-6, msg=key)


@needs_netns
def test_preflight_across_two_hosts(project, tmp_path):
    args = ["--preflight", "--backend", "gloo", "--output-dir", str(tmp_path / "o")]
    with two_hosts() as hosts:
        results = on_hosts(hosts, args, [{}, {}], cwd=project)
    for code, output in results:
        assert code == 0, output
    table = results[0][1]
    assert table.count("preflight: 2 ranks, backend gloo, all-reduce ok") == 1, table
    rows = re.findall(r"^\s+(\d)\s+(\S+)\s+(\d)\s+cpu\s+([\d.]+)$", table, re.MULTILINE)
    assert sorted(row[0] for row in rows) == ["0", "1"], table
    assert all(row[2] == "0" for row in rows)  # one process per host
    assert all(float(row[3]) > 0 for row in rows), table
    assert "preflight:" not in results[1][1]  # rank 0 alone prints the table


@needs_netns
def test_wrong_master_addr_fails_within_the_timeout(project, launcher, tmp_path):
    # Host 1 is told an address nobody has. DIST_TIMEOUT=10: both give up after ~10 s.
    args = [*TINY, "--backend", "gloo", "--output-dir", str(tmp_path / "o")]
    env = [{"DIST_TIMEOUT": "10"}, {"DIST_TIMEOUT": "10", "MASTER_ADDR": NOBODY}]
    start = time.monotonic()
    with two_hosts() as hosts:
        results = on_hosts(hosts, args, env, cwd=project, timeout=90)
    seconds = time.monotonic() - start
    (code0, output0), (code1, output1) = results
    assert seconds < 60, (output0, output1)
    assert code1 != 0
    assert f"failed to connect to any network address of ({NOBODY}" in output1, output1
    assert code0 != 0
    assert "1/2 clients joined" in output0, output0  # it waited for host 1 in vain
    if launcher == "spawn":
        assert f"error: rendezvous with {NOBODY}:" in output1, output1


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs `ip` (iproute2)")
def test_own_interface_variable_wins(project):
    # The user's GLOO_SOCKET_IFNAME is kept; the unset NCCL_SOCKET_IFNAME gets the
    # interface that reaches MASTER_ADDR. A busy port stops the script right after.
    with socket.create_server(("", 0)) as busy:
        env = {"NNODES": "2", "NODE_RANK": "0", "NPROC_PER_NODE": "1"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy.getsockname()[1])}
        env |= {"GLOO_SOCKET_IFNAME": "myif0"}
        [(code, output)] = run_jobs([(["./run_multi.sh"], env)], project, timeout=60)
    assert code == 1, output
    line = "network: GLOO_SOCKET_IFNAME=myif0 (yours) NCCL_SOCKET_IFNAME=lo "
    assert line + "(reaches 127.0.0.1)" in output.splitlines(), output


def test_busy_master_port_is_one_line(project):
    with socket.create_server(("", 0)) as busy:  # another job's rendezvous, say
        port = busy.getsockname()[1]
        env = {"NNODES": "2", "NODE_RANK": "0", "NPROC_PER_NODE": "1"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        # stderr alone: the error line must be all of it.
        command = ["bash", "-c", "./run_multi.sh --epochs 1 2>&1 >/dev/null", "-"]
        start = time.monotonic()
        [(code, stderr)] = run_jobs([(command, env)], project, timeout=60)
    assert time.monotonic() - start < 10
    assert code == 1
    assert stderr == (
        f"error: MASTER_PORT {port} is in use on this machine; choose another, "
        f"e.g. MASTER_PORT={port + 1}\n"
    )


def test_without_ip_a_hint_and_it_goes_on(project, tmp_path):
    # A PATH with bash and python3 only. Then a busy port, to stop right after the hint.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "python3"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    with socket.create_server(("", 0)) as busy:
        env = {"PATH": str(bin_dir), "NNODES": "2", "NODE_RANK": "0"}
        env |= {"NPROC_PER_NODE": "1", "MASTER_PORT": str(busy.getsockname()[1])}
        [(code, output)] = run_jobs([(["./run_multi.sh"], env)], project, timeout=60)
    assert code == 1, output
    hint = "network: 'ip' not found; if the job hangs, set GLOO_SOCKET_IFNAME and "
    hint += "NCCL_SOCKET_IFNAME to the interface that reaches 127.0.0.1"
    assert output.splitlines()[0] == hint, output
    assert "error: MASTER_PORT" in output.splitlines()[1], output


def test_an_elastic_job_without_enough_machines_is_one_line(tmp_path):
    """NNODES=2:3 (elastic: torchrun) started on one machine: after DIST_TIMEOUT (5 s)
    no round has formed, and stderr is one line saying so (torch's
    RendezvousTimeoutError says nothing; it used to end in a traceback of ours)."""
    project = bake(tmp_path, nodes="multi")
    env = {"NNODES": "2:3", "NPROC_PER_NODE": "1", "DIST_TIMEOUT": "5"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = ["bash", "-c", "./run_multi.sh --epochs 1 2>&1 >/dev/null", "-"]
    [(code, stderr)] = run_jobs([(command, env)], project, timeout=60)
    assert code == 1
    assert stderr == (
        f"error: no round of the rendezvous at 127.0.0.1:{env['MASTER_PORT']} within "
        "5 s (DIST_TIMEOUT): fewer than 2 machines (NNODES) joined; start the missing "
        "ones, or give a slow one longer with DIST_TIMEOUT\n"
    )
