#!/usr/bin/env bash
# The lossless check without bf16 rounding, on the H200, in one call (~2 min): the runtime's
# check (gpu_run's lossless phase: 2 prompts x {linear D=4, EAGLE s3 k2 D6, EAGLE s4 k4 D16},
# batch 2, live, CUDA graphs, against plain greedy) on fp32 weights:
#   Qwen3.6-27B whole (64 layers, 109 GB in fp32);
#   the DeepSeek-V4-Flash ep=8 rank on its first 24 of 43 layers, every kind kept (99 GB; the
#   whole rank is 171 GB in fp32, more than one H200 holds).
# -> $OUT/lossless_<model>_fp32.csv and .log; at home they go beside the session archives and
# scripts/full_report.sh DIR adds them to lossless.csv.
#   bash scripts/lossless_fp32_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/simtree_lossless
source scripts/gpu_install.sh
gpu_install || echo "editable install FAILED"
rc=0
for args in "qwen3.6-27b --deployment tp=1" "deepseek-v4-flash --deployment ep=8 --layers 24"; do
  model=${args%% *}
  dir=/tmp/simtree_lossless/$model
  timeout 200 python3 -m simtree.runtime.full.gpu_run --model $args --dtype fp32 --phases build,lossless \
    --out "$dir" --max-seconds 180 > "$dir.out" 2>&1 || rc=1
  cp "$dir/lossless.csv" "$OUT/lossless_${model}_fp32.csv" 2>/dev/null
  cp "$dir/log.txt" "$OUT/lossless_${model}_fp32.log" 2>/dev/null
  cat "$dir/log.txt"
done
exit $rc
