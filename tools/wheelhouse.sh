#!/usr/bin/env bash
# Download, on a connected machine, the wheels a tier of the offline GPU smoke needs, for
# the GPU machine's Python and platform (default: CPython 3.12, manylinux x86_64), into one
# directory to copy there; tools/gpu_smoke.sh --wheels DIR installs from it with no network.
# The pins live in tools/wheels/<tier>.txt (one list for both scripts, so they cannot drift).
#
#   tools/wheelhouse.sh                         # lite tier into .cache/gpu-wheels/lite
#   tools/wheelhouse.sh --tier lite --dest DIR  # into DIR
#   tools/wheelhouse.sh --tier full             # + vLLM and Transformer Engine (see below)
#   tools/wheelhouse.sh --dry-run               # print the pinned list and the pip command
#
# Tiers:
#   lite  megatron-core 0.19.2 and the small pure packages grpo-mega imports that a CUDA
#         torch image lacks (math-verify and its two dependencies): about 2.7 MiB; the
#         script fails if the directory's wheels exceed MAX_MIB (default 5, issue 39).
#   full  lite + vllm==0.26.0 + Transformer Engine 2.20.2 for CUDA 13. LARGE (vLLM ~290 MiB,
#         TE's core ~700 MiB) and it needs a matching CUDA: vLLM 0.26.0 pins torch 2.11.0,
#         the cu13 TE core fits torch's +cu130 build. vLLM's ~45 own dependencies are not
#         in the list (bring them from a mirror), nor is TE's torch part, a source archive
#         to compile where torch and CUDA match (tools/wheels/full.txt says how).
#
# Environment (${VAR:-default}): PYTHON (python3; the pip that downloads), PY_VERSION (3.12),
# IMPLEMENTATION (cp), PLATFORMS (the manylinux x86_64 tags below, plus "any"), MAX_MIB (5 for
# lite, none for full), pip's own PIP_* settings (index, proxy).
set -euo pipefail
cd "$(dirname "$0")/.."

TIER=lite DEST="" DRY_RUN=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --tier) TIER=$2; shift ;;
        --dest) DEST=$2; shift ;;
        --dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
        *) echo "wheelhouse.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ $TIER == lite || $TIER == full ]] || { echo "wheelhouse.sh: --tier is lite or full, not '$TIER'" >&2; exit 2; }
# The full tier downloads lite.txt too: full.txt holds only what it adds.
LISTS=(tools/wheels/lite.txt)
[[ $TIER == full ]] && LISTS+=(tools/wheels/full.txt)
DEST=${DEST:-.cache/gpu-wheels/$TIER}
PYTHON=${PYTHON:-python3}
PY_VERSION=${PY_VERSION:-3.12}
IMPLEMENTATION=${IMPLEMENTATION:-cp}
# pip matches a manylinux tag exactly, so every glibc level a wheel may be tagged with is named.
PLATFORMS=${PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any}
if [[ $TIER == lite ]]; then MAX_MIB=${MAX_MIB:-5}; else MAX_MIB=${MAX_MIB:-0}; fi

# pins FILE: the requirement lines of FILE, nested -r files followed, comments dropped.
pins() {
    local line
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line%%#*}
        line=$(echo "$line" | xargs)
        [[ -z $line ]] && continue
        if [[ $line == "-r "* ]]; then pins "$(dirname "$1")/${line#-r }"; else echo "$line"; fi
    done < "$1"
}

cmd=("$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION"
     --implementation "$IMPLEMENTATION")
for p in $PLATFORMS; do cmd+=(--platform "$p"); done
cmd+=(-d "$DEST")
for f in "${LISTS[@]}"; do cmd+=(-r "$f"); done

echo "[wheelhouse] tier $TIER, Python $PY_VERSION ($IMPLEMENTATION), pinned in ${LISTS[*]}:"
for f in "${LISTS[@]}"; do pins "$f"; done | sed 's/^/  /'
if [[ $DRY_RUN == 1 ]]; then
    printf '[wheelhouse] would run: '; printf '%q ' "${cmd[@]}"; printf '\n'
    exit 0
fi
mkdir -p "$DEST"
"${cmd[@]}"
echo "[wheelhouse] $DEST:"
ls -l "$DEST" | sed 1d
bytes=$(find "$DEST" -maxdepth 1 -type f \( -name '*.whl' -o -name '*.tar.gz' \) -printf '%s\n' | awk '{s+=$1} END {print s+0}')
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.2f", b / 1048576}')
echo "[wheelhouse] total $mib MiB ($bytes bytes)"
if [[ $MAX_MIB != 0 ]] && awk -v m="$mib" -v lim="$MAX_MIB" 'BEGIN {exit !(m > lim)}'; then
    echo "[wheelhouse] $mib MiB is over the $TIER tier's limit of $MAX_MIB MiB" >&2
    exit 1
fi
echo "[wheelhouse] copy $DEST to the GPU machine, then: tools/gpu_smoke.sh --wheels DIR --tier $TIER"
