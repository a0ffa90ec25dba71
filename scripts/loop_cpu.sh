#!/usr/bin/env bash
# Close the loop on this CPU, no GPU:  profile -> fit -> traces -> plan -> run, predicted vs measured.
#
#   scripts/loop_cpu.sh [OUT_DIR]        (default reports/cpu_loop; < 10 min on 2 shared cores)
#
# Env knobs: BATCH_SIZES (1,2,4,8), NEW_TOKENS (48 per prompt), PROMPTS (8 per run),
# WORKLOAD (sharegpt), SIMTREE (the simtree executable).
# Every number of OUT_DIR/README.md comes from the files these commands write there
# (layout: simtree/cpu_loop.py's docstring).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-reports/cpu_loop}
BATCH_SIZES=${BATCH_SIZES:-1,2,4,8}
NEW_TOKENS=${NEW_TOKENS:-48}
PROMPTS=${PROMPTS:-8}
WORKLOAD=${WORKLOAD:-sharegpt}
SIMTREE=${SIMTREE:-$( [ -x .venv/bin/simtree ] && echo .venv/bin/simtree || echo simtree )}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}

rm -rf "$OUT/profile.csv" "$OUT/profile.meta.json" "$OUT/profile.points.jsonl" "$OUT/costs.json" \
       "$OUT/costs.png" "$OUT/traces" "$OUT/traces.jsonl" "$OUT/plan" "$OUT/runs" "$OUT/timing.tsv" "$OUT/logs"
mkdir -p "$OUT/logs"
step() {  # step NAME CMD...: run, log its output, append its wall time + 1-min load to timing.tsv
    local name=$1; shift
    local t0=$SECONDS
    echo "== $name: $*" >&2
    "$@" > "$OUT/logs/$name.log" 2>&1 || { echo "step $name failed; see $OUT/logs/$name.log" >&2; tail -5 "$OUT/logs/$name.log" >&2; exit 1; }
    printf '%s\t%s\t%s\n' "$name" "$((SECONDS - t0))" "$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo nan)" >> "$OUT/timing.tsv"
}
RUN=(--workload "$WORKLOAD" --max-new-tokens "$NEW_TOKENS" --prompts "$PROMPTS" --threads 1 --json)

# 1. the runtime's own models on this CPU -> profile table; 2. fit C_v, C_d (device "cpu")
step profile "$SIMTREE" profile --sweep scenarios/sweeps/runtime_cpu.yaml --out "$OUT/profile.csv" --json
step fit "$SIMTREE" fit "$OUT/profile.csv" -o "$OUT/costs.json" --json

# 3. acceptance traces of a chain and of a wide tree (ranks 0..3 observed), at batch 4
step traces_linear "$SIMTREE" run --mode linear --budget 6 --batch-size 4 "${RUN[@]}" --out "$OUT/traces/linear"
step traces_eagle "$SIMTREE" run --mode eagle --steps 4 --topk 4 --budget 16 --batch-size 4 "${RUN[@]}" --out "$OUT/traces/eagle"
cat "$OUT/traces/linear/traces.jsonl" "$OUT/traces/eagle/traces.jsonl" > "$OUT/traces.jsonl"

# 4. plan on the fitted bundle and the traces' acceptance, this run's output length
step plan "$SIMTREE" plan --costs "$OUT/costs.json" --workload "$OUT/traces.jsonl" \
    --batch-sizes "$BATCH_SIZES" --output-len "$NEW_TOKENS" --out "$OUT/plan" --json

# 5. per batch size: the chosen policy, then the planner's second choice, best linear, none
for b in ${BATCH_SIZES//,/ }; do
    step "run_b${b}_chosen" "$SIMTREE" run --policy "$OUT/plan/policy.json" --costs "$OUT/costs.json" \
        --batch-size "$b" "${RUN[@]}" --out "$OUT/runs/b${b}_chosen"
    while IFS=$'\t' read -r role name flags; do
        # shellcheck disable=SC2086  # flags is a list of options
        step "run_b${b}_${role}" "$SIMTREE" run $flags --costs "$OUT/costs.json" --batch-size "$b" \
            "${RUN[@]}" --out "$OUT/runs/b${b}_${role}"
    done < <("$PY" -m simtree.cpu_loop contrast "$OUT/plan" "$WORKLOAD" "$b")
done

# 6. the report (README.md + PNG), from the files above
"$PY" -m simtree.cpu_loop report "$OUT"
# keep the folder small: per-run traces were merged (traces/) or only fed the run's own prediction (runs/)
rm -f "$OUT/traces/"*/traces.jsonl "$OUT/runs/"*/traces.jsonl
