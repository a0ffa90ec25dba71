#!/usr/bin/env bash
# Nsight Compute on the GDN tree verify and its pre-pass, one (batch, nodes) shape per process
# (scripts/ncu_gdn_verify.py: Qwen3.6-27B shapes, bf16, EAGLE-like trees stored depth-first,
# the default launch or the given gdn_tree_verify kwargs; every kernel of the third call is
# profiled - pre-pass, K-side kernel where the launch has one, verify (the transposed walk
# where the launch takes it) - inside the profiler
# range that script opens around it):
#   bash scripts/ncu_gdn.sh OUTDIR ["1:128 16:128 64:128"] [k=v,...]
# Writes per shape OUTDIR/verify_b{B}_n{N}.ncu-rep (full section set, clocks left alone) and
# its pages as CSV: .details.csv (throughput, occupancy, launch), .raw.csv.gz (every metric,
# warp stall reasons included), .sass.csv.gz (per-instruction counts and stall samples of the
# verify); `python3 scripts/ncu_summary.py OUTDIR` makes the markdown summary of them.
# Needs a runtime where ncu reads the hardware counters (see the device notes).
set -uo pipefail
out=$1; shapes=${2:-"1:128 16:64 16:128 64:128"}; kw=${3:-}
mkdir -p "$out"
names() { python3 -c "from simtree.kernels.gdn import _tree_kernels as t; print('|'.join(t.$1))"; }
KERNELS=$(names PROFILED_KERNELS) WALKS=$(names PROFILED_WALKS) || { echo "simtree not importable"; exit 2; }
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 2; }
"$NCU" --version | tail -1 > "$out/ncu_version.txt"
for shape in $shapes; do
  b=${shape%%:*}; n=${shape##*:}
  rep="$out/verify_b${b}_n${n}"
  # two or three kernels a call: the profiler range (cudaProfilerStart/Stop) picks the third call
  timeout 300 "$NCU" --clock-control none --set full --import-source yes --profile-from-start off \
      -k regex:"$KERNELS" \
      -f -o "$rep" python3 scripts/ncu_gdn_verify.py "$b" "$n" "$kw" > "$rep.log" 2>&1 \
    || { echo "ncu failed at $shape"; tail -5 "$rep.log"; continue; }
  "$NCU" -i "$rep.ncu-rep" --page details --csv > "$rep.details.csv" 2>&1
  "$NCU" -i "$rep.ncu-rep" --page raw --csv > "$rep.raw.csv" 2>&1
  "$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass -k regex:"$WALKS" > "$rep.sass.csv" 2>&1
  gzip -f "$rep.sass.csv" "$rep.raw.csv"
  echo "== b$b n$n: $(grep -cE "$WALKS" "$rep.details.csv") verify metrics"
done
