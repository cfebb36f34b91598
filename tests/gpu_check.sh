#!/usr/bin/env bash
# The first run on a GPU machine, in one command: the tests marked `gpu`, then a short
# GPU bench (bench/gpu.py), within 9 minutes, every result in one folder.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: tests/gpu_check.sh [--out DIR] [--only tests|bench] [--sections LIST] [--workers N]
       tests/gpu_check.sh --prepare | --list | --help

On a machine with a CUDA GPU (one or more), within 9 minutes:
  1. stop at once, in one line (exit 3), where python3 has no torch or no CUDA
  2. a venv, .gpu_venv, that sees python3's packages (CUDA torch, Accelerate, Lightning)
  3. install from .gpu_wheels/, without a network, each package not importable yet
  4. the device, driver and versions, and a matmul's speed: DIR/device.json
  5. python -m pytest tests -m gpu, at most 200 s: DIR/pytest.log, DIR/junit.xml
  6. bench/gpu.py with the time left: DIR/bench/ (results.json, bench.md, logs/);
     every section runs once before any runs a second time
  7. DIR/summary.md: the machine's torch first, then the device, the tests and the
     bench table, ready for the README
DIR: --out, else $OUT/gpu_check when $OUT is set, else bench/results/gpu/<UTC time>.

  --prepare         here, with a network: download those wheels (for Python 3.12,
                    manylinux x86_64) into .gpu_wheels/, to carry to the GPU machine
  --list            print the steps with their commands, run nothing
  --only tests      steps 1-5 and 7; --only bench: steps 1-4, 6 and 7
  --sections LIST   bench/gpu.py's sections (default: all, in its order)
  --workers N       pytest-xdist workers for the tests (default 12)
Environment: PYTHON (default python3), GPU_CHECK_VENV (default .gpu_venv),
GPU_CHECK_TOTAL_S (default 540) and GPU_CHECK_TESTS_S (default 200): the time caps.
EOF
}

PYTHON=${PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-.gpu_venv}
WHEELS=.gpu_wheels
GPU_PYTHON=3.12 # the GPU machine's Python, for --prepare
TOTAL_S=${GPU_CHECK_TOTAL_S:-540} # the whole check: under 9 minutes (a call's limit: 10)
# The tests' share, at most: on the second GPU machine (one H200, 12 workers) all 71
# took 162 s (bench/results/gpu/2026-11-28-h200); what they leave goes to the bench,
# whose runs without compile took 219 s there (and its set-up about 20 s more).
TESTS_S=${GPU_CHECK_TESTS_S:-200}
TEST_TIMEOUT_S=180
# What the gpu tests (and the projects they generate) and bench/gpu.py import that a
# machine with CUDA torch, Accelerate, Lightning, pytest and pytest-xdist may lack, as
# requirement:module. tensorboard: tests/test_features.py imports it.
PACKAGES=(
  cookiecutter==2.7.1:cookiecutter
  pytest-timeout==2.4.0:pytest_timeout
  tensorboard==2.21.0:tensorboard
  tqdm:tqdm
  pytest==9.0.3:pytest
  pytest-xdist==3.8.0:xdist
)
CUDA_CHECK='
import sys
try:
    import torch
except Exception as err:
    print(f"{sys.executable} has no torch ({type(err).__name__})")
    sys.exit(1)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__}: torch.cuda.is_available() is False")
    sys.exit(1)
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
'

mode=run
only=""
sections=""
workers=12
out_dir=""
while (($#)); do
  case "$1" in
    -h | --help)
      usage
      exit 0
      ;;
    --prepare) mode=prepare ;;
    --list | --dry-run) mode=list ;;
    --out | --only | --sections | --workers)
      if (($# < 2)); then
        echo "gpu_check.sh: $1 needs a value (--help)" >&2
        exit 2
      fi
      case "$1" in
        --out) out_dir=$2 ;;
        --only) only=$2 ;;
        --sections) sections=$2 ;;
        --workers) workers=$2 ;;
      esac
      shift
      ;;
    *)
      echo "gpu_check.sh: unknown argument '$1' (--help lists them)" >&2
      exit 2
      ;;
  esac
  shift
done
if [[ -n $only && $only != tests && $only != bench ]]; then
  echo "gpu_check.sh: --only takes tests or bench, not '$only'" >&2
  exit 2
fi
if [[ -z $out_dir ]]; then
  if [[ -n ${OUT:-} ]]; then
    out_dir=$OUT/gpu_check
  else
    out_dir=bench/results/gpu/$(date -u +%Y%m%d-%H%M%S)
  fi
fi

prepare() {
  local requirements=("${PACKAGES[@]%%:*}")
  rm -rf "$WHEELS"
  "$PYTHON" -m pip download --quiet --only-binary=:all: --implementation cp \
    --python-version "$GPU_PYTHON" --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --dest "$WHEELS" pip "${requirements[@]}"
  # tensorboard's numpy (16 MB) is there already: Accelerate and Lightning need it.
  rm -f "$WHEELS"/numpy-*.whl
  local kib
  kib=$(du -sk "$WHEELS" | cut -f1)
  echo "$WHEELS: $(find "$WHEELS" -name '*.whl' | wc -l) wheels, $((kib / 1024)) MiB"
  if ((kib > 50 * 1024)); then
    echo "gpu_check.sh: $WHEELS is over 50 MiB: the GPU machine takes 64 MiB in all" >&2
    exit 1
  fi
}

gpu_test_files() { grep -l '^@pytest\.mark\.gpu' tests/test_*.py | tr '\n' ' '; }

list_steps() {
  local requirements=("${PACKAGES[@]%%:*}")
  echo "steps of tests/gpu_check.sh (results in $out_dir):"
  echo "1 check   $PYTHON: import torch; torch.cuda.is_available(), else one line, exit 3"
  echo "2 venv    $PYTHON -m venv --system-site-packages --without-pip $VENV"
  echo "3 install from $WHEELS/ (pip --no-index), each one not importable: ${requirements[*]}"
  echo "4 device  bench/gpu.py --device-info $out_dir/device.json"
  echo "5 tests   timeout $TESTS_S python -m pytest tests -m gpu -n $workers" \
    "--timeout $TEST_TIMEOUT_S --junitxml $out_dir/junit.xml > $out_dir/pytest.log" \
    "(marked gpu in: $(gpu_test_files))"
  echo "6 bench   timeout <what is left of ${TOTAL_S} s> bench/gpu.py --out $out_dir/bench" \
    "--budget <the same> ${sections:+--sections $sections }> $out_dir/bench.log" \
    "(runs bench/run.py's contenders: bench/handwritten_ddp.py bench/generated_entry.py" \
    "bench/accelerate_loop.py bench/fabric_loop.py, model bench/gpt.py)"
  echo "7 summary bench/gpu.py --report $out_dir > $out_dir/summary.md"
}

check_cuda() {
  local said
  if said=$("$PYTHON" -c "$CUDA_CHECK" 2>/dev/null); then
    echo "gpu_check.sh: $said"
  else
    echo "gpu_check.sh: no CUDA GPU here (${said:-$PYTHON did not run}): nothing run"
    exit 3
  fi
}

make_venv() {
  if [[ ! -x $VENV/bin/python ]]; then
    "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
  fi
  # python3 may itself be a venv's: a venv made from it sees the base installation's
  # packages, not that venv's. A .pth file adds the site folders it would miss.
  local outer
  outer=$("$PYTHON" -c 'import sys; print("\n".join(sys.path))')
  rm -f "$VENV"/lib/python*/site-packages/gpu_check_outer.pth # from an earlier run
  "$VENV/bin/python" - "$outer" <<'EOF'
import sys, sysconfig
folders = [p for p in sys.argv[1].splitlines() if p.endswith("-packages")]
missing = [p for p in folders if p not in sys.path]
with open(sysconfig.get_paths()["purelib"] + "/gpu_check_outer.pth", "w") as f:
    f.writelines(f"import site; site.addsitedir({p!r})\n" for p in missing)
print(f"venv {sys.prefix}: python3's site folders it lacked, added: {missing}")
EOF
  VIRTUAL_ENV=$(cd "$VENV" && pwd)
  export VIRTUAL_ENV
  export PATH="$VIRTUAL_ENV/bin:$PATH" # python3 of the tests and the run scripts
}

pip_in_venv() {
  if "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip "$@"
  else # no pip at all: the one brought along runs from its wheel
    local wheel
    wheel=$(find "$WHEELS" -name 'pip-*.whl' | head -n 1)
    "$VENV/bin/python" "$wheel/pip" "$@"
  fi
}

install_missing() {
  local entry requirement module
  for entry in "${PACKAGES[@]}"; do
    requirement=${entry%%:*}
    module=${entry##*:}
    if "$VENV/bin/python" -c "import $module" 2>/dev/null; then
      echo "  have $module"
    elif [[ ! -d $WHEELS ]]; then
      echo "  no $module, and no $WHEELS/: run tests/gpu_check.sh --prepare and carry it"
    elif pip_in_venv --isolated install --quiet --no-index --find-links "$WHEELS" \
      "$requirement"; then
      echo "  installed $requirement"
    else
      echo "  could not install $requirement: going on without it"
    fi
  done
}

run_tests() {
  local status=0 limit=()
  if python -c "import pytest_timeout" 2>/dev/null; then
    limit=(--timeout "$TEST_TIMEOUT_S")
  fi
  echo "tests: pytest -m gpu, at most $TESTS_S s ($out_dir/pytest.log)"
  # SIGINT at the cap: pytest stops, its tests end their jobs, junit.xml is written.
  timeout -s INT -k 30 "$TESTS_S" python -m pytest tests -m gpu -n "$workers" \
    -p no:cacheprovider "${limit[@]}" --continue-on-collection-errors \
    --junitxml "$out_dir/junit.xml" -q >"$out_dir/pytest.log" 2>&1 || status=$?
  echo "$status" >"$out_dir/tests_exit"
  tail -n 4 "$out_dir/pytest.log"
  return "$status"
}

run_bench() {
  local left=$((TOTAL_S - SECONDS - 25)) status=0 chosen=()
  if ((left < 60)); then
    echo "bench: not run, $left s left"
    return 1
  fi
  if [[ -n $sections ]]; then
    chosen=(--sections "$sections")
  fi
  echo "bench: bench/gpu.py, $left s ($out_dir/bench.log)"
  timeout -k 15 "$((left + 20))" python bench/gpu.py --out "$out_dir/bench" \
    --budget "$left" "${chosen[@]}" >"$out_dir/bench.log" 2>&1 || status=$?
  grep -E '^round ' "$out_dir/bench.log" || tail -n 5 "$out_dir/bench.log"
  return "$status"
}

case "$mode" in
  prepare)
    prepare
    exit 0
    ;;
  list)
    list_steps
    exit 0
    ;;
esac

check_cuda
mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)
exec > >(tee -a "$out_dir/gpu_check.log") 2>&1
make_venv
install_missing
python bench/gpu.py --device-info "$out_dir/device.json" || echo "device info failed"
tests_status=0
bench_status=0
if [[ $only != bench ]]; then
  run_tests || tests_status=$?
fi
if [[ $only != tests ]]; then
  run_bench || bench_status=$?
fi
python bench/gpu.py --report "$out_dir" >/dev/null || echo "no summary.md" >&2
cat "$out_dir/summary.md" 2>/dev/null || true
echo "gpu_check.sh: results in $out_dir ($SECONDS s; tests exit $tests_status, bench exit $bench_status)"
if ((tests_status != 0)); then
  exit "$tests_status"
fi
exit "$bench_status"
