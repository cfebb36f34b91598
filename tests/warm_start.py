"""A warm start for the tests' training runs: one interpreter per test worker that has
imported torch once, and forks the ranks of each run from there.

On this kind of machine `import torch` costs about 2.4 CPU-seconds, and a tiny run
of the generated script about 7: the launcher and each of its two workers import
torch, and training itself takes a fraction of a second. Tests whose point is what
training computes (equal weights, exact resumes, metrics) need not pay the imports
again and again; tests of how a job starts, fails and stops (test_run.py,
test_faults.py, test_safety.py, test_launchers.py, test_multinode.py, ...) still launch
the scripts as a user does.

A warm run is what the launcher would start, minus the launcher: a leader process (a
fresh session, as a job) hosts the workers' store on a port the kernel picks
(listening before any worker learns it) and forks one process per rank. For a
torchrun project each gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...) and runs main_multi_gpu.py as __main__; for a spawn
project each imports it as __mp_main__ and calls its worker(), as mp.spawn's
processes do. Output goes to the job's file. The leader's exit status is the first failing rank's, as
run_single.sh's (0, 2, 130, 143, ...); a rank killed by a signal counts as 1.

A job may name libraries to `preload` (the Hugging Face tests': transformers, peft,
datasets): imported here before its ranks fork, once, and kept for the jobs after it.

Run as a program, this file is that interpreter: it reads one job per line (JSON)
on stdin and answers two lines, the leader's pid and, when the job is over, its exit
status."""

import importlib
import json
import os
import signal
import sys
import threading
import traceback
import types
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it
PATHS = set(os.environ.get("PYTHONPATH", "").split(os.pathsep)) - {""}

# What the generated scripts import that costs: once, here.
import torch
import torch._dynamo  # imported by the first DDP() (about a second a rank)
import torch.distributed as dist
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.distributed.run
import torch.utils.data  # noqa: F401


def worker(job, rank, port):
    """One rank, as its launcher would start it; it exits. torchrun's worker: its
    environment, then the script as __main__. mp.spawn's: the script imported as
    __mp_main__ (its __main__ block not run), then its worker(rank, args, port)."""
    nproc = job["nproc"]
    os.environ.clear()
    os.environ.update(job["env"], TORCHELASTIC_USE_AGENT_STORE="True")  # the leader's
    torchrun = job["launcher"] == "torchrun"
    if torchrun:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID="warm",
            OMP_NUM_THREADS=job["env"].get("OMP_NUM_THREADS", "1"),
        )
        sys.argv = [job["script"], *job["args"]]
    else:
        sys.argv = [job["script"], f"--nproc-per-node={nproc}", *job["args"]]
    # The job's PYTHONPATH may leave out some of this interpreter's: out of sys.path.
    dropped = PATHS - set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    sys.path[:] = [path for path in sys.path if path not in dropped]
    module = types.ModuleType("__main__" if torchrun else "__mp_main__")
    module.__file__ = job["script"]
    sys.modules["__main__"] = sys.modules[module.__name__] = module
    code = 1
    try:
        source = Path(job["script"]).read_text()
        exec(compile(source, job["script"], "exec"), module.__dict__)  # noqa: S102
        if not torchrun:
            module.worker(rank, module.parse_args(), port)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - shown as a worker would show it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def lead(job):
    """The job: the ranks, their store, and the exit status of the first that failed."""
    os.setsid()
    os.chdir(job["cwd"])
    out = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    pids, pipes = [], []
    for rank in range(job["nproc"]):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write)
            worker(job, rank, int(os.read(read, 16)))
        os.close(read)
        pids.append(pid)
        pipes.append(write)
    # As torchrun: a signal to the job's group is for the ranks; the leader waits.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    store = dist.TCPStore("127.0.0.1", 0, job["nproc"], True, wait_for_workers=False)
    for write in pipes:
        os.write(write, str(store.port).encode())
        os.close(write)
    codes = []
    for pid in pids:
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        codes.append(1 if status < 0 else status)
    os._exit(next((code for code in codes if code), 0))


def main():
    assert threading.active_count() == 1, "a fork needs a process without threads"
    for line in sys.stdin:
        job = json.loads(line)
        for name in job.get("preload", ()):  # a library the job's edit zone imports
            importlib.import_module(name)
        assert threading.active_count() == 1, f"{job['preload']} started a thread"
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            lead(job)
        print(json.dumps({"pid": pid}), flush=True)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(json.dumps({"code": status}), flush=True)


if __name__ == "__main__":
    main()
