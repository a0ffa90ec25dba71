#!/usr/bin/env bash
# The block drafters' costs on the GPU, both targets, in one call of < 8 minutes:
#   (a) correctness first, <= 70 s: tests/test_drafter_stage_round.py (the profile stage's round
#       builds node for node the trees the runtime's block round builds from the same drafter
#       state: float64 on the CPU, bf16 on the GPU, every family, both target families) and the
#       drafters' GPU tests (tests/test_drafters.py -m gpu: the backbone's Triton path against the
#       float64 torch reference, a CUDA-graph replay equal to the eager round);
#   (b) the sweep simtree/data/sweeps/drafters_gpu.yaml per model (draft_block, draft_dspark,
#       draft_tfm; variant round: the runtime's own draft code; contexts 256 and 1024; bf16; every
#       round captured in a CUDA graph and replayed), <= SWEEP_SECONDS a model, into one table;
#   (c) the fit of every drafter family per model and context (simtree.costs.drafter_fit, the
#       convex programs of C_d) with its held-out error -> drafters_fit.csv, <= 70 s.
# Everything lands in $OUT: drafters_profile.csv (+ .meta.json, .points.jsonl), drafters_fit.csv,
# tests.txt, log.txt.  At home, `simtree fit` of a profile holding these rows beside the verify
# rows puts the drafters' C_d in the bundle (key "drafters").
#   OUT=/tmp/out bash scripts/drafters_gpu.sh        (env SWEEP_SECONDS=120 per model, MODELS="a b")
# Time: install ~0.5 min + checks <= 1.25 + 2 x (120 + 20) s sweeps + fit <= 1.25 = under 8 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
source scripts/gpu_install.sh
gpu_log "$LOG"
log "install"
gpu_install || log "editable install FAILED"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >> "$LOG" 2>&1
log "(a) correctness: the stage's round = the runtime's round (CPU + GPU); the drafters' GPU tests"
timeout -k 5 70 python3 -m pytest -q -p no:cacheprovider -k "stage_builds or test_gpu_" \
  tests/test_drafter_stage_round.py tests/test_drafters.py > "$OUT/tests.txt" 2>&1
rc=$?
log "(a) $(tail -1 "$OUT/tests.txt") (exit $rc)"
[ $rc -ne 0 ] && log "(a) CORRECTNESS CHECK FAILED: the rows below do not time the runtime's round (see tests.txt)"
MODELS=${MODELS:-"qwen3.6-27b deepseek-v4-flash"}
SWEEP_SECONDS=${SWEEP_SECONDS:-120}
for M in $MODELS; do
  log "(b) drafters sweep $M, <= $SWEEP_SECONDS s"
  timeout -k 5 $(( SWEEP_SECONDS + 20 )) python3 -m simtree.profiler.sweep --sweep drafters_gpu --model "$M" \
    --out "$OUT/drafters_profile.csv" --max-minutes "$(awk "BEGIN{print $SWEEP_SECONDS / 60}")" --no-progress \
    >> "$LOG" 2>&1
  rc=$?; [ $rc -ne 0 ] && log "(b) sweep $M exited with $rc (its points so far are kept)"
  log "(b) $(grep -E 'measured, .* already in table' "$LOG" | tail -1)"
done
log "(c) fit"
timeout -k 5 70 python3 -m simtree.costs.drafter_fit "$OUT/drafters_profile.csv" --out "$OUT/drafters_fit.csv" \
  >> "$LOG" 2>&1 || log "(c) fit did not finish (the profile is kept: python3 -m simtree.costs.drafter_fit at home)"
cat "$OUT/drafters_fit.csv" 2>/dev/null
log "done"
