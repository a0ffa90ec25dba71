#!/usr/bin/env bash
# The full-scale runtime on one GPU for one model, in one call of at most ~9 minutes: build the
# model (random bf16 weights), lossless check (live, batch 2), plan, measured runs (replay) for
# batch 1,4,16,64 x {plain, linear D=4, plan's choice}, profile of the runtime's own steps
# (python -m simtree.runtime.full.gpu_run; its phases are bounded by MAX_SECONDS and a failed
# phase does not stop the next).  Everything goes to $OUT/full_<model>.tgz; <model>_summary.md
# and <model>_log.txt also to $OUT.
#   bash scripts/full_run_gpu.sh qwen3.6-27b   (env OUT, MAX_SECONDS=480, ARGS="--replay t.jsonl", GPUTEST=1)
#   bash scripts/full_run_gpu.sh deepseek-v4-flash
set -uo pipefail
MODEL=${1:?usage: bash scripts/full_run_gpu.sh MODEL}
OUT=${OUT:-/tmp/out}
RES=/tmp/simtree_full/$MODEL     # many files; tarred into $OUT at the end ($OUT returns <= 8 files)
mkdir -p "$OUT" "$RES"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  > "$RES/gpu_state.csv" 2>&1
if [ -n "${GPUTEST:-}" ]; then   # GPUTEST=1: the runtime's GPU tests first (tiny models, ~1 min)
  timeout 150 python3 -m pytest -q -m gpu tests/test_full_gpu.py 2>&1 | tail -15 | tee "$RES/gputest.log"
fi
LIMIT=${MAX_SECONDS:-480}
# the session bounds its own phases; the timeout only catches a hang (the tar below still runs)
timeout -k 15 $((LIMIT + 45)) python3 -m simtree.runtime.full.gpu_run --model "$MODEL" --out "$RES" \
  --max-seconds "$LIMIT" ${ARGS:-}
rc=$?
[ $rc -eq 124 ] && echo "$(date +%T) gpu_run timed out: its files so far are kept" | tee -a "$RES/log.txt"
tar czf "$OUT/full_$MODEL.tgz" -C "$RES" .
for f in summary.md log.txt; do cp "$RES/$f" "$OUT/${MODEL}_$f" 2>/dev/null; done
ls -la "$OUT"
exit $rc
