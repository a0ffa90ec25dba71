"""Simulator review fixes: bounded long runs, counted output tokens, Monte-Carlo arguments,
budgets a drafted shape cannot fill, and the simulate command's one-line notes."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from simtree.acceptance.model import AcceptanceModel, Workload, calibrate_linear, get_workload
from simtree.errors import SimtreeError
from simtree.planning.modes import BestFirstParams, CostAwareParams, LinearParams, NoneParams, PolicySpec
from simtree.planning.adaptive import AdaptiveRounds, adaptive_bucket
from simtree.planning.simulate import (CTX_QUANTUM, EXACT_ROUNDS, _verify_sums, analytic_run,
                              analytic_static, simulate)
from simtree.costs.synthetic import RooflineDraftCost, RooflineVerifyCost, SyntheticCostBundle, synthetic_costs

QWEN = "simtree/data/costs/h200_qwen3.6-27b_tp1.json"


def _random_workload(rng, output_len):
    levels = int(rng.integers(1, 4))
    rows = rng.dirichlet(np.ones(4), (levels, 16)) * rng.uniform(0.3, 0.95, (levels, 16, 1))
    acc = AcceptanceModel("w", -np.sort(-rows, axis=2), rng.dirichlet(np.ones(levels)))
    return Workload("w", acc, rng.integers(50, 3000, 8), output_len)


def _random_costs(rng):
    scale = lambda: float(np.exp(rng.uniform(-1.0, 1.0)))  # noqa: E731
    verify = RooflineVerifyCost(launch_us=400 * scale(), weights_us=13000 * scale(), per_token_us=78 * scale(),
                                kv_per_ctx_us=0.0154 * scale(), attn_per_pair_us=5.6e-4 * scale())
    return SyntheticCostBundle(verify, RooflineDraftCost(weights_us=800 * scale()))


def _adaptive_reference(workload, spec, costs, b):
    """The adaptive analytic run written out one round at a time (decisions per 32-token bucket
    of context, each round's C_v of the static bucket at its own context)."""
    acc = workload.acceptance
    static = adaptive_bucket(acc, spec, costs, b, workload.mean_prompt_len)
    ad = AdaptiveRounds(acc, spec, costs, b, max_nodes=static)
    levels = np.arange(acc.num_levels)
    produced, ctx, total, rounds, decisions = 0.0, workload.mean_prompt_len, 0.0, 0, {}
    while produced < workload.output_len - 1e-9:
        bucket = int(round(ctx / CTX_QUANTUM))
        if bucket not in decisions:
            decisions[bucket] = ad.decide(bucket * CTX_QUANTUM or ctx)
        nodes, w = decisions[bucket]
        g = 1.0 + float(sum(w[i] * ad.phi(i, int(nodes[i])) for i in levels))
        last = float(costs.verify.predict(float(static), ctx, b)) + ad.draft_us
        total += last
        produced, ctx, rounds = produced + g, ctx + g, rounds + 1
    # throughput pays the rounds a sequence expects: the N-th token lies (N - produced) / g into
    # the last round, which overshoots N by (g - 1) / 2 tokens on average; at least one round
    expected = max(1.0, rounds - (produced - workload.output_len) / g + (g - 1) / (2 * g))
    return rounds, total, b * workload.output_len / (total + (expected - rounds) * last) * 1e6


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_run_matches_a_round_by_round_reference(seed):
    # the bucketed evaluation (every round of a context bucket at once) against the plain loop
    rng = np.random.default_rng(seed)
    wl, costs = _random_workload(rng, int(rng.integers(20, 600))), _random_costs(rng)
    b = int(rng.choice([1, 4, 16, 64]))
    for mode, key in (("cost_aware", "max_budget"), ("batch_alloc", "max_budget_per_seq")):
        spec = PolicySpec.from_dict(mode, {key: int(rng.integers(4, 17)), "draft_depth": int(rng.integers(1, 8))})
        got = analytic_run(wl, spec, costs, b)
        rounds, total, tok_s = _adaptive_reference(wl, spec, costs, b)
        assert got["rounds"] == rounds
        assert got["total_us"] == pytest.approx(total, rel=1e-9)
        assert got["tok_s"] == pytest.approx(tok_s, rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_long_adaptive_runs_decide_per_coarser_bucket_within_a_small_error(seed):
    # outputs longer than CTX_QUANTUM * MAX_DECISIONS tokens decide once per output_len /
    # MAX_DECISIONS tokens of context: against the round-by-round reference deciding every
    # CTX_QUANTUM tokens (12 random cases measured 0.023% at most in tok/s, 0.13% in rounds)
    from simtree.planning.simulate import MAX_DECISIONS
    rng = np.random.default_rng(100 + seed)
    wl, costs = _random_workload(rng, int(rng.integers(3000, 9000))), _random_costs(rng)
    assert wl.output_len > CTX_QUANTUM * MAX_DECISIONS   # the coarser buckets are in use
    b = int(rng.choice([1, 4, 16, 64]))
    for mode, key in (("cost_aware", "max_budget"), ("batch_alloc", "max_budget_per_seq")):
        spec = PolicySpec.from_dict(mode, {key: int(rng.integers(4, 17)), "draft_depth": int(rng.integers(1, 8))})
        got = analytic_run(wl, spec, costs, b)
        rounds, total, tok_s = _adaptive_reference(wl, spec, costs, b)
        assert got["tok_s"] == pytest.approx(tok_s, rel=5e-3)
        assert got["rounds"] == pytest.approx(rounds, rel=1e-2)


def test_long_runs_sum_sampled_rounds_within_a_small_error():
    # Beyond EXACT_ROUNDS rounds C_v is summed from sampled rounds (trapezoid): against the
    # brute-force sum over every round of a measured, piecewise-linear-in-l grid bundle
    from simtree.costs.model import load_costs
    costs = load_costs(QWEN)
    rng = np.random.default_rng(5)
    g = rng.uniform(1.0, 6.0, 6)
    n = rng.integers(1, 17, 6).astype(float)
    rounds = rng.integers(EXACT_ROUNDS + 1, 60000, 6)
    with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
        got = _verify_sums(costs, n, g, rounds, 8, 300.0)
        for i in range(6):
            t = np.arange(rounds[i])
            ref = float(np.sum(costs.verify.predict(np.full(t.size, n[i]), 300.0 + g[i] * t, 8)))
            assert got[i] == pytest.approx(ref, rel=1e-6)   # ~1e-8 in practice


def test_a_million_token_output_plans_without_a_candidates_x_rounds_matrix():
    # 1M output tokens at g = 1: a [C x R] matrix would be 400 candidates x 1M rounds (3 GB);
    # the sums are chunked / sampled instead, so this is quick and small
    import time
    import tracemalloc
    costs, C = synthetic_costs(), 400
    rng = np.random.default_rng(2)
    g = np.concatenate([[1.0], rng.uniform(1.0, 6.0, C - 1)])
    tracemalloc.start()
    t0 = time.perf_counter()
    out = analytic_static(g, rng.integers(1, 17, C), rng.uniform(0, 500, C), costs, 4, 500.0, 1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - t0 < 20 and peak < 300e6
    assert out["rounds"][0] == 1 << 20 and np.all(np.isfinite(out["throughput_tok_s"]))
    wl = Workload("w", calibrate_linear(2.6, 4, name="w"), np.full(4, 300), 1 << 20)
    t0 = time.perf_counter()
    a = analytic_run(wl, CostAwareParams(max_budget=16, draft_depth=4), costs, 4)
    assert time.perf_counter() - t0 < 20 and a["tok_s"] > 0


def test_monte_carlo_needs_two_runs_and_a_nonnegative_seed():
    wl = Workload("w", calibrate_linear(2.6, 4, name="w"), np.full(4, 300), 16)
    with pytest.raises(SimtreeError, match="0 \\(analytic\\) or >= 2"):
        simulate(synthetic_costs(), wl, 2, LinearParams(budget=4), mc_runs=1)
    with pytest.raises(SimtreeError, match="seed must be an integer in \\[0"):
        simulate(synthetic_costs(), wl, 2, LinearParams(budget=4), mc_runs=2, seed=-1)
    for bad in (dict(mc_runs=float("nan")), dict(mc_runs=2, seed=float("inf")), dict(mc_runs=-3)):
        with pytest.raises(SimtreeError, match="must be an integer in"):
            simulate(synthetic_costs(), wl, 2, LinearParams(budget=4), **bad)
    with pytest.raises(SimtreeError, match="output length must be an integer in"):
        get_workload("gsm8k", output_len=float("nan"))
    r = simulate(synthetic_costs(), wl, 2, LinearParams(budget=4), mc_runs=2, seed=3)
    lo, hi = r.ci95["throughput_tok_s"]
    assert math.isfinite(lo) and math.isfinite(hi) and hi > lo   # two samples that differ


@pytest.mark.parametrize("bad", [0, -3, 10 ** 6 + 1, 99999999999999999999, 2.5, True])
def test_batch_size_bounds_are_one_line_errors(bad):
    wl = Workload("w", calibrate_linear(2.6, 4, name="w"), np.full(4, 300), 16)
    with pytest.raises(SimtreeError, match=r"batch size must be an integer in \[1, 1000000\]"):
        simulate(synthetic_costs(), wl, bad, NoneParams())


def test_best_first_budget_beyond_its_shape_compares_linear_at_the_nodes_verified():
    rng = np.random.default_rng(9)
    wl = _random_workload(rng, 64)
    costs = _random_costs(rng)
    depth = 2   # marginals of 2 positions x top-4: at most 1 + 4 + 16 = 21 nodes
    r = simulate(costs, wl, 2, BestFirstParams(budget=500, draft_depth=depth))
    assert r.mean_nodes_per_seq <= 21 and r.linear_budget == round(r.mean_nodes_per_seq)
    lin = simulate(costs, wl, 2, LinearParams(budget=r.linear_budget))
    assert r.speedup_vs_linear == pytest.approx(r.throughput_tok_s / lin.throughput_tok_s, rel=1e-12)
    assert any("budget 500 is more than its drafted shape holds" in n for n in r.notes)
    full = simulate(costs, wl, 2, BestFirstParams(budget=8, draft_depth=3))
    assert full.notes == [] and full.linear_budget == 8


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "simtree", *args], capture_output=True, text=True)


@pytest.mark.parametrize("args, fragment", [
    (["--batch-size", "99999999999999999999"], "batch size must be an integer in [1, 1000000]"),
    (["--monte-carlo", "2", "--seed", "-1"], "seed must be an integer in [0"),
    (["--monte-carlo", "1", "--json"], "Monte-Carlo runs must be 0 (analytic) or >= 2"),
    (["--prompt-len", "1e12"], "prompt length must be in [1, 1048576]"),
    (["--output-len", "100000000"], "output length must be an integer in [1, 1048576]"),
    (["--policy-mode", "eagle", "--draft-depth", "4"], "--draft-depth applies to best_first"),
    (["--policy-mode", "eagle", "--width", "3"], "--width applies to best_first, tfm, not to mode 'eagle'"),   # was ignored
    (["--policy-mode", "linear", "--steps", "5"], "--steps applies to eagle, not to mode 'linear'"),            # was ignored
    (["--policy-mode", "best_first", "--steps", "3", "--topk", "4"], "--steps, --topk applies to eagle"),
])
def test_simulate_bad_arguments_are_one_line_errors(args, fragment):
    proc = _cli("simulate", "--model", "qwen3.6-27b", *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and fragment in proc.stderr


def test_simulate_warnings_are_one_line_notes_and_json_stays_valid():
    # 100 sequences > the 64 the profile measured, prompts below its 128-token context: notes,
    # once each
    proc = _cli("simulate", "--model", "qwen3.6-27b", "--policy-mode", "best_first", "--budget", "16",
                "--draft-depth", "12", "--batch-size", "100", "--prompt-len", "40", "--output-len", "32",
                "--monte-carlo", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))
    assert data["method"] == "monte_carlo x3" and all(math.isfinite(v) for v in data["ci95"]["throughput_tok_s"])
    lines = proc.stderr.strip().splitlines()
    assert lines and all(line.startswith("note: ") for line in lines), proc.stderr
    assert any("draft cost model" in line and "batch_size" in line for line in lines)
    assert any("verify cost model" in line and "context_len" in line for line in lines)
    assert len(lines) == len(set(lines)) and "warnings.warn" not in proc.stderr
