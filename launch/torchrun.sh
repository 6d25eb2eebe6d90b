#!/usr/bin/env bash
# Launch a grpo-mega job with torchrun (c10d rendezvous), on one node or many.
#
# Every setting is an environment override with a default; everything after the
# options is passed through to the entry module as config overrides.
#
#   # one node, all of its GPUs:
#   CONFIG=launch/configs/llama3_8b.yaml launch/torchrun.sh
#   # node 1 of 4 (run the same line on every node, NODE_RANK=0..3):
#   NNODES=4 NODE_RANK=1 MASTER_ADDR=node001 CONFIG=launch/configs/qwen2.5_32b.yaml \
#       launch/torchrun.sh --algorithm.steps=200
#   # what would run / the derived layout and memory budget, without starting anything:
#   launch/torchrun.sh --dry-run
#   CONFIG=launch/configs/llama3_70b.yaml launch/torchrun.sh --check-config
#   # the same config's parallel pattern on this machine (CPU is fine), tiny widths, 2 steps:
#   CONFIG=launch/configs/llama3_70b.yaml launch/torchrun.sh --shrink
#
# A training run needs the paths start-up requires, as overrides (every launch/configs and
# examples file leaves them null): --model.hf_checkpoint=DIR --data.train_path=FILE
# --data.eval_path=FILE. With --model.hf_checkpoint, --check-config validates the checkpoint's
# shape (its config.json), as the trainer will.
#
# Options (before any override): --dry-run, --check-config, --shrink, -h/--help.
#   --check-config  the trainer's own start-up validation (only the GPU probes for FP8 and
#                   Triton are skipped) and the per-GPU memory budget; a config the trainer
#                   would refuse fails here, before a job queues.
#   --shrink        tools/shrink_config.py: every parallel axis above 1 becomes 2, the engine's
#                   ranks per replica keep their ratio to TP, the model keeps its family at tiny
#                   widths on the demo data; runs 2 steps on this node (world <= 8). Overrides
#                   apply to CONFIG before shrinking. SHRINK_DIR holds the result [a new temp dir].
#
# Environment (defaults in brackets):
#   ENTRY           module to run with `python -m`, or a path ending in .py [grpo_mega.train]
#   CONFIG          YAML config passed as --config (none: defaults + overrides) []
#   NNODES          nodes in the job [1]
#   NPROC_PER_NODE  ranks per node [GPUs in CUDA_VISIBLE_DEVICES, else from nvidia-smi, else 1]
#   NODE_RANK       this node's index, 0..NNODES-1; node 0 hosts the rendezvous store [0]
#   MASTER_ADDR     address of node 0; REQUIRED when NNODES > 1 [127.0.0.1 on one node]
#   MASTER_PORT     rendezvous port on MASTER_ADDR [29500 multi-node; a free port on one node]
#   RDZV_ID         rendezvous id shared by all nodes of one job [$SLURM_JOB_ID or grpo-mega]
#   RDZV_TIMEOUT    seconds to wait for all nodes to join [900]
#   MAX_RESTARTS    worker-group restarts torchrun attempts before failing [0]
#   TORCHRUN_LOG_DIR  per-rank stdout/stderr files under this directory (torchrun --log-dir) []
#   PYTHON          interpreter that has grpo_mega installed [python]
#   SKIP_CONFIG_CHECK=1  skip the pre-launch layout check (for entries without a grpo config)
#
# Under torchrun's c10d rendezvous the global rank order comes from the
# rendezvous, not from NODE_RANK; NODE_RANK only decides which agent hosts the
# TCP store (node 0), so a late or dead worker node never takes the store down.
#
# Network and collective knobs (set them in the environment; they pass through):
#   NCCL_SOCKET_IFNAME=eth0   NIC for NCCL bootstrap/socket traffic (also GLOO_SOCKET_IFNAME
#                             for gloo); set it when nodes have several interfaces, e.g. docker0.
#   NCCL_IB_HCA=mlx5_0,mlx5_1 InfiniBand/RoCE adapters to use; NCCL_IB_DISABLE=1 forces TCP.
#   NCCL_IB_GID_INDEX=3       RoCE v2 GID index on many Ethernet fabrics.
#   NCCL_DEBUG=INFO           print topology/transport choices (WARN is quieter);
#                             NCCL_DEBUG_SUBSYS=INIT,NET narrows it.
#   FI_PROVIDER=efa           AWS EFA through the aws-ofi-nccl plugin.
#   NCCL_NVLS_ENABLE=0        disable NVLink SHARP if collectives hang on first use.
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1  (torch default) abort the process when a collective
#                             times out, so a dead node ends the job within
#                             --parallel.timeout_minutes instead of hanging it.
#   TORCH_NCCL_DUMP_ON_TIMEOUT=1  write flight-recorder traces when that happens.
#   CUDA_DEVICE_MAX_CONNECTIONS=1  megatron's recommendation for TP comm/compute overlap;
#                             set here by default.
#   OMP_NUM_THREADS=1         one CPU thread per rank (set here by default; more threads per
#                             rank oversubscribe the cores and slow gloo ranks a lot).
set -euo pipefail

die() { echo "torchrun.sh: error: $*" >&2; exit 2; }

MODE=run
ARGS=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) MODE=dry-run ;;
        --check-config) MODE=check-config ;;
        --shrink) MODE=shrink ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) ARGS+=("$arg") ;;
    esac
done

# ---------------------------------------------------------------- settings
if [[ $MODE == shrink ]]; then
    [[ -n ${CONFIG:-} ]] || die "--shrink needs CONFIG=<scale config>"
    SHRINK_DIR=${SHRINK_DIR:-$(mktemp -d -t grpo-shrink-XXXXXX)}
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    out=$("${PYTHON:-python}" "$here/tools/shrink_config.py" --config "$CONFIG" --out "$SHRINK_DIR" \
          "${ARGS[@]}" | tail -n 1) || die "could not shrink $CONFIG"
    [[ $out =~ ^WORLD=([0-9]+)\ CONFIG=(.+)$ ]] || die "tools/shrink_config.py said: $out"
    NNODES=1 NODE_RANK=0 NPROC_PER_NODE=${BASH_REMATCH[1]} CONFIG=${BASH_REMATCH[2]}
    unset MASTER_ADDR
    ARGS=()
    MODE=run
    echo "[torchrun.sh] shrunk to $CONFIG (world $NPROC_PER_NODE)" >&2
fi
USER_SET_WORLD=${NNODES:+1}${NPROC_PER_NODE:+1}
ENTRY=${ENTRY:-grpo_mega.train}
CONFIG=${CONFIG:-}
PYTHON=${PYTHON:-python}
NNODES=${NNODES:-1}
if [[ -z ${NPROC_PER_NODE:-} ]]; then
    NPROC_PER_NODE=1
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        # The GPUs this job may use, not every GPU of the node (nvidia-smi ignores the mask).
        IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
        [[ ${#visible[@]} -gt 0 && ${visible[0]} != -1 ]] && NPROC_PER_NODE=${#visible[@]}
    elif command -v nvidia-smi >/dev/null 2>&1; then
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
        [[ ${gpus:-0} -gt 0 ]] && NPROC_PER_NODE=$gpus
    fi
fi
NODE_RANK=${NODE_RANK:-0}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-grpo-mega}}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-900}
MAX_RESTARTS=${MAX_RESTARTS:-0}
TORCHRUN_LOG_DIR=${TORCHRUN_LOG_DIR:-}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

# ------------------------------------------------- fail fast, before torchrun
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
is_uint "$NNODES" && (( NNODES >= 1 )) || die "NNODES=$NNODES must be a positive integer"
is_uint "$NPROC_PER_NODE" && (( NPROC_PER_NODE >= 1 )) \
    || die "NPROC_PER_NODE=$NPROC_PER_NODE must be a positive integer"
is_uint "$NODE_RANK" && (( NODE_RANK < NNODES )) \
    || die "NODE_RANK=$NODE_RANK must be an integer in 0..$((NNODES - 1)) (NNODES=$NNODES)"
if (( NNODES > 1 )); then
    [[ -n ${MASTER_ADDR:-} || $MODE == check-config ]] || die "MASTER_ADDR is not set: with NNODES=$NNODES every node needs" \
        "the address of node 0 (e.g. MASTER_ADDR=\$(scontrol show hostnames \"\$SLURM_JOB_NODELIST\" | head -n1))"
    MASTER_PORT=${MASTER_PORT:-29500}
else
    MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
    MASTER_PORT=${MASTER_PORT:-0}   # 0: the store picks a free port (single node only)
fi
is_uint "$MASTER_PORT" || die "MASTER_PORT=$MASTER_PORT must be a port number"
WORLD_SIZE=$((NNODES * NPROC_PER_NODE))

CONFIG_ARGS=()
if [[ -n $CONFIG ]]; then
    [[ -f $CONFIG ]] || die "CONFIG=$CONFIG does not exist"
    CONFIG_ARGS=(--config "$CONFIG")
fi

CHECK=("$PYTHON" -m grpo_mega.preflight.budget "${CONFIG_ARGS[@]}")
if [[ $MODE == check-config ]]; then
    # Without an explicit NNODES/NPROC_PER_NODE the layout is taken from the config.
    [[ -n $USER_SET_WORLD ]] && CHECK+=(--world-size "$WORLD_SIZE" --gpus-per-node "$NPROC_PER_NODE")
    exec "${CHECK[@]}" "${ARGS[@]}"
fi
if [[ ${SKIP_CONFIG_CHECK:-0} != 1 ]]; then
    # The trainer's start-up checks, once, before any rank: a world size that TP x PP x DP
    # cannot fill would hang a collective; a bad value, a missing data file or a model folder
    # without a tokenizer would fail every rank, each with its traceback, under torchrun's block.
    [[ $MODE == run && $ENTRY == grpo_mega.train ]] && CHECK+=(--require-paths)
    if ! out=$("${CHECK[@]}" --world-size "$WORLD_SIZE" --validate-only "${ARGS[@]}" 2>&1 >/dev/null); then
        # The check's own one-line verdict (its other output, if any, is library noise).
        msg=$(grep -E '^(config|layout) error: ' <<< "$out" | tail -n 1 || true)
        case $msg in
            "layout error: "*)
                die "NNODES x NPROC_PER_NODE = $NNODES x $NPROC_PER_NODE = world size $WORLD_SIZE does not" \
                    "fit the config${CONFIG:+ $CONFIG}: ${msg#layout error: }" ;;
            "config error: "*) die "${msg#config error: }" ;;
            *) die "the pre-launch check (${CHECK[*]} --validate-only) failed:"$'\n'"$out" ;;
        esac
    fi
fi

# ------------------------------------------------------------- the command
distributed=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --node-rank "$NODE_RANK")
rdzv_conf="join_timeout=$RDZV_TIMEOUT"
(( NNODES > 1 )) && rdzv_conf+=",is_host=$([[ $NODE_RANK == 0 ]] && echo 1 || echo 0)"
rendezvous=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
            --rdzv-conf "$rdzv_conf")
fault_tolerance=(--max-restarts "$MAX_RESTARTS")
logs=()
[[ -n $TORCHRUN_LOG_DIR ]] && logs=(--log-dir "$TORCHRUN_LOG_DIR" --tee 3)
if [[ $ENTRY == *.py ]]; then entry=("$ENTRY"); else entry=(-m "$ENTRY"); fi

CMD=("$PYTHON" -m torch.distributed.run "${distributed[@]}" "${rendezvous[@]}"
     "${fault_tolerance[@]}" "${logs[@]}" "${entry[@]}" "${CONFIG_ARGS[@]}" "${ARGS[@]}")

if [[ $MODE == dry-run ]]; then
    printf 'OMP_NUM_THREADS=%q CUDA_DEVICE_MAX_CONNECTIONS=%q' "$OMP_NUM_THREADS" "$CUDA_DEVICE_MAX_CONNECTIONS"
    printf ' %q' "${CMD[@]}"
    printf '\n'
    exit 0
fi
echo "[torchrun.sh] node $NODE_RANK/$NNODES x $NPROC_PER_NODE ranks (world $WORLD_SIZE)," \
     "rendezvous $MASTER_ADDR:$MASTER_PORT id $RDZV_ID, entry $ENTRY" >&2
exec "${CMD[@]}"
