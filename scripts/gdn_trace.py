"""Per-kernel GPU time of whole GDN tree verifies, from a CUDA activity trace (torch.profiler):
every kernel one call launches - the Triton pre-pass and K-side kernel, the CUDA K-side
kernel and walk, the Triton walks - with its mean duration, and the median span of the call
(first kernel start to last kernel end; kernels launched programmatically dependent overlap,
so the span can be less than the sum; without CUDA graphs it includes the launch gaps).
The CSV's `us` column holds both (`stat`: mean or median).  Qwen3.6-27B shapes, bf16, random trees stored
depth-first (``--tree-order``), launches as ``VerifyLaunch`` switches (bench_gdn letters;
empty = the rule).

    python3 scripts/gdn_trace.py [--shapes 16:128,64:128] [--configs ",y2a1,y2z1"] [--out CSV]
"""
import argparse
import statistics

import pandas as pd
import torch

from simtree.kernels.gdn import tree_meta
from simtree.kernels.gdn._launch import VerifyLaunch
from simtree.kernels.gdn._launched import launched_verify
from simtree.profiler.bench.bench_gdn import parse_configs
from simtree.profiler.bench.gdn_util import QWEN36, TREE_ORDERS, shape_inputs

KEYS = ("q", "k", "v", "g", "beta", "state", "parents", "cu_nodes")


def split_calls(kernels: list[tuple[str, float, float]], reps: int) -> tuple[dict, list]:
    """{kernel name: [durations]} and the per-call spans of ``reps`` calls from their kernels
    (name, start, end), every call launching the same number of kernels (a call's kernels may
    overlap: programmatically dependent launches)."""
    events = sorted(kernels, key=lambda e: e[1])
    per = len(events) // reps if reps > 0 else 0
    if per == 0 or per * reps != len(events):
        raise SystemExit(f"{len(events)} kernels in {reps} calls: not one fixed sequence per call")
    durations, spans = {}, []
    for i in range(reps):
        call = events[i * per:(i + 1) * per]
        spans.append(max(end for _, _, end in call) - call[0][1])
        for name, start, end in call:
            durations.setdefault(name, []).append(end - start)
    return durations, spans


def trace(fn, reps: int) -> tuple[dict, list]:
    """{kernel name: [durations us]} and the per-call spans (us) of ``reps`` calls of fn."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    return split_calls([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                        if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                        and "memset" not in e.name.lower()], reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16:128,64:128")
    ap.add_argument("--configs", default=",y2a0,y2z1", help="bench_gdn letters; empty = the rule")
    ap.add_argument("--tree-order", default="dfs", choices=TREE_ORDERS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", help="CSV of the rows printed")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gdn_trace traces GPU kernels; no CUDA device is visible")
    rows = []
    for shape in args.shapes.split(","):
        b, n = map(int, shape.split(":"))
        inp = shape_inputs(b, n, 0, QWEN36, dtype=torch.bfloat16, device="cuda", max_copies=1,
                           order=args.tree_order)[0]
        meta = tree_meta(inp["parents"], inp["cu_nodes"], depth_first=inp["tb"].is_depth_first)
        for c in args.configs.split(","):
            launch = VerifyLaunch(backend="triton", **(parse_configs(c)[0] if c else {}))
            kernels, spans = trace(lambda: launched_verify(
                *(inp[k] for k in KEYS), launch=launch, meta=meta, check=False), args.reps)
            base = dict(batch_size=b, nodes_per_seq=n, config=c or "rule")
            rows.append(dict(base, kernel="(span)", us=statistics.median(spans), stat="median"))
            for name, ds in kernels.items():
                rows.append(dict(base, kernel=name[:60], us=statistics.fmean(ds), stat="mean"))
            print("\n".join(f"b{r['batch_size']:3d} n{r['nodes_per_seq']:4d} {r['config']:8s} "
                            f"{r['us']:9.1f}  {r['kernel']}" for r in rows[-len(kernels) - 1:]),
                  flush=True)
    if args.out:
        df = pd.DataFrame(rows).assign(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                       tree_order=args.tree_order)
        df.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
