#!/usr/bin/env bash
# Home side of the GPU sessions (scripts/full_gpu.sh), on the CPU: unpack every full_<model>.tgz
# found in DIR, compose its layer profile, fit each model's bundle to its session's profile of the runtime's layers, plan over
# the measured shapes, predict the measured runs again, and compare the composed steps with the
# measured ones -> reports/h200/live/ (summary.csv/.md, predicted_vs_measured.png,
# composed_vs_measured.csv/.md, costs_<model>.json, profile_<model>_<tag>.csv (the rank's profile
# for scripts/ship_defaults.sh, docs/full_runtime.md), alternatives.csv, lossless.csv (with the
# lossless_<model>_<dtype>.csv checks of scripts/lossless_fp32_gpu.sh found in DIR)).
#   bash scripts/full_report.sh DIR [OUT]        (DIR: the fetched $OUT folders' files)
set -euo pipefail
DIR=${1:?usage: bash scripts/full_report.sh DIR [OUT]}
OUT=${2:-reports/h200/live}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
sessions=(); sweep_only=()
for tgz in "$DIR"/full_*.tgz; do
  [ -e "$tgz" ] || continue
  model=$(basename "$tgz" .tgz); model=${model#full_}
  mkdir -p "$WORK/$model" && tar xzf "$tgz" -C "$WORK/$model"
  # a sweep cut short before its composition: compose its layer profile here
  [ -f "$WORK/$model/profile/profile.csv" ] && "$PY" - "$WORK/$model/profile/profile.csv" <<'PY'
import sys
from simtree.costs.profile_table import load_profile
from simtree.profiler.compose import compose_table
df = load_profile(sys.argv[1])
if not ((df.stage == "model_verify_step") & (df.variant == "composed")).any():
    print(f"composing {sys.argv[1]}: {compose_table(sys.argv[1])['composed_rows']} rows")
PY
  if [ -f "$WORK/$model/steps_profile.csv" ]; then sessions+=("$WORK/$model")
  else sweep_only+=(--sweep-only "$WORK/$model"); fi   # a rank the runtime does not build: its profile only
done
[ $(( ${#sessions[@]} + ${#sweep_only[@]} )) -gt 0 ] || { echo "error: no full_<model>*.tgz in $DIR" >&2; exit 2; }
# lossless_<model>_<dtype>.csv (scripts/lossless_fp32_gpu.sh): lossless checks run apart from the sessions
checks=(); for f in "$DIR"/lossless_*.csv; do
  [ -e "$f" ] || continue
  m=$(basename "$f" .csv); m=${m#lossless_}; dtype=${m##*_}
  case "$dtype" in
    bf16|fp32|fp64) checks+=(--lossless "${m%_*}=$f") ;;
    *) echo "error: $f: name it lossless_<model>_<dtype>.csv (dtype bf16, fp32 or fp64)" >&2; exit 2 ;;
  esac
done
# UNTAGGED="deepseek-v4-flash=ep=8 ...": the rank of sessions whose tables predate the deployment column
untagged=(); for u in ${UNTAGGED:-}; do untagged+=(--untagged "$u"); done
"$PY" -m simtree.runtime.full.session_report "${sessions[@]}" "${sweep_only[@]}" --out "$OUT" "${untagged[@]}" "${checks[@]}"
