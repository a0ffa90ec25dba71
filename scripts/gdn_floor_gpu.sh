#!/usr/bin/env bash
# The GDN verify + commit against its two-pass memory floor on one GPU (H100 or H200), today's commit
# beside both deferred forms and the launch variants (profiler/bench/gdn_floor_variants.py), every
# variant checked first (python -m simtree.profiler.bench.gdn_floor; < 6 minutes):
#   OUT=/tmp/out bash scripts/gdn_floor_gpu.sh
# writes $OUT/floor.csv (kernel, layer_kind, batch, nodes, context, measured_us, floor_us, ratio,
# variant, gpu),
# $OUT/floor.json (GPU, bandwidth, checks, targets), $OUT/gdn_floor_log.txt, $OUT/gpu_state.csv.
# Exit status: the benchmark's (1 where a check failed).  reports/h200/floor/ takes the first two.
# Shapes are timed in passes (the rule's launches and the launch-free round, then each variant,
# most promising first); no pass starts a shape after 300 s, and floor.json lists what was
# skipped: a second call with GDN_FLOOR_ARGS="--variants NAME,..." and another OUT times those.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source scripts/gpu_install.sh
gpu_install || echo "editable install FAILED" | tee -a "$OUT/gdn_floor_log.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu_state.csv" 2>&1
timeout -k 5 370 python3 -m simtree.profiler.bench.gdn_floor --out "$OUT/floor.csv" --max-seconds 300 ${GDN_FLOOR_ARGS:-} \
  2>&1 | tee -a "$OUT/gdn_floor_log.txt"
exit "${PIPESTATUS[0]}"
