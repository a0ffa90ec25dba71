"""Simulator: analytic vs Monte-Carlo agreement, closed-form cases, batch allocation optimality."""
import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from simtree.acceptance.model import Workload, calibrate_linear, get_workload
from simtree.errors import SimtreeError
from simtree.planning.modes import (BatchAllocParams, BestFirstParams, CostAwareParams, EagleParams, LinearParams,
                                    NoneParams, PolicySpec)
from simtree.planning.simulate import batch_allocation, simulate
from simtree.costs.synthetic import SyntheticCostBundle, synthetic_costs


@dataclass(frozen=True)
class Affine:
    """C(x, y, z) = base + per_x * x (ignores the other two axes): a verify or draft cost."""
    base: float
    per_x: float

    convex_in_n, valid_range, heldout_median_error = True, {}, None   # analytic, not fitted

    def predict(self, x, y, z):
        return self.base + self.per_x * np.asarray(x, np.float64)


def _workload(mean=2.6, output_len=48, spread=0.25, prompt=200):
    acc = calibrate_linear(mean, 4, name="w", spread=spread)
    return Workload("w", acc, np.full(8, prompt), output_len)


@pytest.mark.parametrize("spec", [
    LinearParams(budget=5),
    EagleParams(num_steps=3, topk=2, budget=6),
    BestFirstParams(budget=8, draft_depth=4),
    CostAwareParams(max_budget=12, draft_depth=4),
], ids=lambda s: s.name)
def test_analytic_lies_in_the_monte_carlo_interval(spec):
    costs, wl = synthetic_costs(), _workload()
    ana = simulate(costs, wl, 4, spec)
    mc = simulate(costs, wl, 4, spec, mc_runs=40, seed=3)
    lo, hi = mc.ci95["accepted_tokens_per_round"]
    assert lo <= ana.accepted_tokens_per_round <= hi
    # Both output N tokens per sequence and drop a last round's surplus.  The analytic run
    # takes R = ceil(N / g) whole rounds (a surplus of R g - N < g tokens); Monte-Carlo's
    # sequences finish after their own random number of rounds (and their slot takes the next
    # request), wasting less on average: the analytic lies at most a share g / N below.
    lo, hi = mc.ci95["throughput_tok_s"]
    share = ana.accepted_tokens_per_round / wl.output_len
    assert lo * (1 - share) <= ana.throughput_tok_s <= hi
    assert hi - lo < 0.1 * ana.throughput_tok_s  # the interval says something


@pytest.mark.parametrize("spec", [LinearParams(budget=16),
                                  CostAwareParams(max_budget=12, draft_depth=4)],
                         ids=lambda s: s.name)
def test_one_output_token_is_not_sped_up_by_speculation(spec):
    # A round accepts several tokens, but a sequence that outputs one token gains nothing from
    # them: speculation only adds its draft and wider verify, so it is slower than plain decoding.
    costs, wl = synthetic_costs(), _workload(output_len=1)
    for r in (simulate(costs, wl, 4, spec), simulate(costs, wl, 4, spec, mc_runs=5, seed=1)):
        assert r.rounds == 1 and r.accepted_tokens_per_round > 1.5
        assert r.throughput_tok_s == pytest.approx(4 / r.round_latency_us * 1e6, rel=1e-9 if not r.ci95 else 1e-2)
        assert r.speedup_vs_none < 1.0


def test_analytic_counts_only_output_tokens_at_any_length():
    # context-free costs: throughput = b N / (R_e (C_d + C_v)), R_e the rounds a sequence expects
    # to need for N tokens: N / g + (g - 1) / (2 g) (the last round's mean overshoot), at least
    # one; R = ceil(N / g) whole rounds are run; for random N
    rng = np.random.default_rng(11)
    wl0 = _workload(spread=0.0)
    costs = SyntheticCostBundle(Affine(1000.0, 100.0), Affine(0.0, 50.0))
    for n_out in rng.integers(1, 400, 12):
        wl = Workload("w", wl0.acceptance, wl0.prompt_lens, int(n_out))
        r = simulate(costs, wl, 3, LinearParams(budget=5))
        g = r.accepted_tokens_per_round
        assert r.rounds == int(np.ceil(n_out / g - 1e-9))
        expected = max(1.0, n_out / g + (g - 1) / (2 * g))
        assert r.throughput_tok_s == pytest.approx(3 * n_out / (expected * (1000 + 500 + 200)) * 1e6, rel=1e-12)


def test_linear_closed_form_with_context_free_costs():
    # C_v = 1000 + 100 n, C_d = 50 s: tokens/round = 1 + sum_{i<D} alpha^i exactly (one level)
    wl = _workload(spread=0.0)
    alpha = wl.acceptance.tables[0, 0, 0]
    costs = SyntheticCostBundle(Affine(1000.0, 100.0), Affine(0.0, 50.0))
    for d in (2, 4, 7):
        r = simulate(costs, wl, 3, LinearParams(budget=d))
        g = 1.0 + sum(alpha ** i for i in range(1, d))
        assert r.accepted_tokens_per_round == pytest.approx(g)
        expected = wl.output_len / g + (g - 1) / (2 * g)   # rounds a sequence expects for its N tokens
        assert r.throughput_tok_s == pytest.approx(3 * wl.output_len / (expected * (1000 + 100 * d + 50 * (d - 1))) * 1e6)
        plain = 3 / 1100 * 1e6
        assert r.speedup_vs_none == pytest.approx(r.throughput_tok_s / plain)


def test_plain_decoding_is_its_own_baseline():
    r = simulate(synthetic_costs(), get_workload("sharegpt", output_len=16), 8, NoneParams())
    assert r.accepted_tokens_per_round == 1.0 and r.speedup_vs_none == pytest.approx(1.0)
    assert r.rounds == 16 and r.draft_us == 0.0


def test_context_growth_slows_decoding():
    costs = synthetic_costs(kv_per_ctx_us=2.0)  # steep in context length
    short = simulate(costs, _workload(prompt=100), 4, LinearParams(budget=4))
    long = simulate(costs, _workload(prompt=4000), 4, LinearParams(budget=4))
    assert long.round_latency_us > short.round_latency_us and long.throughput_tok_s < short.throughput_tok_s


def test_batch_allocation_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lists = [np.sort(rng.random(rng.integers(1, 5)))[::-1] * rng.random() for _ in range(3)]
        curv = float(rng.uniform(10, 400))
        cv = lambda n: 500.0 + curv * np.maximum(0, n - 1.5) ** 2 + 40 * n  # noqa: E731  convex, rising
        got = batch_allocation(lists, np.ones(3), cv, 100.0, 3)
        obj = lambda c: (3 + sum(l[:k].sum() for l, k in zip(lists, c))) / (100 + cv(1 + sum(c) / 3))  # noqa: E731
        best = max(itertools.product(*[range(len(l) + 1) for l in lists]), key=obj)
        assert obj(tuple(got)) == pytest.approx(obj(best))


def test_batch_alloc_builds_partial_trees_and_beats_short_linear():
    wl = _workload(spread=0.45)
    costs = synthetic_costs()
    r = simulate(costs, wl, 16, BatchAllocParams(max_budget_per_seq=16, draft_depth=5))
    assert 1.0 < r.mean_nodes_per_seq < 16.0
    assert r.throughput_tok_s >= simulate(costs, wl, 16, LinearParams(budget=2)).throughput_tok_s * 0.9


@pytest.mark.parametrize("bad, fragment", [
    (lambda: PolicySpec.from_dict("tree"), "unknown policy mode"),
    (lambda: PolicySpec.from_dict("eagle", {"num_steps": 2, "topk": 2}), "needs the parameter 'budget'"),
    (lambda: EagleParams(num_steps=1, topk=2, budget=9), "exceeds"),
    (lambda: LinearParams(budget=0), "integer >= 1"),
    (lambda: simulate(synthetic_costs(), _workload(), 0, NoneParams()), "batch size"),
])
def test_bad_policy_or_batch_is_one_line_error(bad, fragment):
    with pytest.raises(SimtreeError, match=fragment):
        bad()
