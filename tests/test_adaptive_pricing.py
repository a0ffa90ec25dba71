"""cost_aware and batch_alloc priced as the full runtime runs them: the rule's trees accepted,
the static bucket (one function, shared by the planner and the runtime) verified every round;
the planner's prediction for a run equals the runtime's."""
import numpy as np
import pytest

from simtree.acceptance.model import Workload, get_workload
from simtree.costs.synthetic import synthetic_costs
from simtree.planning.adaptive import AdaptiveRounds, adaptive_bucket
from simtree.planning.planner import SearchSpace, plan
from simtree.planning.simulate import PolicySpec, analytic_run, simulate

# nodes cost verify time (no weight-bound floor): the rule's trees stay below the max budget
COSTLY = synthetic_costs(weights_us=0.0, per_token_us=10.0)
CA = PolicySpec.from_dict("cost_aware", {"max_budget": 16, "draft_depth": 3})
BA = PolicySpec.from_dict("batch_alloc", {"max_budget_per_seq": 16, "draft_depth": 3})


def _workload(prompt: int, output: int) -> Workload:
    return Workload("w", get_workload("gsm8k").acceptance, np.array([prompt]), output, "test")


@pytest.mark.parametrize("spec", [CA, BA])
def test_bucket_pricing_pays_the_bucket_every_round(spec):
    wl = _workload(64, 96)
    bucket = adaptive_bucket(wl.acceptance, spec, COSTLY, 4, 64)
    nodes, _ = AdaptiveRounds(wl.acceptance, spec, COSTLY, 4).decide(64.0)
    assert bucket == max(2, int(nodes.max())) and bucket < spec.max_nodes
    a = analytic_run(wl, spec, COSTLY, 4)
    assert a["bucket"] == bucket and a["n"] == bucket and a["nodes_std"] == 0.0
    # the rule's trees are mostly smaller than the bucket, whose verify every round pays
    assert a["tree_nodes"] < bucket
    assert a["verify_us"] == pytest.approx(float(COSTLY.verify.predict(bucket, 64 + a["g"] * (a["rounds"] - 1) / 2, 4)),
                                           rel=1e-6)
    # a smaller bucket caps the rule's trees: fewer accepted tokens per round
    small = analytic_run(wl, spec, COSTLY, 4, bucket=2)
    assert small["n"] == 2 and small["tree_nodes"] <= 2 + 1e-9 and small["g"] < a["g"]
    sim = simulate(COSTLY, wl, 4, spec)
    assert sim.throughput_tok_s == a["tok_s"] and any("static bucket" in n for n in sim.notes)
    mc = simulate(COSTLY, wl, 4, spec, mc_runs=2, seed=1)
    assert mc.ci95 and mc.mean_nodes_per_seq == bucket


def test_the_planner_predicts_what_full_run_predicts(tmp_path):
    """A cost_aware run of the full runtime (tiny model, CPU) and the planner's candidate for the
    same run (its context, its tokens per sequence): the same bucket, accepted tokens per round
    and tok/s over the mean round."""
    from full_helpers import tiny_model
    from simtree.runtime.full.measure import full_run
    B, ctx = 2, 24
    res = full_run(tiny_model("tiny-v4"), device="cpu", costs=COSTLY, batch_sizes=[B], acceptance="gsm8k",
                   context_len=ctx, rounds=3, warmup_rounds=0, extra=[("cost_aware", CA)])
    row, run = res["rows"][-1], res["runs"][-1]
    assert row["policy"] == "cost_aware:cost_aware_max16_p3"
    N = max(1, int(round(run["stats"].tokens / B)))     # the run's tokens per sequence, as predict reads them
    space = SearchSpace(budgets=(2,), eagle_steps=(1,), eagle_topk=(2,), draft_depths=(3,), modes=("cost_aware",))
    cands = plan(COSTLY, [_workload(ctx, N)], [B], space).candidates
    cand = cands[cands["policy"] == CA.name].iloc[0]
    assert row["nodes"] == cand["nodes_per_seq"] == adaptive_bucket(get_workload("gsm8k").acceptance, CA, COSTLY, B, ctx)
    assert row["predicted_accepted"] == pytest.approx(cand["tokens_per_round"], rel=1e-12)
    assert row["predicted_tok_s"] == pytest.approx(B * cand["tokens_per_round"] / cand["round_us"] * 1e6, rel=1e-12)


def test_simulate_prices_the_bucket_an_engine_verifies():
    """``simulate(..., bucket=)``: the nodes an engine verifies per sequence every round (the tiny
    default's live runs take the max budget), as analytic_run prices them."""
    costs, wl = synthetic_costs(), get_workload("sharegpt")
    spec = PolicySpec.from_dict("cost_aware", {"max_budget": 12, "draft_depth": 3})
    for bucket in (4, 12):
        sim = simulate(costs, wl, 4, spec, bucket=bucket)
        run = analytic_run(wl, spec, costs, 4, bucket=bucket)
        assert sim.mean_nodes_per_seq == bucket == run["n"]
        assert sim.throughput_tok_s == pytest.approx(run["tok_s"]) and f"bucket of {bucket} nodes" in sim.notes[0]
