#!/usr/bin/env bash
# Measure NCCL collectives on this machine's GPUs and fit the communication model (issue 34).
#
#   bash scripts/collectives_gpu.sh OUT      # e.g. reports/h200/comm_8gpu
#
# With 2 or more GPUs: the collectives_gpu sweep (all-reduce, all-gather, all-to-all over groups
# of 2, 4, 8 GPUs - those the machine has - 4 KB to 256 MB and the models' layer sizes, CUDA
# graphs, one process per GPU, rank 0 writes) -> OUT/profile.csv, then `simtree fit` ->
# OUT/profile.comm.json, which `simtree plan --comm` and `COMM=... scripts/ship_defaults.sh` use
# instead of the assumed defaults.  With one GPU: the dry run (a group of one rank) checks the
# stage's code path; nothing is fitted.  Rerunning resumes.
set -euo pipefail
OUT=${1:?usage: bash scripts/collectives_gpu.sh OUT}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
GPUS=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count())")
echo "$(date +%T) $GPUS GPU(s) visible"
if [[ "$GPUS" -ge 2 ]]; then
  .venv/bin/simtree profile --sweep collectives_gpu --out "$OUT/profile.csv" | tee -a "$OUT/log.txt"
  .venv/bin/simtree fit "$OUT/profile.csv" | tee -a "$OUT/log.txt"
else
  .venv/bin/simtree profile --sweep collectives_dryrun --out "$OUT/profile_dryrun.csv" | tee -a "$OUT/log.txt"
  echo "one GPU: dry run only (no communication cost to fit)" | tee -a "$OUT/log.txt"
fi
echo "$(date +%T) done"
