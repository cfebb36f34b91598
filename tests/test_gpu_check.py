"""tests/gpu_check.sh and bench/gpu.py, without a GPU: the refusals, the arguments,
the steps and the files they name, the gpu tests it runs, and the bench's GPU mode
(the model and its FLOP count, the MFU table, the summary, a tiny run on CPU)."""

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from combinations import TEMPLATE
from conftest import bake, load_module

SCRIPT = TEMPLATE / "tests" / "gpu_check.sh"
BENCH = TEMPLATE / "bench"
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # no CUDA, even on a machine with a GPU
# The first run on a GPU (one H100, torch 2.11), as committed: tests/gpu_check.sh as
# it was then, its tests and its bench.
FIRST_GPU_RUN = BENCH / "results" / "gpu" / "2026-11-27-h100" / "run1"
# The second (one H200, torch 2.11): every gpu test passed, 12 workers.
SECOND_GPU_RUN = BENCH / "results" / "gpu" / "2026-11-28-h200" / "check"


def check(*args, env=None, timeout=60):
    """Run gpu_check.sh; (exit status, its lines: stdout and stderr together)."""
    result = subprocess.run(
        [str(SCRIPT), *args],
        env={**os.environ, **NO_GPU, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.returncode, (result.stdout + result.stderr).splitlines()


@pytest.fixture(scope="module")
def bench():
    """bench/gpt.py and bench/gpu.py, imported as the bench imports them (bench/ on
    sys.path); sys.path and the plain names in sys.modules left as they were for the
    other tests of this worker."""
    names = ("gpt", "gpu", "run", "streams")
    sys.path.insert(0, str(BENCH))
    try:
        import gpt
        import gpu
    finally:
        sys.path.remove(str(BENCH))
        for name in names:
            sys.modules.pop(name, None)
    return SimpleNamespace(gpt=gpt, gpu=gpu)


def tripwire(tmp_path):
    """A folder for PATH's front whose `timeout` (the command the tests and the bench
    start under) leaves a file: it shows whether anything was started."""
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "timeout").write_text(f"#!/bin/sh\ntouch {tmp_path / 'started'}\n")
    (shims / "timeout").chmod(0o755)
    return {"PATH": f"{shims}{os.pathsep}{os.environ['PATH']}"}


def test_without_cuda_one_line_and_nothing_made(tmp_path):
    env = {**tripwire(tmp_path), "GPU_CHECK_VENV": str(tmp_path / "venv")}
    code, lines = check("--out", str(tmp_path / "results"), env=env)
    assert code == 3, lines
    why = f"torch {torch.__version__}: torch.cuda.is_available() is False"
    assert lines == [f"gpu_check.sh: no CUDA GPU here ({why}): nothing run"]
    assert not (tmp_path / "venv").exists()
    assert not (tmp_path / "results").exists()
    assert not (tmp_path / "started").exists()  # no pytest, no bench


def test_without_torch_one_line(tmp_path):
    """A Python without its site-packages stands for one without torch."""
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    env = {"PYTHON": str(python), "GPU_CHECK_VENV": str(tmp_path / "venv")}
    code, lines = check("--out", str(tmp_path / "results"), env=env)
    assert code == 3, lines
    assert len(lines) == 1
    assert lines[0].startswith("gpu_check.sh: no CUDA GPU here (")
    assert "has no torch (ModuleNotFoundError)" in lines[0]
    assert not (tmp_path / "venv").exists()
    assert not (tmp_path / "results").exists()


def test_help_and_arguments_it_refuses():
    code, lines = check("--help")
    assert code == 0
    assert lines[0].startswith("usage: tests/gpu_check.sh")
    for option in ("--prepare", "--list", "--out DIR", "--only tests", "--sections"):
        assert any(option in line for line in lines), option
    for args, named in [
        (["--bogus"], "'--bogus'"),
        (["--out"], "--out needs a value"),
        (["--only", "all"], "'all'"),
        (["--list", "extra"], "'extra'"),
    ]:
        code, lines = check(*args)
        assert code == 2, args
        assert len(lines) == 1 and named in lines[0], lines


def gpu_test_files():
    """The test files with a test marked gpu (a decorator line of its own)."""
    return sorted(
        f"tests/{path.name}"
        for path in (TEMPLATE / "tests").glob("test_*.py")
        if re.search(r"^@pytest\.mark\.gpu\b", path.read_text(), re.MULTILINE)
    )


def test_list_shows_every_step_and_the_files_exist(tmp_path):
    code, lines = check("--list", env={"OUT": str(tmp_path)})
    assert code == 0, lines
    assert lines[0] == f"steps of tests/gpu_check.sh (results in {tmp_path}/gpu_check):"
    steps = [line.split()[:2] for line in lines[1:]]
    assert steps == [
        ["1", "check"],
        ["2", "venv"],
        ["3", "install"],
        ["4", "device"],
        ["5", "tests"],
        ["6", "bench"],
        ["7", "summary"],
    ]
    text = "\n".join(lines)
    named = set(re.findall(r"\b(?:tests|bench)/[\w/.-]+\.(?:py|sh)\b", text))
    assert {"bench/gpu.py", "bench/gpt.py", "bench/handwritten_ddp.py"} <= named
    missing = [path for path in named if not (TEMPLATE / path).is_file()]
    assert not missing
    tests_step = next(line for line in lines if line.startswith("5 tests"))
    listed = re.search(r"marked gpu in: ([^)]*)\)", tests_step).group(1).split()
    assert listed == gpu_test_files() and listed
    assert "-m gpu" in tests_step and "--junitxml" in tests_step
    assert not (tmp_path / "gpu_check").exists()  # listed, not made


def test_the_tests_share_is_what_they_took_on_the_last_gpu():
    """The tests' cap (step 5's timeout, and what --help says) is the time the gpu
    tests took on the last GPU machine, every one passing, with a little room (the
    first machine's 134 s were with half of them failing at their start)."""
    suite = next(ET.parse(SECOND_GPU_RUN / "junit.xml").getroot().iter("testsuite"))
    took = float(suite.get("time"))
    assert 155 < took < 170 and suite.get("failures") == "0"  # 161.2 s, 71 tests
    code, lines = check("--list")
    assert code == 0, lines
    tests_step = next(line for line in lines if line.startswith("5 tests"))
    cap = int(re.search(r"timeout (\d+) python -m pytest", tests_step).group(1))
    assert took <= cap <= 1.25 * took, cap
    bench_step = next(line for line in lines if line.startswith("6 bench"))
    assert "<what is left of 540 s>" in bench_step  # under a call's 10 minutes
    code, lines = check("--help")
    assert f"-m gpu, at most {cap} s" in "\n".join(lines)


def test_the_gpu_tests_it_runs_are_collected():
    files = gpu_test_files()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu"]
        + ["-p", "no:cacheprovider", *files],
        cwd=TEMPLATE,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert {line.split("::")[0] for line in collected} == set(files)
    assert len(collected) > len(files)  # test_run.py's alone: one per combination


def test_shellcheck_and_executable():
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}")
    result = subprocess.run(
        [shellcheck or "shellcheck", str(SCRIPT)], capture_output=True, text=True
    )
    assert result.returncode == 0 and not result.stdout, result.stdout
    assert os.access(SCRIPT, os.X_OK)
    staged = subprocess.run(
        ["git", "ls-files", "-s", "tests/gpu_check.sh"],
        cwd=TEMPLATE,
        capture_output=True,
        text=True,
    ).stdout
    assert not staged or staged.startswith("100755 ")


def test_packages_it_brings_are_the_pinned_ones():
    """The versions gpu_check.sh installs on the GPU machine are those this suite
    is verified with (requirements-dev.txt)."""
    script = SCRIPT.read_text()
    brought = re.search(r"\nPACKAGES=\(\n(.*?)\n\)", script, re.DOTALL).group(1)
    brought = dict(
        entry.split(":")[0].partition("==")[::2] for entry in brought.split()
    )
    pinned = {}
    for line in (TEMPLATE / "requirements-dev.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if version:
            pinned[name] = version
    assert {"cookiecutter", "pytest-timeout", "tensorboard"} <= set(brought)
    for name, version in brought.items():
        if name in pinned:
            assert version == pinned[name], name
    assert "torch" not in brought and "accelerate" not in brought


def test_the_model_and_its_flop_count(tmp_path, bench):
    """The GPT put into a generated project trains through the project's functions,
    and gpt.flops_per_token is what torch's FLOP counter counts for a forward and
    backward pass (attention by the math kernel, whose matmuls it sees)."""
    project = bench.gpt.make_gpt_project(bake(tmp_path), tmp_path / "gpt", "tiny")
    module = load_module(project)
    assert module.default_build_model is not module.build_model
    data_args = SimpleNamespace(seed=0, train_size=6, val_size=3)
    train_set, val_set = module.build_datasets(data_args)
    tokens, targets = train_set[:4]
    assert tokens.shape == targets.shape == (4, bench.gpt.SIZES["tiny"]["seq_len"])
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    model = module.build_model(None)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        loss, units = module.compute_loss(model, (tokens, targets))
        loss.backward()
    assert units == tokens.numel()
    counted = counter.get_total_flops()
    assert counted == bench.gpt.flops_per_token("tiny") * tokens.numel()
    metrics = module.compute_metrics(model.eval(), val_set[:3])
    assert set(metrics) == {"loss", "acc"} and metrics["loss"][1] == 3 * 32
    with torch.device("meta"):  # GPT-2 small's size, without its memory
        module.GPT.update(bench.gpt.SIZES["gpt2-small"])
        weights = sum(p.numel() for p in module.build_model(None).parameters())
    assert 160e6 < weights < 165e6  # 124M with a tied head; 38.6M more untied
    assert bench.gpt.matmul_weights("gpt2-small") < weights


def test_peaks_mfu_and_the_table(bench):
    gpu = bench.gpu
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3") == (989.4, 494.7, 66.9)
    assert gpu.peak_tflops("NVIDIA H100 PCIe")[0] == 756.5  # not the SXM's
    assert gpu.peak_tflops("NVIDIA H200 NVL")[0] == 835.5
    assert gpu.peak_tflops("NVIDIA H200") == gpu.peak_tflops("NVIDIA H100 80GB HBM3")
    assert gpu.peak_tflops("NVIDIA A100-SXM4-80GB") is None
    args = SimpleNamespace(model="gpt2-small", batch_size=16)
    peaks = gpu.peak_tflops("NVIDIA H200")
    flops = bench.gpt.flops_per_token("gpt2-small")
    tokens_per_step = 16 * 1024
    step_ms = 1e3 * flops * tokens_per_step / (0.4 * 989.4e12)  # 40% of the peak
    tokens_per_s, mfu = gpu.mfu({"steady_step_ms": step_ms}, args, 1, peaks, "bf16")
    assert mfu == pytest.approx(0.4)
    assert tokens_per_s == pytest.approx(tokens_per_step / step_ms * 1e3)
    _, mfu = gpu.mfu({"steady_step_ms": step_ms}, args, 1, peaks, "none")
    assert mfu == pytest.approx(0.8)  # float32 runs against the TF32 peak, half
    assert gpu.mfu({"steady_step_ms": step_ms}, args, 1, None, "bf16")[1] is None

    def measured(contender, amp, rate, compiled=False):
        return {
            "round": 1,
            "section": "s",
            "contender": contender,
            "amp": amp,
            "compile": compiled,
            "steady_samples_per_s": rate,
            "tokens_per_s": rate * 1024,
            "steady_step_ms": 1e3 * 16 / rate,
            "mfu": 0.5,
            "first_step_from_launch_s": 9.0,
        }

    report = {
        "device": {
            "name": "NVIDIA H200",
            "peak_tflops": {"bf16": 989.4, "tf32": 494.7},
        },
        "config": {"model": "gpt2-small", "batch_size": 16, "steps": 50}
        | {"warmup_steps": 10, "lr": 0.001, "nproc": 1},
        "flops_per_token": flops,
        "runs": [
            measured("handwritten", "bf16", 100.0),
            measured("generated", "bf16", 98.0),
            measured("handwritten_noddp", "bf16", 104.0),
            {"round": 1, "section": "compile", "contender": "generated", "amp": "bf16"}
            | {"compile": True, "skipped": "30 s of the budget left"},
            {"round": 1, "section": "s", "contender": "fabric", "amp": "bf16"}
            | {"compile": False, "error": "no result"},
        ],
    }
    table = gpu.bench_table(report)
    assert (
        "| generated | bf16 | no | 1 | 98.0 [98.0–98.0] | 100352 | 163.3 | 50.0% |"
        in table
    )
    assert "| 9.0 | 0.980 |" in table
    assert "| generated | bf16 | yes | 0 | failed or skipped |" in table
    assert "- DDP at world size 1 ÷ the same loop without DDP (bf16): 0.962" in table
    assert "- FSDP2 ÷ DDP, the generated project (bf16): not measured" in table
    assert (
        "- round 1 generated (bf16, compile): skipped: 30 s of the budget left" in table
    )
    assert "- round 1 fabric (bf16): failed: no result" in table
    assert "bf16 989.4 TFLOP/s, fp32 runs TF32 494.7 TFLOP/s" in table


def test_summary_from_the_results_folder(tmp_path, bench):
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0" '
        'time="61.5"><testcase classname="tests.test_run" name="test_a"/>'
        '<testcase classname="tests.test_run" name="test_b"><failure message="'
        'AssertionError: nccl said no&#10;second line"/></testcase>'
        '<testcase classname="tests.test_fsdp2" name="test_c"/></testsuite></testsuites>'
    )
    (tmp_path / "tests_exit").write_text("1\n")
    bench.gpu.write_summary(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "3 tests in 62 s: 2 passed, 1 failed, 0 errors, 0 skipped" in summary
    assert "- tests.test_run::test_b: AssertionError: nccl said no\n" in summary
    assert "Device: no device.json." in summary and "\nNot run.\n" in summary
    assert "Stopped at the time cap" not in summary
    (tmp_path / "tests_exit").write_text("124\n")
    (tmp_path / "junit.xml").unlink()
    bench.gpu.write_summary(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "**Stopped at the time cap**" in summary
    assert "No junit.xml (pytest exit status 124)" in summary


def test_summary_names_the_machines_torch_first(tmp_path, bench):
    """summary.md's first line is the machine's torch version, against the one the
    suite is verified with: a torchrun flag that torch 2.11 lacks is what failed
    half the first GPU run's tests (its summary began with the date)."""
    verified = re.search(
        r"^torch==(\S+)$",
        (TEMPLATE / "requirements-dev.txt").read_text(),
        re.MULTILINE,
    ).group(1)
    shutil.copy(FIRST_GPU_RUN / "device.json", tmp_path / "device.json")
    shutil.copy(FIRST_GPU_RUN / "junit.xml", tmp_path / "junit.xml")
    bench.gpu.write_summary(tmp_path)
    first, *rest = (tmp_path / "summary.md").read_text().splitlines()
    assert first.startswith("torch 2.11.0+cu130 on this machine (CUDA 13.0); "), first
    assert f"the suite is verified with torch {verified} " in first
    assert rest[1].startswith("# GPU check, ") and rest[3].startswith("Device: 1 x ")
    assert "70 tests in 134 s: 34 passed, 35 failed, 1 errors" in "\n".join(rest)

    (tmp_path / "device.json").unlink()  # device info failed: the torch it runs
    bench.gpu.write_summary(tmp_path)
    first = (tmp_path / "summary.md").read_text().splitlines()[0]
    assert first.startswith(f"torch {torch.__version__} on this machine"), first
    if torch.__version__.split("+")[0] == verified:
        assert "the version the suite is verified with" in first


def simulate_bench(tmp_path, bench, monkeypatch, budget, compile_s):
    """bench/gpu.py's run_all with every section, each run taking the seconds its
    kind took on the first GPU machine (run1's results.json; a compile run
    `compile_s`), on a clock of its own: nothing launched. Its report's runs."""
    gpu = bench.gpu
    measured = json.loads((FIRST_GPU_RUN / "bench" / "results.json").read_text())
    took = {
        (r["contender"], r["amp"], r["compile"]): r["job_wall_s"]
        for r in measured["runs"]
        if "job_wall_s" in r
    }
    clock = [0.0]

    def generate_project(template, out_dir, *answers):
        clock[0] += 10  # before the first run, about 20 s there
        Path(out_dir).mkdir(parents=True)
        return Path(out_dir)

    def run_one(contender, options, project, nproc, workdir, tag, steps):
        seconds = (
            compile_s if options.compile else took[(contender, options.amp, False)]
        )
        clock[0] += seconds
        log = Path(workdir) / f"{tag}_{contender}.log"
        log.write_text("")
        return {
            "job_wall_s": seconds,
            "log": str(log),
            "steady_samples_per_s": 100.0,
            "steady_step_ms": 160.0,
            "first_step_from_launch_s": 10.0,
        }

    monkeypatch.setattr(gpu, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(gpu.run, "generate_project", generate_project)
    monkeypatch.setattr(gpu.run, "run_one", run_one)
    monkeypatch.setattr(gpu.run, "template_version", lambda template: None)
    monkeypatch.setattr(gpu.gpt, "make_gpt_project", lambda p, out, size: p)
    args = SimpleNamespace(
        out=str(tmp_path / "bench"),
        budget=budget,
        sections=",".join(gpu.SECTIONS),
        contenders=None,
        rounds=2,
        model="gpt2-small",
        batch_size=16,
        steps=50,
        warmup_steps=10,
        lr=0.001,
        template=str(TEMPLATE),
        cpu_smoke=True,  # one process, no device queried
    )
    report = gpu.run_all(args, torch)
    assert report == json.loads((tmp_path / "bench" / "results.json").read_text())
    return report["runs"]


def test_every_bench_section_runs_once_before_any_runs_again(
    tmp_path, bench, monkeypatch
):
    """With the first GPU run's budget (363 s) and eager run lengths, and compile runs
    as long as on the second machine (49 s): the compile section runs in the first
    round (the first run skipped it, guessing 150 s, and spent 69 s on second runs of
    three bf16 contenders instead); what does not fit is the last float32 run, and
    then no run starts a second time."""
    rows = {
        (c, amp, compiled)
        for s in bench.gpu.SECTIONS.values()
        for c, amp, compiled in s
    }
    runs = simulate_bench(tmp_path, bench, monkeypatch, budget=363, compile_s=49)
    first = [r for r in runs if r["round"] == 1]
    assert {(r["contender"], r["amp"], r["compile"]) for r in first} == rows
    assert [r["contender"] for r in first if r["compile"]] == [
        "handwritten",
        "generated",
    ]
    assert all("steady_samples_per_s" in r for r in first if r["compile"])
    skipped = [(r["contender"], r["amp"]) for r in first if "skipped" in r]
    assert skipped == [("fabric", "none")]
    assert all("s of the budget left" in r["skipped"] for r in first if "skipped" in r)
    second = [r for r in runs if r["round"] == 2]
    assert len(second) == len(rows)
    assert not [r for r in second if "steady_samples_per_s" in r]  # none started
    assert all(
        r["skipped"].startswith("round 2 starts only where every run of round 1 ran")
        and "fabric (none)" in r["skipped"]
        for r in second
    )

    # Time enough for every section once, and some more: second runs, after all.
    runs = simulate_bench(
        tmp_path / "more", bench, monkeypatch, budget=560, compile_s=49
    )
    rounds = [r["round"] for r in runs if "steady_samples_per_s" in r]
    assert rounds[: len(rows)] == [1] * len(rows) and 2 in rounds
    assert rounds == sorted(rounds)


def test_bench_gpu_mode_refuses_without_cuda(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCH / "gpu.py"), "--out", str(tmp_path / "out")],
        env={**os.environ, **NO_GPU},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 3
    lines = (result.stdout + result.stderr).splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_bench_gpu_mode_runs_tiny_on_cpu(tmp_path):
    """One run of the GPU mode's pieces end to end (a generated project with the
    tiny GPT, launched by torchrun on gloo): the numbers land in results.json and
    the table."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(BENCH / "gpu.py"), "--cpu-smoke", "--out", str(out)]
        + [
            "--sections",
            "frameworks-fp32",
            "--contenders",
            "generated",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "results.json").read_text())
    [run] = report["runs"]
    assert run["contender"] == "generated" and run["amp"] == "none"
    assert run["steps"] == 6 and run["group_size"] == 1
    assert run["steady_samples_per_s"] > 0 and run["mfu"] is None
    assert run["tokens_per_s"] == pytest.approx(run["steady_samples_per_s"] * 32)
    table = (out / "bench.md").read_text()
    assert "| generated | fp32 (TF32) | no | 1 | " in table
    assert (out / "logs" / "r1_none_generated.log").is_file()
