#!/usr/bin/env bash
# Refit the shipped default cost bundles from the shipped H200 profiles and re-plan.
#
#   simtree/data/deployments.yaml lists the default deployments (model + deployment);
#   for each one a table in simtree/data/profiles/h200/*.csv holding that rank's rows
#   (deployment column) is fitted:
#     -> simtree/data/costs/h200_<model>_<tag>.json           (the embedded default)
#     -> reports/h200/fit/<model>_<tag>.{json,png,txt}
#   a default without such a table is reported as waiting for its profile; then
#     -> reports/h200/plan/ (policy + report per planned deployment, tree_vs_linear.csv each)
#
#   bash scripts/ship_defaults.sh
#
# A newly measured rank profile: a full-runtime GPU session's (scripts/full_gpu.sh, then
# scripts/full_report.sh -> reports/h200/live/profile_<model>_<tag>.csv, docs/full_runtime.md) or
# `simtree profile --model deepseek-v4-flash --deployment ep=8 --out X/profile_ep8.csv` (with its
# .meta.json and .compose.json): copy it into simtree/data/profiles/h200/ under its own name (one
# table per model and deployment), then run this script.  A collectives profile's fit
# (COMM=path/to/x.comm.json) replaces the assumed communication model in the bundles.
set -euo pipefail
export COLUMNS=${COLUMNS:-150}   # rich wraps tables at 80 columns when piped to tee
cd "$(dirname "$0")/.."
PY=.venv/bin/python
COMM_ARGS=()
if [[ -n "${COMM:-}" ]]; then COMM_ARGS=(--comm "$COMM"); fi
mkdir -p simtree/data/costs reports/h200/fit reports/h200/plan
# bundles of defaults that no table holds any more must not linger
waiting=0
while read -r verdict model deployment tag table; do
  if [[ "$verdict" == WAIT ]]; then
    echo "waits for a profile: $model at $deployment (no table in simtree/data/profiles/h200/ holds its rows)"
    waiting=$((waiting + 1))
    continue
  fi
  name="${model}_${tag}"
  DRAFT_ARGS=()
  if ! grep -q "^draft_step," "$table"; then   # a sweep-only rank profile (no whole draft steps measured)
    DRAFT_ARGS=(--draft-from-verify)
    echo "$table has no draft_step rows: $model at $deployment fits its draft cost from the verify model (assumed)"
  fi
  .venv/bin/simtree fit "$table" --model "$model" --deployment "$deployment" "${COMM_ARGS[@]}" "${DRAFT_ARGS[@]}" \
      -o "reports/h200/fit/$name.json" --png "reports/h200/fit/$name.png" | tee "reports/h200/fit/$name.txt"
  cp "reports/h200/fit/$name.json" "simtree/data/costs/h200_$name.json"
done < <($PY -m simtree.deploy.shipped --machine h200)
rm -rf reports/h200/plan/*/
.venv/bin/simtree plan --out reports/h200/plan
echo "$waiting default deployment(s) wait for a measured profile"
