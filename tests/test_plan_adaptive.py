"""The adaptive budget never loses where its own trees are verified: cost_aware priced at its
ragged trees against the best fixed budget (grid over budget and depth) in the planner, on the
shipped bundles and on random models; adaptive_vs_fixed.csv
and the spread of the per-round budgets in plan.md."""
import numpy as np
import pandas as pd
import pytest

from simtree.acceptance.model import PRESETS, AcceptanceModel, Workload, get_workload
from simtree.costs.model import load_costs, resolve_costs
from simtree.costs.synthetic import RooflineDraftCost, RooflineVerifyCost, SyntheticCostBundle
from simtree.planning.compare import ADAPTIVE_VS_FIXED_COLUMNS, FIXED_MODES, adaptive_vs_fixed
from simtree.planning.modes import BestFirstParams, CostAwareParams, LinearParams
from simtree.planning.planner import DEFAULT_BATCH_SIZES, SearchSpace, plan
from simtree.planning.simulate import analytic_run
from simtree.cli.plan import plan_and_write

TOLERANCE = 0.005   # issue 31: matches or beats the best fixed budget within 0.5%


# the measured single-GPU V4-Flash fit (tests/data/costs/README.md) keeps an MoE verify cost,
# not convex in n, among the bundles: the shipped ones hold only dense models until a V4 rank is measured
V4_FIXTURE = "tests/data/costs/v4_flash_one_gpu.json"


@pytest.fixture(scope="module")
def shipped_plans():
    """The shipped bundles planned with cost_aware's rule priced at its own ragged trees (an engine
    that verifies them): the rule against every fixed budget.  The full runtime's static bucket
    (the default pricing) costs the rule what tests/test_adaptive_pricing.py checks."""
    workloads = [get_workload(name) for name in PRESETS]
    ragged = SearchSpace(adaptive_verify="ragged")
    return [plan(costs, workloads, DEFAULT_BATCH_SIZES, ragged) for costs in [*resolve_costs(()), load_costs(V4_FIXTURE)]]


def _steady(cands: pd.DataFrame, workload: str, b: int, policy: str) -> float:
    """Tokens per second counting every token of every round: b g / round time."""
    row = cands[(cands["workload"] == workload) & (cands["batch_size"] == b) & (cands["policy"] == policy)].iloc[0]
    return b * row["tokens_per_round"] / row["round_us"]


def test_cost_aware_matches_or_beats_the_best_fixed_budget_in_every_shipped_cell(shipped_plans):
    models = set()
    for res in shipped_plans:
        versus = adaptive_vs_fixed(res.candidates)
        models.add(res.model)
        assert len(versus) == len(PRESETS) * len(DEFAULT_BATCH_SIZES)
        rel = versus["adaptive_tok_s"] / versus["best_fixed_tok_s"] - 1
        assert rel.min() >= -TOLERANCE, versus.loc[rel.idxmin()].to_dict()
        # and counting every token of every round (no end-of-output term), the adaptive budget
        # is at least the best fixed shape too
        for r in versus.itertuples():
            steady = _steady(res.candidates, r.workload, r.batch_size, r.adaptive_policy)
            assert steady >= _steady(res.candidates, r.workload, r.batch_size, r.best_fixed_policy) * (1 - 2e-3), r
    assert models == {"deepseek-v4-flash", "qwen3.6-27b"}


def test_the_adaptive_budget_varies_by_round(shipped_plans):
    for res in shipped_plans:
        adaptive = res.candidates[res.candidates["mode"] == "cost_aware"]
        fixed = res.candidates[res.candidates["mode"].isin(["linear", "eagle"])]
        assert (fixed["nodes_std"] < 1e-9).all()   # the same shape every round
        # the drafter's confidence varies by round (8 levels per preset): so does the budget
        assert (adaptive["nodes_std"] > 0.3).mean() > 0.5


def _random_case(seed: int):
    """A calibrated acceptance model of 1-4 levels, a roofline cost bundle and a batch size."""
    rng = np.random.default_rng(seed)
    levels = int(rng.integers(1, 5))
    rows = rng.dirichlet(np.ones(4), (levels, 16)) * rng.uniform(0.3, 0.95, (levels, 16, 1))
    acc = AcceptanceModel("w", -np.sort(-rows, axis=2), rng.dirichlet(np.ones(levels)))
    wl = Workload("w", acc, rng.integers(50, 3000, 8), int(rng.integers(200, 800)))
    scale = lambda: float(np.exp(rng.uniform(-1.5, 1.5)))  # noqa: E731
    verify = RooflineVerifyCost(launch_us=400 * scale(), weights_us=13000 * scale(), per_token_us=78 * scale(),
                                per_seq_us=70 * scale(), kv_per_ctx_us=0.0154 * scale(), attn_per_pair_us=5.6e-4 * scale())
    costs = SyntheticCostBundle(verify, RooflineDraftCost(launch_us=60 * scale(), weights_us=800 * scale(),
                                                          per_token_us=4.8 * scale()))
    return wl, costs, int(rng.choice([1, 2, 8, 32, 64]))


@pytest.mark.parametrize("seed", range(4))
def test_cost_aware_beats_every_fixed_budget_of_its_drafted_depth(seed):
    # every fixed best-first budget at the same drafted depth (and the chain it could verify) is
    # one of the allocations cost_aware chooses among, round by round: it may trail only by the
    # share of its last round that is not output (g / N)
    wl, costs, b = _random_case(seed)
    most = 12
    for depth in (1, 2, 3, 5):
        got = analytic_run(wl, CostAwareParams(most, depth), costs, b, verify="ragged")
        fixed = [analytic_run(wl, BestFirstParams(d, depth), costs, b)["tok_s"] for d in range(depth + 1, most + 1)]
        fixed.append(analytic_run(wl, LinearParams(depth + 1), costs, b)["tok_s"])
        assert got["tok_s"] >= max(fixed) * (1 - got["g"] / wl.output_len - 1e-3), (depth, got["tok_s"], max(fixed))


def test_plan_writes_adaptive_vs_fixed_and_the_budget_spread(tmp_path):
    space = SearchSpace(budgets=(2, 3, 4, 6, 8), eagle_steps=(2, 3), draft_depths=(2, 3), adaptive_max_budget=8)
    out = plan_and_write(workload_specs=["gsm8k", "sharegpt"], batch_sizes=[1, 8], out_dir=str(tmp_path), space=space)
    for o in out:
        versus = pd.read_csv(o["report"]["adaptive_vs_fixed"])
        assert tuple(versus.columns) == ADAPTIVE_VS_FIXED_COLUMNS and len(versus) == 4
        cands = o["result"].candidates
        for r in versus.itertuples():
            cell = cands[(cands["workload"] == r.workload) & (cands["batch_size"] == r.batch_size)]
            fixed = cell[cell["mode"].isin(FIXED_MODES)]
            assert r.best_fixed_tok_s == pytest.approx(fixed["tok_s"].max())
            assert r.best_fixed_policy == fixed.loc[fixed["tok_s"].idxmax(), "policy"]
            assert r.adaptive_tok_s == pytest.approx(cell.loc[cell["mode"] == "cost_aware", "tok_s"].max())
        md = o["report"]["markdown"].read_text()
        assert "## Adaptive budget vs the best fixed budget" in md and "adaptive_vs_fixed.csv" in md
        for r in versus.itertuples():
            std = float(cands.loc[cands["policy"] == r.adaptive_policy].query(
                "workload == @r.workload and batch_size == @r.batch_size")["nodes_std"].iloc[0])
            assert f"| {r.workload} | {r.batch_size} | {r.best_fixed_policy} |" in md and f"± {std:.2f} |" in md
