"""Planner performance (printed, not a timed test).

1. The full default search: 3 workload presets x 7 batch sizes x (linear D 2..16, EAGLE s 1..6 x
   k 2..4 x D 2..16, best-first D x depth, cost-aware and batch allocation) - target <= 30 s.
2. One cost-aware per-round budget decision for one sequence (n <= 256) - target <= 50 us:
   `cost_aware_budget` on the round's best-first order (the order itself is built once per
   round from the drafter's marginals; its time is printed too).

    python benchmarks/bench_planner.py
"""
from __future__ import annotations

import time

import numpy as np

from simtree.acceptance.model import PRESETS, get_workload
from simtree.trees.builders import best_first_order, cost_aware_budget
from simtree.planning.planner import plan
from simtree.costs.synthetic import synthetic_costs


def bench_search() -> float:
    costs = synthetic_costs()
    t0 = time.perf_counter()
    res = plan(costs, [get_workload(w) for w in PRESETS])
    dt = time.perf_counter() - t0
    print(f"full default search: {dt:.2f} s for {len(res.candidates)} candidates "
          f"({len(res.chosen)} workload x batch pairs)  target <= 30 s")
    return dt


def bench_decision(max_budget: int = 256, repeats: int = 2000) -> float:
    rng = np.random.default_rng(0)
    probs = -np.sort(-rng.dirichlet(np.ones(8), size=32)[:, :8], axis=1)
    toks = np.tile(np.arange(8), (32, 1))
    costs = synthetic_costs()
    verify = lambda n: costs.verify.predict(n, 1000.0, 16)  # noqa: E731
    order = best_first_order(toks, probs, max_budget)
    cost_aware_budget(order, verify, 500.0, max_budget)
    t0 = time.perf_counter()
    for _ in range(repeats):
        cost_aware_budget(order, verify, 500.0, max_budget)
    dec = (time.perf_counter() - t0) / repeats * 1e6
    t0 = time.perf_counter()
    for _ in range(repeats // 10):
        best_first_order(toks, probs, max_budget)
    build = (time.perf_counter() - t0) / (repeats // 10) * 1e6
    table = np.asarray(verify(np.arange(1, max_budget + 1)))
    cached = lambda n: table[n - 1]  # noqa: E731  C_v(1..n_max) at this round's context, computed once
    t0 = time.perf_counter()
    for _ in range(repeats):
        cost_aware_budget(order, cached, 500.0, max_budget)
    dec_cached = (time.perf_counter() - t0) / repeats * 1e6
    print(f"cost-aware budget decision, n <= {max_budget}: {dec:.1f} us with the cost model called inside, "
          f"{dec_cached:.1f} us with C_v(1..n) precomputed for the round  target <= 50 us")
    print(f"  (building the best-first order itself from [32, 8] marginals: {build:.0f} us, once per round)")
    return dec


if __name__ == "__main__":
    bench_search()
    bench_decision()
