"""Benchmark the generated project against a hand-written loop, Accelerate and Fabric.

One command (see bench/README.md):
    python3 bench/run.py            # 10 repeats of 200 steps each

Generates the default project with cookiecutter (or takes --project), then runs the
four contenders round-robin, the order rotated every repeat, all with the same model,
data, loss, per-process batch size, SGD settings, DataLoader workers and steps, all
launched by torchrun with the same environment. Each writes one JSON from rank 0 (see
steptimer.py); this script prints and saves the table of medians and ratios.
"""

import argparse
import importlib.util
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpt import SIZES, make_gpt_project
from streams import make_stream_project

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
VENV_PYTHON = BENCH / ".venv" / "bin" / "python"
CONTENDERS = {  # name: script; the first is what the ratios divide by
    "handwritten": "handwritten_ddp.py",
    "handwritten_noddp": "handwritten_ddp.py",  # the same without DDP (one process)
    "generated": "generated_entry.py",
    "generated_stream": "generated_entry.py",  # the same, its data as a stream
    "generated_fsdp2": "generated_entry.py",  # the project with parallelism=fsdp2
    "accelerate": "accelerate_loop.py",
    "fabric": "fabric_loop.py",
}
# glibc's tunables for what main_multi_gpu.py's keep_freed_memory() sets with mallopt.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}
TABLE_START, TABLE_END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps a run")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=5,
        help="steps left out of the steady-state rate",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="DataLoader workers per process (the project's own default is 2)",
    )
    parser.add_argument(
        "--nproc", type=int, help="processes (default: the GPU count, or 2 on CPU)"
    )
    parser.add_argument(
        "--project", help="a generated project folder (default: generate the default)"
    )
    parser.add_argument(
        "--template", default=str(REPO), help="cookiecutter template to generate from"
    )
    parser.add_argument(
        "--contenders",
        help="comma-separated subset of: " + ", ".join(CONTENDERS) + " (default: "
        "handwritten,generated,accelerate,fabric, and handwritten_noddp first with "
        "--nproc 1)",
    )
    parser.add_argument(
        "--malloc-env",
        action="store_true",
        help="give every contender the generated project's glibc malloc settings "
        f"({', '.join(f'{k}={v}' for k, v in MALLOC_ENV.items())}): a control that "
        "leaves only the loops' own differences",
    )
    parser.add_argument(
        "--model",
        choices=("default", *SIZES),
        default="default",
        help="default: the generated project's own model and data; else a GPT-2-class "
        "transformer on random tokens put into a copy of it (gpt.py), for GPUs",
    )
    parser.add_argument(
        "--amp",
        choices=("none", "bf16"),
        default="none",
        help="bf16: every contender autocasts to bfloat16 (the project's --amp bf16)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (the generated projects and the hand-written "
        "loop only)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds a run")
    parser.add_argument(
        "--grace",
        type=float,
        default=60,
        help="seconds a run may stay up after writing its result (a teardown hang)",
    )
    parser.add_argument("--workdir", help="logs and outputs (default: a temp folder)")
    parser.add_argument(
        "--results",
        default=str(BENCH / "results" / "latest.json"),
        help="where to write every measurement and the summary",
    )
    parser.add_argument(
        "--update-readme",
        nargs="?",
        const=str(BENCH / "README.md"),
        metavar="PATH",
        help=f"replace the table between {TABLE_START} and {TABLE_END} in PATH "
        "(default bench/README.md)",
    )
    parser.add_argument(
        "--note", default="", help="a line to print under the table (e.g. the machine)"
    )
    return parser.parse_args()


def reexec_in_venv(names):
    """Accelerate and Lightning live in bench/.venv: run there if a contender needs
    them and they are missing."""
    needed = {"accelerate": "accelerate", "fabric": "lightning"}
    wanted = [needed[name] for name in names if name in needed]
    missing = [m for m in wanted if not importlib.util.find_spec(m)]
    if not missing:
        return
    if VENV_PYTHON.exists() and Path(sys.executable) != VENV_PYTHON:
        os.execv(VENV_PYTHON, [str(VENV_PYTHON), *sys.argv])
    raise SystemExit(
        f"error: {', '.join(missing)} not importable; install the bench requirements:\n"
        f"  python3 -m venv {BENCH / '.venv'}\n"
        f"  {VENV_PYTHON} -m pip install -r {BENCH / 'requirements.txt'}"
    )


def refused_options(args, names, nproc):
    """Why these contenders cannot run with these options, or None."""
    if args.compile and set(names) & {"accelerate", "fabric"}:
        return "--compile: the generated projects and the hand-written loop only"
    if "handwritten_noddp" in names and nproc != 1:
        return "handwritten_noddp (no DDP) runs on one process only: --nproc 1"
    if args.model != "default" and "generated_stream" in names:
        return "--model replaces build_datasets, which generated_stream replaces too"
    return None


def generate_project(template, out_dir, *answers):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "cookiecutter",
            "--no-input",
            "-f",
            "-o",
            out_dir,
            template,
            *answers,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    (project,) = [p for p in Path(out_dir).iterdir() if p.is_dir()]
    return project


def template_version(template):
    """The template's commit, "+changes" when its files differ from it; or None."""
    try:
        git = ["git", "-C", str(template)]
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        changes = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", "."],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return (commit + ("+changes" if changes else "")) or None


def machine_info(torch, nproc):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [
                ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")
            ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "os": platform.platform(),
        "torch": torch.__version__,
        "accelerate": version_of("accelerate"),
        "lightning": version_of("lightning"),
        "nproc": nproc,
    }
    if torch.cuda.is_available():
        info["device"] = f"{nproc} x {torch.cuda.get_device_name(0)} (NCCL)"
    else:
        info["device"] = f"CPU, {nproc} processes (gloo)"
    return info


def version_of(name):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cpu_seconds():
    """(busy CPU seconds of the whole machine, CPU seconds of us and our children)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal: all but idle and iowait
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = float("nan")
    ours = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        ours += usage.ru_utime + usage.ru_stime
    return busy, ours


def command_for(name, args, project, nproc, out_dir):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += [f"--nproc-per-node={nproc}", str(BENCH / CONTENDERS[name])]
    common = [f"--batch-size={args.batch_size}", f"--lr={args.lr}"]
    common += [f"--seed={args.seed}", f"--num-workers={args.num_workers}"]
    common += [f"--amp={args.amp}"] + (["--compile"] if args.compile else [])
    val_size = args.batch_size * nproc  # one batch a rank (only the project evaluates)
    if name.startswith("generated"):
        train_size = args.steps * args.batch_size * nproc  # one epoch = --steps steps
        # A stream has no length: its run is --max-steps long (the same steps).
        length = "--epochs=1" if name == "generated" else f"--max-steps={args.steps}"
        if name == "generated_stream":
            project = args.stream_project
        if name == "generated_fsdp2":
            project = args.fsdp2_project
        return launcher + [
            str(project),
            "--",
            length,
            f"--train-size={train_size}",
            f"--val-size={val_size}",
            f"--output-dir={out_dir}",
            "--resume=never",
            *common,
        ]
    return launcher + [
        f"--project={project}",
        f"--steps={args.steps}",
        f"--val-size={val_size}",
        *common,
        *(["--no-ddp"] if name == "handwritten_noddp" else []),
    ]


def run_one(name, args, project, nproc, workdir, tag, steps):
    """Launch one contender; return its rank-0 result (or a failure record)."""
    result_path = workdir / f"{tag}_{name}.json"
    log_path = workdir / f"{tag}_{name}.log"
    run_args = argparse.Namespace(**{**vars(args), "steps": steps})
    command = command_for(name, run_args, project, nproc, workdir / f"{tag}_out")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, stated for all
    if args.malloc_env:
        env.update(MALLOC_ENV)
    env.update(
        PYTHONUNBUFFERED="1",
        BENCH_RESULT=str(result_path),
        BENCH_STEPS=str(steps),
        BENCH_WARMUP=str(args.warmup_steps),
        BENCH_SAMPLES=str(args.batch_size * nproc),
    )
    for stale in workdir.glob(f"{result_path.name}*"):  # from an earlier run here
        stale.unlink()
    busy0, ours0 = cpu_seconds()
    with log_path.open("w") as log:
        env["BENCH_LAUNCH_T0"] = repr(time.time())
        start = time.perf_counter()
        job = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            start_new_session=True,  # its own process group, to kill it whole
        )
        rc, note = wait(job, result_path, args.timeout, args.grace)
        wall = time.perf_counter() - start
    busy1, ours1 = cpu_seconds()
    others = max(0.0, (busy1 - busy0) - (ours1 - ours0))
    result = {"contender": name, "rc": rc, "job_wall_s": wall, "log": str(log_path)}
    # Share of the machine's CPUs that other processes used while this run ran.
    result["others_share"] = others / (wall * len(os.sched_getaffinity(0)))
    if note:
        result["note"] = note
    if result_path.exists():
        result |= json.loads(result_path.read_text()) | {"contender": name}
        result.pop("step_end_s", None)
        problem = check_ranks(result, result_path, nproc)
        if problem:  # not a valid data-parallel run: keep it out of the table
            result["error"] = problem
            result["invalid_steady_samples_per_s"] = result.pop("steady_samples_per_s")
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        result["error"] = "no result; log ends: " + " | ".join(tail)
    return result


def check_ranks(result, result_path, nproc):
    """Why this run was not the data-parallel training asked for, or None."""
    if result.get("group_size") != nproc:
        return f"process group of {result.get('group_size')}, not {nproc}"
    for rank in range(1, nproc):
        path = Path(f"{result_path}.rank{rank}")
        if not path.exists():
            return f"rank {rank} wrote no result"
        other = json.loads(path.read_text())["param_abs_sum"]
        mine = result["param_abs_sum"]
        if abs(other - mine) > 1e-7 * abs(mine):
            return f"rank {rank}'s weights differ from rank 0's ({other} vs {mine})"
    return None


def descendants(pid):
    """Every process below pid, from /proc (torchrun starts each worker in a session of
    its own, so killing the launcher's process group would miss them)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(job):
    """SIGKILL the launcher, its process group and every process below it."""
    below = descendants(job.pid)
    for pid in [job.pid, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.wait()


def wait(job, result_path, timeout, grace=60):
    """Wait for the launcher; kill its process group past the timeout, or when it is
    still up `grace` s after writing its result (a teardown hang)."""
    deadline = time.monotonic() + timeout
    result_seen = None
    while job.poll() is None:
        now = time.monotonic()
        if result_seen is None and result_path.exists():
            result_seen = now
        if now > deadline or (result_seen is not None and now - result_seen > grace):
            kill_tree(job)
            why = f"{timeout:g} s (--timeout)" if now > deadline else ""
            why = why or f"{grace} s past its result (a teardown hang)"
            return job.returncode, f"killed: still running after {why}"
        time.sleep(0.1)
    return job.returncode, ""


def spread(values):
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarize(runs, names, reference):
    """Per contender: medians and ranges, and ratios paired within each repeat."""
    by_repeat = {}
    for run in runs:
        if "steady_samples_per_s" in run:
            by_repeat.setdefault(run["repeat"], {})[run["contender"]] = run
    summary = {}
    for name in names:
        mine = [r[name] for r in by_repeat.values() if name in r]
        paired = [r for r in by_repeat.values() if name in r and reference in r]
        if not mine:
            summary[name] = None
            continue
        entry = {
            "steady_samples_per_s": spread([m["steady_samples_per_s"] for m in mine]),
            "first_step_s": spread([m["first_step_from_launch_s"] for m in mine]),
            "cpu_ms_per_step": spread([m["steady_cpu_ms_per_step"] for m in mine]),
            "page_faults_per_step": spread(
                [m["steady_page_faults_per_step"] for m in mine]
            ),
            "first_step_from_process_start_s": spread(
                [m["first_step_from_process_start_s"] for m in mine]
            ),
        }
        if paired:
            entry["steady_ratio"] = spread(
                [
                    r[name]["steady_samples_per_s"]
                    / r[reference]["steady_samples_per_s"]
                    for r in paired
                ]
            )
            entry["first_step_ratio"] = spread(
                [
                    r[name]["first_step_from_launch_s"]
                    / r[reference]["first_step_from_launch_s"]
                    for r in paired
                ]
            )
        summary[name] = entry
    return summary


def paired_ratio(runs, a, b, key):
    """Median over repeats of a/b for one key, pairing runs of the same repeat."""
    by_repeat = {}
    for run in runs:
        if key in run:
            by_repeat.setdefault(run["repeat"], {})[run["contender"]] = run[key]
    ratios = [r[a] / r[b] for r in by_repeat.values() if a in r and b in r]
    return statistics.median(ratios) if ratios else None


def targets(runs, names):
    """The issue's targets, each (text, ratio, holds)."""
    checks = []
    key, first = "steady_samples_per_s", "first_step_from_launch_s"
    if {"generated", "handwritten"} <= set(names):
        ratio = paired_ratio(runs, "generated", "handwritten", key)
        checks.append(("steady: generated / hand-written >= 0.98", ratio, 0.98, ">="))
        ratio = paired_ratio(runs, "generated", "handwritten", first)
        checks.append(
            ("first step: generated / hand-written <= 1.10", ratio, 1.1, "<=")
        )
    if {"generated", "handwritten_noddp"} <= set(names):  # one process
        ratio = paired_ratio(runs, "generated", "handwritten_noddp", key)
        text = "one process: generated / no-DDP loop >= 0.98"
        checks.append((text, ratio, 0.98, ">="))
        cpu = "steady_cpu_ms_per_step"
        ratio = paired_ratio(runs, "generated", "handwritten_noddp", cpu)
        text = "one process: rank-0 CPU per step, generated / no-DDP loop <= 1.02"
        checks.append((text, ratio, 1.02, "<="))
    if {"generated", "generated_fsdp2"} <= set(names):  # reported, no target
        ratio = paired_ratio(runs, "generated_fsdp2", "generated", key)
        text = "steady: fsdp2 / ddp, the default model (no target: FSDP2 saves memory)"
        checks.append((text, ratio, None, None))
    if {"generated", "generated_stream"} <= set(names):
        ratio = paired_ratio(runs, "generated_stream", "generated", key)
        checks.append(("steady: stream / map-style data >= 0.97", ratio, 0.97, ">="))
    for other in ("accelerate", "fabric"):
        if {"generated", other} <= set(names):
            ratio = paired_ratio(runs, "generated", other, key)
            checks.append((f"steady: generated / {other} >= 1.00", ratio, 1.0, ">="))
    results = []
    for text, ratio, bound, op in checks:
        ok = None  # reported, with no target
        if bound is not None:
            ok = ratio is not None and (
                ratio >= bound if op == ">=" else ratio <= bound
            )
        results.append((text, ratio, ok))
    return results


def fmt_spread(s, digits):
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def render(report):
    s, m, cfg = report["summary"], report["machine"], report["config"]
    names = cfg["contenders"]
    ref = "hand-written" if "handwritten" in names else names[0]
    header = (
        f"| contender | steady samples/s, median [min–max] | ÷ {ref} "
        f"| time to first step (s) | ÷ {ref} | rank-0 CPU ms/step "
        "| rank-0 page faults/step |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|"]
    for name in cfg["contenders"]:
        e = s.get(name)
        if e is None:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        ratio = fmt_spread(e["steady_ratio"], 3) if "steady_ratio" in e else ""
        first_ratio = (
            fmt_spread(e["first_step_ratio"], 3) if "first_step_ratio" in e else ""
        )
        lines.append(
            f"| {name} | {fmt_spread(e['steady_samples_per_s'], 0)} | {ratio} "
            f"| {fmt_spread(e['first_step_s'], 2)} | {first_ratio} "
            f"| {e['cpu_ms_per_step']['median']:.2f} "
            f"| {e['page_faults_per_step']['median']:.0f} |"
        )
    load = report["load"]
    shares = [r["others_share"] for r in report["runs"]] or [float("nan")]
    versions = f"torch {m['torch']}, accelerate {m['accelerate']}, "
    versions += f"lightning {m['lightning']}, Python {m['python']}"
    malloc = " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
    machine = f"Machine: {m['cpu']}, {m['cpus_usable']} usable CPUs; {m['device']}; "
    run = (
        f"Run: {cfg['repeats']} repeats (+{cfg['warmup_rounds']} untimed round) of "
        f"{len(cfg['contenders'])} contenders, round-robin, the order rotated each "
        f"repeat; {cfg['steps']} steps a run, the first {cfg['warmup_steps']} left out "
        f"of the steady rate; batch {cfg['batch_size']} per process x {cfg['nproc']} "
        f"processes; {cfg['num_workers']} DataLoader workers per process; "
        f"OMP_NUM_THREADS={cfg['omp_num_threads']}"
        + (", and for every contender " + malloc if cfg["malloc_env"] else "")
        + settings(cfg)
        + ". Ratios: the median over repeats "
        "of the ratio within each repeat. Time to first step: from the launch "
        "(torchrun started) to the end of the first optimizer step on rank 0. "
        "CPU ms/step: CPU time of rank 0's main process per steady step (median), "
        "which other load on the machine disturbs less than wall time. Page faults: "
        "minor page faults of rank 0's main process per steady step (median)."
    )
    other = (
        f"Other load: processes outside the benchmark used {load['others_cpu_s']:.0f} "
        f"CPU-seconds of the {load['capacity_cpu_s']:.0f} available during the run "
        f"({100 * load['others_share']:.0f}%; per run "
        f"{100 * min(shares):.0f}-{100 * max(shares):.0f}%); load average "
        f"{load['loadavg_before']} before, {load['loadavg_after']} after."
    )
    source = cfg.get("template_version")
    source = f"Project: generated from template {source}. " if source else ""
    lines += ["", machine + versions + ".", source + run, other]
    if report.get("note"):
        lines.append(report["note"])
    lines += ["", "Targets:"]
    for text, ratio, ok in report["targets"]:
        shown = "n/a" if ratio is None else f"{ratio:.3f}"
        verdict = "reported" if ok is None else "holds" if ok else "MISSED"
        lines.append(f"- {text}: {shown} — {verdict}")
    failures = [r for r in report["runs"] if "error" in r or r.get("note")]
    for r in failures:
        lines.append(
            f"- run {r['repeat']} {r['contender']}: "
            f"{r.get('error') or r.get('note')} (rc {r['rc']})"
        )
    return "\n".join(lines)


def settings(cfg):
    """The model and speed options of a run, where not the defaults."""
    chosen = []
    if cfg.get("model", "default") != "default":
        chosen.append(f"model {cfg['model']} (bench/gpt.py)")
    if cfg.get("amp", "none") != "none":
        chosen.append(f"--amp {cfg['amp']}")
    if cfg.get("compile"):
        chosen.append("--compile")
    return "; " + ", ".join(chosen) if chosen else ""


def update_readme(path, table):
    path = Path(path)
    text = path.read_text()
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        raise SystemExit(f"error: {path} has no {TABLE_START} ... {TABLE_END} block")
    text = text[: start + len(TABLE_START)] + "\n" + table + "\n" + text[end:]
    path.write_text(text)


def main():
    args = parse_args()
    if args.contenders is None:  # one process: the loop without DDP is the yardstick
        one = args.nproc == 1
        args.contenders = "handwritten_noddp," * one + "handwritten,generated,"
        args.contenders += "accelerate,fabric"
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    reexec_in_venv(names)
    import torch

    unknown = set(names) - set(CONTENDERS)
    if unknown or not names:
        raise SystemExit(f"error: unknown contenders {sorted(unknown)}")
    if not 1 <= args.warmup_steps < args.steps:
        raise SystemExit("error: need 1 <= --warmup-steps < --steps")
    nproc = args.nproc or torch.cuda.device_count() or 2
    refused = refused_options(args, names, nproc)
    if refused:
        raise SystemExit(f"error: {refused}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ddp-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    project = Path(args.project) if args.project else None
    if project is None:
        project = generate_project(args.template, workdir / "project")
    project = project.resolve()
    if not (project / "main_multi_gpu.py").is_file():
        raise SystemExit(f"error: {project} has no main_multi_gpu.py")
    args.stream_project = args.fsdp2_project = None
    if "generated_stream" in names:
        args.stream_project = str(make_stream_project(project, workdir / "stream"))
    if "generated_fsdp2" in names:
        fsdp2 = generate_project(args.template, workdir / "fsdp2", "parallelism=fsdp2")
        args.fsdp2_project = str(fsdp2)
    if args.model != "default":  # the same model and data put into both projects
        project = make_gpt_project(project, workdir / "gpt", args.model)
        if args.fsdp2_project:
            fsdp2 = make_gpt_project(
                args.fsdp2_project, workdir / "gpt_fsdp2", args.model
            )
            args.fsdp2_project = str(fsdp2)
    machine = machine_info(torch, nproc)
    template = None if args.project else template_version(args.template)
    print(f"project {project}\nlogs {workdir}\n{machine['device']}, {machine['cpu']}")

    runs = []
    loadavg_before = os.getloadavg()
    busy0, ours0 = cpu_seconds()
    wall0 = time.monotonic()
    for rnd in range(-args.warmup_rounds, args.repeats):
        shift = rnd % len(names)
        order = names[shift:] + names[:shift]
        timed = rnd >= 0
        for name in order:
            steps = args.steps if timed else min(args.steps, args.warmup_steps + 5)
            tag = f"r{rnd}" if timed else f"w{-rnd}"
            run = run_one(name, args, project, nproc, workdir, tag, steps)
            run["repeat"] = rnd
            label = f"repeat {rnd + 1}/{args.repeats}" if timed else "warm-up"
            if "steady_samples_per_s" in run:
                print(
                    f"{label:<13} {name:<12} "
                    f"{run['steady_samples_per_s']:9.0f} samples/s  first step "
                    f"{run['first_step_from_launch_s']:5.2f} s  job "
                    f"{run['job_wall_s']:5.1f} s  other load "
                    f"{100 * run['others_share']:3.0f}%{'  ' + run.get('note', '')}",
                    flush=True,
                )
            else:
                print(f"{label:<13} {name:<12} FAILED: {run['error']}", flush=True)
            if timed:
                runs.append(run)
    busy1, ours1 = cpu_seconds()
    elapsed = time.monotonic() - wall0
    capacity = elapsed * machine["cpus_usable"]
    others = max(0.0, (busy1 - busy0) - (ours1 - ours0))
    report = {
        "machine": machine,
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("update_readme",)},
            "contenders": names,
            "nproc": nproc,
            "project": str(project),
            "template_version": template,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
        },
        "load": {
            "elapsed_s": elapsed,
            "capacity_cpu_s": capacity,
            "others_cpu_s": others,
            "others_share": others / capacity if capacity else float("nan"),
            "loadavg_before": " ".join(f"{x:.2f}" for x in loadavg_before),
            "loadavg_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        },
        "note": args.note,
        "summary": summarize(
            runs, names, names[0] if "handwritten" not in names else "handwritten"
        ),
        "runs": runs,
    }
    report["targets"] = targets(runs, names)
    table = render(report)
    print("\n" + table)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {results}")
    if args.update_readme:
        update_readme(args.update_readme, table)
        print(f"updated {args.update_readme}")


if __name__ == "__main__":
    main()
