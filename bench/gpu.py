"""The GPU half of the bench: a short pass, within a time budget, over what a GPU shows.

    python3 bench/gpu.py --out DIR [--budget S]     # on a machine with a CUDA GPU
    python3 bench/gpu.py --device-info FILE         # the device, as JSON
    python3 bench/gpu.py --report DIR               # DIR/summary.md (tests/gpu_check.sh)
    python3 bench/gpu.py --cpu-smoke --out DIR ...  # the tiny model on CPU: pieces work

Every run trains a GPT-2-small-class transformer on random tokens (gpt.py), put into
copies of the default project and the `parallelism=fsdp2` one; the contenders are
run.py's, launched by run.run_one() as run.py launches them, with the same GPU
settings (common.gpu_settings). Sections, in the order they run; the first round runs
each of their runs once, and a second round (--rounds) starts only where every run of
the first one ran (the first GPU run spent its last minute on second runs while the
compile section had none):

  frameworks-bf16   hand-written, generated, Accelerate, Fabric; bf16 autocast
  no-ddp            the hand-written loop without DDP (one process), bf16
  fsdp2             the generated project with parallelism=fsdp2, bf16
  compile           hand-written and generated with torch.compile, bf16
  frameworks-fp32   the four again in float32 (TF32 matmuls, as gpu_settings sets)

A run that would not end within the budget is not started (listed as skipped), nor
is any run of a later round once one of the first round's was not.
DIR/results.json and DIR/bench.md are written again after every run, so a cut run
leaves what it measured. MFU: model FLOPs a step (gpt.flops_per_token) over the step
time and the device's dense peak (PEAK_TFLOPS).
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import gpt
import run

BENCH = Path(__file__).resolve().parent
FOUR = ("handwritten", "generated", "accelerate", "fabric")
SECTIONS = {  # name: (contender, amp, compile) in the order they run
    "frameworks-bf16": [(name, "bf16", False) for name in FOUR],
    "no-ddp": [("handwritten_noddp", "bf16", False)],
    "fsdp2": [("generated_fsdp2", "bf16", False)],
    "compile": [("handwritten", "bf16", True), ("generated", "bf16", True)],
    "frameworks-fp32": [(name, "none", False) for name in FOUR],
}
# Dense (no 2:4 sparsity) tensor-core peaks in TFLOP/s: (bf16, tf32, fp32 without
# tensor cores). From NVIDIA's datasheets, "NVIDIA H100 Tensor Core GPU" (SXM, PCIe,
# NVL) and "NVIDIA H200 Tensor Core GPU" (SXM, NVL), whose tensor-core figures are
# given with sparsity: halved here (H100 SXM: BF16 1,979 and TF32 989 with sparsity,
# 989.4 and 494.7 dense, as in NVIDIA's Hopper architecture whitepaper). H200's
# compute is H100's (the same GH100 chip, more and faster memory). Float32 runs use
# the TF32 peak: gpu_settings lets matmuls and convolutions run in TF32.
# The first name contained in torch.cuda.get_device_name() counts.
PEAK_TFLOPS = {
    "H100 NVL": (835.5, 417.5, 60.0),
    "H100 PCIe": (756.5, 378.0, 51.0),
    "H200 NVL": (835.5, 417.5, 60.0),
    "H100": (989.4, 494.7, 66.9),  # SXM5: "NVIDIA H100 80GB HBM3"
    "H200": (989.4, 494.7, 66.9),  # SXM
}
PEAK_SOURCE = (
    "NVIDIA H100 and H200 Tensor Core GPU datasheets, dense (the sparsity figures "
    "halved); float32 runs against the TF32 peak"
)
# A run's length before one of its kind ran: on the H200 (results/gpu/2026-11-28-h200)
# an eager run took 18-27 s from launch to exit, a first compile run 43-49 s.
FIRST_GUESS_S = {False: 45, True: 60}


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--out", help="the results folder (run mode)")
    parser.add_argument("--budget", type=float, default=200, help="seconds of runs")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--contenders", help="only these, of the sections' runs")
    parser.add_argument(
        "--rounds", type=int, default=2, help="at most, budget allowing"
    )
    parser.add_argument("--model", choices=tuple(gpt.SIZES), default="gpt2-small")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="sequences a process"
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup-steps", type=int, default=10, help="not timed")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--template", default=str(BENCH.parent))
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="on CPU (gloo), the tiny model, 6 steps: the pieces work, nothing measured",
    )
    parser.add_argument("--device-info", metavar="FILE", help="write the device's JSON")
    parser.add_argument("--report", metavar="DIR", help="write DIR/summary.md")
    args = parser.parse_args()
    if args.cpu_smoke:
        args.model, args.batch_size, args.steps, args.warmup_steps = "tiny", 4, 6, 2
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(
            f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}"
        )
    if not (args.out or args.device_info or args.report):
        parser.error("give --out DIR, --device-info FILE or --report DIR")
    return args


def refuse_without_cuda(torch):
    if not torch.cuda.is_available():
        print(
            f"bench/gpu.py: no CUDA GPU (torch {torch.__version__}): nothing run "
            "(--cpu-smoke runs the tiny model on CPU)"
        )
        raise SystemExit(3)


def peak_tflops(device_name):
    """(bf16, tf32, fp32) dense TFLOP/s of a device by its name, or None."""
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            return peaks
    return None


def nvidia_smi():
    """The driver's view of GPU 0 (nvidia-smi), or {} where there is none."""
    fields = "name,driver_version,memory.total,power.limit,clocks.max.sm"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
    return dict(zip(fields.split(","), values))


def matmul_tflops(torch, dtype, n=8192, repeats=20):
    """TFLOP/s of an n x n matmul in dtype (float32: with TF32 allowed)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def nccl_version(torch):
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def device_info(torch, measure):
    """Device, driver and versions; with `measure`, the matmul speed too."""
    name = torch.cuda.get_device_name(0)
    props = torch.cuda.get_device_properties(0)
    smi = nvidia_smi()
    info = {
        "name": name,
        "count": torch.cuda.device_count(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": nccl_version(torch),
        "driver": smi.get("driver_version"),
        "nvidia_smi": smi,
        "accelerate": run.version_of("accelerate"),
        "lightning": run.version_of("lightning"),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "peak_tflops": dict(zip(("bf16", "tf32", "fp32"), peak_tflops(name) or ())),
        "peak_source": PEAK_SOURCE,
    }
    if measure:
        torch.backends.cuda.matmul.allow_tf32 = True
        info["matmul_tflops"] = {
            "bf16": round(matmul_tflops(torch, torch.bfloat16), 1),
            "tf32": round(matmul_tflops(torch, torch.float32), 1),
        }
        torch.cuda.empty_cache()
    return info


def plan(args, nproc):
    """[(round, section, contender, amp, compile)] in the order they run."""
    only = set(args.contenders.split(",")) if args.contenders else None
    runs = []
    for rnd in range(1, args.rounds + 1):
        for section in args.sections.split(","):
            if section == "no-ddp" and nproc != 1:
                continue  # without DDP, processes would not train together
            for contender, amp, compiled in SECTIONS[section]:
                if only is None or contender in only:
                    runs.append((rnd, section, contender, amp, compiled))
    return runs


def why_not_started(rnd, left, guess, first_not_run):
    """Why a planned run is not started, or None (start it). `left`: seconds of the
    budget left; `guess`: how long such a run takes; `first_not_run`: the first
    round's runs not started so far. Every section runs once before any runs again:
    a later round waits for the whole first round, even where a short run of it
    would fit in what is left."""
    if rnd > 1 and first_not_run:
        return (
            f"round {rnd} starts only where every run of round 1 ran; "
            f"{len(first_not_run)} did not ({', '.join(first_not_run)})"
        )
    if left < guess:
        return f"{left:.0f} s of the budget left, such a run takes {guess:.0f}"
    return None


def mfu(result, args, nproc, peaks, amp):
    """(tokens/s, model FLOP utilisation) of a run; MFU None without a peak."""
    size = gpt.SIZES[args.model]
    tokens_per_step = args.batch_size * nproc * size["seq_len"]
    step_s = result["steady_step_ms"] / 1e3
    tokens_per_s = tokens_per_step / step_s
    if not peaks:
        return tokens_per_s, None
    peak = (peaks[0] if amp == "bf16" else peaks[1]) * 1e12 * nproc
    return tokens_per_s, gpt.flops_per_token(args.model) * tokens_per_s / peak


def run_all(args, torch):
    """Every planned run the budget allows; results saved after each."""
    began = time.monotonic()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    nproc = 1 if args.cpu_smoke else torch.cuda.device_count()
    device = (
        {"name": "CPU (--cpu-smoke)"} if args.cpu_smoke else device_info(torch, False)
    )
    peaks = None if args.cpu_smoke else peak_tflops(device["name"])
    workdir = Path(tempfile.mkdtemp(prefix="gpu-bench-"))  # checkpoints: not in DIR
    planned = plan(args, nproc)
    wanted = {contender for _, _, contender, _, _ in planned}
    project = run.generate_project(args.template, workdir / "project")
    fsdp2 = None
    if "generated_fsdp2" in wanted:
        fsdp2 = run.generate_project(
            args.template, workdir / "fsdp2", "parallelism=fsdp2"
        )
        fsdp2 = gpt.make_gpt_project(fsdp2, workdir / "gpt_fsdp2", args.model)
    project = gpt.make_gpt_project(project, workdir / "gpt", args.model)
    report = {
        "device": device,
        "config": {**vars(args), "nproc": nproc, "project": str(project)},
        "template_version": run.template_version(args.template),
        "flops_per_token": gpt.flops_per_token(args.model),
        "runs": [],
    }
    if not args.cpu_smoke:  # imports from disk once, before the first timed launch
        subprocess.run([sys.executable, "-c", "import torch, accelerate, lightning"])
    lengths = {}  # (contender, compile): seconds the last such run took
    first_not_run = []  # the first round's runs skipped: no later round then
    for rnd, section, contender, amp, compiled in planned:
        left = args.budget - (time.monotonic() - began)
        guess = lengths.get((contender, compiled), FIRST_GUESS_S[compiled])
        entry = {"round": rnd, "section": section, "contender": contender}
        entry |= {"amp": amp, "compile": compiled}
        why = why_not_started(rnd, left, guess, first_not_run)
        if why:
            entry["skipped"] = why
            if rnd == 1:
                first_not_run.append(f"{contender} ({amp}{', compile' * compiled})")
            report["runs"].append(entry)
            print(
                f"round {rnd} {section:<16} {contender:<18} skipped: {entry['skipped']}"
            )
            continue
        options = argparse.Namespace(
            batch_size=args.batch_size,
            lr=args.lr,
            seed=0,
            num_workers=0,
            amp=amp,
            compile=compiled,
            malloc_env=False,
            warmup_steps=args.warmup_steps,
            timeout=max(left, 30),
            grace=15,
            stream_project=None,
            fsdp2_project=str(fsdp2) if fsdp2 else None,
        )
        tag = f"r{rnd}_{amp}{'_compile' if compiled else ''}"
        result = run.run_one(
            contender, options, project, nproc, workdir, tag, args.steps
        )
        lengths[(contender, compiled)] = result["job_wall_s"]
        shutil.copy(result["log"], out / "logs" / Path(result["log"]).name)
        shutil.rmtree(workdir / f"{tag}_out", ignore_errors=True)  # the checkpoints
        entry |= {k: v for k, v in result.items() if k != "log"}
        if "steady_samples_per_s" in result:
            entry["tokens_per_s"], entry["mfu"] = mfu(result, args, nproc, peaks, amp)
        report["runs"].append(entry)
        print(line(entry), flush=True)
        save(report, out)
    save(report, out)
    shutil.rmtree(workdir, ignore_errors=True)
    print("\n" + bench_table(report))
    return report


def line(entry):
    head = f"round {entry['round']} {entry['section']:<16} {entry['contender']:<18}"
    if "steady_samples_per_s" not in entry:
        return f"{head} FAILED: {entry.get('error')}"
    shown = "n/a" if entry["mfu"] is None else f"{100 * entry['mfu']:.1f}%"
    return (
        f"{head} {entry['steady_samples_per_s']:8.1f} samples/s  MFU {shown}  first "
        f"step {entry['first_step_from_launch_s']:.1f} s  job {entry['job_wall_s']:.0f} s"
    )


def save(report, out):
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "bench.md").write_text(bench_table(report) + "\n")


def median_of(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


# (what, numerator, denominator): each a (contender, amp, compile) row of the table.
COMPARISONS = [
    (
        "one process: the generated project ÷ the loop without DDP (bf16; >= 0.99)",
        ("generated", "bf16", False),
        ("handwritten_noddp", "bf16", False),
    ),
    (
        "DDP at world size 1 ÷ the same loop without DDP (bf16)",
        ("handwritten", "bf16", False),
        ("handwritten_noddp", "bf16", False),
    ),
    (
        "FSDP2 ÷ DDP, the generated project (bf16)",
        ("generated_fsdp2", "bf16", False),
        ("generated", "bf16", False),
    ),
    (
        "--compile ÷ eager, the generated project (bf16)",
        ("generated", "bf16", True),
        ("generated", "bf16", False),
    ),
    (
        "compile ÷ eager, the hand-written loop (bf16)",
        ("handwritten", "bf16", True),
        ("handwritten", "bf16", False),
    ),
    (
        "bf16 ÷ fp32, the generated project",
        ("generated", "bf16", False),
        ("generated", "none", False),
    ),
]
HEADER = (
    "| contender | precision | compile | runs | steady samples/s, median [min–max] "
    "| tokens/s | step ms | MFU | time to first step (s) | ÷ hand-written |"
)


def bench_table(report):
    """The markdown table (a row per contender, precision and compile), what it
    measured, the comparisons, and the runs that failed or were skipped."""
    rows = {}  # (contender, amp, compile): its measured runs
    for r in report["runs"]:
        rows.setdefault((r["contender"], r["amp"], r["compile"]), [])
        if "steady_samples_per_s" in r:
            rows[(r["contender"], r["amp"], r["compile"])].append(r)

    def rate(row):
        return median_of(rows.get(row, []), "steady_samples_per_s")

    lines = [HEADER, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row, runs in rows.items():
        contender, amp, compiled = row
        precision = "bf16" if amp == "bf16" else "fp32 (TF32)"
        cells = [contender, precision, "yes" if compiled else "no", str(len(runs))]
        if runs:
            speeds = [r["steady_samples_per_s"] for r in runs]
            mfu_value = median_of(runs, "mfu")
            reference = rate(("handwritten", amp, compiled))
            cells += [
                (
                    f"{median_of(runs, 'steady_samples_per_s'):.1f} "
                    f"[{min(speeds):.1f}–{max(speeds):.1f}]"
                ),
                f"{median_of(runs, 'tokens_per_s'):.0f}",
                f"{median_of(runs, 'steady_step_ms'):.1f}",
                "n/a" if mfu_value is None else f"{100 * mfu_value:.1f}%",
                f"{median_of(runs, 'first_step_from_launch_s'):.1f}",
                f"{rate(row) / reference:.3f}" if reference else "",
            ]
        else:
            cells += ["failed or skipped", "", "", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        *about(report),
        "",
        "Comparisons (steady samples/s, ratio of medians):",
    ]
    for text, a, b in COMPARISONS:
        shown = f"{rate(a) / rate(b):.3f}" if rate(a) and rate(b) else "not measured"
        lines.append(f"- {text}: {shown}")
    for r in report["runs"]:
        why = r.get("skipped") or r.get("error") or r.get("note")
        if why:
            what = "skipped" if "skipped" in r else "failed" if "error" in r else "note"
            run_name = f"{r['contender']} ({r['amp']}{', compile' * r['compile']})"
            lines.append(f"- round {r['round']} {run_name}: {what}: {why}")
    return "\n".join(lines)


def about(report):
    """The lines under the table: device, model and run, what MFU divides by."""
    cfg, device = report["config"], report["device"]
    size = gpt.SIZES[cfg["model"]]
    versions = ""
    if "torch" in device:
        versions = (
            f", driver {device['driver']}, CUDA {device['cuda']}, torch "
            f"{device['torch']}, accelerate {device['accelerate']}, lightning "
            f"{device['lightning']}"
        )
    peaks = device.get("peak_tflops")
    if peaks:
        peak = f"bf16 {peaks['bf16']} TFLOP/s, fp32 runs TF32 {peaks['tf32']} TFLOP/s"
    else:
        peak = "none known for this device"
    return [
        f"Device: {device['name']}{versions}; {cfg['nproc']} process(es).",
        (
            f"Model: {cfg['model']} (bench/gpt.py: {size['layers']} layers, width "
            f"{size['width']}, {size['seq_len']} tokens, vocabulary {size['vocab']}; "
            f"{report['flops_per_token'] / 1e9:.3f} GFLOP a token, forward and "
            f"backward), random tokens; batch {cfg['batch_size']} sequences a process, "
            f"{cfg['steps']} steps a run, the first {cfg['warmup_steps']} not timed; SGD, "
            f"lr {cfg['lr']}; the same GPU settings for every contender "
            "(common.gpu_settings); each launched by torchrun as run.py launches it."
        ),
        (
            f"MFU: model FLOPs a step / (step time x the dense peak: {peak}; "
            f"{PEAK_SOURCE}). Time to first step: from the launch to the end of the "
            "first optimizer step (with compile, compiling included)."
        ),
    ]


def device_line(info):
    peaks = info.get("peak_tflops") or {}
    measured = info.get("matmul_tflops") or {}
    return (
        f"{info['count']} x {info['name']} (compute capability {info['capability']}, "
        f"{info['memory_gib']} GiB, {info['sm_count']} SMs), driver {info['driver']}, "
        f"CUDA {info['cuda']}, cuDNN {info['cudnn']}, NCCL {info['nccl']}; torch "
        f"{info['torch']}, accelerate {info['accelerate']}, lightning "
        f"{info['lightning']}, Python {info['python']}; {info['cpus']} CPUs. "
        f"8192³ matmul: bf16 {measured.get('bf16')} TFLOP/s, TF32 "
        f"{measured.get('tf32')} TFLOP/s, against dense peaks of {peaks.get('bf16')} "
        f"and {peaks.get('tf32')} ({PEAK_SOURCE})."
    )


def tests_summary(folder):
    """Lines on the gpu-marked tests, from the junit XML and the exit status that
    tests/gpu_check.sh wrote."""
    status_file = folder / "tests_exit"
    status = status_file.read_text().strip() if status_file.exists() else None
    lines = []
    if status == "124":
        lines.append(
            "**Stopped at the time cap** (tests/gpu_check.sh); see pytest.log."
        )
    junit = folder / "junit.xml"
    if not junit.exists():
        return lines + [f"No junit.xml (pytest exit status {status}); see pytest.log."]
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    count = {
        key: sum(int(s.get(key, 0)) for s in suites)
        for key in ("tests", "failures", "errors", "skipped")
    }
    seconds = sum(float(s.get("time", 0)) for s in suites)
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    lines.append(
        f"{count['tests']} tests in {seconds:.0f} s: {passed} passed, "
        f"{count['failures']} failed, {count['errors']} errors, {count['skipped']} "
        f"skipped (pytest exit status {status})."
    )
    for case in root.iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            message = (problem.get("message") or "").strip().splitlines()[:1]
            name = "::".join(filter(None, (case.get("classname"), case.get("name"))))
            lines.append(f"- {name}: {message[0][:200] if message else problem.tag}")
    return lines


def verified_torch():
    """The torch version the suite is verified with (requirements-dev.txt), or None."""
    requirements = BENCH.parent / "requirements-dev.txt"
    if not requirements.exists():
        return None
    for line in requirements.read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip() == "torch" and version:
            return version.split("#")[0].strip()
    return None


def torch_line(info):
    """summary.md's first line: the machine's torch, against the one the suite is
    verified with. The first GPU run failed where they differed (torchrun's flags)."""
    here = info.get("torch") if info else run.version_of("torch")
    verified = verified_torch()
    if not here:
        return f"torch: none found on this machine (the suite's: {verified})."
    cuda = f" (CUDA {info['cuda']})" if info and info.get("cuda") else ""
    if not verified:
        return f"torch {here} on this machine{cuda}."
    if here.split("+")[0] == verified:
        return (
            f"torch {here} on this machine{cuda}: the version the suite is verified "
            "with (requirements-dev.txt)."
        )
    return (
        f"torch {here} on this machine{cuda}; the suite is verified with torch "
        f"{verified} (requirements-dev.txt): where a test fails here, the difference "
        "is the first suspect."
    )


def write_summary(folder):
    """folder/summary.md: the machine's torch first, then the device, the tests and
    the bench table."""
    device_file = folder / "device.json"
    info = json.loads(device_file.read_text()) if device_file.exists() else None
    lines = [torch_line(info), ""]
    lines += [f"# GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    if info:
        lines.append("Device: " + device_line(info))
    else:
        lines.append("Device: no device.json.")
    lines += ["", "## Tests marked `gpu` (`pytest -m gpu`)", "", *tests_summary(folder)]
    lines += ["", "## Bench (bench/gpu.py)", ""]
    bench = folder / "bench" / "bench.md"
    lines.append(bench.read_text().strip() if bench.exists() else "Not run.")
    (folder / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def stop(signum, frame):
    """A SIGTERM (the caller's time cap): end the run under way too (torchrun's
    processes are in a session of their own), keep what was saved."""
    for pid in run.descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(128 + signum)


def main():
    args = parse_args()
    if args.report:
        write_summary(Path(args.report))
        return
    import torch

    if args.device_info:
        refuse_without_cuda(torch)
        info = device_info(torch, measure=True)
        Path(args.device_info).write_text(json.dumps(info, indent=1) + "\n")
        print(device_line(info))
        return
    if not args.cpu_smoke:
        refuse_without_cuda(torch)
    signal.signal(signal.SIGTERM, stop)
    run_all(args, torch)


if __name__ == "__main__":
    main()
