#!/usr/bin/env bash
# Throughput predicted out of sample, GPU side: one model per call against a bundle frozen (committed)
# before the call; every (context, batch) point of simtree.runtime.full.oos measured whole, each with every
# runnable policy (plain, linear, EAGLE, best-first, cost-aware, batch allocation, block, TfM, DSpark; replayed
# acceptance), predicted from the frozen bundle.  $OUT/oos_<model>.tgz holds the run folder.
# Freeze first (home side), the shipped bundle with the block drafters' C_d fitted from the drafter profile
# (a bundle without them runs the other modes), and commit it before the GPU call:
#   python -m simtree.runtime.full.oos freeze --model qwen3.6-27b --costs simtree/data/costs/h100_qwen3.6-27b_tp1.json \
#     --drafter-profile reports/h100/drafters_profile.csv --out reports/validation/frozen_<bundle>.json
# then
#   bash scripts/oos_gpu.sh qwen3.6-27b reports/validation/frozen_<qwen bundle>.json
#   bash scripts/oos_gpu.sh deepseek-v4-flash reports/validation/frozen_<v4 bundle>.json
# (env OUT, MAX_SECONDS=420: with the install and build one call stays within 9.5 min; CONTEXTS, BATCH_SIZES,
# MODES: e.g. linear,eagle for the first runs' policies).  Home side:
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
timeout -k 5 $(( ${MAX_SECONDS:-420} + 60 )) python3 -m simtree.runtime.full.oos run --model "$MODEL" --costs "$BUNDLE" \
  --out "$RES" --max-seconds "${MAX_SECONDS:-420}" ${CONTEXTS:+--contexts $CONTEXTS} ${BATCH_SIZES:+--batch-sizes $BATCH_SIZES} \
  ${MODES:+--modes $MODES}
