#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on the CPU; Triton kernels run through
# Triton's interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest tests "$@"
