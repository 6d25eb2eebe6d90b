#!/usr/bin/env bash
# The first thing to run on a machine with one GPU (README "GPU"). In at most 10 minutes
# (the checks' limits add up to 580 s):
#   1. installs the GPU stack from wheels into a fresh venv (or --target DIR);
#   2. runs the gpu-marked tests;
#   3. trains the demo model 5 steps at world 1 on the GPU (Transformer Engine layers when
#      TE imports, else megatron's local ones, said in the record);
#   4. checks the log-prob gap between the vLLM GPU engine (synced every step) and the trainer;
#   5. runs benchmarks/gpu.py's smallest rows (1B).
# Every check is appended to benchmarks/results/<date>-<device>.md as soon as it ends, with
# its exit code and the tail of its log; a failing check is recorded and the next one runs.
#
#   tools/gpu_smoke.sh                       # fresh venv .venv-gpu (sees the preinstalled torch)
#   tools/gpu_smoke.sh --wheels DIR          # offline: install only from the wheels in DIR
#   tools/gpu_smoke.sh --target DIR          # pip install --target DIR instead of a venv
#   tools/gpu_smoke.sh --no-install          # use $PYTHON (default python3) as it is
#   tools/gpu_smoke.sh --dry-run             # print what would run; runs and writes nothing
#
# Environment: PYTHON (the base interpreter), GAP_MAX (largest accepted mean |log-prob gap|,
# default 0.05), RESULTS_DIR (default benchmarks/results), pip's own PIP_* settings.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

DRY_RUN=0 MODE=venv DEST=.venv-gpu WHEELS=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --target) MODE=target DEST=$2; shift ;;
        --venv) MODE=venv DEST=$2; shift ;;
        --no-install) MODE=none ;;
        --wheels) WHEELS=$2; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "gpu_smoke.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
BASE_PY=${PYTHON:-python3}
GAP_MAX=${GAP_MAX:-0.05}
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
STAMP=$(date -u +%Y-%m-%d)
WORK=${WORK:-/tmp/grpo_mega_gpu_smoke.$$}
pip_src=()
[[ -n $WHEELS ]] && pip_src=(--no-index --find-links "$WHEELS")

case $MODE in
    venv) PY=$DEST/bin/python ;;
    target) PY=$BASE_PY; export PYTHONPATH=$REPO/$DEST:$REPO${PYTHONPATH:+:$PYTHONPATH} ;;
    none) PY=$BASE_PY; export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} ;;
esac

if [[ $DRY_RUN == 1 ]]; then
    DEVICE=dry-run RESULTS=/dev/null
else
    mkdir -p "$WORK" "$RESULTS_DIR"
    DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    DEVICE=${DEVICE:-no-gpu}
    RESULTS=$RESULTS_DIR/$STAMP-$(echo "$DEVICE" | tr -c 'A-Za-z0-9\n' '-' | sed 's/-*$//').md
    {
        echo
        echo "## gpu_smoke.sh, $(date -u +%FT%TZ) on $DEVICE ($(hostname -s))"
        echo
        echo "| check | result | seconds | detail |"
        echo "|---|---|---|---|"
    } >> "$RESULTS"
fi
FAILED=0

# check NAME TIMEOUT_S CMD...: run it, append one row to the results file, go on either way.
check() {
    local name=$1 limit=$2; shift 2
    if [[ $DRY_RUN == 1 ]]; then
        printf '[gpu-smoke] %s (limit %ss): ' "$name" "$limit"; printf '%q ' "$@"; printf '\n'
        return 0
    fi
    local log=$WORK/$name.log start rc detail
    start=$(date +%s)
    echo "[gpu-smoke] $name ..."
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    detail=$(grep -v '^\s*$' "$log" | tail -n 3 | tr '\n|' ' /' | cut -c1-300)
    if [[ $rc == 0 ]]; then
        echo "| $name | PASS | $(( $(date +%s) - start )) | $detail |" >> "$RESULTS"
    else
        FAILED=$((FAILED + 1))
        [[ $rc == 124 || $rc == 137 ]] && detail="timed out after ${limit}s; $detail"
        echo "| $name | FAIL (exit $rc) | $(( $(date +%s) - start )) | $detail |" >> "$RESULTS"
    fi
    echo "[gpu-smoke] $name: exit $rc (log $log)"
}

# 1. the GPU stack, from wheels (pip honours PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL as well)
case $MODE in
    venv)
        # --system-site-packages: the machine's CUDA torch is reused, not downloaded again.
        check install-venv 20 "$BASE_PY" -m venv --system-site-packages "$DEST"
        check install-gpu-stack 160 "$PY" -m pip install "${pip_src[@]}" -e ".[gpu,test]" ;;
    target)
        check install-gpu-stack 180 "$BASE_PY" -m pip install "${pip_src[@]}" --target "$DEST" ".[gpu,test]" ;;
esac

# 2. the gpu-marked tests
check gpu-tests 90 "$PY" -m pytest -q -m gpu tests

# 3. the demo model, 5 GRPO steps at world 1 on the GPU, TE layers when TE imports
IMPL=local
[[ $DRY_RUN == 1 ]] || { "$PY" -c "import transformer_engine.pytorch" >/dev/null 2>&1 && IMPL=transformer_engine; }
ASSETS=grpo_mega/assets/demo_v1
RUN=$WORK/demo_world1
check "demo-convert" 40 "$PY" tools/convert_checkpoint.py hf-to-mcore --no-progress --overwrite \
    --hf-dir "$ASSETS/hf" --out "$RUN/init_mcore"
check "demo-5-steps-$IMPL" 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m grpo_mega.train --config grpo_mega/configs/demo.yaml --parallel.tp=1 --rollout.tp=1 \
    --model.transformer_impl=$IMPL --algorithm.steps=5 --data.eval_every=0 \
    --checkpoint.save_every=0 --logging.tensorboard=false --rollout.verify_sync=true \
    "--model.hf_checkpoint=$ASSETS/hf" "--model.init_checkpoint=$RUN/init_mcore" \
    "--data.train_path=$ASSETS/train.jsonl" "--data.eval_path=$ASSETS/eval.jsonl" \
    "--logging.run_dir=$RUN"

# 4. the vLLM GPU engine samples what the trainer computes: mean |log-prob gap| per step
check sync-logprob-gap 10 "$PY" - "$RUN/metrics.jsonl" "$GAP_MAX" <<'EOF'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "rollout_logp_gap" in l]
gaps = [r["rollout_logp_gap"] for r in rows]
print("rollout_logp_gap per step:", ", ".join(f"{g:.2e}" for g in gaps))
sys.exit(0 if gaps and all(math.isfinite(g) and abs(g) <= float(sys.argv[2]) for g in gaps) else 1)
EOF

# 5. benchmarks/gpu.py, smallest rows; its table is copied into the results file
check bench-1b 110 "$PY" benchmarks/gpu.py --models 1b --repeats 3 --out-dir "$WORK/bench"
if [[ $DRY_RUN == 0 ]]; then
    for f in "$WORK"/bench/*.md; do [[ -f $f ]] && { echo; sed 's/^# /### /' "$f"; } >> "$RESULTS"; done
    echo "[gpu-smoke] $FAILED check(s) failed; results in $RESULTS"
fi
[[ $FAILED == 0 ]]
