#!/usr/bin/env bash
# Train on this machine: one process per GPU, or 2 on a machine without one.
#   ./run_single.sh                      # defaults
#   NPROC_PER_NODE=4 ./run_single.sh --epochs 20 --batch-size 64
{% if cookiecutter.launcher == "torchrun" %}
#   MAX_RESTARTS=3 ./run_single.sh       # restart all workers (from the last
#                                        # checkpoint) when one fails
{% endif %}
# Any arguments are passed to main_multi_gpu.py (see python main_multi_gpu.py --help).
# Exit status: 0 when done; 2 for an argument that cannot work (nothing started);
# 130 after Ctrl-C, 143 after SIGTERM, 129 after SIGHUP (a checkpoint was saved); 1 for
# a failure.
set -euo pipefail

# A variable that must be a whole number from $2 up: one line and exit 2 otherwise.
require_number() {
  if [[ ! "${!1}" =~ ^[0-9]+$ ]] || ((10#${!1} < $2)); then
    echo "error: $1 must be a whole number of at least $2, not '${!1}'" >&2
    exit 2
  fi
}

{% if cookiecutter.launcher == "torchrun" %}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE="$(python3 -c 'import torch; print(torch.cuda.device_count() or 2)')"
fi
require_number NPROC_PER_NODE 1
MAX_RESTARTS="${MAX_RESTARTS:-0}"
require_number MAX_RESTARTS 0

# main_multi_gpu.py runs torchrun itself, in its own process: it checks the arguments
# first, and a failure, Ctrl-C or SIGTERM then ends in one line and the exit status
# above. --standalone: a private rendezvous on a free local port.
torchrun="--standalone --nproc-per-node=${NPROC_PER_NODE} --max-restarts=${MAX_RESTARTS}"
exec python3 "$(dirname "$0")/main_multi_gpu.py" --torchrun="${torchrun}" "$@"
{% else %}
if [[ -n "${NPROC_PER_NODE:-}" ]]; then
  require_number NPROC_PER_NODE 1
fi
# main_multi_gpu.py starts its own worker processes (by default one per GPU, or 2).
exec python3 "$(dirname "$0")/main_multi_gpu.py" \
  ${NPROC_PER_NODE:+"--nproc-per-node=${NPROC_PER_NODE}"} "$@"
{% endif %}
