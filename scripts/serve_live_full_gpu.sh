#!/usr/bin/env bash
# The online controller live on a full-scale model (MODEL: qwen3.6-27b, one GPU, or deepseek-v4-flash, its
# ep=8 rank with FP8 experts; random weights, bf16), the
# batch changing phase by phase; measured TPOT against the serving benchmark's prediction, OUT OF
# SAMPLE: costs frozen (the shipped bundle of the GPU's kind, H100 or H200, fitted in an earlier session: nothing is profiled
# or fitted here), acceptance replayed (sharegpt's acceptance model, as the modes runs replay it;
# random weights accept nothing) -> $OUT/serve_live_full.csv and $OUT/live_full_run.tgz (logs).
# Every tier of the controller (DEFAULT_TIERS within the bundle's draft range: plain, linear
# D=2..7, 7 EAGLE trees) is built and captured in each phase's engine.  On an H100 (2026-12-07) the
# whole call took 111 s (install, build, 6 phases of 64 tokens, each phase's engine capturing its 14
# tiers, and the GPU test); the timeouts bound it to about 295 s; a GPU test of the tiers' replays
# under graphs runs in the time left.
#   OUT=/tmp/out bash scripts/serve_live_full_gpu.sh          (env MODEL, PHASES, NEW_TOKENS, COSTS)
# then, at home, its section of reports/bench_serve/README.md:
#   .venv/bin/python -m simtree.serving.live_report OUT/serve_live_full.csv --full-scale --readme reports/bench_serve/README.md
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RES=${RES:-/tmp/serve_live_full}; rm -rf "$RES"; mkdir -p "$RES"
trap 'cp "$RES/serve_live_full.csv" "$OUT/" 2>/dev/null; tar czf "$OUT/live_full_run.tgz" -C "$RES" .; true' EXIT
# shellcheck source=scripts/gpu_install.sh
source scripts/gpu_install.sh
gpu_log "$RES/log.txt"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$gpu" in *H200*) kind=h200 ;; *) kind=h100 ;; esac     # the shipped bundle of this GPU's kind
MODEL=${MODEL:-qwen3.6-27b}
case "$MODEL" in deepseek-v4-flash) tag=ep8 ;; *) tag=tp1 ;; esac
COSTS=${COSTS:-simtree/data/costs/${kind}_${MODEL}_${tag}.json}
log "install"
timeout 60 bash -c 'source scripts/gpu_install.sh && gpu_install' || log "editable install FAILED"
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$RES/log.txt" 2>&1
case "$COSTS:$gpu" in *h100*:*H100*|*h200*:*H200*) ;; *) log "WARNING: $COSTS on a $gpu: another device's costs";; esac
log "serve_live: $MODEL bf16, replay sharegpt, costs $COSTS (frozen), phases ${PHASES:-1,16,4,8,16,1}"
left=$(( 285 - ($(date +%s) - START) )); [ "$left" -lt 60 ] && { log "only ${left}s left after the install: 60 s given"; left=60; }
# in the background and waited for, so that a TERM to this script (an outer timeout) reaches it: bash
# runs a trap only once its foreground command has returned
timeout -k 5 "$left" python3 scripts/serve_live.py --model "$MODEL" --dtype bf16 \
    --replay sharegpt --random-prompts 256,511 --costs "$COSTS" --no-warmup --device cuda \
    --phases "${PHASES:-1,16,4,8,16,1}" --new-tokens "${NEW_TOKENS:-64}" --out "$RES/serve_live_full.csv" \
    > "$RES/serve_live.log" 2>&1 &
child=$!
trap 'kill -TERM "$child" 2>/dev/null; cat "$RES/serve_live.log"; exit 143' TERM
wait "$child"; rc=$?
trap - TERM
cat "$RES/serve_live.log"
[ "$rc" -ne 0 ] && log "serve_live exited with $rc (the phases it finished are in the CSV)"
# then, in the time left (<= 60 s), the GPU case of tests/test_live_full.py: tiers switching under CUDA
# graphs, each drafted round accepting its own tier's replay row (skipped where pytest is missing)
left=$(( 292 - ($(date +%s) - START) )); [ "$left" -gt 60 ] && left=60
if [ "$left" -gt 20 ] && python3 -c "import pytest" 2>/dev/null; then
  timeout -k 3 "$left" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_live_full.py > "$RES/gpu_tests.log" 2>&1 \
    && log "gpu test: $(tail -1 "$RES/gpu_tests.log")" \
    || { trc=$?; [ "$trc" -eq 124 ] && log "gpu test timed out after ${left}s" || log "gpu test FAILED ($trc)"
         tail -15 "$RES/gpu_tests.log"; }
else
  log "gpu test skipped (${left}s left, or no pytest)"
fi
log "done"
