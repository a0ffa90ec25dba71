#!/usr/bin/env bash
# Throughput predicted out of sample, GPU side: one model per call against a bundle frozen (committed)
# before the call; every (context, batch, policy) of simtree.runtime.full.oos measured with replayed
# acceptance, predicted from the frozen bundle.  $OUT/oos_<model>.tgz holds the run folder.
# Freeze first: copy the bundle under test to a committed path (e.g. reports/validation/frozen_<bundle>.json)
# and commit it before the GPU call; then
#   bash scripts/oos_gpu.sh qwen3.6-27b reports/validation/frozen_h200_qwen3.6-27b_tp1.json
#   bash scripts/oos_gpu.sh deepseek-v4-flash reports/validation/frozen_h200_deepseek-v4-flash_ep8.json
# (env OUT, MAX_SECONDS=300, CONTEXTS, BATCH_SIZES).  Home side:
#   python -m simtree.runtime.full.oos report DIR_QWEN DIR_V4 --bundle B1 --bundle B2 --out reports/validation
set -uo pipefail
MODEL=${1:?usage: bash scripts/oos_gpu.sh MODEL FROZEN_BUNDLE}
BUNDLE=${2:?usage: bash scripts/oos_gpu.sh MODEL FROZEN_BUNDLE}
OUT=${OUT:-/tmp/out}
RES=/tmp/simtree_oos/$MODEL
mkdir -p "$OUT" "$RES"
trap 'tar czf "$OUT/oos_$MODEL.tgz" -C "$RES" .; cp "$RES/log.txt" "$OUT/oos_${MODEL}_log.txt" 2>/dev/null' EXIT
source scripts/gpu_install.sh
gpu_install || echo "editable install FAILED"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$RES/gpu_state.csv" 2>&1
timeout -k 5 $(( ${MAX_SECONDS:-300} + 60 )) python3 -m simtree.runtime.full.oos run --model "$MODEL" --costs "$BUNDLE" \
  --out "$RES" --max-seconds "${MAX_SECONDS:-300}" ${CONTEXTS:+--contexts $CONTEXTS} ${BATCH_SIZES:+--batch-sizes $BATCH_SIZES}
