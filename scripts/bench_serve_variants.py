"""Controller settings side by side on the serving benchmark's points, against the best static
tier (how a setting of :class:`simtree.control.Controller` is chosen on the benchmark's seeds and
then tested on fresh ones).

For every (model, arrivals, load) point of ``simtree bench-serve`` (its traces, loads and
acceptance seeds ``seed .. seed + 3``) the fixed tiers are served once (cached in ``--cache``)
and the controller once per ``--set`` variant; per point it prints the controller's tok/s and
TPOT p99 against the best static tier's, and a summary line per variant.

    python scripts/bench_serve_variants.py --seed 0 --set tail_hold=0 --set tail_hold=2
    python scripts/bench_serve_variants.py --seed 100 --set tail_hold=2      # fresh seeds
"""
from __future__ import annotations

import argparse
import json
import pickle
import warnings
from pathlib import Path

import numpy as np

from simtree.acceptance.model import get_workload
from simtree.control.controller import DEFAULT_TIERS, Controller, tier_shape
from simtree.costs.model import load_costs
from simtree.serving.bench import LOADS, REPLICAS, default_models
from simtree.serving.costgrid import CostGrid
from simtree.serving.policies import ControllerDriver, FixedDriver
from simtree.serving.sim import MAX_BATCH, serve_replicas
from simtree.serving.traces import ARRIVALS, make_trace

CTX = 512.0     # bench-serve's context for the load unit


def _variant(text: str) -> dict:
    out = {}
    for part in filter(None, text.split(",")):
        key, value = part.split("=")
        out[key.strip()] = json.loads(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="arrivals' seed; acceptance seeds seed .. seed + 3")
    ap.add_argument("--set", action="append", default=[], help="controller settings, e.g. tail_hold=2,tail_power=2")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--cache", default="/tmp/bench_serve_statics", help="folder for the fixed tiers' results")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    acc = get_workload("sharegpt").acceptance
    cache = Path(args.cache) / f"seed{args.seed}_{args.requests}.pkl"
    statics = pickle.loads(cache.read_bytes()) if cache.is_file() else {}
    variants = [_variant(v) for v in args.set] or [{}]
    summary = {i: [] for i in range(len(variants))}
    for path in default_models():
        grid = CostGrid(load_costs(path))
        model = grid.meta.get("model", path.stem)
        none_rate = MAX_BATCH / float(grid.verify.predict(1.0, CTX, MAX_BATCH)) * 1e6
        tiers = [tier_shape(acc, s, i) for i, s in enumerate(DEFAULT_TIERS)]
        for kind in ARRIVALS:
            for load in LOADS:
                base = make_trace(kind, 1.0, args.requests, args.seed)
                trace = make_trace(kind, load * none_rate / float(base.output_len.mean()), args.requests, args.seed)
                seeds = range(args.seed, args.seed + REPLICAS)
                key = (model, kind, load)
                if key not in statics:
                    res = {t.name: serve_replicas(trace, lambda t=t: FixedDriver(grid, t), acc.weights, seeds)
                           for t in tiers}
                    best = max(res, key=lambda k: res[k].tok_s)
                    statics[key] = (best, res[best].tok_s, res[best].tpot_p99_ms)
                    cache.parent.mkdir(parents=True, exist_ok=True)
                    cache.write_bytes(pickle.dumps(statics))
                best, tok_s, p99 = statics[key]
                for i, v in enumerate(variants):
                    r = serve_replicas(trace, lambda v=v: ControllerDriver(Controller(grid, acc, **v)), acc.weights,
                                       seeds)
                    summary[i].append((r.tok_s / tok_s - 1, r.tpot_p99_ms / p99 - 1))
                    print(f"{json.dumps(v)} {model} {kind} {load:g}x: tok/s {r.tok_s / tok_s - 1:+.4%}, TPOT p99 "
                          f"{r.tpot_p99_ms:.4f} vs {best} {p99:.4f} ({r.tpot_p99_ms / p99 - 1:+.4%})", flush=True)
    for i, v in enumerate(variants):
        tok, p99 = np.array(summary[i]).T
        print(f"{json.dumps(v)} seed {args.seed}: tok/s >= best static at {int((tok >= 0).sum())}/{tok.size} "
              f"(lowest {tok.min():+.4%}); TPOT p99 <= best static at {int((p99 <= 0).sum())}/{p99.size} "
              f"(highest {p99.max():+.4%}, mean {p99.mean():+.2%})")


if __name__ == "__main__":
    main()
