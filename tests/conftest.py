import ast
import contextlib
import csv
import importlib.util
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import jinja2
import pytest
import torch
from cookiecutter import generate
from cookiecutter.main import cookiecutter

from combinations import CONFIG, TEMPLATE

# Tiny runs: 2 epochs of a few steps each. 37 validation samples: not divisible by the
# world size, so the shards differ in length.
TINY = ["--epochs", "2", "--batch-size", "8", "--train-size", "64", "--val-size", "37"]
TINY += ["--num-workers", "0"]
JOB_TIMEOUT = 120


# Files of many short cases (about ten seconds each), run after the rest: the few tests of tens
# of seconds then start early, and two workers run out of work at about the same time.
MANY_SHORT = ("test_run.py", "test_generation.py", "test_hooks.py", "test_docs.py")
# Files whose tests run on one worker, one after another, for minutes (xdist_group):
# first, so that none is left running alone at the end.
LONG_GROUPS = ("test_slurm.py", "test_elastic_hosts.py", "test_faults.py")


def pytest_collection_modifyitems(config, items):
    def order(item):  # sort is stable: the order within each kind is kept
        return item.path.name in MANY_SHORT, item.path.name not in LONG_GROUPS

    items.sort(key=order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU for NCCL (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class CompiledOnce(jinja2.BytecodeCache):
    """Jinja's compiled templates, kept by this test worker: a bake compiled the same
    sources again each time (0.3 of its 0.4 CPU-seconds). Keyed by name, checked
    against the source."""

    def __init__(self):
        self.codes = {}

    def load_bytecode(self, bucket):
        if bucket.key in self.codes:
            bucket.bytecode_from_string(self.codes[bucket.key])

    def dump_bytecode(self, bucket):
        self.codes[bucket.key] = bucket.bytecode_to_string()


COMPILED = CompiledOnce()
MAKE_ENVIRONMENT = generate.create_env_with_context


def _environment(context):
    environment = MAKE_ENVIRONMENT(context)
    environment.bytecode_cache = COMPILED
    return environment


# What cookiecutter (so bake()) calls for each generation.
generate.create_env_with_context = _environment


def bake(output_dir, **context):
    """Generate a project with these answers (names checked against cookiecutter.json,
    since cookiecutter silently ignores unknown keys) and return its folder."""
    unknown = set(context) - set(CONFIG)
    assert not unknown, f"not prompts in cookiecutter.json: {unknown}"
    project = cookiecutter(
        str(TEMPLATE), no_input=True, output_dir=str(output_dir), extra_context=context
    )
    return Path(project)


# Network namespaces, as hosts of their own (test_multinode.py, test_elastic_hosts.py).
if os.geteuid() != 0:
    WHY_NO_NETNS = "needs root to create network namespaces (CI runs as root)"
elif shutil.which("ip") is None:
    WHY_NO_NETNS = "needs `ip` to create network namespaces: apt-get install iproute2"
else:
    WHY_NO_NETNS = ""
needs_netns = pytest.mark.skipif(bool(WHY_NO_NETNS), reason=WHY_NO_NETNS)


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def kill_namespace(namespace):
    """Kill every process in a network namespace at once, as a machine that dies
    (torchrun's workers run in sessions of their own: a process group would miss them)."""
    pids = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True
    ).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def free_port():
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


# Every job's processes carry a mark of their own in their environment, which their
# children inherit: torchrun starts each worker in a session of its own, so killing the
# launcher's process group leaves them running, and its end leaves them orphans.
JOB_MARK = "TEST_JOB_MARK"


def new_mark():
    """The environment variable that marks one job's processes."""
    return {JOB_MARK: uuid.uuid4().hex}


def live_processes():
    """(pid, its /proc folder, the fields of its stat after the name) for every live
    process, zombies excluded."""
    for process in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            fields = (process / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                yield int(process.name), process, fields


def live_members(group):
    """Processes of a process group that are still running."""
    return [pid for pid, _, fields in live_processes() if int(fields[2]) == group]


def marked(mark):
    """The live processes whose environment carries `mark`."""
    [(name, value)] = mark.items()
    needle = f"{name}={value}".encode()
    pids = []
    for pid, process, _ in live_processes():
        with contextlib.suppress(OSError):
            if needle in (process / "environ").read_bytes().split(b"\0"):
                pids.append(pid)
    return pids


def kill_marked(mark):
    for pid in marked(mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def started(commands, cwd, env=None):
    """Start every (command, extra_env) at once, like launches on several machines, each
    in a process group of its own with its output in a temporary file; yield the jobs'
    mark and their Popen objects. On leaving, every group is killed whole, with every
    process that carries the mark (torchrun's workers, in sessions of their own), so no
    worker outlives the test; then each Popen's `output` is what that job printed."""
    mark = new_mark()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), **mark}
    procs = []
    with contextlib.ExitStack() as stack:
        try:
            for command, extra in commands:
                log = stack.enter_context(tempfile.TemporaryFile("w+"))
                proc = subprocess.Popen(
                    command,
                    cwd=cwd,
                    env={**env, **extra},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
                proc.log = log
                procs.append(proc)
            yield mark, procs
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            kill_marked(mark)
            for proc in procs:
                proc.log.seek(0)
                proc.output = proc.log.read()


def run_jobs(commands, cwd, env=None, timeout=JOB_TIMEOUT):
    """Run every (command, extra_env) at once (see started), wait for all, and return
    [(returncode, output)] (returncode a message on timeout, so the test fails showing
    the output)."""
    with started(commands, cwd, env) as (_, procs):
        deadline = time.monotonic() + timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(f"timed out after {timeout} s")  # output shown below
    return [(code, proc.output) for code, proc in zip(codes, procs, strict=True)]


def error_lines(output):
    """The lines of a job's output that speak of an error (any case)."""
    return [line for line in output.splitlines() if "error" in line.lower()]


def run_job(command, cwd, env=None, timeout=JOB_TIMEOUT):
    return run_jobs([(command, env or {})], cwd, timeout=timeout)[0]


def run_single(project, out_dir, nproc, *args, env=None, expect=0):
    """./run_single.sh on nproc processes, writing to out_dir, as a user runs it:
    asserts its exit status and returns its output."""
    command = ["./run_single.sh", *args, "--output-dir", str(out_dir)]
    code, output = run_job(
        command, project, {"NPROC_PER_NODE": str(nproc), **(env or {})}
    )
    assert code == expect, output
    return output


WARM = {}  # this test worker's warm_start.py interpreters, by python, once started


def run_warm(
    project, out_dir, nproc, *args, env=None, expect=0, preload=(), python=None
):
    """What run_single() does, for the tests of what training computes, without the
    imports of a fresh launch: the ranks run main_multi_gpu.py forked from an
    interpreter that imported torch once (warm_start.py; `python`'s, this one's by
    default), as their launcher (torchrun or mp.spawn) would start them."""
    # A path of the test's own (a sitecustomize, a module made to fail): a fresh
    # launch. Fewer paths: the ranks leave them out of sys.path.
    ours = os.environ.get("PYTHONPATH", "")
    paths = (env or {}).get("PYTHONPATH", ours).split(os.pathsep)
    if not set(paths) - {""} <= set(ours.split(os.pathsep)):
        if python:  # (run_single.sh's python3: the first on PATH)
            env = {**(env or {}), "PATH": f"{Path(python).parent}{os.pathsep}"}
            env["PATH"] += os.environ["PATH"]
        return run_single(project, out_dir, nproc, *args, env=env, expect=expect)
    python = str(python or sys.executable)
    if python not in WARM or WARM[python].poll() is not None:
        WARM[python] = subprocess.Popen(
            [python, str(TEMPLATE / "tests" / "warm_start.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    warm = WARM[python]
    script = (project / "run_single.sh").read_text()
    with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        job = {
            "cwd": str(project),
            "script": str(project / "main_multi_gpu.py"),
            "args": [*args, "--output-dir", str(out_dir)],
            "nproc": nproc,
            "launcher": "torchrun" if "--torchrun" in script else "spawn",
            "env": {**os.environ, **(env or {})},
            "output": log.name,
            "preload": list(preload),  # see warm_start.py
        }
        warm.stdin.write(json.dumps(job) + "\n")
        warm.stdin.flush()
        leader = json.loads(warm.stdout.readline())["pid"]
        if not select.select([warm.stdout], [], [], JOB_TIMEOUT)[0]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader, signal.SIGKILL)
        code = json.loads(warm.stdout.readline())["code"]
        output = log.read()
    assert code == expect, output
    return output


def metrics(out_dir):
    """The rows of a run's metrics.csv, as dicts of strings."""
    with (out_dir / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def load_module(project):
    """Import the generated main_multi_gpu.py, as a user's evaluation script would."""
    spec = importlib.util.spec_from_file_location(
        f"generated_{project.name}", project / "main_multi_gpu.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PYTHON = sys.executable


def edit(project, old, new):
    """Edit the generated script at a place that must occur exactly once, as a user
    editing the marked functions would."""
    script = project / "main_multi_gpu.py"
    code = script.read_text()
    assert code.count(old) == 1, f"{old!r} occurs {code.count(old)} times"
    script.write_text(code.replace(old, new))


def without_batchnorm(project):
    """The example model with its two BatchNorm layers replaced by nn.Identity."""
    for channels in (32, 64):
        edit(project, f"nn.BatchNorm2d({channels}),", "nn.Identity(),")


# The line of the training loop that records each optimizer update; code added after
# it runs after every update, with `here` in scope: "rank:epoch:step" (0-based, step
# the micro-batch of this process within the pass).
UPDATE = (
    "            at.step, at.epoch_samples, at.stream = at.step + 1, position, state\n"
)
HERE = f"""{UPDATE}            per_step = dist.get_world_size() * args.batch_size
            step = -(-position // per_step) - 1
            here = f"{{dist.get_rank()}}:{{at.epoch}}:{{step}}"
"""

# After every optimizer update: when TEST_ACT_AT is "rank:epoch:step", run the action
# in TEST_ACTION (os.kill(...)); never in a torchrun restart.
ACT_AFTER_STEP = f"""{HERE}            if os.environ.get("TEST_ACT_AT") == here and not int(
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            ):
                exec(os.environ["TEST_ACTION"])
"""


def act_after_step(project):
    edit(project, UPDATE, ACT_AFTER_STEP)


def default_model(project):
    """The generated build_model() with the default arguments, as a user loads it."""
    module = load_module(project)
    return module.build_model(module.parse_args([]))


def load_weights(path):
    return torch.load(path, weights_only=True, map_location="cpu")


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


USER_FUNCTIONS = (
    "build_datasets",
    "build_model",
    "build_optimizer",
    "compute_loss",
    "compute_metrics",
)


def nan_loss_on_rank_1(call):
    """compute_loss for replace_user_functions: the default loss, except that rank 1's
    call number `call` (from 1) returns NaN."""
    return f"""
CALLS = []


def compute_loss(model, batch):
    images, labels = batch
    loss = F.cross_entropy(model(images), labels)
    CALLS.append(1)
    if dist.get_rank() == 1 and len(CALLS) == {call}:
        loss = loss * float("nan")
    return loss, len(labels)
"""


# The edit zone's functions: the five, and add_arguments() for flags of the project's.
EDITABLE = (*USER_FUNCTIONS, "add_arguments")


def replace_user_functions(project, source):
    """Replace, wholesale, each of the edit zone's functions (the five a user edits,
    add_arguments) that `source` defines, as a user adapting the project would;
    `source`'s other statements (imports, settings, helper classes and functions) go
    before them. Nothing else in the script changes: they must be one block of it."""
    script = project / "main_multi_gpu.py"
    code = script.read_text()
    lines = code.splitlines(keepends=True)
    ours = {
        node.name: node
        for node in ast.parse(code).body
        if isinstance(node, ast.FunctionDef) and node.name in EDITABLE
    }
    assert sorted(ours) == sorted(EDITABLE)
    first = min(node.lineno for node in ours.values())
    last = max(node.end_lineno for node in ours.values())
    inside = [n for n in ast.parse(code).body if first <= n.lineno <= last]
    assert len(inside) == len(EDITABLE), "the edit zone's functions are not one block"

    new = ast.parse(source).body
    # The edit zone's among its functions; the others are helpers of theirs.
    theirs = {n.name: n for n in new if getattr(n, "name", 0) in EDITABLE}
    assert theirs, [getattr(n, "name", "") for n in new]
    source_lines = source.splitlines(keepends=True)

    def text(node, lines):
        return "".join(lines[node.lineno - 1 : node.end_lineno]) + "\n\n"

    helpers = [
        text(n, source_lines) for n in new if getattr(n, "name", 0) not in theirs
    ]
    block = [
        text(theirs[name], source_lines) if name in theirs else text(node, lines)
        for name, node in sorted(ours.items(), key=lambda item: item[1].lineno)
    ]
    script.write_text("".join([*lines[: first - 1], *helpers, *block, *lines[last:]]))


def pytest_xdist_auto_num_workers(config):
    """-n auto: one test worker more than there are cores. A test spends part of its
    time waiting (for a timeout, a Slurm scheduler, a process that sleeps), and the
    extra worker's runs use the cores meanwhile."""
    return (os.cpu_count() or 1) + 1
