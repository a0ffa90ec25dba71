#!/usr/bin/env bash
# The block drafters' costs on the GPU, both targets, in one call of < 8 minutes:
#   (a) GPU tests of the drafters (tests/test_drafters.py -m gpu: the backbone's Triton path against
#       the float64 torch reference, a CUDA-graph replay equal to the eager round), <= 60 s;
#   (b) the sweep simtree/data/sweeps/drafters_gpu.yaml per model (draft_block, draft_dspark,
#       draft_tfm; variant layers; bf16; every round captured in a CUDA graph and replayed), <= 3 min
#       a model, into one profile table;
#   (c) the fit of every drafter family per model (simtree.costs.drafter_fit, the convex programs of
#       C_d) with its held-out error -> drafters_fit.json, summary.md.
# Everything lands in $OUT: drafters_profile.csv (+ .meta.json, .points.jsonl), drafters_fit.json,
# summary.md, log.txt.
#   OUT=/tmp/out bash scripts/drafters_gpu.sh        (env SWEEP_MINUTES=3 per model, MODELS="a b")
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
START=$(date +%s)
log() { echo "[$(date +%T) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
log "install"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || log "editable install FAILED"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >> "$LOG" 2>&1
log "(a) GPU tests of the drafters"
timeout 60 python3 -m pytest -q -m gpu tests/test_drafters.py 2>&1 | tail -8 >> "$LOG"
MODELS=${MODELS:-"qwen3.6-27b deepseek-v4-flash"}
SWEEP_MINUTES=${SWEEP_MINUTES:-3}
for M in $MODELS; do
  log "(b) drafters sweep $M, <= $SWEEP_MINUTES min"
  timeout -k 5 $(( SWEEP_MINUTES * 60 + 30 )) python3 -m simtree.profiler.sweep --sweep drafters_gpu --model "$M" \
    --out "$OUT/drafters_profile.csv" --max-minutes "$SWEEP_MINUTES" --no-progress >> "$LOG" 2>&1
  rc=$?; [ $rc -ne 0 ] && log "(b) sweep $M exited with $rc (its points so far are kept)"
done
log "(c) fit"
python3 - "$OUT" >> "$LOG" 2>&1 <<'PY'
import json, sys
from pathlib import Path
from simtree.costs.drafter_fit import fit_drafters
from simtree.costs.profile_table import load_profile
from simtree.fileio import write_text_atomic
out = Path(sys.argv[1])
df = load_profile(out / "drafters_profile.csv")
fits, lines = {}, ["| model | drafter | form | points | held-out median | held-out p90 |", "|---|---|---|---|---|---|"]
for (model, device, dtype, dep), _ in df.groupby(["model", "device", "dtype", "deployment"]):
    models, notes = fit_drafters(df, model=model, device=device, dtype=dtype, deployment=dep,
                                 source={"profile": "drafters_profile.csv"})
    fits[model] = {fam: m.to_dict() for fam, m in models.items()}
    for fam, m in models.items():
        e = m.info["fit_error"]["heldout"][m.info["form"]]
        lines.append(f"| {model} | {fam} | {m.info['form']} | {m.info['num_points']} | "
                     f"{100 * e['median']:.2f}% | {100 * e['p90']:.2f}% |")
write_text_atomic(out / "drafters_fit.json", json.dumps(fits, indent=1) + "\n")
write_text_atomic(out / "summary.md", "\n".join(lines) + "\n")
print("\n".join(lines))
PY
log "done"
