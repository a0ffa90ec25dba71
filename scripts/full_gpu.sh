#!/usr/bin/env bash
# One GPU session of the full runtime for one model, in one call of at most ~9 minutes:
#   (a) the profile sweep of the runtime's own layer calls (simtree/data/sweeps/full_layers_gpu.yaml,
#       variant layers; <= 3 min) -> profile/profile.csv with its composed model_verify_step rows;
#   (b) lossless check (2 prompts x 5 policies, batch 2, live), (c) measured runs (replay, gsm8k)
#       for batch 1,4,16,64 x {plain, linear D=4, the shipped plan's choice, best-first, cost_aware,
#       batch_alloc, 2 EAGLE shapes} (every mode a plan may name), (d) the runtime's whole verify steps at a few (b, n, l) and its draft steps over the (b, s, k) grid
#       (python -m simtree.runtime.full.gpu_run, bounded by RUNTIME_SECONDS).
# A failed phase is logged and the next runs; progress lines carry timestamps.  Everything is in
# $OUT/full_<model>.tgz, plus <model>_log.txt and <model>_summary.md (<= 8 files in $OUT).
# The fit, plan and predictions from this profile run at home: bash scripts/full_report.sh DIR.
# The whole call stays within TOTAL_SECONDS (default 525: a 9-minute call with room to spare); the
# runtime phases get what the sweep leaves; $OUT is packed after the sweep and again at the end.
#   bash scripts/full_gpu.sh qwen3.6-27b        (env OUT, TOTAL_SECONDS=525, SWEEP_MINUTES=3, GPUTEST=1,
#                                                 ARGS="--replay t.jsonl" for gpu_run, DEPLOYMENT)
#   bash scripts/full_gpu.sh deepseek-v4-flash
#   DEPLOYMENT=tp=2 bash scripts/full_gpu.sh qwen3.6-27b    (the sweep of the tp=2 rank's layers only)
# DEPLOYMENT (default: the model's shipped one, simtree/data/deployments.yaml: V4-Flash ep=8, Qwen
# tp=1) goes to the sweep (rows tagged with it, pieces at its shard shapes) and to gpu_run; the
# runtime builds only Qwen at tp=1 and the V4 ep=8 rank, so other deployments skip (b-d).
set -uo pipefail
MODEL=${1:?usage: bash scripts/full_gpu.sh MODEL}
OUT=${OUT:-/tmp/out}
NAME=$MODEL${DEPLOYMENT:+_${DEPLOYMENT//[^a-z0-9]/}}   # a deployment asked for by name: in the files' names
RES=/tmp/simtree_full/$NAME      # many files; tarred into $OUT at the end (one folder per session, so two in a call stay apart)
mkdir -p "$OUT" "$RES/profile"
LOG="$RES/log.txt"
START=$(date +%s)
log() { echo "[$(date +%T) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
pack() {
  tar czf "$OUT/full_$NAME.tgz" -C "$RES" .
  cp "$LOG" "$OUT/${NAME}_log.txt" 2>/dev/null
  cp "$RES/summary.md" "$OUT/${NAME}_summary.md" 2>/dev/null
  ls -la "$OUT"
}
trap pack EXIT
log "session $MODEL: install"
source "$(dirname "$0")/gpu_install.sh"
gpu_install || log "editable install FAILED"
DEPLOYMENT=${DEPLOYMENT:-$(python3 -m simtree.deploy.shipped --default-for "$MODEL")}
RUNTIME_DEPLOYMENT=$(python3 - "$MODEL" "$DEPLOYMENT" <<'PY'
import sys
from simtree.runtime.full.gpu_run import runtime_deployment
try:
    print(runtime_deployment(sys.argv[1], sys.argv[2]))
except Exception as exc:
    print(f"none: {exc}")
PY
)
log "deployment $DEPLOYMENT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  > "$RES/gpu_state.csv" 2>&1
if [ -n "${GPUTEST:-}" ]; then   # GPUTEST=1: the layers' and the runtime's GPU tests first (~1-2 min)
  log "GPU tests"
  timeout 150 python3 -m pytest -q -m gpu tests/test_layers_fused.py tests/test_full_gpu.py 2>&1 | tail -15 >> "$LOG"
fi
SWEEP_MINUTES=${SWEEP_MINUTES:-3}
log "(a) profile sweep of the runtime's layers, <= $SWEEP_MINUTES min"
timeout -k 5 $(( SWEEP_MINUTES * 60 + 40 )) python3 -m simtree.profiler.sweep --sweep full_layers_gpu \
  --model "$MODEL" --deployment "$DEPLOYMENT" --out "$RES/profile/profile.csv" --max-minutes "$SWEEP_MINUTES" \
  --no-progress >> "$LOG" 2>&1
rc=$?; [ $rc -ne 0 ] && log "(a) sweep exited with $rc (its points so far are kept)"
pack > /dev/null
if [[ "$RUNTIME_DEPLOYMENT" == none:* ]]; then
  log "(b-d) skipped: ${RUNTIME_DEPLOYMENT#none: }"
  log "done"
  exit 0
fi
TOTAL=${TOTAL_SECONDS:-525}
RUNTIME_SECONDS=$(( TOTAL - ($(date +%s) - START) - 35 ))   # 35 s: the runtime's exit and the packing
[ $RUNTIME_SECONDS -gt 330 ] && RUNTIME_SECONDS=330
log "(b-d) lossless, measured runs, whole steps, <= $RUNTIME_SECONDS s"
# gpu_run logs its own timestamped lines into log.txt; its raw output goes to gpu_run.out
timeout -k 5 $(( RUNTIME_SECONDS + 20 )) python3 -m simtree.runtime.full.gpu_run --model "$MODEL" --deployment "$DEPLOYMENT" \
  --out "$RES" --max-seconds "$RUNTIME_SECONDS" ${ARGS:-} > "$RES/gpu_run.out" 2>&1
rc=$?; [ $rc -ne 0 ] && log "(b-d) gpu_run exited with $rc (its files so far are kept; see gpu_run.out)"
log "done"
