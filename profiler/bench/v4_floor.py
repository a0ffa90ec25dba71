"""A V4 layer's verify against its memory floor, current path vs fused variants, one GPU call:

    python -m simtree.profiler.bench.v4_floor --out $OUT/floor_v4.csv

1. correctness on the device, before any timing: every variant's tree verify + commit vs float64
   sequential decoding on random trees (tiny shapes, each layer kind), and at V4-Flash shapes
   the fused launches against their torch forms (the compressors' GEMMs vs float64, the top-k
   list vs torch.topk's set) and each variant's attention block against the current one;
2. the copy bandwidth (the floor's denominator);
3. the sweep: layer kinds x batch 1/4/16 x nodes 1/4/16 x context 4K/16K at V4-Flash shapes
   (simtree/data/models/deepseek-v4-flash), the attention block of a layer (hc_pre, norms,
   projections, RoPE, the tree verify, the output projections, hc_post: what
   kernels.layers.v4 runs, bf16 with the attention's linears FP8 as V4-Flash's checkpoint stores
   them - variant fused_bf16: the same values in bf16, against its bf16 floor -; compressors fp32
   or, variant fused_all on, bf16) per variant on random trees and on a chain
   of the same n (tree / linear), the kernels' tree verify alone (scope "core") per variant,
   the block's two ends (pre, post) and the Triton attention core alone per launch (attn_*);
   CUDA-graph replays over fresh random inputs (copies rotated), warm-up first, medians;
   floors from v4_floor_model at the measured bandwidth.  The variants, the layer
   they run and the checks live in v4_variants.py.

Writes the CSV at --out (kernel, layer_kind, batch_size, nodes_per_seq, context_len,
measured_us, floor_us, ratio, tree_over_linear, compute_floor_us: the matrix products at the
H200's bf16 peak, floor_fp8_projections_us: the block's floor with the attention's linears in
FP8 as the checkpoint stores them, ...) and a JSON summary beside it (the
checks, the worst ratio per variant and kind, the targets, which form of each switch was
faster).  Points run in priority order until --max-seconds; the files are rewritten as it goes.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import csv
import time
from pathlib import Path

import numpy as np
import torch

from simtree.fileio import write_text_atomic
from simtree.kernels.layers import v4 as V
from simtree.kernels.layers.forms import forms
from simtree.models import get_model
from simtree.profiler.timing import measured_bandwidth, time_workload

from .v4_floor_model import verify_floor
from .v4_variants import ATTENTION, ATTN_LAUNCHES, BLOCK_VARIANTS, MODEL, PROJ, VARIANTS, Layer, log, run_checks, variants

TARGET_RATIO, TARGET_TREE_OVER_LINEAR = 4.0, 1.05
COLUMNS = ["kernel", "layer_kind", "batch_size", "nodes_per_seq", "context_len", "measured_us", "floor_us", "ratio",
           "tree_over_linear", "linear_us", "compute_floor_us", "floor_fp8_projections_us", "p10_us", "p90_us", "scope",
           "variant", "tree_shape", "bandwidth_gbs"]


def timed(fns, device, variant: str) -> tuple[float, float, float]:
    """(median, p10, p90) us per call of the rotated fns under the variant's forms (the CUDA
    graph is captured inside, so the forms hold for the replays)."""
    with forms(**VARIANTS[variant]):
        # a CPU runs only --smoke: one call each (the code path, not a number)
        kw = dict(use_graph=True, spin_ms=10.0) if device == "cuda" else dict(warmup=0, min_reps=1, max_reps=1)
        st = time_workload(fns, device, **kw)
    return st.median_us, st.p10_us, st.p90_us


# ---- sweep ------------------------------------------------------------------------------------
def sweep_points(kinds, batches, ns, contexts) -> list[tuple]:
    """(kind, batch, n, ctx): trees before plain decoding (n = 1), n = 4 (the issue's points)
    first, then by context and batch."""
    pts = [(k, b, n, c) for n in ns for c in contexts for b in batches for k in kinds]
    return sorted(pts, key=lambda p: (p[2] == 1, p[2] != 4, p[3], p[1], p[2]))


def _attention_launches(L, inp, cache, rm, device) -> dict:
    """{("attn_" + name, "current", "random"): times} of sparse_attention alone on the round's
    lists, per launch of ATTN_LAUNCHES (v4_variants: names and switches; a launch that fails
    to compile is skipped)."""
    from simtree.kernels.v4._launched import sparse_attention_launched
    from simtree.kernels.v4.verify import attention_lists
    idx, sources, _ = attention_lists(cache, L.lw, inp, rm.plans[L.kind])
    out = {}
    for name, kw in ATTN_LAUNCHES.items():
        try:
            out[("attn_" + name, "current", "random")] = timed(
                [lambda kw=kw: sparse_attention_launched(inp.q, idx, sources, L.lw.sink, L.cfg.scale, **kw)],
                device, "current")
        except Exception as exc:  # noqa: BLE001 - a launch the GPU refuses (registers, shared memory)
            log(f"attention launch {name}: {type(exc).__name__}: {str(exc)[:200]}")
    return out


def _end_floors(d, kind, b, n, ctx, bw) -> dict:
    """Floors of the block's two ends (us): their weights, the streams in and out (pre: x in,
    q / kv / indexer rows out; post: o and x in, x out)."""
    f = verify_floor(d, kind, b, n, ctx, "attention")
    post_w = ("wo_a", "wo_b")
    core_w = tuple(k for k in f.weights if k.startswith(("comp.", "idx.", "sink")))
    wb = {"pre": sum(v for k, v in f.weights.items() if k not in post_w + core_w),
          "post": sum(f.weights[k] for k in post_w)}
    core = verify_floor(d, kind, b, n, ctx, "core")
    T, el, streams = b * n, 2, f.activations // 2
    attn = core.cache.get("window", 0) + core.cache.get("compressed", 0) + 2 * T * d.H * d.D * el
    return {"pre": (wb["pre"] + streams + core.activations - T * d.H * d.D * el) / (bw * 1e3),
            "post": (wb["post"] + 2 * streams + T * d.H * d.D * el) / (bw * 1e3),
            "attn": attn / (bw * 1e3)}


def measure_point(layers, kind, b, n, ctx, bw, device, copies, names, dropped, contexts=(4096,)) -> list[dict]:
    """Rows of one point, one per (scope, variant) timed on random trees; ``names``: the
    variants still running (a failing one is removed and its error put in ``dropped``)."""
    L, T = layers[kind], b * n
    with forms(v4_comp="model"):    # the floor at the checkpoint's dtypes: its compressor projections are bf16
        floors = {s: verify_floor(L.d, kind, b, n, ctx, s).us(bw) for s in ("attention", "core")}
        compute = {s: verify_floor(L.d, kind, b, n, ctx, s).compute_us() for s in ("attention", "core")}
        fp8_floor = verify_floor(L.d, kind, b, n, ctx, fp8_projections=True).us(bw)   # the checkpoint's FP8 linears
        bf16_floor = verify_floor(L.d, kind, b, n, ctx, fp8_projections=False).us(bw)  # a variant's bf16 linears
        floors.update(_end_floors(L.d, kind, b, n, ctx, bw))
    xs = L.inputs(T, copies, seed=b * 1000 + n * 10 + ctx)
    rows = []
    shapes = ("random", "linear") if n > 1 else ("random",)
    got = {}
    for shape in shapes:
        cache, rm = L.round(b, n, ctx, shape)
        inps = [L.core_inputs(x, rm) for x in xs]
        for scope in ("block", "core"):
            for variant in list(names):
                if (scope == "block" and variant not in BLOCK_VARIANTS) or (scope == "core" and shape != "random"):
                    continue
                impl = ATTENTION.get(variant, "triton")
                Lv = L.for_variant(variant)
                fns = ([lambda x=x, a=impl, Lv=Lv: Lv.block(x, cache, rm, a) for x in xs] if scope == "block"
                       else [lambda i=i, a=impl, Lv=Lv: Lv.core(i, cache, rm, a) for i in inps])
                try:
                    got[(scope, variant, shape)] = timed(fns, device, variant)
                except Exception as exc:  # noqa: BLE001 - an optional core failing drops that variant only
                    if variant == "current":
                        raise
                    names.remove(variant)
                    dropped[variant] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    log(f"variant {variant} dropped: {dropped[variant]}")
        if shape == "random" and n > 1 and ctx == min(contexts):  # the attention core alone, launch by launch
            got.update(_attention_launches(L, inps[0], cache, rm, device))
        if shape == "random":           # where the block's time goes: its two ends
            pres = [L.pre(x, rm) for x in xs]
            o = torch.randn(T, L.d.H, L.d.D, device=xs[0].device).to(xs[0].dtype)
            got[("pre", "current", shape)] = timed([lambda x=x: L.pre(x, rm) for x in xs], device, "current")
            got[("post", "current", shape)] = timed([lambda x=x, p=p: L.post(x, o, p[1], rm) for x, p in zip(xs, pres)],
                                                    device, "current")
        del cache, rm
    for (scope, variant, shape), t in got.items():
        if shape != "random":
            continue
        lin = got.get((scope, variant, "linear"), t if n == 1 else None)   # n = 1: the chain is the tree
        fl = floors[{"block": "attention"}.get(scope, "attn" if scope.startswith("attn_") else scope)]
        if scope == "block" and PROJ.get(variant) == "bf16":
            fl = bf16_floor
        rows.append(dict(kernel=scope if scope.startswith("attn_") else f"{scope}_{variant}", layer_kind=kind, batch_size=b, nodes_per_seq=n, context_len=ctx,
                         measured_us=round(t[0], 2), floor_us=round(fl, 3), ratio=round(t[0] / fl, 2),
                         tree_over_linear=round(t[0] / lin[0], 3) if lin else None,
                         linear_us=round(lin[0], 2) if lin else None, p10_us=round(t[1], 2),
                         compute_floor_us=round(compute[{"block": "attention"}.get(scope, scope)], 3)
                         if scope in ("block", "core") else None,
                         floor_fp8_projections_us=round(fp8_floor, 3) if scope == "block" else None,
                         p90_us=round(t[2], 2), scope={"block": "attention"}.get(scope, scope.split("_bk")[0]),
                         variant=variant,
                         tree_shape="random", bandwidth_gbs=round(bw, 1)))
    return rows


def summarize(rows: list[dict]) -> dict:
    out = {"worst_ratio": {}, "worst_tree_over_linear": {}, "faster_form": {}}
    for kernel in sorted({r["kernel"] for r in rows}):
        sub = [r for r in rows if r["kernel"] == kernel]
        out["worst_ratio"][kernel] = {k: max(r["ratio"] for r in sub if r["layer_kind"] == k)
                                      for k in sorted({r["layer_kind"] for r in sub})}
        out["worst_tree_over_linear"][kernel] = max((r["tree_over_linear"] for r in sub if r["tree_over_linear"]),
                                                    default=None)
    for kernel in ("block_fused", "block_fused_hc", "block_fused_all", "block_fused_live", "block_fused_pool",
                   "block_fused_bf16", "block_fused_flashmla"):
        block = [r for r in rows if r["kernel"] == kernel]
        if block:
            out[f"targets_met_{kernel}"] = all(r["ratio"] <= TARGET_RATIO for r in block) and all(
                (r["tree_over_linear"] or 0) <= TARGET_TREE_OVER_LINEAR for r in block)
    core = {(r["variant"], r["layer_kind"], r["batch_size"], r["nodes_per_seq"], r["context_len"]): r["measured_us"]
            for r in rows if r["scope"] == "core"}
    # each form against the variant without it (v4_pool: "live" against fused_all, "split" against "live")
    for form, (on, off) in {"v4_topk": ("fused", "current"), "v4_pool": ("fused_live", "fused_all"),
                            "v4_pool_split": ("fused_pool", "fused_live")}.items():
        gains = [core[(off, *k[1:])] / v for k, v in core.items() if k[0] == on and (off, *k[1:]) in core]
        if gains:
            out["faster_form"][form] = {"median_speedup_fused": round(float(np.median(gains)), 3),
                                        "min_speedup_fused": round(float(min(gains)), 3),
                                        "faster": "fused" if np.median(gains) > 1.0 else "unfused"}
    # the attention's FP8 linears: the block of fused_pool (FP8) against fused_bf16 (the same values in bf16)
    block = {(r["variant"], r["layer_kind"], r["batch_size"], r["nodes_per_seq"], r["context_len"]): r["measured_us"]
             for r in rows if r["kernel"].startswith("block_")}
    gains = [block[("fused_bf16", *k[1:])] / v for k, v in block.items()
             if k[0] == "fused_pool" and ("fused_bf16", *k[1:]) in block]
    if gains:
        out["faster_form"]["attn_proj_fp8"] = {"median_speedup_fused": round(float(np.median(gains)), 3),
                                               "min_speedup_fused": round(float(min(gains)), 3),
                                               "faster": "fused" if np.median(gains) > 1.0 else "unfused"}
    return out


def write(out: Path, rows, summary) -> None:
    buf = io.StringIO()
    wr = csv.DictWriter(buf, fieldnames=COLUMNS)
    wr.writeheader()
    wr.writerows(rows)
    write_text_atomic(out, buf.getvalue())
    write_text_atomic(out.with_suffix(".json"), json.dumps({**summary, **summarize(rows)}, indent=1, default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="floor_v4.csv", help="the CSV (a JSON summary is written beside it)")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="stop starting points after this")
    ap.add_argument("--kinds", default="csa,hca,swa")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ns", default="1,4,16")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--copies", type=int, default=4, help="input copies rotated through the timed replays")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--model", default=MODEL, help="a V4 model shape (tests: tiny-v4)")
    ap.add_argument("--smoke", action="store_true", help="run the sweep on a CPU too (the code path, not numbers)")
    ap.add_argument("--attn-proj", choices=("bf16", "fp8"), default=None,
                    help="the attention's linears (default: the model's; V4-Flash fp8, as its checkpoint)")
    args = ap.parse_args(argv)
    t0 = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from .bench_v4 import env_info
    d = V.V4Dims.of(get_model(args.model))
    if args.attn_proj:
        d = dataclasses.replace(d, proj=args.attn_proj)
    summary = {"env": env_info(), "model": args.model, "variants": VARIANTS, "args": vars(args),
               "targets": {"ratio": TARGET_RATIO, "tree_over_linear": TARGET_TREE_OVER_LINEAR}}
    summary["checks"] = [] if args.no_check else run_checks(device, d)
    if device != "cuda" and not args.smoke:
        log("no CUDA device: checks only")
        write(out, [], summary)
        return 0
    bw = measured_bandwidth(device)["copy_GBps"] if device == "cuda" else 50.0
    summary["copy_bandwidth_gbs"] = bw
    log(f"copy bandwidth {bw:.0f} GB/s; checks {sum(bool(c.get('ok')) for c in summary['checks'])}"
        f"/{len(summary['checks'])} OK")
    kinds = args.kinds.split(",")
    layers = {k: Layer(d, k, device) for k in kinds}
    contexts = [int(v) for v in args.contexts.split(",")]
    pts = sweep_points(kinds, [int(v) for v in args.batches.split(",")], [int(v) for v in args.ns.split(",")], contexts)
    names = variants(device)
    summary["variants_run"], summary["variants_dropped"] = names, {}
    rows, errors = [], []
    for i, (kind, b, n, ctx) in enumerate(pts):
        if time.time() - t0 > args.max_seconds:
            summary["points_skipped"] = len(pts) - i
            log(f"time budget spent after {i} of {len(pts)} points")
            break
        try:
            new = measure_point(layers, kind, b, n, ctx, bw, device, args.copies, names, summary["variants_dropped"],
                                contexts)
            rows += new
            log(f"{kind} b={b} n={n} ctx={ctx}: floor {new[0]['floor_us']:.1f} us; "
                + ", ".join(f"{r['variant']} {r['measured_us']:.1f} us (x{r['ratio']:.1f}, tree/linear "
                            f"{r['tree_over_linear']})" for r in new if r["scope"] == "attention"))
        except Exception as exc:  # noqa: BLE001 - one failing point is a logged error, not the end
            errors.append({"point": [kind, b, n, ctx], "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            log(f"{kind} b={b} n={n} ctx={ctx}: FAILED {errors[-1]['error']}")
            torch.cuda.empty_cache()
        summary["errors"] = errors
        write(out, rows, summary)
    write(out, rows, summary)
    log(f"done in {time.time() - t0:.0f} s: {len(rows)} rows in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
