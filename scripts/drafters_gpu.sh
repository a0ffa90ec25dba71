#!/usr/bin/env bash
# The block drafters' costs on the GPU, both targets, in one call of < 8 minutes:
#   (a) GPU tests of the drafters (tests/test_drafters.py -m gpu: the backbone's Triton path against
#       the float64 torch reference, a CUDA-graph replay equal to the eager round), <= 60 s;
#   (b) the sweep simtree/data/sweeps/drafters_gpu.yaml per model (draft_block, draft_dspark,
#       draft_tfm; variant layers; bf16; every round captured in a CUDA graph and replayed), <= 150 s
#       a model, into one profile table;
#   (c) the fit of every drafter family per model (simtree.costs.drafter_fit, the convex programs of
#       C_d) with its held-out error -> summary.md.
# Everything lands in $OUT: drafters_profile.csv (+ .meta.json, .points.jsonl), summary.md, log.txt.
# At home, `simtree fit` of a profile holding these rows beside the verify rows puts the drafters'
# C_d in the bundle (key "drafters").
#   OUT=/tmp/out bash scripts/drafters_gpu.sh        (env SWEEP_SECONDS=150 per model, MODELS="a b")
# Time: install ~0.5 min + tests <= 0.75 + 2 x 2.5 sweeps + fit ~1 = under 8 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
source scripts/gpu_install.sh
gpu_log "$LOG"
log "install"
gpu_install || log "editable install FAILED"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >> "$LOG" 2>&1
log "(a) GPU tests of the drafters"
timeout 45 python3 -m pytest -q -m gpu tests/test_drafters.py 2>&1 | tail -8 >> "$LOG"
MODELS=${MODELS:-"qwen3.6-27b deepseek-v4-flash"}
SWEEP_SECONDS=${SWEEP_SECONDS:-150}
for M in $MODELS; do
  log "(b) drafters sweep $M, <= $SWEEP_SECONDS s"
  timeout -k 5 $(( SWEEP_SECONDS + 20 )) python3 -m simtree.profiler.sweep --sweep drafters_gpu --model "$M" \
    --out "$OUT/drafters_profile.csv" --max-minutes "$(awk "BEGIN{print $SWEEP_SECONDS / 60}")" --no-progress \
    >> "$LOG" 2>&1
  rc=$?; [ $rc -ne 0 ] && log "(b) sweep $M exited with $rc (its points so far are kept)"
done
log "(c) fit"
python3 -m simtree.costs.drafter_fit "$OUT/drafters_profile.csv" --out "$OUT/summary.md" >> "$LOG" 2>&1
log "done"
