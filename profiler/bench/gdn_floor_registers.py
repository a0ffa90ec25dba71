"""Registers and spills of every Triton launch the GDN floor benchmark makes, without a GPU:
each variant's calls (``gdn_floor_variants.py``) run on CPU tensors at Qwen3.6-27B shapes with
the kernels replaced by a recorder, and every distinct launch is compiled for sm_90 (Triton's
CUDA backend and its bundled ptxas) and its ptxas report read.  It also proves each launch
compiles before the GPU run.  The CUDA walk is not covered (the rule's Triton walks only).

    python -m simtree.profiler.bench.gdn_floor_registers --shapes 1x1,16x1 [--variants round]

Prints one line per launch (the shape and variant that first made it, kernel, FOLD, block_v,
warps, stages, register cap, registers, spill bytes) and ``--out`` writes them as CSV.
Programmatic dependent launches are compiled as on Hopper.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

import pandas as pd
import torch

from simtree.fileio import write_text_atomic

DTYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int64: "*i64",
          torch.int32: "*i32", torch.int8: "*i8", torch.float16: "*fp16"}
LAUNCH_KEYS = ("num_warps", "num_stages", "maxnreg")


def ptxas_path() -> str:
    """A ptxas that reads this Triton's PTX (TRITON_PTXAS_PATH, else the bundled ones)."""
    import triton
    bundled = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__),
                                            "backends/nvidia/bin/ptxas*")), reverse=True)
    asked = [os.environ["TRITON_PTXAS_PATH"]] if "TRITON_PTXAS_PATH" in os.environ else []
    for p in asked + bundled:
        if os.access(p, os.X_OK):
            return p
    raise SystemExit("error: no ptxas found (set TRITON_PTXAS_PATH)")


class Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kw)`` compiles the launch for
    sm_90 once per distinct signature and records its registers and spills."""

    def __init__(self, fn, rows: list, seen: set, ptxas: str, where: dict):
        self.fn, self.rows, self.seen, self.ptxas, self.where = fn, rows, seen, ptxas, where

    def __getitem__(self, grid):
        return self.launch

    def launch(self, *args, **kw):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        opts = {k: kw.pop(k) for k in LAUNCH_KEYS if k in kw}
        kw.pop("launch_pdl", None)
        vals = dict(zip(self.fn.arg_names, args), **kw)
        sig, const = {}, {}
        for p in self.fn.params:
            v = vals.get(p.name, p.default)
            if p.is_constexpr or v is None:
                sig[p.name], const[p.name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[p.name] = DTYPES[v.dtype]
            elif isinstance(v, bool):
                sig[p.name] = "i1"
            elif isinstance(v, int):
                sig[p.name] = "i32" if abs(v) < 2 ** 31 else "i64"
            else:
                sig[p.name] = "fp32"
        key = (self.fn.__name__, repr(sorted(const.items(), key=str)), repr(sorted(sig.items())),
               repr(sorted(opts.items())))
        if key in self.seen:
            return
        self.seen.add(key)
        k = triton.compile(ASTSource(fn=self.fn, signature=sig, constexprs=const),
                           target=GPUTarget("cuda", 90, 32), options=opts)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        cap = ["--maxrregcount", str(opts["maxnreg"])] if opts.get("maxnreg") else []
        rep = subprocess.run([self.ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull] + cap,
                             capture_output=True, text=True).stderr
        os.unlink(f.name)
        regs = re.findall(r"Used (\d+) registers", rep)
        spill = re.findall(r"(\d+) bytes spill stores", rep)
        self.rows.append(dict(**self.where, kernel=self.fn.__name__, fold=const.get("FOLD", ""),
                              block_v=const.get("BV", ""), warps=opts.get("num_warps"),
                              stages=opts.get("num_stages", ""), cap=opts.get("maxnreg", 0),
                              registers=int(regs[-1]) if regs else None,
                              spill_bytes=int(spill[-1]) if spill else None))
        print(" ".join(f"{k}={v}" for k, v in self.rows[-1].items()), flush=True)


def record(shapes, chosen) -> list[dict]:
    """Every distinct launch of the chosen variants at ``shapes`` [(batch, nodes)]."""
    from simtree.kernels.gdn import (GDNTreeCache, _deferred_kernels, _launch, _stream_kernel,
                                     _tree_kernels, new_pending, tree_meta)
    from simtree.kernels.gdn import _launched_deferred as ld
    from simtree.kernels.gdn._launch import CommitLaunch, FoldLaunch, VerifyLaunch
    from simtree.kernels.gdn._launched import launched_commit, launched_verify
    from simtree.kernels.gdn.pending import new_pending_round
    from simtree.profiler.bench.gdn_util import QWEN36, random_gdn_inputs, shape_trees
    rows, seen, ptxas, where = [], set(), ptxas_path(), {}
    mods = {_tree_kernels: ("_qk_prenorm_kernel", "_tree_kside_kernel", "_tree_verify_kernel",
                            "_tree_verify_t_kernel", "_tree_commit_kernel"),
            _deferred_kernels: ("_fold_pending_kernel", "_round_fold_kernel",
                                "_defer_commit_kernel"),
            _stream_kernel: ("_tree_verify_stream_kernel",)}
    saved = {(m, n): getattr(m, n) for m, names in mods.items() for n in names}
    pdl_ok = _launch.pdl_ok
    try:
        for (m, n), fn in saved.items():
            setattr(m, n, Recorder(fn, rows, seen, ptxas, where))
        _launch.pdl_ok = lambda device: True
        d = {k: QWEN36[k] for k in ("H", "HV", "K", "V")}
        for b, n in shapes:
            trees, _, _ = shape_trees(b, n, 0, "dfs")
            c = random_gdn_inputs(trees, **d, device="cpu")
            meta = tree_meta(c["parents"], c["cu_nodes"], depth_first=True)
            N = c["q"].shape[0]
            cache = GDNTreeCache(torch.zeros(N, d["HV"], d["V"], dtype=torch.bfloat16),
                                 torch.zeros(N, d["HV"]), meta, True)
            acc = torch.as_tensor(c["tb"].deepest_nodes)
            cw = _launch.verify_launch_config(b, d["HV"], d["V"], "cpu", n, True,
                                              d["H"]).cuda_walk > 0
            x = [c[k] for k in ("q", "k", "v", "g", "beta", "state", "parents", "cu_nodes")]
            for v in chosen:
                ks = set(v.kernels_at(b, n, cw))
                if not ks:
                    continue
                where.update(batch=b, nodes=n, variant=v.name)   # where a launch is first seen
                L = VerifyLaunch("triton", **v.verify)
                pend = new_pending(b, d["H"], d["HV"], d["K"], d["V"], 16, "cpu", torch.bfloat16)
                pr = new_pending_round(b, d["HV"], d["V"], "cpu")
                pr.arm(c["k"], cache, c["cu_nodes"], acc)
                for kern, fold in (("gdn_verify", {}), ("gdn_verify_fold+defer", dict(pending=pend)),
                                   ("gdn_verify_fold+arm", dict(pending_round=pr))):
                    if kern in ks or (kern == "gdn_verify" and "gdn_verify+commit" in ks):
                        launched_verify(*x, meta=meta, check=False, launch=L, **fold)
                if ks & {"gdn_verify+commit", "gdn_commit"}:
                    launched_commit(c["state"], c["k"], cache, c["parents"], c["cu_nodes"], acc,
                                    check=False, launch=CommitLaunch("triton", **v.commit))
                if ks & {"gdn_defer_commit", "gdn_verify_fold+defer"}:
                    ld.launched_defer_commit(c["state"], pend, c["k"], cache, c["parents"],
                                             c["cu_nodes"], acc, check=False,
                                             launch=FoldLaunch("triton", **v.defer))
                if "gdn_fold_pending" in ks:
                    ld.launched_fold_pending(c["state"], pend,
                                             launch=FoldLaunch("triton", **v.fold))
                if "gdn_fold_round" in ks:
                    ld.launched_fold_round(c["state"], pr, launch=FoldLaunch("triton", **v.fold))
    finally:
        for (m, n), fn in saved.items():
            setattr(m, n, fn)
        _launch.pdl_ok = pdl_ok
    return rows


def main(argv=None) -> int:
    from simtree.profiler.bench.gdn_floor_variants import variants
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x1,1x16,1x128,4x16,4x128,16x1,16x16,16x128,64x16,64x128",
                    help="BxN, comma-separated")
    ap.add_argument("--variants", default="all")
    ap.add_argument("--out", help="CSV of the launches")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("error: compiles for the GPU: run without TRITON_INTERPRET=1")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = record(shapes, variants(args.variants))
    if args.out:
        write_text_atomic(args.out, pd.DataFrame(rows).to_csv(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
