"""A real one-node Slurm cluster for the tests, in a temporary folder.

munged, slurmctld and slurmd run as the test's own children, in the foreground, with a
configuration that needs no cgroups, no accounting database and no system service:
Debian's `slurm-wlm` and `munge` packages, installed, and root are all it takes. The
cluster is private (its own munge key and socket, free ports, its own state folders), so
test workers may each run one at the same time. On the way out every job is cancelled
and every process started for the cluster, jobs' processes included, is killed.
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo", "srun")
# Debian puts the daemons in /usr/sbin, which is not on every user's PATH.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
# Every process of the cluster carries this variable (jobs inherit it from sbatch), so
# stop() finds them all, wherever they were reparented.
MARKER = "DDP_TEMPLATE_TEST_SLURM"
CLIENT_TIMEOUT = 30
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OOM")

CONFIG = """\
ClusterName=ddptest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again
# (cred_expire + 1 s; the default is 120 s).
AuthInfo=socket={root}/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
# No cgroups: processes are tracked through /proc, tasks are not bound to CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Start eligible jobs (a requeued one, say) within a second, not at the next minute.
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
# Finished jobs stay visible to `scontrol show job` (there is no accounting database).
MinJobAge=3600
JobRequeue=1
KillWait=5
InactiveLimit=0
# The node is described, not probed: the same on any machine.
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def unavailable():
    """Why no cluster can run here, or None."""
    missing = [
        name for name in DAEMONS + CLIENTS if not shutil.which(name, path=SEARCH_PATH)
    ]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} not found); "
            "apt-get install slurm-wlm munge (.ci/run does)"
        )
    if os.geteuid() != 0:
        return "a private Slurm cluster's slurmd must run as root"
    return None


def _free_port():
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class Cluster:
    """One node named after this host, with `cpus` CPUs and no GPUs."""

    def __init__(self, root, cpus=2):
        self.root = Path(root)
        self.cpus = cpus
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {
            **os.environ,
            "PATH": SEARCH_PATH,
            "SLURM_CONF": str(self.conf),
            MARKER: str(self.root),
        }
        self.daemons = []

    # Set-up and tear-down.

    def start(self):
        try:  # jobs on several nodes find the first one by its name
            socket.gethostbyname(self.host)
        except OSError as error:
            raise RuntimeError(f"this host's name {self.host!r}: {error}") from error
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for folder in ("state", "spool"):
            (self.root / folder).mkdir(mode=0o700, exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(
            CONFIG.format(
                host=self.host,
                root=self.root,
                cpus=self.cpus,
                ctld_port=_free_port(),
                slurmd_port=_free_port(),
            )
        )
        socket_path = self.root / "munge.socket"
        self._daemon(
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={socket_path}",
            f"--pid-file={self.root / 'munged.pid'}",
            f"--seed-file={self.root / 'munged.seed'}",
        )
        self._until(socket_path.exists, "munged to open its socket")
        self._daemon("slurmctld", "-D", "-f", str(self.conf))
        self._until(
            lambda: self.client("scontrol", "ping", check=False).returncode == 0,
            "slurmctld to answer",
        )
        self._daemon("slurmd", "-D", "-f", str(self.conf), "-N", self.host)
        self._until(
            lambda: self.client("sinfo", "-h", "-o", "%t").stdout.strip() == "idle",
            "the node to be idle",
        )

    def stop(self):
        with contextlib.suppress(Exception):
            self.cancel_all(timeout=10)
        self._kill_marked()
        for process in reversed(self.daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(self.daemons):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._kill_marked()

    def _daemon(self, name, *args):
        # The child keeps its own copy of the log's file descriptor.
        with open(self.root / f"{name}.log", "w") as log:
            self.daemons.append(
                subprocess.Popen(
                    [shutil.which(name, path=SEARCH_PATH), *args],
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )

    def _until(self, ready, what, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.SubprocessError):
                if ready():
                    return
            for process in self.daemons:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} exited\n{self.logs()}")
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}\n{self.logs()}")

    def _kill_marked(self):
        """SIGKILL every process that carries this cluster's marker (daemons' children,
        slurmstepd, job scripts and their workers), except this one."""
        marker = f"{MARKER}={self.root}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)

    def logs(self):
        """The daemons' logs, for a failure message."""
        parts = []
        for name in DAEMONS:
            path = self.root / f"{name}.log"
            if path.exists():
                parts.append(f"--- {name}.log\n{path.read_text()[-3000:]}")
        return "\n".join(parts)

    # Using it.

    def client(self, *command, check=True):
        result = subprocess.run(
            list(command),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{command} failed: {result.stdout}{result.stderr}")
        return result

    def cancel_all(self, timeout=30):
        """Cancel every job still queued or running, and wait until they are gone."""
        jobs = self.client("squeue", "-h", "-o", "%i").stdout.split()
        if not jobs:
            return
        self.client("scancel", "--full", "--signal=KILL", *jobs, check=False)
        self.client("scancel", *jobs, check=False)
        self._until(
            lambda: not self.client("squeue", "-h", "-o", "%i").stdout.split(),
            "cancelled jobs to end",
            timeout,
        )

    def submit(self, script, *args, options=(), env=None, cwd=None):
        """sbatch [options] script [args] with extra environment; returns the job id."""
        result = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT,
        )
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stdout}{result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id):
        """`scontrol show job` as a dict: JobState, ExitCode, Restarts, StdOut, ..."""
        text = self.client("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id, until=None, timeout=180, interval=0.5):
        """Poll the job until until(job) is true (default: a final state); return it."""
        until = until or (lambda job: job["JobState"] in FINAL_STATES)
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} after {timeout} s: {job}")
            time.sleep(interval)


@contextlib.contextmanager
def running(root, cpus=2):
    """A started cluster, stopped (every process of it killed) on the way out."""
    cluster = Cluster(root, cpus)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
