"""The controller's ranking against what the serving simulator charges and what its rounds yield,
at one ``simtree bench-serve`` point (docs/controller.md, "On the reshipped V4-Flash H200 bundle"):

    python scripts/controller_prices.py --model deepseek-v4-flash --arrivals bursty --load 1.5 --seed 0

The point's trace and acceptance seeds ``seed .. seed + 3`` are the benchmark's (as
:func:`simtree.serving.bench.serve_points` makes them).  Every tier of ``--tiers`` is served fixed
on them, and over its steps at the full batch (``MAX_BATCH`` live sequences) the script prints:
(a) the controller's expected time per token there, its tabulated price (C_d + C_v at the tier's
mean nodes and the batch's mean context, as ``Controller.predicted_tok_s`` prices a step) over
the tokens it expects of a sequence-round, 1 + r * phi (r = 1, the acceptance model; the running
r the controller learned is printed with its own run); (b) the simulator's price of the same
steps (``simtree.serving.policies``: the nodes the sequences' drawn levels verify) beside the
bundle's own untabulated price at the steps' mean context and the mean over the live sequences of
its price at each one's own context; (c) the tokens the rounds drew per sequence-round against
1 + phi, the tokens lost at the replies' ends over the whole run (a round's tokens past the
reply's last), and the time per token the simulator realised at the full batch.  Then the
controller serves the point: at its full-batch steps, the tiers it ran, its running ratio r, the
tier its mean rate ranks first against the tier its objective (that rate over the youngest live
reply's penalty, ``Controller.objective``) ranks first, and the youngest reply's horizon; last,
each policy's time and tokens at and below the full batch, and its tok/s over the replicas.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

from simtree.control.controller import Controller
from simtree.errors import SEED_MAX, SimtreeError, check_int
from simtree.serving.bench import REPLICAS, _model_setup, default_models
from simtree.serving.policies import ControllerDriver, FixedDriver
from simtree.serving.sim import MAX_BATCH, serve
from simtree.serving.traces import ARRIVALS, make_trace

TIERS = "linear_d2,linear_d3,linear_d4,eagle_s2_k2_d4,eagle_s2_k2_d5"


class Recorder:
    """A driver that records every step of the driver it wraps (and, for the controller, what it
    ranked before choosing)."""

    def __init__(self, inner):
        self.inner, self.costs, self.lags = inner, inner.costs, inner.lags
        self.steps: list[dict] = []

    def step(self, b, ctx, levels, u, rounds=None):
        row = {"b": b, "ctx": ctx.copy(), "levels": levels.copy()}
        ctl = getattr(self.inner, "ctl", None)
        if ctl is not None:
            rate = ctl.predicted_tok_s(b, float(ctx.mean()))
            h = ctl.horizon_rounds(rounds)
            row.update(ratio=ctl.ratio, h=h, by_rate=int(np.argmax(rate)),
                       by_objective=int(np.argmax(rate / ctl.penalty(h))))
        us, accepted, label = self.inner.step(b, ctx, levels, u, rounds)
        row.update(us=us, drawn=float((accepted + 1).sum()), label=label)
        self.steps.append(row)
        return us, accepted, label


def serve_recorded(trace, make_driver, weights, seeds) -> tuple[list[dict], list[float]]:
    """Every step of the runs under ``seeds`` (one fresh driver each) and each run's tok/s."""
    steps, tok_s = [], []
    for s in seeds:
        rec = Recorder(make_driver())
        tok_s.append(serve(trace, rec, weights, seed=int(s)).tok_s)
        steps += rec.steps
    return steps, tok_s


def split_line(name: str, steps: list[dict], tok_s: list[float], out_tokens: float) -> str:
    """Time and drawn tokens at and below the full batch, the tokens lost at the replies' ends."""
    full = np.array([r["b"] == MAX_BATCH for r in steps])
    us = np.array([r["us"] for r in steps])
    drawn = np.array([r["drawn"] for r in steps])

    def part(label: str, sel: np.ndarray) -> str:
        if not sel.any():
            return f"{label} no step"
        time_us = us[sel].sum()
        return f"{label} {sel.sum()} steps, {time_us * 1e-6:.3f} s, {time_us / drawn[sel].sum():.2f} us/token"
    lost = drawn.sum() - out_tokens
    return (f"  {name}: tok/s {np.mean(tok_s):.2f}; {part('full batch', full)}; {part('below', ~full)}; tokens lost "
            f"at replies' ends {lost:.0f} of {drawn.sum():.0f} drawn ({lost / drawn.sum():.3%})")


def tier_line(t, steps: list[dict], grid) -> str:
    """(a), (b) and (c) of a fixed tier's steps at the full batch (module docstring)."""
    full = [r for r in steps if r["b"] == MAX_BATCH]
    if not full:
        return f"  {t.name}: no step at the full batch"
    costs, b = grid.costs, MAX_BATCH
    ctx = np.array([r["ctx"].mean() for r in full])
    nodes = [float(t.nodes[r["levels"]].mean()) for r in full]    # what the levels drawn verify
    ctl_us = np.array([t.draft_us(grid, b) + float(grid.verify.predict(t.nodes_per_seq, c, b)) for c in ctx])
    sim_us = np.array([r["us"] for r in full])
    raw_us = np.array([t.draft_us(costs, b) + float(costs.verify.predict(n, c, b)) for n, c in zip(nodes, ctx)])
    own_us = np.array([t.draft_us(costs, b) + float(np.mean(costs.verify.predict(np.full(r["ctx"].size, n),
                                                                                 r["ctx"], b)))
                       for n, r in zip(nodes, full)])
    expected = 1.0 + t.expected_accepted
    per_round = sum(r["drawn"] for r in full) / (b * len(full))
    return (f"  {t.name}: {len(full)} steps at mean context {ctx.mean():.0f} (range {ctx.min():.0f}-{ctx.max():.0f}); "
            f"(a) {ctl_us.mean() / (b * expected):.2f} us/token ({ctl_us.mean():.1f} us a step over {expected:.4f} "
            f"tokens); (b) simulator {sim_us.mean():.1f} us ({sim_us.mean() / ctl_us.mean() - 1:+.4%}; step by step at "
            f"most {np.max(np.abs(sim_us / ctl_us - 1)):.4%}), untabulated {raw_us.mean():.1f} us "
            f"({raw_us.mean() / sim_us.mean() - 1:+.4%}), per-sequence contexts {own_us.mean():.1f} us "
            f"({own_us.mean() / raw_us.mean() - 1:+.4%}); (c) {per_round:.4f} tokens a sequence-round "
            f"({per_round / expected - 1:+.3%}), realised {sim_us.sum() / (per_round * b * len(full)):.2f} us/token")


def controller_lines(ctl: Controller, steps: list[dict], names: list[str]) -> list[str]:
    """What the controller ran at the full batch and why: its running ratio, the youngest reply's
    horizon, the first tier by mean rate against the first by objective, and the ranking at a few
    horizons (``ctl`` a fresh controller: r = 1)."""
    full = [r for r in steps if r["b"] == MAX_BATCH]
    ran = Counter(r["label"] for r in full)
    lines = [f"controller at the full batch: {len(full)} steps"]
    if not full:
        return lines
    lines[0] += "; ran " + ", ".join(f"{k} {v}" for k, v in ran.most_common())
    tiers = {t.name: t for t in ctl.tiers}
    ratio, h = np.array([r["ratio"] for r in full]), np.array([r["h"] for r in full])
    pairs = Counter((ctl.tiers[r["by_rate"]].name, ctl.tiers[r["by_objective"]].name) for r in full)
    lines += [f"  running ratio r: mean {ratio.mean():.4f} (range {ratio.min():.4f}-{ratio.max():.4f}); youngest "
              f"reply's horizon h: 1 at {np.mean(h == 1):.1%} of steps, <= 3 at {np.mean(h <= 3):.1%}, "
              f"median {np.median(h):.0f}",
              "  first by mean rate -> first by objective: " +
              "; ".join(f"{a} -> {b} at {v} steps" for (a, b), v in pairs.most_common())]
    rate = ctl.predicted_tok_s(MAX_BATCH, float(np.mean([r["ctx"].mean() for r in full])))
    a, b = tiers[pairs.most_common(1)[0][0][0]], tiers[ran.most_common(1)[0][0]]
    if a is not b:   # the running r where the tier run most ties the mean rate's first: 1 + r phi_b = k (1 + r phi_a)
        k = (1.0 + b.expected_accepted) * rate[a.index] / ((1.0 + a.expected_accepted) * rate[b.index])
        slope = b.expected_accepted - k * a.expected_accepted
        tie = f"r = {(k - 1.0) / slope:.2f}" if slope > 0 else "no r"
        lines.append(f"  on the mean rate {b.name} ties {a.name} at {tie} (a step costs {k:.4f} times as much; "
                     f"phi {b.expected_accepted:.4f} against {a.expected_accepted:.4f})")
    for hh in (1, 2, 3, 10, 60):
        pen = ctl.penalty(hh)
        obj = rate / pen
        top = np.argsort(-obj)[:2]
        lines.append(f"  at r = 1 and the steps' mean context, h = {hh}: {ctl.tiers[top[0]].name} first, "
                     f"{ctl.tiers[top[1]].name} {obj[top[1]] / obj[top[0]] - 1:+.2%}; " +
                     ", ".join(f"{n} rate {rate[tiers[n].index]:.0f} tok/s penalty {pen[tiers[n].index]:.4f}"
                               for n in names))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v4-flash", help="a shipped bundle's model (the benchmark's)")
    ap.add_argument("--arrivals", default="bursty", choices=ARRIVALS)
    ap.add_argument("--load", type=float, default=1.5, help="a multiple of plain decoding's saturating rate")
    ap.add_argument("--seed", type=int, default=0, help="arrivals' seed; acceptance seeds seed .. seed + 3")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tiers", default=TIERS, help="comma-separated tiers served fixed")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="simtree-prices-") as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")   # lookups past the measured range warn; priced as the benchmark prices them
        return report(args, Path(scratch))


def report(args, scratch: Path) -> int:
    """Prints the point's numbers (module docstring); 2 and one line on bad input."""
    try:
        check_int(args.seed, "--seed", 0, SEED_MAX - REPLICAS + 1)   # acceptance seeds run to seed + REPLICAS - 1
        paths = {p.name: p for p in default_models()}
        m = next((_model_setup(p, scratch, "sharegpt") for p in paths.values() if args.model in p.name), None)
        if m is None:
            raise SimtreeError(f"no shipped bundle of model {args.model!r} among {', '.join(paths)}")
        base = make_trace(args.arrivals, 1.0, args.requests, args.seed)
        trace = make_trace(args.arrivals, args.load * m["none_rate"] / float(base.output_len.mean()),
                           args.requests, args.seed)
        ctl = Controller(m["grid"], m["acc"])
        by_name = {t.name: t for t in ctl.tiers}
        names = [n.strip() for n in args.tiers.split(",") if n.strip()]
        unknown = [n for n in names if n not in by_name]
        if unknown or not names:
            raise SimtreeError(f"unknown tiers {unknown or names}: use some of {', '.join(by_name)}")
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    grid, weights = m["grid"], m["acc"].weights
    seeds = range(args.seed, args.seed + REPLICAS)
    out_tokens = float(trace.output_len.sum() - trace.output_len.size) * len(seeds)   # the first comes with admission
    print(f"{m['model']} {args.arrivals} {args.load:g}x, arrivals seed {args.seed}, acceptance seeds {seeds[0]}.."
          f"{seeds[-1]} ({args.requests} requests, {trace.rate_req_s:.3f} req/s); full batch = {MAX_BATCH}")
    print("(a) controller's us/token = its price / (b * (1 + phi)); (b) simulator's price of the same steps, the "
          "bundle's untabulated one, at each sequence's own context; (c) tokens drawn per sequence-round, realised "
          "us/token:")
    runs = {}
    for name in names:
        runs[name] = serve_recorded(trace, lambda t=by_name[name]: FixedDriver(grid, t), weights, seeds)
        print(tier_line(by_name[name], runs[name][0], grid))
    runs["controller"] = serve_recorded(trace, lambda: ControllerDriver(Controller(grid, m["acc"])), weights, seeds)
    print("\n".join(controller_lines(ctl, runs["controller"][0], names)))
    print("time and tokens per policy:")
    for name, (steps, tok_s) in runs.items():
        print(split_line(name, steps, tok_s, out_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
