#!/usr/bin/env bash
# Set up (if needed) and run the main job on the embedded default (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/simtree plan "$@"
