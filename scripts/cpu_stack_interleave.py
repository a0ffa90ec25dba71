"""Why the CPU profile's composed stacks miss the measured ones: each piece timed alone
(as the sweep times it) beside the same piece timed inside the stack's sequence.

    python scripts/cpu_stack_interleave.py reports/cpu_host/stack_interleave.csv

For each tiny model's ``stack4`` at the quick CPU sweep's points: every piece of the stack
(per layer: projections, attention core, MLP; then the LM head) timed with
``profiler.timing.time_cpu`` on its own, then the whole stack run ``--reps`` times with each
piece's wall time taken where it runs; and the stack timed whole, as the sweep does. One
row per piece, plus a ``stack`` row (alone = the sum of the pieces alone, in_stack = the
whole stack timed).
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from simtree.fileio import write_text_atomic
from simtree.models import get_model
from simtree.profiler import pieces, stages
from simtree.profiler.timing import time_cpu


def _stack_parts(ctx, point):
    names, fns = [], []
    for i, kind in enumerate(ctx.model.stack(4)):
        variant = stages.stack_core_variant(stages.VERIFY_STAGE[kind], "cpu")
        for part, (fn, _) in zip(("proj", "core", "mlp"), stages._layer_parts(ctx, kind, point, variant)):
            names.append(f"L{i}_{kind}_{part}")
            fns.append(fn)
    names.append("lm_head")
    fns.append(pieces.lm_head_piece(ctx, point.tokens)[0])
    return names, fns


def measure(model: str, b: int, n: int, l: int, reps: int, target_s: float) -> list[dict]:
    ctx = pieces.Ctx(get_model(model), torch.device("cpu"), torch.float32)
    point = stages.Point("stack_verify_step", "stack4", model, b, n, l, "eagle")
    names, fns = _stack_parts(ctx, point)
    alone = [time_cpu([f], target_s=target_s).median_us for f in fns]
    for f in fns:   # warm the sequence once
        f()
    samples = np.zeros((reps, len(fns)))
    for r in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            samples[r, i] = (time.perf_counter() - t0) * 1e6
    in_stack = np.median(samples, axis=0)

    def whole():
        for f in fns:
            f()
    stack = time_cpu([whole], target_s=target_s).median_us
    common = {"model": model, "batch_size": b, "nodes_per_seq": n, "context_len": l,
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "torch": torch.__version__}
    rows = [{**common, "piece": nm, "alone_us": round(a, 1), "in_stack_us": round(float(s), 1),
             "ratio": round(float(s) / a, 3)} for nm, a, s in zip(names, alone, in_stack)]
    rows.append({**common, "piece": "stack", "alone_us": round(sum(alone), 1), "in_stack_us": round(stack, 1),
                 "ratio": round(stack / sum(alone), 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--target-s", type=float, default=0.5, help="time_cpu's budget per piece")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU sweep's cpu_threads: 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for model in ("tiny-gdn", "tiny-v4"):
        for b, l in ((1, 64), (2, 256)):
            rows += measure(model, b, 4, l, args.reps, args.target_s)
            print(rows[-1])
    write_text_atomic(args.out, pd.DataFrame(rows).to_csv(index=False))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
