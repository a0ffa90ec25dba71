#!/usr/bin/env bash
# Close the loop on this CPU, no GPU:  profile -> fit -> traces -> plan -> run, predicted vs measured.
#
#   scripts/loop_cpu.sh [OUT_DIR]        (default reports/cpu_loop; < 10 min on 2 shared cores)
#
# The steps and their env knobs are in scripts/loop.sh (this is DEVICE=cpu of it).
set -euo pipefail
DEVICE=cpu exec bash "$(dirname "$0")/loop.sh" "${1:-reports/cpu_loop}"
