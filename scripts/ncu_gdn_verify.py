"""Three GDN tree verifies for Nsight Compute to read (``scripts/ncu_gdn.sh``): Qwen3.6-27B
shapes, bf16, the benchmark's random EAGLE-like trees stored depth-first (``shape_trees``,
order "dfs"), the default launch or the VerifyLaunch switches given as k=v,...; the third call
runs inside a profiler range (cudaProfilerStart / Stop), which ``ncu --profile-from-start off``
reads: the first two calls compile and touch memory.

    python3 scripts/ncu_gdn_verify.py BATCH NODES [k=v,...]
"""
import sys

import torch

from simtree.kernels.gdn._launch import VerifyLaunch
from simtree.kernels.gdn._launched import launched_verify
from simtree.profiler.bench.gdn_util import probe_inputs

KEYS = ("q", "k", "v", "g", "beta", "state", "parents", "cu_nodes")


def main() -> None:
    if len(sys.argv) not in (3, 4):
        raise SystemExit("usage: ncu_gdn_verify.py BATCH NODES [k=v,...]")
    if not torch.cuda.is_available():
        raise SystemExit("ncu_gdn_verify needs a CUDA GPU; none is visible")
    b, n = int(sys.argv[1]), int(sys.argv[2])
    kw = {k: int(v) for k, v in (x.split("=") for x in filter(None, (sys.argv[3:] or [""])[0].split(",")))}
    inp = probe_inputs(b, n)
    launch = VerifyLaunch(backend="triton", **kw)
    for i in range(3):
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
        launched_verify(*(inp[k] for k in KEYS), launch=launch)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"b{b} n{n}: three verifies done ({kw or 'default launch'})")


if __name__ == "__main__":
    main()
