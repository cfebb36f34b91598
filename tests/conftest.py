import ast
import contextlib
import csv
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
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


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in MANY_SHORT)  # stable: order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU for NCCL (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def bake(output_dir, **context):
    """Generate a project with these answers (names checked against cookiecutter.json,
    since cookiecutter silently ignores unknown keys) and return its folder."""
    unknown = set(context) - set(CONFIG)
    assert not unknown, f"not prompts in cookiecutter.json: {unknown}"
    project = cookiecutter(
        str(TEMPLATE), no_input=True, output_dir=str(output_dir), extra_context=context
    )
    return Path(project)


def free_port():
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def run_jobs(commands, cwd, env=None, timeout=JOB_TIMEOUT):
    """Start every (command, extra_env) at once, like launches on several machines, wait
    for all, and return [(returncode, output)] (returncode a message on timeout, so the
    test fails showing the output). Each runs in its own process group,
    killed whole afterwards (and on timeout), so no worker outlives the test."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    procs = []
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        try:
            for (command, extra), log in zip(commands, logs, strict=True):
                procs.append(
                    subprocess.Popen(
                        command,
                        cwd=cwd,
                        env={**env, **extra},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        text=True,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + timeout
            codes = []
            for proc in procs:
                try:
                    codes.append(proc.wait(timeout=max(0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(f"timed out after {timeout} s")  # output shown below
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
    return list(zip(codes, outputs, strict=True))


# torch 2.13 + gloo, intermittently (about 1 run in 150 here): in a process's exit
# teardown, after the job has done its work (finished and saved, or stopped and saved),
# a rank aborts with this message, or hangs there (it looks like pytorch#56297: a gloo
# thread waiting for the GIL at exit). Such a job, and only such (the message, or a
# timeout after the final weights were saved), is run again once, from its output
# folder as it was before the first try: a resume must not find what that try wrote.
TEARDOWN_ABORT = "terminate called without an active exception"


def failed_in_teardown(code, output):
    if TEARDOWN_ABORT in output:
        return True
    return not isinstance(code, int) and "model_final.pt" in output


def output_dir(command, cwd):
    """The --output-dir a run command names (else the scripts' default, outputs/)."""
    for i, arg in enumerate(command):
        if arg == "--output-dir" and i + 1 < len(command):
            return Path(cwd) / command[i + 1]
        if arg.startswith("--output-dir="):
            return Path(cwd) / arg.partition("=")[2]
    return Path(cwd) / "outputs"


@contextlib.contextmanager
def as_before(folders):
    """Yields restore(), which puts each folder back as it was on entry (or removes
    it, if it did not exist then)."""
    with tempfile.TemporaryDirectory() as saved:
        copies = {}
        for n, folder in enumerate(folders):
            if folder.exists():
                copies[folder] = Path(saved) / str(n)
                shutil.copytree(folder, copies[folder], symlinks=True)

        def restore():
            for folder in folders:
                shutil.rmtree(folder, ignore_errors=True)
                if folder in copies:
                    shutil.copytree(copies[folder], folder, symlinks=True)

        yield restore


def run_jobs_retrying_teardown_abort(commands, cwd, env=None, timeout=JOB_TIMEOUT):
    with as_before(sorted({output_dir(c, cwd) for c, _ in commands})) as restore:
        results = run_jobs(commands, cwd, env, timeout)
        if any(failed_in_teardown(code, output) for code, output in results):
            restore()
            results = run_jobs(commands, cwd, env, timeout)
    return results


def run_job(command, cwd, env=None, timeout=JOB_TIMEOUT):
    return run_jobs_retrying_teardown_abort(
        [(command, env or {})], cwd, timeout=timeout
    )[0]


def run_single(project, out_dir, nproc, *args, env=None, expect=0):
    """./run_single.sh on nproc processes, writing to out_dir, as a user runs it:
    asserts its exit status and returns its output."""
    command = ["./run_single.sh", *args, "--output-dir", str(out_dir)]
    code, output = run_job(
        command, project, {"NPROC_PER_NODE": str(nproc), **(env or {})}
    )
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
UPDATE = "            at.step, at.samples, at.stream = at.step + 1, position, state\n"
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


def replace_user_functions(project, source):
    """Replace, wholesale, each of the five functions a user edits that `source`
    defines, as a user adapting the project would; `source`'s other statements
    (imports, helpers) go before them. Nothing else in the script changes: the five
    must be one block of it."""
    script = project / "main_multi_gpu.py"
    code = script.read_text()
    lines = code.splitlines(keepends=True)
    ours = {
        node.name: node
        for node in ast.parse(code).body
        if isinstance(node, ast.FunctionDef) and node.name in USER_FUNCTIONS
    }
    assert sorted(ours) == sorted(USER_FUNCTIONS)
    first = min(node.lineno for node in ours.values())
    last = max(node.end_lineno for node in ours.values())
    inside = [n for n in ast.parse(code).body if first <= n.lineno <= last]
    assert len(inside) == len(USER_FUNCTIONS), "the five are not one block"

    new = ast.parse(source).body
    theirs = {n.name: n for n in new if isinstance(n, ast.FunctionDef)}
    assert theirs and set(theirs) <= set(USER_FUNCTIONS), sorted(theirs)
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
