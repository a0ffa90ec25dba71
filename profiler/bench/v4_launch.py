"""Launch parameters of the V4 layer's fused pieces, timed against their torch forms on the GPU
(one call; each variant checked against the torch form first):

    python -m simtree.profiler.bench.v4_launch --out $OUT/v4_launch.csv

- ``mix``: ``fused_mhc.hc_mix_partials`` + the reduce (``hc_mix``) over row block, K step,
  programs aimed at, the products' precision and warps, beside the torch mix (fp32 flat, RMS,
  GEMM);
- ``collapse`` / ``merge``: ``hc_collapse`` / ``hc_merge`` over channels per program and warps,
  beside the torch forms (``mhc``'s);
- ``proj``: a compressor's two projections (kv, score + position bias) as the verify makes them
  (``verify.project_stacked``) with fp32 weights (an fp32 copy of the checkpoint's bf16) and
  with the bf16 weights themselves (tensor cores, fp32 out).

At V4-Flash shapes (hc 4, h 4096; CSA compressor 2 x 512 channels and the indexer's 2 x 128; HCA
512) and T = 1, 4, 16, 64, 256 tokens.  CUDA graphs, warm-up, medians over fresh inputs rotated
through the calls (copies filling 64 MB, beyond L2); a variant outside its error gate (GATE) is
not timed.
Writes --out (op, variant, tokens, us, max_rel_err, gpu, torch, triton).  On a CPU only --smoke
runs (tiny sizes, the code path).
"""
from __future__ import annotations

import argparse
import csv
import io
import itertools
import sys
import time

import torch

from simtree.errors import SimtreeError, check_int
from simtree.fileio import write_text_atomic
from simtree.profiler.timing import time_workload

H, HC, N_MIX = 4096, 4, 24
COLUMNS = ["op", "variant", "tokens", "us", "max_rel_err", "gpu", "torch", "triton"]
# a variant is timed only within its gate of the torch form (relative to its largest value): the
# mix at fp32 accuracy, the bf16 collapse / merge at a few roundings
GATE = {"mix": 1e-5, "collapse": 2e-2, "merge": 2e-2}


def _err(got, want) -> float:
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def cases(T: int, device: str, h: int, smoke: bool, copy: int = 0):
    """{op: (torch fn, {variant: fn}, inputs maker)} at T tokens."""
    from simtree.kernels.layers import _launched as F
    from simtree.kernels.layers import reference as ref
    from simtree.kernels.layers.mhc import hc_post, mix as mix_torch
    from simtree.kernels.v4.compressor import random_compressor
    from simtree.kernels.v4.verify import project_stacked
    g = torch.Generator(device=device).manual_seed(T * 1000 + copy)
    dt = torch.bfloat16
    x = torch.randn(T, HC, h, generator=g, device=device).to(dt)
    fn = torch.randn(N_MIX, HC * h, generator=g, device=device) * (HC * h) ** -0.5
    pre = torch.rand(T, HC, generator=g, device=device)
    out = torch.randn(T, h, generator=g, device=device).to(dt)
    post = torch.rand(T, HC, generator=g, device=device) * 2
    comb = torch.rand(T, HC, HC, generator=g, device=device)
    comb = comb / comb.sum(-1, keepdim=True)
    grid_mix = ([(16, 64, 256, "tf32x3", 4), (16, 64, 256, "ieee", 4)] if smoke else
                [(bt, bk, pr, "tf32x3", w) for bt, bk, pr, w in itertools.product((16, 64), (64, 128), (132, 264, 528),
                                                                                  (4, 8))]
                + [(16, 64, 256, "ieee", 4)])
    mix = {f"bt{bt}_bk{bk}_p{pr}_{prec}_w{w}": (lambda bt=bt, bk=bk, pr=pr, prec=prec, w=w: ref.hc_mix_reduce(
        F.hc_mix_partials_launched(x, fn, bt, bk, pr, prec, w), HC * h, 1e-6)) for bt, bk, pr, prec, w in grid_mix}
    blocks = ((512, 4),) if smoke else tuple(itertools.product((256, 512, 1024, 2048), (2, 4, 8)))
    coll = {f"b{b}_w{w}": (lambda b=b, w=w: F.hc_collapse_launched(x, pre, b, w)) for b, w in blocks}
    merge = {f"b{b}_w{w}": (lambda b=b, w=w: F.hc_merge_launched(x, out, post, comb, b, w)) for b, w in blocks}
    ops = {"mix": (lambda: mix_torch(x, fn, 1e-6), mix),
           "collapse": (lambda: (pre.unsqueeze(-1) * x).sum(1).to(dt), coll),
           "merge": (lambda: hc_post(x, out, post, comb), merge)}
    for kind, comps in (("csa", ((512, 4), (128, 4))), ("hca", ((512, 128),))):
        gen = torch.Generator().manual_seed(T + 1)
        ps = [random_compressor(dim, r, h, 64 if not smoke else 8, r == 4, gen, dtype=torch.float32).to(device)
              for dim, r in comps]
        ps16 = [p.to(device) for p in ps]
        for p in ps16:
            p.wkv, p.wgate = p.wkv.to(dt), p.wgate.to(dt)
        ps32 = [p.to(device) for p in ps16]
        for p, q in zip(ps32, ps16):
            p.wkv, p.wgate = q.wkv.float(), q.wgate.float()
        xin = torch.randn(T, h, generator=g, device=device).to(dt)
        pos = torch.arange(T, device=device) % 4
        ops[f"proj_{kind}"] = (lambda ps32=ps32, xin=xin, pos=pos: torch.cat(
            [project_stacked(p, xin, pos % p.ratio).flatten() for p in ps32]),
            {"bf16_out32": lambda ps16=ps16, xin=xin, pos=pos: torch.cat(
                [project_stacked(p, xin, pos % p.ratio).flatten() for p in ps16])})
    return ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,4,16,64,256")
    ap.add_argument("--max-seconds", type=float, default=200.0)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not a.smoke:
        print("no CUDA device (pass --smoke for the code path on a CPU)", file=sys.stderr)
        return 1
    import triton
    env = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
               triton=triton.__version__)
    kw = dict(use_graph=True, spin_ms=2.0) if device == "cuda" else dict(warmup=0, min_reps=1, max_reps=1)
    t0, rows = time.time(), []
    h = H if not a.smoke else 96
    try:
        tokens = [check_int(int(t), "--tokens", 1) for t in a.tokens.split(",")]
    except (ValueError, SimtreeError) as exc:
        print(f"error: --tokens {a.tokens!r}: {exc if isinstance(exc, SimtreeError) else 'not integers'}",
              file=sys.stderr)
        return 2
    for T in tokens:
        if time.time() - t0 > a.max_seconds:
            print(f"time budget spent before T={T}", flush=True)
            break
        # fresh inputs rotated through the timed calls, as many copies as fill 64 MB (beyond the
        # H100's 50 MB L2: the mix's 1.5 MB fn is not there in a step of 43 layers either)
        per_copy = 4 * N_MIX * HC * h + 2 * T * HC * h
        copies = 1 if a.smoke else max(2, min(64, -(-(64 << 20) // per_copy)))
        sets = [cases(T, device, h, a.smoke, c) for c in range(copies)]
        for op, (ref, variants) in sets[0].items():
            want = ref()
            for name, fn in [("torch", ref), *variants.items()]:
                fns = [s[op][0] if name == "torch" else s[op][1][name] for s in sets]
                try:
                    err = 0.0 if name == "torch" else _err(fn(), want)
                    if not err <= GATE.get(op, 1e-2):        # NaN fails too
                        print(f"{op} {name} T={T}: error {err:.2e} over its gate {GATE.get(op, 1e-2):.0e}: not timed",
                              flush=True)
                        continue
                    us = time_workload(fns, device, **kw).median_us
                except Exception as exc:  # noqa: BLE001 - a launch the GPU refuses is a row, not the end
                    print(f"{op} {name} T={T}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                rows.append(dict(op=op, variant=name, tokens=T, us=round(us, 2), max_rel_err=f"{err:.2e}", **env))
            best = min((r for r in rows if r["op"] == op and r["tokens"] == T), key=lambda r: r["us"])
            tor = next(r["us"] for r in rows if r["op"] == op and r["tokens"] == T and r["variant"] == "torch")
            print(f"T={T} {op}: torch {tor} us, best {best['variant']} {best['us']} us (err {best['max_rel_err']})",
                  flush=True)
        buf = io.StringIO()
        wr = csv.DictWriter(buf, fieldnames=COLUMNS)
        wr.writeheader()
        wr.writerows(rows)
        write_text_atomic(a.out, buf.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
