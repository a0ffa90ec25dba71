"""Where a full-scale round's device time goes: per-kernel totals of the engine's stages run
eagerly under torch.profiler, beside the same stages replayed as CUDA graphs (wall per step).

    python scripts/full_kernel_breakdown.py --model qwen3.6-27b --points 1:1,16:1,1:4,16:4 --out DIR

Writes DIR/<model>_kernels.csv (point, kernel, calls, total_us) and prints the top kernels and
the graph-replay time of each point; the profile's composed step is set beside it by
``simtree.costs`` users, not here.
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

from simtree.runtime.full.build import build_model
from simtree.runtime.full.steps import verify_step


def graph_ms(step, reps: int = 20) -> float:
    for _ in range(3):
        step.run()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(reps):
        ev[0].record(); step.run(); ev[1].record(); torch.cuda.synchronize()
        ts.append(ev[0].elapsed_time(ev[1]))
    ts.sort()
    return ts[len(ts) // 2]


def eager_kernels(step) -> list[tuple[str, int, float]]:
    fns = [fn for name, fn in step.engine._stages() if name in step.stages]
    for fn in fns:   # warm
        step._restore(); fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step._restore()
        for fn in fns:
            fn()
        torch.cuda.synchronize()
    agg: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg.setdefault(e.name[:90], [0, 0.0])
            a[0] += 1
            a[1] += e.device_time
    return sorted(((k, c, t) for k, (c, t) in agg.items()), key=lambda r: -r[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--points", default="1:1,16:1,1:4,16:4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    model = build_model(a.model, "cuda")
    rows = []
    for pt in a.points.split(","):
        b, n = map(int, pt.split(":"))
        t0 = time.time()
        step = verify_step(model, b, n, a.context)
        g = graph_ms(step) if step.engine.graphs else float("nan")
        ks = eager_kernels(step)
        total = sum(t for _, _, t in ks)
        print(f"== b={b} n={n} l={a.context}: graph replay {g:.3f} ms, eager kernel sum {total/1e3:.3f} ms, "
              f"{sum(c for _, c, _ in ks)} kernels ({time.time()-t0:.0f} s)", flush=True)
        for k, c, t in ks[:14]:
            print(f"   {t/1e3:8.3f} ms {c:6d}x  {k}")
        rows += [dict(point=pt, graph_ms=g, kernel=k, calls=c, total_us=t) for k, c, t in ks]
        step.close()
    with open(a.out / f"{a.model}_kernels.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader(); w.writerows(rows)


if __name__ == "__main__":
    main()
