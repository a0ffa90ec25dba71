#!/usr/bin/env bash
# Refit the shipped default cost bundles from the committed H200 profile and re-plan.
#   reports/h200/profile/profile.csv  ->  simtree/data/costs/h200_<model>.json (embedded default)
#                                      ->  reports/h200/fit/<model>.{json,png,txt}
#                                      ->  reports/h200/plan/ (policy + report on the new default)
set -euo pipefail
export COLUMNS=${COLUMNS:-150}   # rich wraps tables at 80 columns when piped to tee
cd "$(dirname "$0")/.."
PROFILE=${1:-reports/h200/profile/profile.csv}
mkdir -p simtree/data/costs reports/h200/fit reports/h200/plan
for model in qwen3.6-27b deepseek-v4-flash; do
  .venv/bin/simtree fit "$PROFILE" --model "$model" -o "reports/h200/fit/$model.json" \
      --png "reports/h200/fit/$model.png" | tee "reports/h200/fit/$model.txt"
  cp "reports/h200/fit/$model.json" "simtree/data/costs/h200_$model.json"
done
.venv/bin/simtree plan --out reports/h200/plan | tee reports/h200/plan/plan_stdout.txt
