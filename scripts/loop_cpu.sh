#!/usr/bin/env bash
# Close the loop on this CPU, no GPU:  profile -> fit -> traces -> plan -> run, predicted vs measured.
#
#   scripts/loop_cpu.sh [OUT_DIR]        (default out/cpu_loop, git-ignored; < 10 min on 2 shared cores)
#
# The steps and their env knobs are in scripts/loop.sh (this is DEVICE=cpu of it).  The committed
# results in reports/cpu_loop are regenerated only when asked for by name:
#   PHASES="measure plan runs report repeat" bash scripts/loop_cpu.sh reports/cpu_loop
set -euo pipefail
DEVICE=cpu exec bash "$(dirname "$0")/loop.sh" "${1:-out/cpu_loop}"
