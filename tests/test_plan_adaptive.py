"""The planner sets the adaptive budget beside the best fixed budget (grid over budget and depth):
adaptive_vs_fixed.csv and the spread of the per-round budgets in plan.md."""
import pandas as pd
import pytest

from simtree.planning.compare import ADAPTIVE_VS_FIXED_COLUMNS, FIXED_MODES
from simtree.planning.planner import SearchSpace
from simtree.cli.plan import plan_and_write


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
