#!/usr/bin/env bash
# Refit the shipped default cost bundles of every machine from its shipped profiles and re-plan.
#
#   simtree/data/deployments.yaml lists each machine's default deployments (model + deployment);
#   for each one a table in simtree/data/profiles/<machine>/*.csv holding that rank's rows
#   (deployment column) is fitted:
#     -> simtree/data/costs/<machine>_<model>_<tag>.json       (the embedded default)
#     -> reports/<machine>/fit/<model>_<tag>.{json,txt} (+ .png for the machines in PNG_MACHINES)
#   a default without such a table is reported as waiting for its profile; then
#     -> reports/<machine>/plan/ (`simtree plan --machine <machine>`: a folder per planned deployment)
#
#   bash scripts/ship_defaults.sh                 # every machine with a profiles folder
#   MACHINE=h100 bash scripts/ship_defaults.sh    # one machine
#
# `simtree plan` with no --costs plans the default machine's bundles (h200); `--machine h100` another's.
# A newly measured rank profile: a full-runtime GPU session's (scripts/full_gpu.sh, then
# scripts/full_report.sh -> OUT/profile_<model>_<tag>.csv, docs/full_runtime.md) or
# `simtree profile --model deepseek-v4-flash --deployment ep=8 --out X/profile_ep8.csv` (with its
# .meta.json and .compose.json): copy it into simtree/data/profiles/<machine>/ under its own name (one
# table per model and deployment), then run this script.  A collectives profile's fit
# (COMM=path/to/x.comm.json) replaces the assumed communication model in the bundles.
set -euo pipefail
export COLUMNS=${COLUMNS:-150}   # rich wraps tables at 80 columns when piped to tee
cd "$(dirname "$0")/.."
PY=.venv/bin/python
# machines whose fit folders get a plot per bundle (none by default: reports/ tracks at most 150 files)
PNG_MACHINES=${PNG_MACHINES:-}
COMM_ARGS=()
if [[ -n "${COMM:-}" ]]; then COMM_ARGS=(--comm "$COMM"); fi
if [[ -n "${MACHINE:-}" ]]; then
  machines=("$MACHINE")
else
  machines=()
  while read -r m; do
    if [[ -d "simtree/data/profiles/$m" ]]; then machines+=("$m"); fi
  done < <($PY -m simtree.deploy.shipped --machines)
fi

ship_machine() {
  local machine=$1 waiting=0 verdict model deployment tag table name
  local list fit=reports/$machine/fit plan=reports/$machine/plan
  list=$($PY -m simtree.deploy.shipped --machine "$machine")   # fails (one line) for an unknown machine
  mkdir -p simtree/data/costs "$fit" "$plan"
  while read -r verdict model deployment tag table; do
    if [[ "$verdict" == WAIT ]]; then
      echo "waits for a profile: $model at $deployment (no table in simtree/data/profiles/$machine/ holds its rows)"
      waiting=$((waiting + 1))
      continue
    fi
    name="${model}_${tag}"
    local DRAFT_ARGS=() PNG_ARGS=(--no-png)
    if ! grep -q "^draft_step," "$table"; then   # a sweep-only rank profile (no whole draft steps measured)
      DRAFT_ARGS=(--draft-from-verify)
      echo "$table has no draft_step rows: $model at $deployment fits its draft cost from the verify model (assumed)"
    fi
    if [[ " $PNG_MACHINES " == *" $machine "* ]]; then PNG_ARGS=(--png "$fit/$name.png"); fi
    .venv/bin/simtree fit "$table" --model "$model" --deployment "$deployment" "${COMM_ARGS[@]}" "${DRAFT_ARGS[@]}" \
        -o "$fit/$name.json" "${PNG_ARGS[@]}" | tee "$fit/$name.txt"
    $PY -m simtree.deploy.shipped --machine "$machine" --stamp "$fit/$name.json"   # the entry's caveat, if any
    cp "$fit/$name.json" "simtree/data/costs/${machine}_$name.json"
  done <<< "$list"
  rm -rf "${plan:?}"/*/
  .venv/bin/simtree plan --machine "$machine" --out "$plan"
  echo "$machine: $waiting default deployment(s) wait for a measured profile"
}

for machine in "${machines[@]}"; do
  ship_machine "$machine"
done
