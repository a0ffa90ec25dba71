# Sourced by the GPU session scripts (run from the repository root): gpu_install puts the wheels
# shipped in .whl/ (if any; scripts/gpu_wheels.sh makes them) on PYTHONPATH via /tmp/site, then installs simtree itself editable;
# its status is the editable install's.  gpu_log (below) starts a call's clock and its log.
gpu_install() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  export PYTHONUNBUFFERED=1
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
}

# gpu_log FILE: the call's clock starts (START, seconds since the epoch) and log MSG prints
# "[HH:MM:SS +Ns] MSG", N the seconds since START, and appends it to FILE.
gpu_log() {
  GPU_LOG_FILE=$1
  START=$(date +%s)
  log() { echo "[$(date +%T) +$(( $(date +%s) - START ))s] $*" | tee -a "$GPU_LOG_FILE"; }
}
