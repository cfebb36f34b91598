#!/usr/bin/env bash
# Train on this machine: one process per GPU, or 2 on a machine without one.
#   ./run_single.sh                      # defaults
#   NPROC_PER_NODE=4 ./run_single.sh --epochs 20 --batch-size 64
{% if cookiecutter.launcher == "torchrun" %}
#   MAX_RESTARTS=3 ./run_single.sh       # restart all workers (from the last
#                                        # checkpoint) when one fails
{% endif %}
# Any arguments are passed to main_multi_gpu.py (see ./main_multi_gpu.py --help).
{% if cookiecutter.launcher == "spawn" %}
# main_multi_gpu.py starts its own worker processes.
{% endif %}
set -euo pipefail

{% if cookiecutter.launcher == "torchrun" %}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE="$(python3 -c 'import torch; print(torch.cuda.device_count() or 2)')"
fi
# Restarted workers rendezvous reliably on gloo only without the shared TCP store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# --standalone: a private rendezvous on a free local port, nothing to configure.
exec torchrun --standalone --nproc-per-node="${NPROC_PER_NODE}" \
  --max-restarts="${MAX_RESTARTS:-0}" "$(dirname "$0")/main_multi_gpu.py" "$@"
{% else %}
exec python3 "$(dirname "$0")/main_multi_gpu.py" \
  ${NPROC_PER_NODE:+"--nproc-per-node=${NPROC_PER_NODE}"} "$@"
{% endif %}
