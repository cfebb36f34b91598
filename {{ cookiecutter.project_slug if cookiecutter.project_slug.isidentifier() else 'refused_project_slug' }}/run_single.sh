{% if cookiecutter.launcher == "torchrun" %}
#!/usr/bin/env bash
# Train on this machine: one process per GPU, or 2 on a machine without one.
#   ./run_single.sh                      # defaults
#   NPROC_PER_NODE=4 ./run_single.sh --epochs 20 --batch-size 64
# Any arguments are passed to main_multi_gpu.py (see ./main_multi_gpu.py --help).
set -euo pipefail

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE="$(python3 -c 'import torch; print(torch.cuda.device_count() or 2)')"
fi

# --standalone: a private rendezvous on a free local port, nothing to configure.
exec torchrun --standalone --nproc-per-node="${NPROC_PER_NODE}" \
  "$(dirname "$0")/main_multi_gpu.py" "$@"
{% else %}
#!/usr/bin/env bash
# Train on this machine: one process per GPU, or 2 on a machine without one.
#   ./run_single.sh                      # defaults
#   NPROC_PER_NODE=4 ./run_single.sh --epochs 20 --batch-size 64
# Any arguments are passed to main_multi_gpu.py (see ./main_multi_gpu.py --help),
# which starts its own worker processes.
set -euo pipefail

exec python3 "$(dirname "$0")/main_multi_gpu.py" \
  ${NPROC_PER_NODE:+"--nproc-per-node=${NPROC_PER_NODE}"} "$@"
{% endif %}
