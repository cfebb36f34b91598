#!/usr/bin/env bash
# Train on several machines: run this once on every machine; only NODE_RANK differs.
#   machine 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_multi.sh
#   machine 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./run_multi.sh
# MASTER_ADDR is machine 0's address, reachable from every machine, and MASTER_PORT
# (default 29500) must be open on it. Where machines have several network interfaces,
# name the one that connects them, on every machine, before running:
#   export NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0
# Any arguments are passed to main_multi_gpu.py (see ./main_multi_gpu.py --help).
set -euo pipefail

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE="$(python3 -c 'import torch; print(torch.cuda.device_count() or 2)')"
fi

echo "rendezvous: node ${NODE_RANK} of ${NNODES}, ${NPROC_PER_NODE} processes per node," \
  "master ${MASTER_ADDR}:${MASTER_PORT}"
{% if cookiecutter.launcher == "torchrun" %}
exec torchrun --nnodes="${NNODES}" --node-rank="${NODE_RANK}" \
  --nproc-per-node="${NPROC_PER_NODE}" \
  --master-addr="${MASTER_ADDR}" --master-port="${MASTER_PORT}" \
  "$(dirname "$0")/main_multi_gpu.py" "$@"
{% else %}
exec python3 "$(dirname "$0")/main_multi_gpu.py" --nnodes="${NNODES}" --node-rank="${NODE_RANK}" \
  --nproc-per-node="${NPROC_PER_NODE}" \
  --master-addr="${MASTER_ADDR}" --master-port="${MASTER_PORT}" "$@"
{% endif %}
