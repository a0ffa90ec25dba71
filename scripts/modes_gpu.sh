#!/usr/bin/env bash
# Every mode the full runtime builds, decoded at full scale on the GPU, and the plan's choice
# measured beside every other runnable mode at each batch size - one model per call (< 9 min):
#   (a) GPU tests of the block drafters' rounds (tests/test_block_drafters_gpu.py -m gpu: CUDA-graph
#       rounds equal to eager ones, fp32 lossless, bf16 lossless up to near-ties), <= 90 s;
#   (b) python -m simtree.runtime.full.modes_gpu: the shipped bundle plus the drafters' C_d fitted from
#       reports/h100/drafters_profile.csv -> the plan (block drafters included); live lossless of every
#       mode's shape (bf16, near-ties named); full_run replay (gsm8k) at batch 1,4,16,64 of plain,
#       linear D=4, the plan's choice and one shape of every runnable mode (eagle, best_first, cost_aware,
#       batch_alloc, block x2, tfm, dspark scheduled and threshold 0.3).
# $OUT/<model>/: modes.csv (per batch: each mode's measured and predicted tok/s, its rank, the plan's
# choice over the best measured), lossless.csv, plan/{policy.json,candidates.csv}, measure/summary.*,
# log.txt; $OUT/<model>_tests.log.
#   OUT=/tmp/out bash scripts/modes_gpu.sh qwen3.6-27b
#   OUT=/tmp/out bash scripts/modes_gpu.sh deepseek-v4-flash     (env TOTAL_SECONDS=500, BATCH_SIZES=1,4,16,64)
set -uo pipefail
MODEL=${1:?usage: bash scripts/modes_gpu.sh MODEL}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/$MODEL"
source scripts/gpu_install.sh
gpu_log "$OUT/$MODEL/log.txt"
TOTAL=${TOTAL_SECONDS:-500}
gpu_install || log "editable install FAILED"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$OUT/$MODEL/log.txt" 2>&1
log "(a) GPU tests of the block drafters' rounds"
timeout -k 5 90 python3 -m pytest -q -m gpu tests/test_block_drafters_gpu.py 2>&1 | tail -20 > "$OUT/${MODEL}_tests.log"
left=$(( TOTAL - ($(date +%s) - START) - 20 ))
log "(b) modes at full scale, <= ${left}s"
timeout -k 5 $(( left + 15 )) python3 -m simtree.runtime.full.modes_gpu --model "$MODEL" --out "$OUT/$MODEL" \
  --max-seconds "$left" --batch-sizes "${BATCH_SIZES:-1,4,16,64}" > "$OUT/$MODEL/modes_gpu.out" 2>&1
rc=$?; [ $rc -ne 0 ] && log "(b) exited with $rc (its files so far are kept; see modes_gpu.out)"
log "done"
ls -la "$OUT/$MODEL"
