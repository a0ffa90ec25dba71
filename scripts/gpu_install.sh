# Sourced by the GPU session scripts (run from the repository root): gpu_install puts the wheels
# shipped in .whl/ (if any) on PYTHONPATH via /tmp/site, then installs simtree itself editable;
# its status is the editable install's.
gpu_install() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  export PYTHONUNBUFFERED=1
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
}
