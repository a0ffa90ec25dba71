#!/usr/bin/env bash
# A V4 layer's verify against its memory floor on one GPU, one call of at most ~6 minutes:
#   python3 -m simtree.profiler.bench.v4_floor (docs/math/v4_compression.md, "The verify's memory
#   floor"): checks every variant against float64 sequential decoding and its torch forms, then
#   times the attention block and the tree verify, current path vs fused variants, at V4-Flash
#   shapes, batch 1/4/16, nodes 1/4/16, context 4K/16K, CUDA graphs; FlashMLA's FP8 core joins
#   as variant fused_flashmla where sgl-flash-mla is installed (a wheel in .whl/).
# Results in $OUT: floor_v4.csv (kernel, layer_kind, batch_size, nodes_per_seq, context_len,
# measured_us, floor_us, ratio, tree_over_linear, ...), floor_v4.json (checks, worst ratios,
# targets, the faster form of each switch), floor_v4_log.txt, gpu_state.csv.
#   OUT=/tmp/out bash scripts/v4_floor_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source scripts/gpu_install.sh
gpu_install || echo "editable install FAILED"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu_state.csv" 2>&1
timeout ${FLOOR_TIMEOUT:-350} python3 -m simtree.profiler.bench.v4_floor --out "$OUT/floor_v4.csv" \
  --max-seconds ${FLOOR_SECONDS:-290} 2>&1 | tee "$OUT/floor_v4_log.txt" | tail -80
