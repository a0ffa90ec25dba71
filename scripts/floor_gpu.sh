#!/usr/bin/env bash
# Both verify steps against their memory floor on one GPU in one call (< 10 minutes): the GDN
# verify + commit (python -m simtree.profiler.bench.gdn_floor, every variant checked first) and the
# V4 layer's verify at 4K context (python -m simtree.profiler.bench.v4_floor: every variant and
# attention launch checked against float64 / its torch form first), HCA again at 4223 tokens (where
# its 128-token windows complete and its pool holds 32 full rows), then one table of all three:
#   OUT=/tmp/out bash scripts/floor_gpu.sh
# writes $OUT/floor.csv (profiler/bench/floor_table.py: kernel, layer_kind, batch, nodes, context,
# measured_us, floor_us, ratio, ...), $OUT/gdn/, $OUT/v4/ and $OUT/hca4223/ (each run's csv, json and log) and
# $OUT/gpu_state.csv.  reports/h200/floor/ takes floor.csv and the two json files.
# GDN_SECONDS / V4_SECONDS / HCA_SECONDS (default 190, 190, 60; whole seconds) bound each run's timing (a run cut short
# keeps the shapes it finished and lists the rest in its json).  Exit status: 0, or the first failing
# step's (a benchmark exits 1 where a check failed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/gdn" "$OUT/v4" "$OUT/hca4223"
source scripts/gpu_install.sh
gpu_install > "$OUT/install_log.txt" 2>&1 || echo "editable install FAILED"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu_state.csv"
G=${GDN_SECONDS:-190}; V=${V4_SECONDS:-190}; H=${HCA_SECONDS:-60}; G=${G%.*}; V=${V%.*}; H=${H%.*}
RC=0
timeout -k 5 $(( G + 50 )) python3 -m simtree.profiler.bench.gdn_floor --out "$OUT/gdn/floor.csv" --max-seconds "$G" \
  > "$OUT/gdn/gdn_floor_log.txt" 2>&1; rc=$?; echo "gdn_floor rc $rc"; [ $RC -eq 0 ] && RC=$rc
tail -4 "$OUT/gdn/gdn_floor_log.txt" | cut -c1-300
timeout -k 5 $(( V + 60 )) python3 -m simtree.profiler.bench.v4_floor --out "$OUT/v4/floor_v4.csv" --contexts 4096 \
  --max-seconds "$V" > "$OUT/v4/floor_v4_log.txt" 2>&1; rc=$?; echo "v4_floor rc $rc"; [ $RC -eq 0 ] && RC=$rc
grep -i "check\|FAIL\|Error\|attention launch" "$OUT/v4/floor_v4_log.txt" | cut -c1-300 | tail -24
timeout -k 5 $(( H + 50 )) python3 -m simtree.profiler.bench.v4_floor --out "$OUT/hca4223/floor_v4.csv" --contexts 4223 \
  --kinds hca --batches 1,16 --ns 4,16 --max-seconds "$H" > "$OUT/hca4223/floor_v4_log.txt" 2>&1; rc=$?
echo "v4_floor hca 4223 rc $rc"; [ $RC -eq 0 ] && RC=$rc
grep -i "FAIL\|Error" "$OUT/hca4223/floor_v4_log.txt" | cut -c1-300 | tail -6
python3 -m simtree.profiler.bench.floor_table --gdn "$OUT/gdn" --v4 "$OUT/v4" --v4 "$OUT/hca4223" --out "$OUT/floor.csv"
rc=$?; echo "floor_table rc $rc"; [ $RC -eq 0 ] && RC=$rc
exit $RC
