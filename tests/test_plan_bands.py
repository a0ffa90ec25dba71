"""Uncertainty bands on a plan's choices: the quantiles of the predictions under bootstrap
acceptance models, the advantage over the runner-up, plan.md's marks, and the policy file's
additive band fields."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from simtree.acceptance.bootstrap import bootstrap_models
from simtree.acceptance.model import get_workload
from simtree.cli import app
from simtree.costs.model import load_costs
from simtree.errors import SimtreeError
from simtree.planning.bands import BAND_COLUMNS, band_workloads, plan_bands
from simtree.planning.modes import ADAPTIVE_MODES, PolicySpec
from simtree.planning.planner import SearchSpace, plan
from simtree.planning.policy_file import Policy
from simtree.planning.simulate import analytic_run
from simtree.cli.plan import plan_and_write
from simtree.reporting.plan_report import render_plan_dir

V4 = "tests/data/costs/v4_flash_one_gpu.json"   # a measured MoE fit, one GPU (tests/data/costs/README.md)
# plan_and_write refuses a deployment that does not fit its GPUs (V4-Flash on one): a shipped bundle
QWEN = "simtree/data/costs/h200_qwen3.6-27b_tp1.json"
SMALL = SearchSpace(budgets=(2, 3, 4, 6, 8), eagle_steps=(2, 3), eagle_topk=(2,), draft_depths=(1, 2, 3),
                    adaptive_max_budget=8)
BAND_KEYS = {"predicted_tok_s_band", "band_models", "runner_up", "within_band"}


@pytest.fixture(scope="module")
def v4_bands():
    costs = load_costs(V4)
    workloads = [get_workload(name) for name in ("gsm8k", "sharegpt")]
    res = plan(costs, workloads, [1, 4, 16, 64], SMALL)
    sets = {w.name: band_workloads(w.name, w, 8) for w in workloads}
    return costs, res, sets, plan_bands(res.chosen, res.candidates, costs, sets)


def test_bands_are_quantiles_of_the_predictions_under_the_bootstrap_models(v4_bands):
    costs, res, sets, bands = v4_bands
    assert tuple(bands.columns) == BAND_COLUMNS and len(bands) == len(res.chosen)
    for r in bands.itertuples():
        chosen = res.chosen[(res.chosen["workload"] == r.workload) & (res.chosen["batch_size"] == r.batch_size)].iloc[0]
        spec = PolicySpec.from_dict(chosen["mode"], json.loads(chosen["params"]))
        mine = np.array([analytic_run(w, spec, costs, r.batch_size)["tok_s"] for w in sets[r.workload]])
        assert (r.tok_s_lo, r.tok_s_hi) == pytest.approx((np.quantile(mine, 0.1), np.quantile(mine, 0.9)), rel=1e-9)
        cell = res.candidates[(res.candidates["workload"] == r.workload) & (res.candidates["batch_size"] == r.batch_size)]
        runner = cell[cell["policy"] == r.runner_up].iloc[0]
        family = lambda m: "adaptive" if m in ADAPTIVE_MODES else m  # noqa: E731
        assert family(runner["mode"]) != family(chosen["mode"])
        # the runner-up is the best of the other families (a policy predicting exactly the same is passed over)
        other = cell[[family(m) != family(chosen["mode"]) for m in cell["mode"]]]
        other = other[~np.isclose(other["tok_s"], chosen["tok_s"], rtol=1e-9, atol=0)]
        assert runner["tok_s"] == other["tok_s"].max()
        theirs = np.array([analytic_run(w, PolicySpec.from_dict(runner["mode"], json.loads(runner["params"])), costs,
                                        r.batch_size)["tok_s"] for w in sets[r.workload]])
        advantage = mine / theirs - 1
        assert (r.advantage_lo, r.advantage_hi) == pytest.approx((np.quantile(advantage, 0.1),
                                                                  np.quantile(advantage, 0.9)), abs=1e-12)
        assert r.within_band == (r.advantage_lo <= 0)
    # the bootstrap models separate these choices from their runners-up (advantages of 0.02-3%,
    # each band above zero); a choice they do not separate is within band (the next test)
    assert bands["within_band"].sum() < len(bands)
    assert (bands["tok_s_hi"] > bands["tok_s_lo"]).all()


def test_a_choice_the_runner_up_beats_under_the_models_is_within_band(v4_bands):
    # the plain-decoding candidate put in place of each choice: the best of the other families
    # beats it under every bootstrap model, so its advantage band lies below zero
    costs, res, sets, _ = v4_bands
    cand = res.candidates
    plain = cand[cand["mode"] == "none"].set_index(["workload", "batch_size"])
    worse = res.chosen.copy()
    for col in cand.columns:
        worse[col] = [plain.loc[(w, b), col] if col not in ("workload", "batch_size") else v
                      for w, b, v in zip(worse["workload"], worse["batch_size"], worse[col])]
    bands = plan_bands(worse, cand, costs, sets)
    assert bands["within_band"].all() and (bands["advantage_hi"] < 0).all()


def test_preset_bootstrap_models_are_drawn_once_per_process():
    wl = get_workload("mbpp")
    first, again = band_workloads("mbpp", wl, 3), band_workloads("mbpp", wl, 3)
    assert all(a.acceptance is b.acceptance for a, b in zip(first, again))
    assert all(np.array_equal(a.acceptance.tables, m.tables) for a, m in zip(first, bootstrap_models("mbpp", 3, 0)))
    assert {w.output_len for w in first} == {wl.output_len} and all(w.name == "mbpp" for w in first)


def test_policy_carries_the_band_and_plan_md_marks_choices_within_it(tmp_path):
    out = plan_and_write([QWEN], ["gsm8k"], [1, 16], str(tmp_path), space=SMALL, band_models=6)[0]
    bands, policy = out["bands"], Policy.load(out["policy"])
    raw = json.loads(out["policy"].read_text())["entries"]
    for e, d in zip(policy.entries, raw):
        r = bands[(bands["workload"] == e.workload) & (bands["batch_size"] == e.batch_max)].iloc[0]
        assert BAND_KEYS <= set(d) and d["band_models"] == 6
        assert e.tok_s_band == pytest.approx((r.tok_s_lo, r.tok_s_hi)) and e.within_band == r.within_band
        assert e.runner_up[0] == r.runner_up and e.runner_up[1] == pytest.approx((r.advantage_lo, r.advantage_hi))
        # additive: without the band fields the entry is what a plan without bands writes
        core = {k: v for k, v in d.items() if k not in BAND_KEYS}
        assert set(core) == set(out["result"].to_policy().entries[0].to_dict())
    md = out["report"]["markdown"].read_text()
    assert "## Uncertainty" in md
    rows = [line for line in md.splitlines() if line.startswith("| gsm8k |") and " to " in line]
    assert len(rows) == 2 and sum("**within band**" in line for line in rows) == int(bands["within_band"].sum())
    # a re-render reads the bands back from the policy file
    before = md
    render_plan_dir(tmp_path)
    assert out["report"]["markdown"].read_text() == before


def test_no_band_models_no_bands(tmp_path):
    out = plan_and_write([QWEN], ["sharegpt"], [4], str(tmp_path), space=SMALL, band_models=0)[0]
    assert out["bands"] is None
    assert not BAND_KEYS & set(json.loads(out["policy"].read_text())["entries"][0])
    assert "## Uncertainty" not in out["report"]["markdown"].read_text()
    render_plan_dir(tmp_path)   # an older plan, without bands, still renders


@pytest.mark.parametrize("change, fragment", [
    ({"predicted_tok_s_band": [200.0, 100.0]}, "lo <= hi"),
    ({"predicted_tok_s_band": [100.0, "x"]}, "two finite numbers"),
    ({"band_models": 0}, "band_models"),
    ({"within_band": "yes"}, "within_band"),
    ({"runner_up": {"advantage_band": [0.0, 0.1]}}, "runner_up"),
    ({"runner_up": {"policy": "linear_d2", "advantage_band": [0.1, -0.1]}}, "advantage_band"),
])
def test_malformed_band_fields_are_one_line_errors(tmp_path, change, fragment):
    out = plan_and_write([QWEN], ["sharegpt"], [4], str(tmp_path / "p"), space=SMALL, band_models=3)[0]
    data = json.loads(out["policy"].read_text())
    data["entries"][0].update(change)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SimtreeError, match=fragment) as err:
        Policy.load(path)
    assert "\n" not in str(err.value)


def test_cli_plan_json_carries_the_bands(tmp_path):
    res = CliRunner().invoke(app, ["plan", "--costs", QWEN, "--workload", "gsm8k", "--batch-sizes", "2",
                                   "--band-models", "3", "--out", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    entry = json.loads(res.stdout)[0]["entries"][0]
    assert BAND_KEYS <= set(entry) and entry["band_models"] == 3
    res = CliRunner().invoke(app, ["plan", "--costs", QWEN, "--band-models", "-1", "--out", str(tmp_path)])
    assert res.exit_code != 0
