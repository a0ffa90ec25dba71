#!/usr/bin/env bash
# Lossless check of every speculative mode on a GPU (simtree run --check: each prompt is also
# decoded plain greedy and the token sequences compared), batch 4 then 1, into OUT_DIR, then
# OUT_DIR/README.md (python -m simtree.reporting.loop lossless).  Bounded by LIMIT seconds (default
# 280): the report lists the runs that finished.  A quick check of `simtree run --check`; the shipped
# full-scale lossless result of every mode is reports/h100/modes (python -m simtree.runtime.full.modes_gpu).
#   bash scripts/lossless_gpu.sh OUT_DIR [COSTS.json]     (env DEVICE=cuda, SIMTREE, PY, LIMIT)
set -uo pipefail
read -r -a SIMTREE <<< "${SIMTREE:-$( [ -x .venv/bin/simtree ] && echo .venv/bin/simtree || echo simtree )}"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
L=$1; C=${2:-reports/cpu_loop/costs.json}; mkdir -p "$L"   # the tiny models' cost bundle (the CPU loop's by default)
R=(--prompts 8 --max-new-tokens 32 --check --device "${DEVICE:-cuda}" --threads 1 --json)
end=$((SECONDS + ${LIMIT:-280}))
for b in 4 1; do
  for spec in "linear:--mode linear --budget 4" "eagle:--mode eagle --steps 4 --topk 4 --budget 16" \
      "best_first:--mode best_first --budget 16 --draft-depth 3 --width 1" \
      "cost_aware:--mode cost_aware --budget 16 --draft-depth 3 --costs $C" \
      "batch_alloc:--mode batch_alloc --budget 16 --draft-depth 3 --costs $C"; do
    [ $SECONDS -lt $end ] || { echo "time limit: ${spec%%:*} b$b and later not run"; break 2; }
    read -r -a flags <<< "${spec#*:}"
    timeout $((end - SECONDS)) "${SIMTREE[@]}" run "${flags[@]}" --batch-size "$b" "${R[@]}" \
      --out "$L/${spec%%:*}_b$b" > "$L/${spec%%:*}_b$b.log" 2>&1 || echo "${spec%%:*} b$b failed (see its log)"
  done
done
"$PY" -m simtree.reporting.loop lossless "$L"
