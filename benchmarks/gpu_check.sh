#!/usr/bin/env bash
# The GPU path measured in one run of at most ten minutes: gpu_smoke.py, then --preset gpu rows, each row's JSON
# written as soon as it ends (benchmarks/gpu_check.py says what runs in which order and what each row holds).
#
#   bash benchmarks/gpu_check.sh [--budget 540] [--bundle DIR] [--results DIR] [--out DIR] [gpu_check.py flags]
#   bash benchmarks/gpu_check.sh --dry_run          # the same path on the CPU: tiny task, tiny BERT, a few steps
#
# The budget (seconds) counts from this script's start, the bundle's set-up included. With a bundle (default
# outputs/gpu_bundle, made by `python benchmarks/gpu_bundle.py` for a machine without network) it is unpacked under
# $GPU_CHECK_STAGE (default /tmp/gpu_check_stage; a second run on the same machine reuses it): its packages go first on
# PYTHONPATH, its encoder and datasets are used where the checkout has none. Without one (one's own GPU, with
# network) the installed packages are used: pip install -e '.[benchmarks,faiss]'.
# $OUT (the device tool's result folder), or --out, receives gpu_check.log, gpu_env.json, gpu_smoke.json and
# gpu_rows.jsonl as they are written; --results (default outputs/gpu_check) keeps them and each row's training log.
set -uo pipefail
START=$(date +%s)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE="$REPO/outputs/gpu_bundle"
STAGE=${GPU_CHECK_STAGE:-/tmp/gpu_check_stage}
RESULTS="$REPO/outputs/gpu_check"
OUT_DIR=${OUT:-}
DRY=0
PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) BUNDLE=$2; shift 2 ;;
        --results) RESULTS=$2; shift 2 ;;
        --out) OUT_DIR=$2; shift 2 ;;
        --dry_run) DRY=1; PASS+=("$1"); shift ;;
        *) PASS+=("$1"); shift ;;
    esac
done
# the interpreter: $PYTHON, else the checkout's .venv, else python3 (the GPU image's holds torch)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"
else PY=python3; fi

mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
if [ -n "$OUT_DIR" ]; then mkdir -p "$OUT_DIR"; LOG="$OUT_DIR/gpu_check.log"; fi
exec > >(tee "$LOG") 2>&1
TEE=$!
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "gpu_check.sh: $(date -u +%FT%TZ), $PY, results $RESULTS${OUT_DIR:+, out $OUT_DIR}"

if [ "$DRY" = 0 ] && [ -f "$BUNDLE/manifest.json" ]; then
    echo "gpu_check.sh: unpacking $BUNDLE into $STAGE"
    "$PY" "$REPO/benchmarks/gpu_bundle.py" --restore "$BUNDLE" "$STAGE" || { echo "gpu_check.sh: the bundle did not unpack"; exit 1; }
    export PYTHONPATH="$STAGE/site${PYTHONPATH:+:$PYTHONPATH}"
    # transformers asks for Hub kernels by default; the bundle carries no `kernels` (no network to fetch them, and the
    # BERT encoders here have none): gpu_bundle.py's BUNDLE_ENV
    export USE_HUB_KERNELS=0 GPU_CHECK_BUNDLE="$BUNDLE" GPU_CHECK_DATA="$STAGE/data"
    if [ -f "$STAGE/minilm/config.json" ]; then export GPU_CHECK_ENCODER="$STAGE/minilm"; fi
    echo "gpu_check.sh: unpacked in $(( $(date +%s) - START )) s"
fi
OUT_ARGS=()
if [ -n "$OUT_DIR" ]; then OUT_ARGS=(--out "$OUT_DIR"); fi
"$PY" "$REPO/benchmarks/gpu_check.py" --started_at "$START" --results "$RESULTS" "${OUT_ARGS[@]}" "${PASS[@]}"
STATUS=$?
echo "gpu_check.sh: exit $STATUS after $(( $(date +%s) - START )) s"
exec >&- 2>&-  # tee sees the end of its input and writes the log's last lines before this script returns
wait "$TEE" 2>/dev/null
exit $STATUS
