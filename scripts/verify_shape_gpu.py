"""Does the full runtime's verify step cost depend on the tree's shape at a fixed node count?

C_v(n, l, b) takes the node count only; the shipped rank profiles time one shape per n (EAGLE
top-2, ``runtime/full/steps.py``).  The H100 modes run (reports/h100/modes) verified cost_aware's
and batch_alloc's 14-node buckets (best-first trees over 3 positions, top-4 marginals, padding past
each sequence's budget) in 58.4 ms at batch 32, against 47.6 ms for block's 16-node trees over 7
positions, and the same 15-node bucket in 23.5 ms at batch 8 (as the others).  This script times
the runtime's whole verify + commit (:func:`runtime.full.steps.verify_step`'s stages) at equal
(b, n, l) for several shapes: a chain, the profile's EAGLE top-2 tree, best-first trees over 3
and 7 positions (the marginal modes'), and cost_aware's bucket of n (its rule choosing budgets on
the device, padding ``valid`` False), recording each tree's depth, leaves and valid nodes.  Same
node count, different time: a shape feature; equal times at b = 32 but not at n b = 448 only: the
token count's kernel choice.  Each point is timed alone (its engine built, captured, timed, freed);
a point that fails is logged and the others go on.

    python scripts/verify_shape_gpu.py --model qwen3.6-27b --out $OUT/verify_shape.csv
    python scripts/verify_shape_gpu.py --model runtime-tiny --device cpu --batch-sizes 2 --nodes 6,8 --out /tmp/s.csv
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from simtree.costs.model import load_costs
from simtree.fileio import write_atomic
from simtree.planning.modes import PolicySpec
from simtree.runtime.full.acceptance import TraceReplay
from simtree.runtime.full.build import build_model
from simtree.runtime.full.drafting import MARGINAL_TOPK, RoundShape, round_shape
from simtree.runtime.full.engine import FullEngine
from simtree.runtime.full.gpu_run import time_step
from simtree.runtime.full.steps import Step, tree_round_shape

SHAPES = ("chain", "eagle_top2", "best_first_p3", "best_first_p7", "cost_aware_p3")


def shape_of(name: str, n: int) -> RoundShape:
    if name == "chain":
        return tree_round_shape(n, "linear")
    if name == "eagle_top2":
        return tree_round_shape(n, "eagle")
    if name.startswith("best_first_p"):
        p = int(name.rsplit("p", 1)[1])
        return RoundShape(p, MARGINAL_TOPK, min(n, 1 + p * MARGINAL_TOPK), n, "best_first")
    if name == "cost_aware_p3":
        spec = PolicySpec.from_dict("cost_aware", {"max_budget": 16, "draft_depth": 3})
        return round_shape(spec, nodes=n)
    raise ValueError(name)


def tree_stats(engine) -> dict:
    """Depth, leaves and valid nodes of the timed round's trees (means over the batch)."""
    t = engine.tree
    valid = t.valid.bool()
    n = valid.shape[1]
    node = torch.arange(n, device=valid.device)
    has_child = ((t.parents[:, None, :] == node[None, :, None]) & valid[:, None, :]).any(2)   # [B, n]
    leaves = (valid & ~has_child).sum(1).float()
    depth = torch.where(valid, t.depth, torch.zeros_like(t.depth)).max(1).values.float()
    return {"depth_max": float(depth.mean()), "leaves": float(leaves.mean()), "valid_nodes": float(valid.sum(1).float().mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.6-27b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--nodes", default="12,13,14,16")
    ap.add_argument("--context-len", type=int, default=256)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--costs", default="reports/validation/frozen_h100_qwen3.6-27b_tp1.json",
                    help="bundle cost_aware decides with (default: the H100 modes run's Qwen bundle)")
    ap.add_argument("--max-seconds", type=float, default=480.0)
    args = ap.parse_args()
    t0 = time.time()
    model = build_model(args.model, device=args.device)
    costs = load_costs(args.costs) if "cost_aware_p3" in args.shapes else None
    rows, l = [], args.context_len
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for n in (int(x) for x in args.nodes.split(",")):
            for name in args.shapes.split(","):
                if time.time() - t0 > args.max_seconds:
                    print(f"time is up at b={b} n={n} {name}", flush=True)
                    break
                try:
                    rs = shape_of(name, n)
                    source = TraceReplay.fixed(min(2, rs.max_depth), b, model.device)
                    engine = FullEngine(model, rs, b, l + 4 * rs.path_rows + 8, source, costs=costs)
                    engine.capture(shared_pool=False)
                    engine.fill_context(l, 0)
                    step = Step("model_verify_step", engine, ("verify", "commit"), l, {"nodes_per_seq": n}).prime()
                    med, p10, p90 = time_step(step)
                    row = {"batch_size": b, "nodes_per_seq": n, "shape": name, "context_len": l, "verify_us_median": med,
                           "verify_us_p10": p10, "verify_us_p90": p90, **tree_stats(engine),
                           "graphs": engine.graphs is not None, "device": str(model.device)}
                    step.close()
                    rows.append(row)
                    print(f"b={b} n={n} {name}: {med:.0f} us (depth {row['depth_max']:.1f}, leaves {row['leaves']:.1f}, "
                          f"valid {row['valid_nodes']:.1f})", flush=True)
                except Exception as exc:   # noqa: BLE001 - one shape failing leaves the others timed
                    print(f"b={b} n={n} {name} FAILED: {type(exc).__name__}: {exc}", flush=True)
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
    if not rows:
        sys.exit("error: no point was timed")
    import pandas as pd
    write_atomic(args.out, lambda p: pd.DataFrame(rows).to_csv(p, index=False, float_format="%.6g"))
    print(f"wrote {args.out} ({len(rows)} points)")


if __name__ == "__main__":
    main()
