#!/usr/bin/env bash
# Create .venv and install simtree with its test extras. Idempotent; CPU-only machines get
# the CPU torch 2.13 wheel (a looser pin, or plain PyPI, would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # a torch 2.13 wheel on this machine's disk (pip's find-links) first; else, without an
  # NVIDIA GPU, PyTorch's CPU wheel index (plain PyPI would give the multi-GB CUDA build)
  if .venv/bin/python -m pip install -q --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0"   # its dependencies, from the index
  elif command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
  else
    .venv/bin/python -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  fi
fi
# an editable install of this layout (root folders mapped into simtree) always gets setuptools'
# informational "Editable installation." notice; nothing in it needs acting on
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".[test,data,sglang]"
# SGLang itself without its GPU dependencies (pyproject.toml, extra "sglang"): its loaders and
# schedulers' pure-Python parts import on a CPU machine; tests skip where it is missing
.venv/bin/python -c "import sglang" 2>/dev/null || .venv/bin/python -m pip install -q --no-deps "sglang==0.5.23"
