#!/usr/bin/env bash
# FP8 experts on a Hopper GPU, one call of at most ~9 minutes (TOTAL_SECONDS, default 540):
#   (a) the FP8 GPU tests (tests/test_fp8.py -m gpu), <= 90 s
#   (b) python3 scripts/fp8_gpu.py: the FP8 GEMMs (Triton grouped kernel, cuBLAS block-scaled
#       torch._scaled_mm) against the FP8 GEMM's math at V4-Flash's expert shapes; FP8 vs bf16
#       expert GEMMs timed under CUDA graphs for 1-512 tokens; the V4-Flash ep=8 rank built with
#       FP8 experts and its plain decoding step timed (then with bf16 experts where they fit)
#   (c) the profile sweep's MoE piece (mlp_step, variant layers) of the V4-Flash ep=8 rank at FP8
#       (the shipped ep=8 bundle was measured with bf16 experts: bash scripts/full_gpu.sh
#       deepseek-v4-flash remeasures the whole rank at FP8)
# Each phase is bounded by `timeout` and logged; a failing phase does not stop the next.  Results
# in $OUT: fp8_meta.json (GPU, versions, shapes, phase status), fp8_check.csv, fp8_times.csv,
# fp8_rank.csv, profile_mlp_fp8.csv (+ sidecars), fp8_log.txt, gpu_state.csv.  FP8_GEMM (auto,
# scaled_mm, triton, ref; default auto) is the FP8 GEMM form of the rank phase, passed as
# fp8_gpu.py --fp8-gemm (the layers take it from set_forms, never from the environment).
#   OUT=/tmp/out bash scripts/fp8_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/fp8_log.txt"
source scripts/gpu_install.sh
gpu_log "$LOG"
TOTAL=${TOTAL_SECONDS:-540}
left() { echo $(( TOTAL - ($(date +%s) - START) )); }
log "install"
gpu_install || log "editable install FAILED"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu_state.csv" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  2>&1 | tee -a "$LOG"

log "(a) FP8 GPU tests"
timeout -k 5 90 python3 -m pytest -q -m gpu tests/test_fp8.py 2>&1 | tail -15 >> "$LOG"
log "(a) exit ${PIPESTATUS[0]}"

B_SECONDS=$(( $(left) - 150 ))
[ $B_SECONDS -gt 330 ] && B_SECONDS=330
log "(b) check, time, rank: <= $B_SECONDS s"
timeout -k 5 $(( B_SECONDS + 30 )) python3 scripts/fp8_gpu.py --out "$OUT" --max-seconds "$B_SECONDS" \
  --fp8-gemm "${FP8_GEMM:-auto}" >> "$LOG" 2>&1
log "(b) exit $?"

C_SECONDS=$(( $(left) - 20 ))
if [ $C_SECONDS -gt 45 ]; then
  MINUTES=$(python3 -c "print(round(($C_SECONDS - 40) / 60, 2))")
  log "(c) mlp_step sweep of the V4-Flash ep=8 rank at FP8, <= $MINUTES min"
  timeout -k 5 "$C_SECONDS" python3 -m simtree.profiler.sweep --sweep full_layers_gpu --model deepseek-v4-flash \
    --deployment ep=8 --only-stage mlp_step --out "$OUT/profile_mlp_fp8.csv" --max-minutes "$MINUTES" \
    --no-progress >> "$LOG" 2>&1
  log "(c) exit $?"
  timeout 30 python3 - "$OUT" >> "$LOG" 2>&1 <<'PY'
import sys
from simtree.costs.profile_table import load_profile
t = load_profile(f"{sys.argv[1]}/profile_mlp_fp8.csv")
t = t[t["stage"] == "mlp_step"]
print(t.pivot_table(index="batch_size", columns="nodes_per_seq", values="latency_us_median").round(1).to_string())
PY
else
  log "(c) skipped: $C_SECONDS s left"
fi
log "done"
ls -la "$OUT" | tee -a "$LOG"
