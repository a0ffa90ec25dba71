#!/usr/bin/env bash
# Nsight Compute on the GDN tree verify kernel, one (batch, nodes) shape per process:
#   bash scripts/ncu_gdn.sh OUTDIR "1:128 16:32 64:128" [extra gdn_tree_verify kwargs as k=v,...]
# Writes OUTDIR/ncu_b{B}_n{N}.txt (the details page: throughput, occupancy, warp stalls).
# NCU_SOURCE=1: also keep the report (OUTDIR/ncu_b{B}_n{N}.ncu-rep) and write its per-line
# source page (SASS and Python, OUTDIR/src_b{B}_n{N}_{sass,py}.csv: instructions, stall samples).
# Needs a runtime where ncu reads the hardware counters (see the device notes).
set -uo pipefail
out=$1; shapes=$2; kw=${3:-}
mkdir -p "$out"
for s in $shapes; do
  b=${s%:*}; n=${s#*:}
  rep=()
  [ "${NCU_SOURCE:-0}" = 1 ] && rep=(--import-source yes -f -o "$out/ncu_b${b}_n${n}")
  ncu --clock-control none --set full "${rep[@]}" -k regex:_tree_verify --launch-skip 1 --launch-count 1 \
    python3 - "$b" "$n" "$kw" > "$out/ncu_b${b}_n${n}.txt" 2>&1 <<'PY'
import sys, torch
from simtree.kernels.gdn import gdn_tree_verify, tree_meta
from simtree.kernels.gdn.bench_util import QWEN36, shape_inputs
b, n = int(sys.argv[1]), int(sys.argv[2])
kw = {k: int(v) for k, v in (x.split("=") for x in filter(None, sys.argv[3].split(",")))}
c = shape_inputs(b, n, 0, QWEN36, device="cuda", max_copies=1)[0]
meta = tree_meta(c["parents"], c["cu_nodes"])
args = [c[k] for k in ("q", "k", "v", "g", "beta", "state", "parents", "cu_nodes")]
for _ in range(2):
    gdn_tree_verify(*args, backend="triton", meta=meta, check=False, **kw)
torch.cuda.synchronize()
PY
  if [ "${NCU_SOURCE:-0}" = 1 ]; then
    ncu -i "$out/ncu_b${b}_n${n}.ncu-rep" --page details > "$out/ncu_b${b}_n${n}.txt" 2>&1
    for v in sass:sass cuda:py; do
      ncu -i "$out/ncu_b${b}_n${n}.ncu-rep" --page source --csv --print-source "${v%:*}" \
        > "$out/src_b${b}_n${n}_${v#*:}.csv" 2>&1
    done
  fi
  echo "== b$b n$n: $(grep -c . "$out/ncu_b${b}_n${n}.txt") lines"
done
