#!/usr/bin/env bash
# Train on several machines: run this once on every machine; only NODE_RANK differs.
#   machine 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_multi.sh
#   machine 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./run_multi.sh
# MASTER_ADDR is machine 0's address, reachable from every machine, and MASTER_PORT
# (default 29500) must be open on it. NPROC_PER_NODE: processes per machine (default:
# one per GPU). DIST_TIMEOUT: seconds to wait for the other machines (default 600).
{% if cookiecutter.launcher == "torchrun" %}
# MAX_RESTARTS: how often torchrun restarts all workers after a failure (default 0).
#
# Elastic: NNODES=MIN:MAX (e.g. 2:4), and the same command on every machine (no
# NODE_RANK). Machines may be lost or join while the run goes on: the others restart
# from the last checkpoint (--save-every N) with its global batch, as long as MIN
# remain, the machine that holds MASTER_ADDR among them (it hosts the rendezvous),
# and --output-dir is on a disk every machine shares. Or RDZV_FILE=/shared/path: the
# rendezvous in that file on the shared disk, so that any machine may be lost.
# MAX_RESTARTS defaults to 10 there (a lost machine takes one).
#   every machine:  NNODES=2:4 MASTER_ADDR=10.0.0.1 ./run_multi.sh --save-every 50
{% endif %}
# Gloo and NCCL are told to use the network interface that reaches MASTER_ADDR; to
# choose another, set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (e.g. eth0) yourself.
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

NNODES="${NNODES:-1}"
{% if cookiecutter.launcher == "torchrun" %}
elastic=""
if [[ "${NNODES}" =~ ^([0-9]+):([0-9]+)$ ]]; then
  elastic="${NNODES}"
  if ((10#${BASH_REMATCH[1]} < 1 || 10#${BASH_REMATCH[1]} > 10#${BASH_REMATCH[2]})); then
    echo "error: NNODES=MIN:MAX needs 1 <= MIN <= MAX, not '${NNODES}'" >&2
    exit 2
  elif [[ -n "${NODE_RANK:-}" ]]; then
    echo "error: NODE_RANK is not used with NNODES=${NNODES}: every machine runs the" \
      "same command (torchrun numbers them); unset it" >&2
    exit 2
  fi
  NNODES="${BASH_REMATCH[2]}"  # for the checks below
fi
{% else %}
if [[ "${NNODES}" == *:* ]]; then
  echo "error: NNODES=${NNODES}: elastic membership (MIN:MAX) needs the torchrun" \
    "launcher (this project starts its processes with torch.multiprocessing); give" \
    "the number of machines" >&2
  exit 2
fi
{% endif %}
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
export DIST_TIMEOUT="${DIST_TIMEOUT:-600}"  # main_multi_gpu.py reads it too
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE="$(python3 -c 'import torch; print(torch.cuda.device_count() or 2)')"
fi
require_number NNODES 1
require_number NODE_RANK 0
require_number NPROC_PER_NODE 1
require_number MASTER_PORT 1
if ((10#${NODE_RANK} >= 10#${NNODES})); then
  echo "error: NODE_RANK must be below NNODES (${NNODES}), not ${NODE_RANK}" >&2
  exit 2
elif ((10#${MASTER_PORT} > 65535)); then
  echo "error: MASTER_PORT must be at most 65535, not ${MASTER_PORT}" >&2
  exit 2
fi
{% if cookiecutter.launcher == "torchrun" %}
MAX_RESTARTS="${MAX_RESTARTS:-$([[ -n "${elastic}" ]] && echo 10 || echo 0)}"
require_number MAX_RESTARTS 0
{% endif %}

# Left alone, gloo binds the address this machine's host name resolves to, often one
# the other machines cannot reach. Use the interface holding the source address of the
# route to MASTER_ADDR (on machine 0, the interface that holds MASTER_ADDR itself).
iface=""
if ! command -v ip >/dev/null; then
  echo "network: 'ip' not found; if the job hangs, set GLOO_SOCKET_IFNAME and" \
    "NCCL_SOCKET_IFNAME to the interface that reaches ${MASTER_ADDR}"
else
  master_ip="$(getent ahosts "${MASTER_ADDR}" | awk '{ print $1; exit }' || true)"
  src="$(ip route get "${master_ip:-${MASTER_ADDR}}" 2>/dev/null \
    | sed -n 's/.* src \([^ ]*\).*/\1/p' || true)"
  if [[ -n "${src}" ]]; then
    iface="$(ip -o addr show to "${src}" | awk '{ print $2; exit }' || true)"
  fi
  if [[ -z "${iface}" ]]; then
    echo "network: warning: no route from this machine to ${MASTER_ADDR}"
  elif [[ "${iface}" == lo && "${NNODES}" != 1 ]]; then
    echo "network: warning: ${MASTER_ADDR} is this machine's loopback address, which" \
      "other machines cannot reach; use machine 0's address on their network"
  fi
fi
network=""
for var in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME; do
  if [[ -n "${!var:-}" ]]; then
    network+=" ${var}=${!var} (yours)"
  elif [[ -n "${iface}" ]]; then
    export "${var}=${iface}"
    network+=" ${var}=${iface} (reaches ${MASTER_ADDR})"
  fi
done
if [[ -n "${network}" ]]; then
  echo "network:${network}"
fi

{% if cookiecutter.launcher == "torchrun" %}
# Elastic: the machine that holds MASTER_ADDR hosts the rendezvous (torchrun's own
# guess goes by what the host name resolves to, often another address; it is left to
# guess only without `ip`). The check below is then the host's.
host=""
if [[ -n "${src:-}" ]]; then
  host=$([[ "${src}" == "${master_ip}" ]] && echo 1 || echo 0)
fi
if [[ -n "${elastic}" ]]; then
  NODE_RANK=$([[ "${host}" == 1 && -z "${RDZV_FILE:-}" ]] && echo 0 || echo 1)
fi
{% endif %}
# Machine 0 hosts the rendezvous on MASTER_PORT: stop now if something else holds it.
# Bound as TCPStore binds it (SO_REUSEADDR): a port left in TIME_WAIT counts as free.
if [[ "${NODE_RANK}" == 0 ]] \
  && ! python3 -c 'import socket, sys; socket.create_server(("", int(sys.argv[1])))' \
    "${MASTER_PORT}" 2>/dev/null; then
  echo "error: MASTER_PORT ${MASTER_PORT} is in use on this machine; choose another," \
    "e.g. MASTER_PORT=$((MASTER_PORT + 1))" >&2
  exit 1
fi

{% if cookiecutter.launcher == "torchrun" %}
# main_multi_gpu.py runs torchrun itself, in its own process: it checks the arguments
# first, and a failure, Ctrl-C or SIGTERM then ends in one line and the exit status
# above.
torchrun="--nproc-per-node=${NPROC_PER_NODE} --max-restarts=${MAX_RESTARTS}"
if [[ -z "${elastic}" ]]; then
  echo "rendezvous: node ${NODE_RANK} of ${NNODES}, ${NPROC_PER_NODE} processes per" \
    "node, master ${MASTER_ADDR}:${MASTER_PORT}, timeout ${DIST_TIMEOUT} s"
  torchrun+=" --nnodes=${NNODES} --node-rank=${NODE_RANK}"
  torchrun+=" --master-addr=${MASTER_ADDR} --master-port=${MASTER_PORT}"
  torchrun+=" --rdzv-conf=timeout=${DIST_TIMEOUT}"
else
  # torchrun's c10d rendezvous (main_multi_gpu.py names it "elastic": it tells the
  # workers each round), with a new round formed within seconds of a change. A
  # machine is dropped from the rendezvous after 12 s without a heartbeat (one each
  # 2 s): a lost one is noticed at once anyway (its sockets close), and a busy one
  # (its CPU shared several times over) is not taken for lost.
  conf="join_timeout=${DIST_TIMEOUT},last_call_timeout=2"
  conf+=",keep_alive_interval=2,keep_alive_max_attempt=6"
  if [[ -n "${RDZV_FILE:-}" ]]; then
    where="file ${RDZV_FILE}"
    torchrun+=" --rdzv-endpoint=${RDZV_FILE} --rdzv-conf=${conf},store_type=file"
  else
    where="${MASTER_ADDR}:${MASTER_PORT}"
    if [[ "${host}" == 1 ]]; then
      where+=", hosted here"
    fi
    torchrun+=" --rdzv-endpoint=${MASTER_ADDR}:${MASTER_PORT}"
    torchrun+=" --rdzv-conf=${conf}${host:+,is_host=${host}}"
  fi
  echo "rendezvous: elastic, ${elastic/:/ to } machines, ${NPROC_PER_NODE} processes" \
    "per machine, at ${where}, up to ${MAX_RESTARTS} restarts"
  torchrun+=" --nnodes=${elastic} --rdzv-backend=elastic"
fi
exec python3 "$(dirname "$0")/main_multi_gpu.py" --torchrun="${torchrun}" "$@"
{% else %}
echo "rendezvous: node ${NODE_RANK} of ${NNODES}, ${NPROC_PER_NODE} processes per node," \
  "master ${MASTER_ADDR}:${MASTER_PORT}, timeout ${DIST_TIMEOUT} s"
exec python3 "$(dirname "$0")/main_multi_gpu.py" --nnodes="${NNODES}" \
  --node-rank="${NODE_RANK}" --nproc-per-node="${NPROC_PER_NODE}" \
  --master-addr="${MASTER_ADDR}" --master-port="${MASTER_PORT}" "$@"
{% endif %}
