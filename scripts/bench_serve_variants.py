"""Controller settings side by side on the serving benchmark's points, against the best static
tier (how a setting of :class:`simtree.control.Controller` is chosen on the benchmark's seeds and
then tested on fresh ones).

For every (model, arrivals, load) point of ``simtree bench-serve`` (its traces, loads and
acceptance seeds ``seed .. seed + 3``, served by :func:`simtree.serving.bench.serve_points`) the
fixed tiers are served once (cached in ``--cache``, keyed on everything their results depend on:
:func:`simtree.serving.bench.statics_key`) and the controller once per ``--set`` variant; per
point it prints the controller's tok/s and TPOT p99 against the best static tier's, and a summary
line per variant.

    python scripts/bench_serve_variants.py --seed 0 --set tail_power=2 --set tail_power=3
    python scripts/bench_serve_variants.py --seed 400 --set tail_power=3      # once, on a seed never used
"""
from __future__ import annotations

import argparse
import json
import warnings

import numpy as np

from simtree.control.controller import Controller
from simtree.fileio import write_atomic
from simtree.serving.bench import serve_points
from simtree.serving.policies import ControllerDriver


def _variant(text: str) -> dict:
    out = {}
    for part in filter(None, text.split(",")):
        key, value = part.split("=")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:   # a bare word: a string setting (tail_mix=mean)
            out[key.strip()] = value.strip()
    return out


def _controller(settings: dict):
    return lambda m: lambda: ControllerDriver(Controller(m["grid"], m["acc"], **settings))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="arrivals' seed; acceptance seeds seed .. seed + 3")
    ap.add_argument("--set", action="append", default=[],
                    help="controller settings, e.g. tail_power=3,tail_rounds=1 or tail_mix=mean (a bare word: a string)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--cache", default="/tmp/bench_serve_statics", help="folder for the fixed tiers' results")
    ap.add_argument("--csv", help="also write the rows (bench.csv's columns, a variant's settings as its policy)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    variants = {json.dumps(v): v for v in (_variant(v) for v in args.set or [""])}
    df = serve_points(num_requests=args.requests, seed=args.seed, policies=("best_static",),
                      extra={name: _controller(v) for name, v in variants.items()}, statics_cache=args.cache,
                      progress=lambda s: print(s, flush=True))
    if args.csv:
        write_atomic(args.csv, lambda tmp: df.to_csv(tmp, index=False, float_format="%.6g"))
    for name in variants:
        tok, p99, above = [], [], 0
        for (model, kind, load), g in df.groupby(["model", "arrivals", "load"], sort=False):
            by = g.set_index("policy")
            c, b = by.loc[name], by.loc["best_static"]
            tok.append(c.tok_s / b.tok_s - 1)
            p99.append(c.tpot_p99_ms / b.tpot_p99_ms - 1)
            above += c.tpot_p99_diff_lo_ms > 0
            print(f"{name} {model} {kind} {load}: tok/s {tok[-1]:+.4%}, TPOT p99 {c.tpot_p99_ms:.4f} vs "
                  f"{b.detail} {b.tpot_p99_ms:.4f} ({p99[-1]:+.4%}; paired difference "
                  f"[{c.tpot_p99_diff_lo_ms:+.3f}, {c.tpot_p99_diff_hi_ms:+.3f}] ms)")
        tok, p99 = np.array(tok), np.array(p99)
        print(f"{name} seed {args.seed}: tok/s >= best static at {int((tok >= 0).sum())}/{tok.size} "
              f"(lowest {tok.min():+.4%}); TPOT p99 <= best static at {int((p99 <= 0).sum())}/{p99.size} "
              f"(highest {p99.max():+.4%}, mean {p99.mean():+.2%}); paired band above 0 at {above}")


if __name__ == "__main__":
    main()
