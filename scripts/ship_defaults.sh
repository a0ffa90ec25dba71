#!/usr/bin/env bash
# Refit the shipped default cost bundles from the shipped H200 profile and re-plan.
#   simtree/data/profiles/h200/profile.csv  ->  simtree/data/costs/h200_<model>.json (embedded default)
#                                            ->  reports/h200/fit/<model>.{json,png,txt}
#                                            ->  reports/h200/plan/ (policy + report on the new default)
#   bash scripts/ship_defaults.sh [PROFILE]   (a new profile: copy it, with its .meta.json and
#   .compose.json, into simtree/data/profiles/h200/ first, so the bundles name the shipped file)
set -euo pipefail
export COLUMNS=${COLUMNS:-150}   # rich wraps tables at 80 columns when piped to tee
cd "$(dirname "$0")/.."
PROFILE=${1:-simtree/data/profiles/h200/profile.csv}
mkdir -p simtree/data/costs reports/h200/fit reports/h200/plan
for model in qwen3.6-27b deepseek-v4-flash; do
  .venv/bin/simtree fit "$PROFILE" --model "$model" -o "reports/h200/fit/$model.json" \
      --png "reports/h200/fit/$model.png" | tee "reports/h200/fit/$model.txt"
  cp "reports/h200/fit/$model.json" "simtree/data/costs/h200_$model.json"
done
.venv/bin/simtree plan --out reports/h200/plan
