"""Per-kernel breakdown of one GDN tree verify on the GPU: every Triton kernel the call
launches (pre-pass with the G pass, K-side kernel where launched, verify; the walk as the
Triton walk: every config runs with cuda_walk=0 unless it sets y, and the CUDA walk, not a
Triton kernel, is not broken down), timed alone (triton.testing.do_bench median, no
CUDA graph, so small kernels include launch cost), with registers, spills, shared memory and
MMA kind (Qwen3.6-27B shapes, bf16, random trees stored depth-first).

    python3 scripts/gdn_kernel_times.py [--shapes 16:128,64:128] [--configs "",q0] > times.txt
"""
import argparse

import torch
import triton

from simtree.kernels.gdn import _tree_kernels as tree_verify
from simtree.kernels.gdn._launch import VerifyLaunch
from simtree.kernels.gdn._launched import launched_verify
from simtree.profiler.bench.bench_gdn import parse_configs
from simtree.profiler.bench.gdn_util import QWEN36, probe_inputs

KEYS = ("q", "k", "v", "g", "beta", "state", "parents", "cu_nodes")
NAMES = tree_verify.VERIFY_KERNELS
VERIFY = tree_verify.WALK_KERNELS   # their npairs_ptr is zeroed by --no-pairs


def without_pairs(kernel, a, kw):
    """A launch's (args, kwargs) with ``npairs_ptr`` (passed by position) zeroed, found by
    its name in the kernel's signature."""
    i = kernel.arg_names.index("npairs_ptr")
    return (*a[:i], torch.zeros_like(a[i]), *a[i + 1:]), kw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16:64,64:64,16:128,64:128")
    ap.add_argument("--configs", default=",q0,q1", help="bench_gdn letters; empty = the rule")
    ap.add_argument("--no-pairs", action="store_true",
                    help="also time each verify launch with no sub-chunk pairs (wrong results on "
                         "purpose: what the walk over earlier sub-chunks costs)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gdn_kernel_times times Triton kernels on a CUDA GPU; none is visible")
    calls, orig = [], {nm: getattr(tree_verify, nm) for nm in NAMES}

    class Spy:
        def __init__(self, nm):
            self.nm = nm

        def __getitem__(self, grid):
            def launch(*a, **kw):
                ck = orig[self.nm][grid](*a, **kw)
                calls.append((self.nm, grid, a, kw, ck))
                return ck
            return launch

    for nm in NAMES:
        setattr(tree_verify, nm, Spy(nm))
    dims = {k: QWEN36[k] for k in ("H", "HV", "K", "V")}
    cfgs = [{"cuda_walk": 0, **(parse_configs(c)[0] if c else {})} for c in args.configs.split(",")]
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}; trees depth-first")
    for shape in args.shapes.split(","):
        b, n = map(int, shape.split(":"))
        inp = probe_inputs(b, n, dims)
        for cfg in cfgs:
            calls.clear()
            launched_verify(*(inp[k] for k in KEYS), launch=VerifyLaunch(backend="triton", **cfg))
            torch.cuda.synchronize()
            total = 0.
            for nm, grid, a, kw, ck in list(calls):
                t = triton.testing.do_bench(lambda: orig[nm][grid](*a, **kw), warmup=20, rep=100)
                total += t
                ptx = ck.asm.get("ptx", "")
                mma = " ".join(m for m in ("wgmma", "mma.sync") if m in ptx)
                print(f"b{b} n{n} cfg={cfg} {nm} grid={grid} {t * 1e3:.1f} us regs={ck.n_regs} "
                      f"spills={ck.n_spills} smem={ck.metadata.shared} {mma}", flush=True)
                if args.no_pairs and nm in VERIFY:
                    a0, kw0 = without_pairs(orig[nm], a, kw)
                    t0 = triton.testing.do_bench(lambda: orig[nm][grid](*a0, **kw0), warmup=20,
                                                 rep=100)
                    print(f"b{b} n{n} cfg={cfg} {nm} no pairs {t0 * 1e3:.1f} us", flush=True)
            print(f"b{b} n{n} cfg={cfg} total {total * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
