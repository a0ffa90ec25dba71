#!/usr/bin/env bash
# The planner's own choice decoded live at full scale: simtree plan searches the families the
# full runtime builds (--modes linear,eagle; plain decoding always) on the shipped H200 bundles,
# and simtree run decodes its policy at batch 1, 4, 16, 64 beside plain and linear D=4 (random
# weights, CUDA graphs, gsm8k acceptance replayed stratified) -> reports/h200/plan_live/<model>/
# (policy.json, summary.csv / .md / .json, predicted_vs_measured.png).
#   bash scripts/plan_live.sh plan          home, CPU: the policies (policy.json per model)
#   bash scripts/plan_live.sh run           GPU, one call (~2 min): $OUT/<model>.tgz
#   bash scripts/plan_live.sh unpack DIR    home: the fetched archives into the report folders
set -euo pipefail
STEP=${1:?usage: bash scripts/plan_live.sh plan | run | unpack DIR}
REP=reports/h200/plan_live
# model, deployment, folder (= the shipped bundle's tag)
RUNS=("qwen3.6-27b tp=1 qwen3.6-27b_tp1" "deepseek-v4-flash ep=8 deepseek-v4-flash_ep8")
case "$STEP" in
  plan)
    PY=${PYTHON:-.venv/bin/python}
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    for r in "${RUNS[@]}"; do
      read -r model dep name <<< "$r"
      "$PY" -m simtree plan --model "$model" --deployment "$dep" --modes linear,eagle --workload gsm8k \
        --band-models 0 --out "$tmp/$name"
      mkdir -p "$REP/$name" && cp "$tmp/$name/policy.json" "$REP/$name/"
    done ;;
  run)
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install FAILED"
    export PYTHONUNBUFFERED=1
    rc=0
    for r in "${RUNS[@]}"; do
      read -r model dep name <<< "$r"
      d=/tmp/plan_live/$name; mkdir -p "$d"
      if ! timeout 200 python3 -m simtree run --model "$model" --deployment "$dep" --device cuda \
          --costs "simtree/data/costs/h200_$name.json" --policy "$REP/$name/policy.json" --batch-size 1,4,16,64 \
          --acceptance gsm8k --out "$d" > "$d/log.txt" 2>&1; then
        echo "$model: simtree run failed (its log.txt is in $OUT/$name.tgz)"; rc=1
      fi
      tail -14 "$d/log.txt"
      tar czf "$OUT/$name.tgz" -C "$d" .
    done
    exit $rc ;;
  unpack)
    DIR=${2:?usage: bash scripts/plan_live.sh unpack DIR}
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    files=(summary.csv summary.md summary.json predicted_vs_measured.png)
    for r in "${RUNS[@]}"; do    # every archive whole before any folder changes
      read -r model dep name <<< "$r"
      mkdir -p "$tmp/$name" && tar xzf "$DIR/$name.tgz" -C "$tmp/$name"
      for f in "${files[@]}"; do
        [ -f "$tmp/$name/$f" ] || { echo "error: $DIR/$name.tgz has no $f (did its run fail?)" >&2; exit 2; }
      done
    done
    for r in "${RUNS[@]}"; do
      read -r model dep name <<< "$r"
      for f in "${files[@]}"; do cp "$tmp/$name/$f" "$REP/$name/"; done
    done ;;
  *) echo "error: unknown step $STEP (plan, run, unpack DIR)" >&2; exit 2 ;;
esac
