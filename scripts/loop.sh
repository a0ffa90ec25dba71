#!/usr/bin/env bash
# Close the loop on one machine:  profile -> fit -> traces -> plan -> run, predicted vs measured.
#
#   DEVICE=cpu|cuda scripts/loop.sh [OUT_DIR]     (scripts/loop_cpu.sh = DEVICE=cpu)
#
# OUT_DIR defaults to out/<device>_loop (git-ignored): a run never rewrites the committed results
# unless its OUT_DIR names them (reports/cpu_loop: reports/README.md gives the command).
#
# PHASES (default "measure plan runs report") runs a subset, in order, on the files OUT_DIR
# already holds: measure = profile sweep + acceptance traces, plan = fit + plan, runs = the
# chosen / second / best linear / none policies per batch size, report = README.md + PNG,
# repeat (not in the default) = the runs once more into runs_repeat/ + repeat.md (spread), then
# runs/ and runs_repeat/ packed into runs.tgz (read in their place by the reports).
# Env knobs: BATCH_SIZES (1,2,4,8), NEW_TOKENS (48 per prompt), PROMPTS (8 per run),
# WORKLOAD (sharegpt), SWEEP (scenarios/sweeps/runtime_cpu.yaml or runtime_gpu.yaml),
# SIMTREE (the simtree command, words allowed), PY.
# Every number of OUT_DIR/README.md comes from the files these commands write there
# (layout: simtree/reporting/loop.py's docstring).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cpu}
OUT=${1:-out/${DEVICE}_loop}
PHASES=${PHASES:-measure plan runs report}
BATCH_SIZES=${BATCH_SIZES:-1,2,4,8}
NEW_TOKENS=${NEW_TOKENS:-48}
PROMPTS=${PROMPTS:-8}
WORKLOAD=${WORKLOAD:-sharegpt}
case "$DEVICE" in
    cpu) SWEEP=${SWEEP:-scenarios/sweeps/runtime_cpu.yaml} ;;
    cuda) SWEEP=${SWEEP:-scenarios/sweeps/runtime_gpu.yaml} ;;
    *) echo "DEVICE must be cpu or cuda, got $DEVICE" >&2; exit 2 ;;
esac
read -r -a SIMTREE <<< "${SIMTREE:-$( [ -x .venv/bin/simtree ] && echo .venv/bin/simtree || echo simtree )}"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}

mkdir -p "$OUT/logs"
step() {  # step NAME CMD...: probe the host's speed into host_probe.tsv (simtree.machine.hostprobe),
    # run, log its output, append its wall time + 1-min load to timing.tsv
    local name=$1; shift
    "$PY" -m simtree.machine.hostprobe --device "$DEVICE" --step "$name" >> "$OUT/host_probe.tsv" 2>/dev/null \
        || echo "host probe before $name failed (the report leaves it out)" >&2
    local t0=$SECONDS
    echo "== $name: $*" >&2
    "$@" > "$OUT/logs/$name.log" 2>&1 || { echo "step $name failed; see $OUT/logs/$name.log" >&2; tail -5 "$OUT/logs/$name.log" >&2; exit 1; }
    printf '%s\t%s\t%s\n' "$name" "$((SECONDS - t0))" "$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo nan)" >> "$OUT/timing.tsv"
}
RUN=(--workload "$WORKLOAD" --max-new-tokens "$NEW_TOKENS" --prompts "$PROMPTS" --threads 1 --device "$DEVICE" --json)

for phase in $PHASES; do
  case "$phase" in
    measure)
      rm -rf "$OUT/profile.csv" "$OUT/profile.meta.json" "$OUT/profile.points.jsonl" "$OUT/costs.json" \
             "$OUT/costs.png" "$OUT/traces" "$OUT/traces.jsonl" "$OUT/plan" "$OUT/runs" "$OUT/runs.tgz" "$OUT/timing.tsv" \
             "$OUT/host_probe.tsv" \
             "$OUT/logs"/*
      # the runtime's own models on this device -> profile table
      step profile "${SIMTREE[@]}" profile --sweep "$SWEEP" --out "$OUT/profile.csv" --json
      # acceptance traces of a chain and of a wide tree (ranks 0..3 observed), at batch 4
      step traces_linear "${SIMTREE[@]}" run --mode linear --budget 6 --batch-size 4 "${RUN[@]}" --out "$OUT/traces/linear"
      step traces_eagle "${SIMTREE[@]}" run --mode eagle --steps 4 --topk 4 --budget 16 --batch-size 4 "${RUN[@]}" --out "$OUT/traces/eagle"
      cat "$OUT/traces/linear/traces.jsonl" "$OUT/traces/eagle/traces.jsonl" > "$OUT/traces.jsonl"
      ;;
    plan)
      # fit C_v, C_d; plan on the fitted bundle and the traces' acceptance, this run's output length
      # (no bootstrap bands: the loop compares the choice with measurements, not with its band)
      step fit "${SIMTREE[@]}" fit "$OUT/profile.csv" -o "$OUT/costs.json" --json
      step plan "${SIMTREE[@]}" plan --costs "$OUT/costs.json" --workload "$OUT/traces.jsonl" \
          --batch-sizes "$BATCH_SIZES" --output-len "$NEW_TOKENS" --band-models 0 --out "$OUT/plan" --json
      ;;
    runs|repeat)
      # per batch size: the chosen policy, then the planner's second choice, best linear, none;
      # repeat: the same runs again into runs_repeat/ (same plan) and repeat.md / repeat.png,
      # the run-to-run spread the errors of the report are to be read against
      dir=runs; pre=run
      [ "$phase" = repeat ] && dir=runs_repeat && pre=repeat
      rm -rf "${OUT:?}/$dir"
      for b in ${BATCH_SIZES//,/ }; do
          step "${pre}_b${b}_chosen" "${SIMTREE[@]}" run --policy "$OUT/plan/policy.json" --costs "$OUT/costs.json" \
              --batch-size "$b" "${RUN[@]}" --out "$OUT/$dir/b${b}_chosen"
          while IFS=$'\t' read -r role name flags; do
              # shellcheck disable=SC2086  # flags is a list of options
              step "${pre}_b${b}_${role}" "${SIMTREE[@]}" run $flags --costs "$OUT/costs.json" --batch-size "$b" \
                  "${RUN[@]}" --out "$OUT/$dir/b${b}_${role}"
          done < <("$PY" -m simtree.reporting.loop contrast "$OUT/plan" "$WORKLOAD" "$b")
      done
      if [ "$phase" = repeat ]; then
          "$PY" -m simtree.reporting.loop repeat "$OUT" runs_repeat
          rm -f "$OUT/runs_repeat/"*/traces.jsonl "$OUT/runs/"*/traces.jsonl
          # one file in place of a folder per run (the reports read runs.tgz), and the report again
          # so that it names the archive
          "$PY" -m simtree.reporting.loop pack "$OUT"
          "$PY" -m simtree.reporting.loop report "$OUT"
      fi
      ;;
    report)
      # the report (README.md + PNG), from the files above; keep the folder small: per-run
      # traces were merged (traces/) or only fed the run's own prediction (runs/)
      "$PY" -m simtree.reporting.loop report "$OUT"
      rm -f "$OUT/traces/"*/traces.jsonl "$OUT/runs/"*/traces.jsonl
      ;;
    *) echo "unknown phase $phase (measure, plan, runs, repeat, report)" >&2; exit 2 ;;
  esac
done
