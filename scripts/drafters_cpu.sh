#!/usr/bin/env bash
# The block drafters' costs on this CPU, no GPU: the sweep simtree/data/sweeps/drafters_cpu.yaml
# (tiny-gdn, tiny-v4; draft_block, draft_dspark, draft_tfm; perf_counter) and the fit of every
# drafter family per model with its held-out error, into OUT_DIR (default out/drafters_cpu):
# profile.csv (+ sidecars), fit.md.  CPU timings of a shared host are noisy: the fit error
# here is the host's, the GPU's comes from scripts/drafters_gpu.sh.
#   bash scripts/drafters_cpu.sh [OUT_DIR]       (~1-2 min on 2 shared cores)
set -euo pipefail
OUT=${1:-out/drafters_cpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
rm -f "$OUT"/profile.*
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} $PY -m simtree.profiler.sweep --sweep drafters_cpu --out "$OUT/profile.csv" --no-progress
$PY -m simtree.costs.drafter_fit "$OUT/profile.csv" --out "$OUT/fit.md"
