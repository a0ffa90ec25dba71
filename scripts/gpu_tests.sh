#!/usr/bin/env bash
# The GPU tests of the full runtime's layers, modes, checkpoints and drafters in one bounded call
# (CUDA graphs, Triton kernels), then the drafters' profile sweep where time is left:
#   OUT=/tmp/out bash scripts/gpu_tests.sh          (env TOTAL_SECONDS=480, DRAFTER_MODELS=qwen3.6-27b)
# $OUT/gpu_tests.log holds each file's pytest summary; $OUT/drafters/ the sweep (scripts/drafters_gpu.sh).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/gpu_tests.log"
source scripts/gpu_install.sh
gpu_log "$LOG"
TOTAL=${TOTAL_SECONDS:-480}
gpu_install || log "editable install FAILED"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$LOG" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$LOG" 2>&1
for f in tests/test_full_gpu.py tests/test_block_drafters_gpu.py tests/test_checkpoint_parity.py tests/test_drafters.py tests/test_layers_fused.py \
         tests/test_fp8.py tests/test_v4_mhc.py; do
  [ -f "$f" ] || continue
  left=$(( TOTAL - ($(date +%s) - START) - 200 ))
  [ $left -lt 30 ] && { log "$f: skipped, time"; continue; }
  [ $left -gt 150 ] && left=150
  log "$f (<= ${left}s)"
  timeout -k 5 $left python3 -m pytest -q -m gpu "$f" 2>&1 | tail -25 >> "$LOG"
done
left=$(( TOTAL - ($(date +%s) - START) - 20 ))
if [ $left -gt 90 ]; then
  log "drafters sweep (<= ${left}s)"
  OUT="$OUT/drafters" MODELS=${DRAFTER_MODELS:-qwen3.6-27b} SWEEP_SECONDS=$(( left - 60 )) \
    timeout -k 5 $left bash scripts/drafters_gpu.sh >> "$LOG" 2>&1
fi
log "done"
