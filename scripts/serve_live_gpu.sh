#!/usr/bin/env bash
# The online controller live in simtree's own runtime on one GPU, the batch changing phase by
# phase; measured TPOT against the serving benchmark's prediction -> $OUT/serve_live.csv.
# The runtime's tiny target and drafter (simtree/data/models; whole models, they fit any GPU):
# profile them on this device (scenarios/sweeps/runtime_gpu.yaml, <= 2 min), fit C_v / C_d,
# then scripts/serve_live.py (phases of batch 1, 8, 2, 4, 8, 1, 4, 2; 96 tokens each).
# About 4 minutes on an H100; the timeouts bound it under 8.
#   OUT=/tmp/out bash scripts/serve_live_gpu.sh
# then, at home, the report (the ## Live run section of reports/bench_serve/README.md):
#   .venv/bin/python -m simtree.serving.live_report OUT/serve_live.csv --readme reports/bench_serve/README.md
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# shellcheck source=scripts/gpu_install.sh
source scripts/gpu_install.sh
gpu_install || echo "editable install FAILED"
timeout 200 python3 -m simtree profile --sweep scenarios/sweeps/runtime_gpu.yaml --out "$OUT/profile.csv" --json \
    > "$OUT/profile.log" 2>&1 || { echo "profile failed"; tail -5 "$OUT/profile.log"; exit 1; }
python3 -m simtree fit "$OUT/profile.csv" -o "$OUT/costs.json" --json > "$OUT/fit.log" 2>&1 \
    || { echo "fit failed"; tail -5 "$OUT/fit.log"; exit 1; }
timeout 180 python3 scripts/serve_live.py --costs "$OUT/costs.json" --out "$OUT/serve_live.csv" --device cuda \
    2>&1 | tee "$OUT/serve_live.log"
