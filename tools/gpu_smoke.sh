#!/usr/bin/env bash
# The first thing to run on a machine with one GPU (docs/guides/gpu.md, "First run on an
# offline GPU machine"). Two tiers:
#   lite  (default; at most 7 minutes, the checks' limits add up to 405 s) needs only the
#         machine's CUDA torch and triton plus the lite wheels (tools/wheelhouse.sh, ~3 MiB):
#         1. installs tools/wheels/lite.txt into $SITE (--no-deps, never over torch);
#         2. records the card, driver, torch, CUDA and megatron-core versions;
#         3. runs every `gpu`-marked test (the fused Triton loss in bf16 and fp32; megatron's
#            DDP and DistributedOptimizer at one NCCL rank with a checkpoint round trip);
#         4. benchmarks/gpu.py on the 1B shape at micro-batch 1 (train step with step time,
#            tokens/s and MFU vs the card's bf16 peak, reference forward, loss, export), each
#            row's peak GPU memory next to the budget's prediction for the same shape.
#   full  lite, then installs tools/wheels/full.txt (vLLM, TE) with its dependencies, and
#         trains the demo model 5 GRPO steps at world 1 (TE layers when TE imports) and
#         checks the vLLM engine's log-prob gap; a check whose package does not import is
#         recorded as skipped with the reason.
# Everything goes into one results file, benchmarks/results/gpu-<date>-<card>.md: the
# versions, one row per check (result, seconds, command), each failure's log tail, the
# benchmark table with its command and the budget it is compared with.
#
#   tools/gpu_smoke.sh --wheels DIR              # offline: pip --no-index --find-links DIR
#   tools/gpu_smoke.sh --wheels DIR --tier full
#   tools/gpu_smoke.sh                           # online: the same pins from the index
#   tools/gpu_smoke.sh --no-install              # use $PYTHON as it is
#   tools/gpu_smoke.sh --dry-run --wheels DIR    # print what would run; runs and writes nothing
#
# Environment (${VAR:-default}): PYTHON (python3: the machine's Python that holds torch),
# SITE (/tmp/grpo_mega_gpu_site: where the lite wheels go; grpo-mega itself runs from this
# checkout by PYTHONPATH, so nothing is built), GAP_MAX (0.05), RESULTS_DIR
# (benchmarks/results), WORK (a scratch directory for logs), pip's own PIP_* settings.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

DRY_RUN=0 INSTALL=1 WHEELS="" TIER=lite
while [[ $# -gt 0 ]]; do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --wheels) WHEELS=$2; shift ;;
        --tier) TIER=$2; shift ;;
        --no-install) INSTALL=0 ;;
        -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
        *) echo "gpu_smoke.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ $TIER == lite || $TIER == full ]] || { echo "gpu_smoke.sh: --tier is lite or full, not '$TIER'" >&2; exit 2; }
[[ -z $WHEELS || -d $WHEELS ]] || { echo "gpu_smoke.sh: --wheels $WHEELS is not a directory" >&2; exit 2; }
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/grpo_mega_gpu_site}
GAP_MAX=${GAP_MAX:-0.05}
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
WORK=${WORK:-/tmp/grpo_mega_gpu_smoke.$$}
export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

# The machine's torch is the one thing never replaced: pip gets a constraint pinning the
# installed version, so a requirement on another torch fails instead of downloading one.
# (read from the package metadata: importing torch takes seconds on a loaded machine)
TORCH_VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null) || {
    echo "gpu_smoke.sh: $PY cannot import torch; the smoke installs none (PYTHON=...)" >&2; exit 2; }
CONSTRAINTS=$WORK/torch-constraint.txt
pip_src=()
[[ -n $WHEELS ]] && pip_src=(--no-index --find-links "$WHEELS")

if [[ $DRY_RUN == 1 ]]; then
    RESULTS=/dev/null
    echo "[gpu-smoke] tier $TIER; PYTHONPATH=$PYTHONPATH; $CONSTRAINTS: torch==$TORCH_VERSION"
else
    mkdir -p "$WORK" "$RESULTS_DIR"
    echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
    DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    DEVICE=${DEVICE:-no-gpu}
    RESULTS=$RESULTS_DIR/gpu-$(date -u +%Y-%m-%d)-$(echo "$DEVICE" | tr -c 'A-Za-z0-9\n' '-' | sed 's/-*$//').md
    {
        echo
        echo "## tools/gpu_smoke.sh --tier $TIER, $(date -u +%FT%TZ) on $DEVICE ($(hostname -s))"
        echo
        echo "| check | result | seconds | command | detail |"
        echo "|---|---|---|---|---|"
    } >> "$RESULTS"
fi
FAILED=0 NOTES=()

# check NAME LIMIT_S CMD...: run it with a time limit, append one row to the results file
# (its log's tail, or on failure keep the tail for the failures section), go on either way.
check() {
    local name=$1 limit=$2; shift 2
    local shown
    shown=$(printf '%q ' "$@")
    if [[ $DRY_RUN == 1 ]]; then
        echo "[gpu-smoke] $name (limit ${limit}s): $shown"
        return 0
    fi
    local log=$WORK/$name.log start rc detail
    start=$(date +%s)
    echo "[gpu-smoke] $name ..."
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    detail=$(grep -v '^\s*$' "$log" | tail -n 3 | tr '\n|' ' /' | cut -c1-300)
    if [[ $rc == 0 ]]; then
        echo "| $name | PASS | $(( $(date +%s) - start )) | \`${shown% }\` | $detail |" >> "$RESULTS"
    else
        FAILED=$((FAILED + 1))
        [[ $rc == 124 || $rc == 137 ]] && detail="timed out after ${limit}s; $detail"
        echo "| $name | FAIL (exit $rc) | $(( $(date +%s) - start )) | \`${shown% }\` | $detail |" >> "$RESULTS"
        NOTES+=("### $name failed (exit $rc): the last 40 lines of its log" '```' "$(tail -n 40 "$log")" '```')
    fi
    echo "[gpu-smoke] $name: exit $rc (log $log)"
}

# skip NAME REASON: a check that cannot run here, recorded with its reason.
skip() {
    echo "[gpu-smoke] $1: skipped, $2"
    [[ $DRY_RUN == 1 ]] || echo "| $1 | SKIP | 0 | | $2 |" >> "$RESULTS"
}

# 1. the lite wheels into $SITE: --no-deps (each wheel's needs are listed or in the image),
#    binaries only (nothing is built, so no setuptools wheel is needed), the torch constraint.
if [[ $INSTALL == 1 ]]; then
    check install-lite 45 "$PY" -m pip install "${pip_src[@]}" --no-deps --only-binary=:all: \
        --upgrade --target "$SITE" -c "$CONSTRAINTS" -r tools/wheels/lite.txt
fi

# 2. what this machine is: the card, driver, torch, CUDA, Python, megatron-core (from $SITE), triton
# (-W ignore: megatron warns once per module that TE and apex are absent)
check versions 30 "$PY" -W ignore benchmarks/gpu.py --versions

# 3. every gpu-marked test (the files are found by their mark, so a new one is never left out)
mapfile -t GPU_TESTS < <(grep -rlE '^\s*(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu)\b' tests \
                         --include='test_*.py' | sort)
check gpu-tests 150 "$PY" -m pytest -q -rfEs -m gpu "${GPU_TESTS[@]}"

# 4. the 1B shape, local spec unless TE imports; the table (with its command and budget) is
#    copied into the results file below
check bench-1b 180 "$PY" benchmarks/gpu.py --models 1b --micro-batch 1 --repeats 3 --out-dir "$WORK/bench"

if [[ $TIER == full ]]; then
    # 5. vLLM and TE with their dependencies, resolved against the installed torch: into
    #    the Python's own environment (a --target would install a second torch).
    [[ $INSTALL == 1 ]] && check install-full 120 "$PY" -m pip install "${pip_src[@]}" -c "$CONSTRAINTS" \
        -r tools/wheels/full.txt
    IMPL=local VLLM_ERR=""
    if [[ $DRY_RUN == 0 ]]; then
        "$PY" -c "import transformer_engine.pytorch" >/dev/null 2>&1 && IMPL=transformer_engine
        VLLM_ERR=$("$PY" -c "import vllm" 2>&1 | tail -n 1)
        [[ $IMPL == local ]] && skip transformer-engine "TE does not import; the demo runs megatron's local layers"
    fi
    ASSETS=grpo_mega/assets/demo_v1
    RUN=$WORK/demo_world1
    check demo-convert 40 "$PY" tools/convert_checkpoint.py hf-to-mcore --no-progress --overwrite \
        --hf-dir "$ASSETS/hf" --out "$RUN/init_mcore"
    if [[ -n $VLLM_ERR ]]; then
        skip "demo-5-steps-$IMPL" "vllm does not import: ${VLLM_ERR//|//}"
        skip sync-logprob-gap "needs the demo run (vllm does not import)"
    else
        # 6. the demo model, 5 GRPO steps at world 1 on the GPU
        check "demo-5-steps-$IMPL" 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
            -m grpo_mega.train --config grpo_mega/configs/demo.yaml --parallel.tp=1 --rollout.tp=1 \
            --model.transformer_impl=$IMPL --algorithm.steps=5 --data.eval_every=0 \
            --checkpoint.save_every=0 --logging.tensorboard=false --rollout.verify_sync=true \
            "--model.hf_checkpoint=$ASSETS/hf" "--model.init_checkpoint=$RUN/init_mcore" \
            "--data.train_path=$ASSETS/train.jsonl" "--data.eval_path=$ASSETS/eval.jsonl" \
            "--logging.run_dir=$RUN"
        # 7. the vLLM GPU engine samples what the trainer computes: mean |log-prob gap| per step
        check sync-logprob-gap 10 "$PY" - "$RUN/metrics.jsonl" "$GAP_MAX" <<'EOF'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "rollout_logp_gap" in l]
gaps = [r["rollout_logp_gap"] for r in rows]
print("rollout_logp_gap per step:", ", ".join(f"{g:.2e}" for g in gaps))
sys.exit(0 if gaps and all(math.isfinite(g) and abs(g) <= float(sys.argv[2]) for g in gaps) else 1)
EOF
    fi
fi

if [[ $DRY_RUN == 0 ]]; then
    {
        echo
        [[ -f $WORK/versions.log ]] && { echo "Versions (\`benchmarks/gpu.py --versions\`):"; echo '```';
                                         cat "$WORK/versions.log"; echo '```'; }
        [[ -f $WORK/gpu-tests.log ]] && { echo "### gpu-tests, pytest's summary"; echo '```';
                                          tail -n 15 "$WORK/gpu-tests.log"; echo '```'; }
        for f in "$WORK"/bench/*.md; do [[ -f $f ]] && { echo; sed 's/^# /### /' "$f"; }; done
        for line in "${NOTES[@]}"; do echo "$line"; done
    } >> "$RESULTS"
    echo "[gpu-smoke] $FAILED check(s) failed; results in $RESULTS"
fi
[[ $FAILED == 0 ]]
