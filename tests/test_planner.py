"""Planner: known optima, trees on under flat verify cost, off under steep cost, CLI."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from simtree import planner
from simtree.acceptance import Workload, calibrate_linear
from simtree.cli import app
from simtree.planner import SearchSpace, plan
from simtree.policy import Policy
from simtree.synthetic import RooflineDraftCost, RooflineVerifyCost, SyntheticCostBundle

SMALL = SearchSpace(budgets=(2, 3, 4, 6, 8), eagle_steps=(2, 3, 4), eagle_topk=(2, 3), draft_depths=(2, 3, 4),
                    adaptive_max_budget=8)


class Affine:
    def __init__(self, base, per_n):
        self.base, self.per_n = base, per_n

    def predict(self, n, l, b):
        return self.base + self.per_n * np.asarray(n, np.float64)


def _wl(mean=2.6, spread=0.25):
    return Workload("w", calibrate_linear(mean, 4, name="w", spread=spread), np.full(4, 300), 64)


def test_linear_search_finds_the_known_optimum():
    wl = _wl(spread=0.0)
    alpha = wl.acceptance.tables[0, 0, 0]
    costs = SyntheticCostBundle(Affine(1000.0, 180.0), Affine(0.0, 0.0), {"model": "m", "device": "d"})
    space = SearchSpace(budgets=tuple(range(2, 17)), eagle_steps=(), draft_depths=(), adaptive=False)
    res = plan(costs, [wl], [1], space)
    truth = max(range(1, 17), key=lambda d: (1 + sum(alpha ** i for i in range(1, d))) / (1000 + 180 * d))
    assert res.chosen.iloc[0]["policy"] == ("none" if truth == 1 else f"linear_d{truth}")


def test_flat_verify_cost_never_turns_trees_off():
    flat = RooflineVerifyCost(per_token_us=0.0, per_seq_us=0.0, kv_per_ctx_us=0.0, attn_per_pair_us=0.0)
    draft = RooflineDraftCost(per_token_us=0.0)  # memory-bound drafter: width is free too
    res = plan(SyntheticCostBundle(flat, draft), [_wl(2.4)], [1, 8, 64], SMALL)
    assert res.chosen["mode"].isin(["eagle", "best_first", "cost_aware", "batch_alloc"]).all()
    assert res.to_policy().entries[-1].tree_on


def test_steep_verify_cost_at_large_batch_picks_linear_or_none():
    steep = RooflineVerifyCost(weights_us=2000.0, per_token_us=400.0)  # compute-bound from T ~ 5
    res = plan(SyntheticCostBundle(steep, RooflineDraftCost()), [_wl(2.4)], [1, 64], SMALL)
    big = res.chosen[res.chosen["batch_size"] == 64].iloc[0]
    assert big["mode"] in ("linear", "none")
    assert not res.to_policy().lookup("w", 64).tree_on


def test_plan_policy_covers_every_batch_size_and_round_trips(tmp_path):
    res = plan(SyntheticCostBundle(RooflineVerifyCost(), RooflineDraftCost(), {"synthetic": True}),
               [_wl()], [1, 4, 16], SMALL)
    pol = res.to_policy()
    path = pol.save(tmp_path / "p.json")
    back = Policy.load(path)
    for b in range(1, 17):
        e = back.lookup("w", b)
        assert e.batch_min <= b <= e.batch_max
    assert back.source["synthetic"] is True
    assert [e.predicted_tok_s for e in back.entries] == [e.predicted_tok_s for e in pol.entries]
    chosen = res.chosen.set_index("batch_size")["tok_s"]
    assert np.all(res.candidates.groupby("batch_size")["tok_s"].max().to_numpy() <= chosen.to_numpy() + 1e-9)


def test_cli_plan_default_is_loudly_synthetic(tmp_path, monkeypatch):
    monkeypatch.setattr(planner, "COSTS_DIR", tmp_path / "none")
    out = tmp_path / "plan"
    res = CliRunner().invoke(app, ["plan", "--workload", "gsm8k", "--batch-sizes", "1,64", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "SYNTHETIC" in res.output
    pol = json.loads((out / "policy.json").read_text())
    assert pol["schema"] == "simtree.policy/1" and pol["source"]["synthetic"] is True
    assert "SYNTHETIC" in (out / "plan.md").read_text()
    assert (out / "gain_heatmap.png").stat().st_size > 0 and (out / "throughput_vs_batch.png").stat().st_size > 0


def test_cli_simulate_json(tmp_path, monkeypatch):
    monkeypatch.setattr(planner, "COSTS_DIR", tmp_path / "none")
    res = CliRunner().invoke(app, ["simulate", "--workload", "mbpp", "--batch-size", "2", "--policy-mode", "eagle",
                                   "--steps", "3", "--topk", "2", "--budget", "5", "--output-len", "32", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["policy"] == "eagle_s3_k2_d5" and data["synthetic"] is True
    assert data["speedup_vs_none"] > 1.0


def test_plan_reads_a_saved_cost_bundle(tmp_path):
    # a measured-style CostBundle (contract 2) saved as JSON goes through --costs, not SYNTHETIC
    from simtree.costfit.forms import BasisSurface
    from simtree.costmodel import CostBundle, DraftCostModel, VerifyCostModel

    verify = BasisSurface("verify", [64.0], [900.0, 0.5, 40.0, 30.0, 0.01, 0.0005])
    draft = BasisSurface("draft", [64.0], [50.0, 2.0, 120.0, 0.1, 0.01, 0.5])
    bundle = CostBundle(VerifyCostModel(verify), DraftCostModel(draft),
                        {"model": "toy", "device": "cpu", "source": "test", "synthetic": False})
    path = bundle.save(tmp_path / "toy.json")
    out = planner.plan_and_write([str(path)], ["sharegpt"], [1, 32], str(tmp_path / "plan"), space=SMALL)
    res = out[0]["result"]
    assert (res.model, res.device, res.synthetic) == ("toy", "cpu", False)
    assert "SYNTHETIC" not in (tmp_path / "plan" / "plan.md").read_text()
    assert Policy.load(out[0]["policy"]).lookup("sharegpt", 32).predicted_tok_s > 0


def test_report_rerenders_a_plan_folder_to_the_same_choice(tmp_path):
    from simtree.report import render_plan_dir, write_plan_report

    res = plan(SyntheticCostBundle(RooflineVerifyCost(), RooflineDraftCost(), {"synthetic": True}),
               [_wl()], [1, 64], SMALL)
    res.to_policy().save(tmp_path / "policy.json")
    write_plan_report(res, tmp_path)
    (tmp_path / "plan.md").unlink()
    render_plan_dir(tmp_path)
    text = (tmp_path / "plan.md").read_text()
    assert all(f"| {p} |" in text for p in res.chosen["policy"]) and "SYNTHETIC" in text


def test_planner_scores_equal_the_simulator_per_policy():
    # the vectorised search and simulate() agree candidate by candidate (fixed and adaptive)
    from simtree.simulate import PolicySpec, simulate

    costs, wl = SyntheticCostBundle(RooflineVerifyCost(), RooflineDraftCost()), _wl()
    res = plan(costs, [wl], [8], SMALL)
    rows = res.candidates.sample(12, random_state=0)
    for row in rows.itertuples():
        sim = simulate(costs, wl, 8, PolicySpec(row.mode, json.loads(row.params)))
        assert sim.throughput_tok_s == pytest.approx(row.tok_s, rel=1e-9)
        assert sim.accepted_tokens_per_round == pytest.approx(row.tokens_per_round, rel=1e-9)
