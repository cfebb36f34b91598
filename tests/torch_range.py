"""The torch range check: every variant of the template, on every supported torch.

    python tests/torch_range.py                  # every release in VERSIONS
    python tests/torch_range.py 2.4.1 2.15.0     # these
    python tests/torch_range.py --floor          # the floors alone (what CI runs)

For each torch release, a virtual environment of its own (made once, then reused, in
$TORCH_RANGE_VENVS, else ~/.cache/ddp-template: the registry's builds, several GB
each) runs the generated projects, while this script (the suite's environment) bakes
them and reads their results. For each launcher x nodes x parallelism it bakes a
project and, on 2 CPU processes (gloo):

- trains a short run to its end (the straight run);
- trains it again, sends SIGTERM to the launcher during the second epoch: exit 143,
  one "preempted: saved" line; then the same command resumes and finishes, and the
  final weights equal the straight run's (torchrun with several machines: the
  straight run with NNODES=1, the stopped one and its resume with NNODES=1:2, the
  elastic rendezvous);
- with parallelism=fsdp2 on a torch that cannot train FSDP2: one line naming the
  release it needs, exit 2.

And on the default project (torchrun; spawn where marked): a second Ctrl-C stops at
once (130, both launchers); SIGHUP saves and stops (129); SIGQUIT stops at once
(131); a rank stuck in compute_loss is named by the hang report (exit 1);
--deterministic trains to the same weights; a checkpoint of 2 processes resumes on
one, keeping the global batch, to the weights of a run never stopped (no BatchNorm).

It prints one table (a row per release) and exits 1 if any cell failed. Run it before
landing any change to launching, signals or checkpoints. --markdown FILE also writes
the table there; --keep DIR keeps the projects and outputs.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# The suite's helpers, from this folder.
from conftest import (
    act_after_step,
    bake,
    free_port,
    live_members,
    load_weights,
    marked,
    max_difference,
    started,
    without_batchnorm,
)

# Every release from the floor to the newest the registry had when this was written.
VERSIONS = [
    "2.4.1",
    "2.5.1",
    "2.6.0",
    "2.7.1",
    "2.8.0",
    "2.9.1",
    "2.10.0",
    "2.11.0",
    "2.12.1",
    "2.13.0",
    "2.14.1",
    "2.15.0",
]
# The oldest release each parallelism supports: --floor checks these alone.
FLOORS = {"ddp": "2.4.1", "fsdp2": "2.7.1"}
VARIANTS = [
    (launcher, nodes, parallelism)
    for parallelism in ("ddp", "fsdp2")
    for launcher in ("torchrun", "spawn")
    for nodes in ("single", "multi")
]
# The cell of a variant its release is too old for, refused as it should be.
REFUSED = "refused in one line"
# 2 processes x batch 8, 256 samples: 16 updates an epoch, checks every 20 updates.
ARGS = ["--epochs", "3", "--batch-size", "8", "--train-size", "256"]
ARGS += ["--val-size", "37", "--num-workers", "0"]
STOP_AT = "0:1:2"  # rank 0, in epoch 2 (from 0: 1), after its third step (update 19)
TIMEOUT = 180  # seconds a job may take, start-up of a cold torch included
WARNINGS = set()  # the warning lines the jobs of a release printed


def venv(version, root):
    """The virtual environment of this torch release: made once (torch and NumPy,
    as the generated requirements.txt asks), then reused."""
    path = root / f"torch-{version}"
    python = path / "bin" / "python"
    check = [
        str(python),
        "-c",
        f"import torch; assert torch.__version__.startswith('{version}')",
    ]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return path
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    # A pip configuration may cap torch (a constraints file) below the release asked
    # for: this environment asks the registry alone.
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    install = [str(python), "-m", "pip", "install", "-q", "--no-cache-dir"]
    install += [f"torch=={version}", "numpy"]
    print(f"torch {version}: installing into {path}", flush=True)
    subprocess.run(install, check=True, env=env)
    return path


class Job:
    """One launch of a project with a torch release's environment: the exit status,
    the output and the seconds it took; a check of it adds to `problems`."""

    def __init__(self, project, env_path, command, env, timeout=TIMEOUT, then=None):
        env = {
            "PATH": f"{env_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "VIRTUAL_ENV": str(env_path),
            "NPROC_PER_NODE": "2",
            **env,
        }
        with started([(command, env)], project) as (mark, [proc]):
            start = time.monotonic()
            if then:
                then(proc)
            try:
                self.code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.code = f"still running after {timeout} s"
            self.seconds = time.monotonic() - start
            deadline = time.monotonic() + 5
            while self.left(proc, mark) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.leftover = self.left(proc, mark)
        self.output = proc.output
        WARNINGS.update(
            re.sub(r"\d+", "N", line.strip())  # one line for every rank, port, time
            for line in self.output.splitlines()
            if re.search(r"warning", line, re.IGNORECASE)
        )

    @staticmethod
    def left(proc, mark):
        return sorted(set(live_members(proc.pid)) | set(marked(mark)))

    def failed(self, code, *lines, seconds=None):
        """Why this job is not what it should be (exit `code`, each of `lines` once,
        no traceback, nothing left running, within `seconds`), or ""."""
        if self.code != code:
            return f"exit {self.code}, not {code}: {last_lines(self.output)}"
        for line in lines:
            if len(re.findall(line, self.output, re.MULTILINE)) != 1:
                return f"not once: {line!r}: {last_lines(self.output)}"
        if "Traceback" in self.output:
            return f"a traceback: {last_lines(self.output)}"
        if self.leftover:
            return f"processes left running: {self.leftover}"
        if seconds and self.seconds > seconds:
            return f"took {self.seconds:.0f} s, more than {seconds}"
        return ""


def release(version):
    """A release's number, to compare: (2, 4, 1)."""
    return tuple(map(int, version.split(".")))


def last_lines(output, n=3):
    lines = [line for line in output.splitlines() if line.strip()]
    return " | ".join(lines[-n:])


def script(nodes):
    return "./run_multi.sh" if nodes == "multi" else "./run_single.sh"


def variant_cell(project, env_path, variant, below_floor, out):
    """A variant: its straight run, SIGTERM -> 143, and the same command to its end;
    on a release below the floor of its parallelism, one line that refuses it."""
    launcher, nodes, parallelism = variant
    command = [script(nodes), *ARGS]
    plain = {"NNODES": "1"} if nodes == "multi" else {}
    straight = Job(
        project,
        env_path,
        [*command, "--output-dir", str(out / "a")],
        {**plain, "MASTER_PORT": str(free_port())},
    )
    if below_floor:
        floor = FLOORS[parallelism].rsplit(".", 1)[0]
        line = f"^error: parallelism={parallelism} needs torch {floor} or newer, not "
        return straight.failed(2, line) or REFUSED
    if why := straight.failed(0, "^done: weights"):
        return f"straight run: {why}"
    # torchrun on several machines: the elastic rendezvous (one machine of 1 to 2).
    elastic = {"NNODES": "1:2"} if (launcher, nodes) == ("torchrun", "multi") else plain
    stop = {
        "TEST_ACT_AT": STOP_AT,
        "TEST_ACTION": "os.kill(os.getppid(), signal.SIGTERM)",
    }
    command += ["--output-dir", str(out / "b")]
    job = Job(
        project, env_path, command, {**elastic, **stop, "MASTER_PORT": str(free_port())}
    )
    # FSDP2's checkpoints are folders (torch.distributed.checkpoint), without .pt
    name = "checkpoint_last" + (".pt" if parallelism == "ddp" else "")
    last = re.escape(str(out / "b" / name))
    if why := job.failed(143, f"^preempted: saved {last} in epoch 2 after 4 batches"):
        return f"SIGTERM: {why}"
    job = Job(project, env_path, command, {**elastic, "MASTER_PORT": str(free_port())})
    if why := job.failed(
        0, f"^resumed from {last} in epoch 2 after 4 batches", "^done: weights"
    ):
        return f"resume: {why}"
    return same_weights(out / "a", out / "b")


def same_weights(a, b, tolerance=1e-5):
    difference = max_difference(
        load_weights(a / "model_final.pt"), load_weights(b / "model_final.pt")
    )
    if difference > tolerance:
        return f"final weights differ by {difference:.3g} (more than {tolerance})"
    return "ok"


def extra_cells(projects, env_path, out):
    """The behaviours checked on the default project (and on spawn's, where marked)."""
    cells = {}
    default, spawn, plain = projects["torchrun"], projects["spawn"], projects["plain"]

    def run(project, name, args=(), env=None, **kwargs):
        command = ["./run_single.sh", *ARGS, *args, "--output-dir", str(out / name)]
        return Job(project, env_path, command, env or {}, **kwargs)

    def signalled(project, name, action):
        return run(project, name, env={"TEST_ACT_AT": STOP_AT, "TEST_ACTION": action})

    twice = "os.kill(os.getppid(), signal.SIGINT); time.sleep(0.3); "
    twice = twice + twice + "time.sleep(60)"
    aborted = "^aborted: a second Ctrl-C stopped the workers at once$"
    whys = [
        f"{name}: {why}"
        for name, project in (("torchrun", default), ("spawn", spawn))
        if (
            why := signalled(project, f"int-{name}", twice).failed(
                130, aborted, seconds=50
            )
        )
    ]
    cells["2nd Ctrl-C"] = "; ".join(whys) or "ok"

    job = signalled(default, "hup", "os.kill(os.getppid(), signal.SIGHUP)")
    last = re.escape(str(out / "hup" / "checkpoint_last.pt"))
    cells["SIGHUP"] = (
        job.failed(129, f"^hung up: saved {last} in epoch 2 after 4") or "ok"
    )

    job = signalled(
        default, "quit", "os.kill(os.getppid(), signal.SIGQUIT); time.sleep(60)"
    )
    quit_line = "^aborted: SIGQUIT stopped the workers at once$"
    cells["SIGQUIT"] = job.failed(131, quit_line, seconds=50) or "ok"

    stuck = {"TEST_ACT_AT": "1:0:1", "TEST_ACTION": "time.sleep(1000)"}
    job = run(default, "hang", ["--dist-timeout", "10"], stuck)
    lines = [r"^hang: no progress for 10 s \(--dist-timeout\); where each rank stood:$"]
    lines += [
        r"^  rank 1: train_pass, line \d+: exec\(os\.environ\[\"TEST_ACTION\"\]\)"
    ]
    cells["hang"] = job.failed(1, *lines, seconds=90) or "ok"

    job = run(default, "deterministic", ["--deterministic"])
    cells["deterministic"] = job.failed(0, "^done: weights") or same_weights(
        out / "deterministic", out / "torchrun-single-ddp" / "a", tolerance=0
    )

    # 2 processes stopped by SIGTERM, resumed on 1: the global batch kept (grad-accum
    # 2), the weights of a run never stopped (without BatchNorm, they match).
    whole = run(plain, "whole")
    stop = {
        "TEST_ACT_AT": STOP_AT,
        "TEST_ACTION": "os.kill(os.getppid(), signal.SIGTERM)",
    }
    first = run(plain, "resized", env=stop)
    then = run(plain, "resized", env={"NPROC_PER_NODE": "1"})
    kept = r"^resume: global batch 16 kept: 1 process x batch 8 x grad-accum 2"
    cells["2 -> 1"] = (
        whole.failed(0, "^done: weights")
        or first.failed(143, "^preempted: saved")
        or then.failed(0, kept, "^done: weights")
        or same_weights(out / "whole", out / "resized")
    )
    return cells


def check_release(version, projects, root, keep, parallelisms=("ddp", "fsdp2")):
    """One release's row, {column: "ok", or what went wrong}, and the warning lines
    its jobs printed."""
    env_path = venv(version, root)
    WARNINGS.clear()
    out = Path(tempfile.mkdtemp(prefix=f"torch-{version}-", dir=keep))
    row = {}
    for variant in VARIANTS:
        if variant[2] in parallelisms:
            name, began = "-".join(variant), time.monotonic()
            parallelism = variant[2]
            below_floor = release(version) < release(FLOORS[parallelism])
            row[name] = variant_cell(
                projects[name], env_path, variant, below_floor, out / name
            )
            seconds = time.monotonic() - began
            print(f"torch {version} {name}: {row[name]} ({seconds:.0f} s)", flush=True)
    if "ddp" in parallelisms:
        for column, cell in extra_cells(projects, env_path, out).items():
            row[column] = cell
            print(f"torch {version} {column}: {cell}", flush=True)
    if keep is None:
        shutil.rmtree(out, ignore_errors=True)
    return row, sorted(WARNINGS)


def make_projects(root):
    """Every variant's project, and the default project's, for the checks above."""
    projects = {}
    for launcher, nodes, parallelism in VARIANTS:
        answers = {"launcher": launcher, "nodes": nodes, "parallelism": parallelism}
        folder = root / f"{launcher}-{nodes}-{parallelism}"
        projects[folder.name] = project = bake(folder, **answers)
        act_after_step(project)
    projects["torchrun"] = projects["torchrun-single-ddp"]
    projects["spawn"] = projects["spawn-single-ddp"]
    projects["plain"] = plain = bake(root / "plain")
    act_after_step(plain)
    without_batchnorm(plain)
    return projects


def report(results):
    """One Markdown table, a row per release and a column per variant and behaviour,
    then the warnings each release printed."""
    rows = {version: row for version, (row, _) in results.items()}
    columns = list(dict.fromkeys(column for row in rows.values() for column in row))
    lines = ["| torch | " + " | ".join(columns) + " |"]
    lines.append("|---" * (len(columns) + 1) + "|")
    for version, row in rows.items():
        cells = [row.get(column, "") for column in columns]
        lines.append(f"| {version} | " + " | ".join(cells) + " |")
    for version, (_, warnings) in results.items():
        lines += ["", f"torch {version}: {len(warnings)} kinds of warning line"]
        lines += [f"    {line}" for line in warnings]
    return "\n".join(lines)


# The README's names of the columns, and of the cells.
HEADS = {
    "torchrun-single-ddp": "DDP: torchrun",
    "torchrun-multi-ddp": "torchrun, machines (elastic)",
    "spawn-single-ddp": "spawn",
    "spawn-multi-ddp": "spawn, machines",
    "torchrun-single-fsdp2": "FSDP2: torchrun",
    "torchrun-multi-fsdp2": "torchrun, machines (elastic)",
    "spawn-single-fsdp2": "spawn",
    "spawn-multi-fsdp2": "spawn, machines",
    "2nd Ctrl-C": "2nd Ctrl-C",
    "SIGHUP": "SIGHUP",
    "SIGQUIT": "SIGQUIT",
    "hang": "hang report",
    "deterministic": "`--deterministic`",
    "2 -> 1": "2 -> 1 processes",
}
README = Path(__file__).resolve().parent.parent / "README.md"
INCLUDED = README.parent / "templates" / "README" / "torch_range.md"
MARKS = ("<!-- torch-range:start -->\n", "<!-- torch-range:end -->\n")


def write_tables(results):
    """The table both READMEs show (the generated one includes INCLUDED; the
    repository's holds a copy between MARKS): every release checked, every
    cell "ok" as a tick, a variant refused as it should be as "needs 2.7"."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = ["| torch | " + " | ".join(HEADS.values()) + " |"]
    lines.append("|---" * (len(HEADS) + 1) + "|")
    for version, (row, _) in results.items():
        cells = []
        for column in HEADS:
            cell = row.get(column, "")
            if cell == REFUSED:
                floor = FLOORS[column.rsplit("-", 1)[1]].rsplit(".", 1)[0]
                cell = f"refused: needs {floor}"
            cells.append("✓" if cell == "ok" else cell or "not run")
        lines.append(f"| {version} | " + " | ".join(cells) + " |")
    when = time.strftime("%Y-%m-%d")
    text = "\n".join(lines) + (
        f"\n\nFrom `tests/torch_range.py` on {when}, template commit {commit}: each"
        " release in a virtual environment of its own (the registry's builds), on a"
        " CPU, 2 processes over gloo. A variant's tick: it trained, a SIGTERM to the"
        " launcher during the second epoch saved and exited 143, and the same command"
        " resumed to the weights of a run never stopped. The other columns, on the"
        " default project: a second Ctrl-C stops at once (130, both launchers); SIGHUP"
        " saves and stops (129); SIGQUIT stops at once (131); a stuck rank is named by"
        " the hang report; `--deterministic` gives the same weights; a checkpoint of"
        " 2 processes resumes on 1, keeping the global batch, to the same weights.\n"
    )
    INCLUDED.write_text(text)
    readme = README.read_text()
    start, end = (readme.index(mark) + len(mark) for mark in MARKS)
    end -= len(MARKS[1])
    README.write_text(readme[:start] + text + readme[end:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "versions", nargs="*", help=f"torch releases (default: {', '.join(VERSIONS)})"
    )
    floors = ", ".join(f"{k} on {v}" for k, v in FLOORS.items())
    parser.add_argument("--floor", action="store_true", help=f"only {floors}")
    parser.add_argument("--markdown", type=Path, help="also write the table there")
    parser.add_argument("--keep", type=Path, help="keep projects and outputs there")
    parser.add_argument(
        "--write",
        action="store_true",
        help="also put the table into both READMEs (this repository's, the template's)",
    )
    args = parser.parse_args()
    default = Path.home() / ".cache" / "ddp-template"
    root = Path(os.environ.get("TORCH_RANGE_VENVS", default))
    root.mkdir(parents=True, exist_ok=True)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    # {release: the parallelisms checked on it}
    plan = {version: ("ddp", "fsdp2") for version in args.versions or VERSIONS}
    if args.floor:
        plan = {}
        for parallelism, version in FLOORS.items():
            plan[version] = (*plan.get(version, ()), parallelism)
    with tempfile.TemporaryDirectory(dir=args.keep) as bakes:
        projects = make_projects(Path(bakes))
        results = {
            version: check_release(version, projects, root, args.keep, parallelisms)
            for version, parallelisms in plan.items()
        }
    text = report(results)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.write:
        write_tables(results)
    cells = [cell for row, _ in results.values() for cell in row.values()]
    return 1 if any(cell not in ("ok", REFUSED) for cell in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
