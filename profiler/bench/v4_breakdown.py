"""Where a V4 attention block's verify time goes, kernel by kernel, on the GPU:

    python -m simtree.profiler.bench.v4_breakdown --out $OUT/v4_breakdown.csv
    python -m simtree.profiler.bench.v4_breakdown --out $OUT/hc.csv --forms torch,fused   # hyper-connections

For each point (layer kind x batch x nodes x context at V4-Flash shapes, random trees) the
block's three parts as ``profiler/bench/v4_floor.py`` times them (pre: hc_pre, norms,
projections, RoPE; core: the kernels' tree verify; post: RoPE out, the grouped output
projections, hc_post) each run eagerly under ``torch.profiler``; every device kernel's
duration is summed per (part, kernel name) over ``--reps`` calls and divided by them.  Beside it
the part's time under a CUDA graph (``v4_floor.timed``): the graph's time less the kernels'
sum is what launches and gaps between kernels cost.  The floor of each part
(``v4_floor._end_floors``, ``verify_floor(..., "core")``) is in every row.  ``--forms`` runs every
point under each listed form of the hyper-connections (the layer form ``v4_hc``: "torch", today's
path, or "fused", kernels/layers/mhc.py) and names it in the ``forms`` column; with more than
one, the JSON's ``hc_check`` holds each point's largest difference of the pre part's block input
and the post part's streams against the first form's.

Writes the CSV at --out (kind, batch, nodes, context, forms, part, kernel, calls_per_rep, kernel_us,
part_kernels_us, part_graph_us, part_floor_us, gpu, torch) and a JSON sidecar (the top kernels
per part and point).  Points run in order until --max-seconds; the files are rewritten after
each.  On a CPU only --smoke runs (tiny-v4, the code path, no numbers worth reading).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from simtree.fileio import write_text_atomic
from simtree.kernels.layers import v4 as V
from simtree.kernels.layers.forms import forms
from simtree.kernels.layers.mhc import hc_pre
from simtree.models import get_model

from .v4_floor import _end_floors, timed
from .v4_floor_model import verify_floor
from .v4_variants import MODEL, Layer, log

COLUMNS = ["kind", "batch", "nodes", "context", "forms", "part", "kernel", "calls_per_rep", "kernel_us",
           "part_kernels_us", "part_graph_us", "part_floor_us", "gpu", "torch"]


def _kernels(fn, reps: int, device: str) -> dict[str, tuple[float, float]]:
    """{kernel name: (calls per rep, device us per rep)} of ``fn`` run ``reps`` times eagerly."""
    from torch.profiler import ProfilerActivity, profile
    fn()                                          # warm: compiles, caches, allocator
    if device == "cuda":
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    want = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    for e in prof.events():
        if e.device_type != want or (device != "cuda" and e.cpu_parent is not None):
            continue
        out[e.name][0] += 1
        out[e.name][1] += e.time_range.elapsed_us()
    return {k: (c / reps, us / reps) for k, (c, us) in out.items()}


def _outputs(L: Layer, x, o, rm, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the block input the pre part makes, the streams the post part makes) under v4_hc=form."""
    with forms(v4_hc=form):
        w, d = L.w, L.d
        a, post, comb = hc_pre(x, w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"], d.hc_iters, d.hc_eps, d.eps)
        return a, L.post(x, o, (post, comb), rm)


def hc_check(L: Layer, b: int, n: int, ctx: int, form_list: list[str]) -> dict:
    """{form: {"pre_max_abs", "post_max_abs", "pre_ref_max_abs", "post_ref_max_abs"}}: each form's
    pre / post outputs at a point against the first form's (same inputs), and the first's size."""
    T = b * n
    _, rm = L.round(b, n, ctx, "random")
    x = L.inputs(T, 1, seed=b * 1000 + n)[0]
    g = torch.Generator(x.device).manual_seed(n)
    o = torch.randn(T, L.d.H, L.d.D, device=x.device, generator=g).to(x.dtype)
    first = _outputs(L, x, o, rm, form_list[0])
    out = {}
    for form in form_list[1:]:
        got = _outputs(L, x, o, rm, form)
        out[form] = {}
        for part, new, ref in zip(("pre", "post"), got, first):
            out[form][f"{part}_max_abs"] = float((new.float() - ref.float()).abs().max())
            out[form][f"{part}_ref_max_abs"] = float(ref.float().abs().max())
    return out


def measure(L: Layer, b: int, n: int, ctx: int, reps: int, bw: float, device: str, form: str = "torch") -> list[dict]:
    """Rows of one point with the hyper-connections in v4_hc form ``form``."""
    with forms(v4_hc=form):
        return _measure(L, b, n, ctx, reps, bw, device, form)


def _measure(L: Layer, b: int, n: int, ctx: int, reps: int, bw: float, device: str, form: str) -> list[dict]:
    cache, rm = L.round(b, n, ctx, "random")
    T = b * n
    x = L.inputs(T, 1, seed=b * 1000 + n)[0]
    inp, hc = L.pre(x, rm)
    o = torch.randn(T, L.d.H, L.d.D, device=x.device).to(x.dtype)
    parts = {"pre": lambda: L.pre(x, rm), "core": lambda: L.core(inp, cache, rm),
             "post": lambda: L.post(x, o, hc, rm)}
    with forms(v4_comp="model"):    # floors at the checkpoint's dtypes, as v4_floor's
        floors = _end_floors(L.d, L.kind, b, n, ctx, bw)
        floors["core"] = verify_floor(L.d, L.kind, b, n, ctx, "core").us(bw)
    env = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__)
    rows = []
    for part, fn in parts.items():
        ks = _kernels(fn, reps, device)
        graph = timed([fn], device, "current")[0]
        total = sum(us for _, us in ks.values())
        for name, (calls, us) in sorted(ks.items(), key=lambda kv: -kv[1][1]):
            rows.append(dict(kind=L.kind, batch=b, nodes=n, context=ctx, forms=form, part=part, kernel=name[:160],
                             calls_per_rep=round(calls, 2), kernel_us=round(us, 2), part_kernels_us=round(total, 2),
                             part_graph_us=round(graph, 2), part_floor_us=round(floors[part], 2), **env))
    del cache, rm
    return rows


def _top(rows: list[dict], k: int = 6) -> dict:
    out: dict = {}
    for r in rows:
        key = f"{r['kind']} b{r['batch']} n{r['nodes']} l{r['context']} {r['forms']} {r['part']}"
        e = out.setdefault(key, {"graph_us": r["part_graph_us"], "kernels_us": r["part_kernels_us"],
                                 "floor_us": r["part_floor_us"], "top": []})
        if len(e["top"]) < k:
            e["top"].append([r["kernel"][:80], r["calls_per_rep"], r["kernel_us"]])
    return out


def write(out: Path, rows: list[dict], meta: dict) -> None:
    buf = io.StringIO()
    wr = csv.DictWriter(buf, fieldnames=COLUMNS)
    wr.writeheader()
    wr.writerows(rows)
    write_text_atomic(out, buf.getvalue())
    write_text_atomic(out.with_suffix(".json"), json.dumps({**meta, "parts": _top(rows)}, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", default="csa,hca,swa")
    ap.add_argument("--points", default="1x1,1x16,4x4,16x4,16x16", help="BATCHxNODES, comma-separated")
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--forms", default="torch", help="v4_hc forms of the hyper-connections, comma-separated "
                                                     "(torch, fused, auto): rows for each")
    ap.add_argument("--smoke", action="store_true", help="tiny-v4 on a CPU: the code path only")
    args = ap.parse_args(argv)
    t0 = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.smoke:
        log("no CUDA device (pass --smoke for the code path on a CPU)")
        return 1
    from simtree.profiler.timing import measured_bandwidth
    bw = measured_bandwidth(device)["copy_GBps"] if device == "cuda" else 50.0
    d = V.V4Dims.of(get_model(args.model))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "copy_bandwidth_gbs": bw, "args": vars(args)}
    pts = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    form_list = args.forms.split(",")
    bad = [f for f in form_list if f not in ("torch", "fused", "auto")]
    if bad:
        log(f"--forms {','.join(bad)}: use torch, fused or auto")
        return 1
    if len(form_list) > 1:
        meta["hc_check"] = {}
    rows: list[dict] = []
    for kind in args.kinds.split(","):
        L = Layer(d, kind, device)
        for ctx in (int(c) for c in args.contexts.split(",")):
            for b, n in pts:
                if time.time() - t0 > args.max_seconds:
                    meta["stopped"] = f"time budget spent before {kind} b{b} n{n} l{ctx}"
                    write(out, rows, meta)
                    return 0
                if len(form_list) > 1:
                    meta["hc_check"][f"{kind} b{b} n{n} l{ctx}"] = hc_check(L, b, n, ctx, form_list)
                for form in form_list:
                    new = measure(L, b, n, ctx, args.reps, bw, device, form)
                    rows += new
                    log(f"{kind} b={b} n={n} l={ctx} v4_hc={form}: " + ", ".join(
                        f"{p} graph {next(r['part_graph_us'] for r in new if r['part'] == p):.1f} us / kernels "
                        f"{next(r['part_kernels_us'] for r in new if r['part'] == p):.1f} / floor "
                        f"{next(r['part_floor_us'] for r in new if r['part'] == p):.1f}"
                        for p in ("pre", "core", "post")))
                    write(out, rows, meta)
        del L
        if device == "cuda":
            torch.cuda.empty_cache()
    write(out, rows, meta)
    log(f"done in {time.time() - t0:.0f} s: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
