"""Planner / report review fixes: a fair depth search, extrapolation and model-error flags in
plan.md and the policy, name collisions, `simtree report` over per-model folders, and plan
files that must come from one plan."""
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from simtree.acceptance.model import AcceptanceModel, Workload, calibrate_linear, get_workload
from simtree.costs.forms import BasisSurface
from simtree.costs.model import CostBundle, DraftCostModel, VerifyCostModel, load_costs
from simtree.errors import SimtreeError
from simtree.planning.modes import TREE_MODES, BestFirstParams, CostAwareParams, LinearParams, PolicySpec
from simtree.planning.planner import SearchSpace, candidate_specs, choose_policies, plan
from simtree.planning.policy_file import Policy
from simtree.planning.simulate import analytic_run, simulate, static_round
from simtree.cli.plan import plan_and_write
from simtree.reporting.plan_report import render_plan_dir

DEEPSEEK = "tests/data/costs/v4_flash_one_gpu.json"   # a measured MoE fit, one GPU (tests/data/costs/README.md)
QWEN = "simtree/data/costs/h200_qwen3.6-27b_tp1.json"
SMALL = SearchSpace(budgets=(2, 3, 4, 6, 8), eagle_steps=(1, 2, 3, 5, 7), eagle_topk=(2, 3),
                    draft_depths=(1, 2, 3, 5, 7), adaptive_max_budget=8)


def _depth(spec: PolicySpec) -> int:
    s, _ = spec.draft_shape()
    return s


def test_every_family_may_draft_as_deep_as_linear_within_its_budget():
    fixed, adaptive = candidate_specs()
    deepest = {m: max(_depth(s) for s in fixed + adaptive if s.mode == m)
               for m in ("linear", "eagle", "best_first", "cost_aware", "batch_alloc")}
    assert deepest == dict.fromkeys(deepest, 15)
    for spec in fixed:
        if spec.mode in ("eagle", "best_first"):
            assert _depth(spec) <= spec.budget - 1, spec.name   # deeper builds the same tree
    # every budget offers every depth up to D - 1 to best-first
    for d in range(2, 17):
        assert {_depth(s) for s in fixed if s.mode == "best_first" and s.budget == d} == set(range(1, d))


@pytest.mark.parametrize("seed", range(3))
def test_depths_left_out_build_the_same_tree_as_depth_budget_minus_one(seed):
    rng = np.random.default_rng(seed)
    rows = rng.dirichlet(np.ones(4), (2, 20)) * rng.uniform(0.3, 0.95, (2, 20, 1))
    acc = AcceptanceModel("w", -np.sort(-rows, axis=2), rng.dirichlet(np.ones(2)))
    d = int(rng.integers(3, 10))
    for mode, key in (("best_first", "draft_depth"), ("eagle", "num_steps")):
        extra = {"width": 1} if mode == "best_first" else {"topk": 2}
        at = static_round(acc, PolicySpec.from_dict(mode, {"budget": d, key: d - 1, **extra}))
        deeper = static_round(acc, PolicySpec.from_dict(mode, {"budget": d, key: d + 3, **extra}))
        assert np.allclose(at.accepted, deeper.accepted, rtol=1e-12) and np.array_equal(at.nodes, deeper.nodes)


def test_deepseek_gsm8k_batch_8_finds_the_deep_tree_that_beats_linear():
    # the reviewer's case: best-first D=16 drafted 15 deep beats the chosen linear_d16
    costs, wl = load_costs(DEEPSEEK), get_workload("gsm8k")
    res = plan(costs, [wl], [8])
    best = res.chosen.iloc[0]
    deep = simulate(costs, wl, 8, BestFirstParams(budget=16, draft_depth=15))
    lin = simulate(costs, wl, 8, LinearParams(budget=16))
    assert deep.throughput_tok_s > lin.throughput_tok_s
    assert best["mode"] in TREE_MODES and best["tok_s"] >= deep.throughput_tok_s * (1 - 1e-9)
    assert "draft.num_steps" not in best["extrapolated"]   # the profile measured 1-15 steps


def _toy_bundle(tmp_path, name="toy", device="cpu"):
    verify = BasisSurface("verify", [64.0], [900.0, 0.5, 40.0, 30.0, 0.01, 0.0005],
                          ("nodes_per_seq", "context_len", "batch_size"),
                          {"nodes_per_seq": [1, 64], "context_len": [128, 8192], "batch_size": [1, 16]})
    draft = BasisSurface("draft", [64.0], [50.0, 2.0, 120.0, 0.1, 0.01, 0.5], ("topk", "num_steps", "batch_size"),
                         {"topk": [1, 8], "num_steps": [1, 4], "batch_size": [1, 16]})
    info = {"form": "basis", "fit_error": {"heldout": {"basis": {"median": 0.02, "p90": 0.05}}}}
    return CostBundle(VerifyCostModel(verify, info), DraftCostModel(draft),
                      {"model": name, "device": device, "synthetic": False}).save(tmp_path / f"{name}.json")


def test_plan_md_and_policy_say_which_costs_are_extrapolated(tmp_path):
    path = _toy_bundle(tmp_path)
    out = plan_and_write([str(path)], ["gsm8k"], [1, 64], str(tmp_path / "plan"), space=SMALL)[0]
    res = out["result"]
    md = (tmp_path / "plan" / "plan.md").read_text()
    # batch 64 > the measured 16 on both models, drafts of 5-7 steps > the measured 4
    assert "verify cost model: batch_size measured in [1, 16], the plan asks [1, 64]" in md
    assert "draft cost model: num_steps measured in [1, 4], the plan asks [1, 7]" in md
    big = res.chosen[res.chosen["batch_size"] == 64].iloc[0]
    assert "verify.batch_size" in big["extrapolated"]
    row = [line for line in md.splitlines() if line.startswith("| gsm8k | 64 |")][0]
    assert "verify.batch_size" in row
    cands = res.candidates
    deep = cands[(cands["mode"] == "best_first") & cands["params"].str.contains('"draft_depth": 7')]
    assert deep["extrapolated"].str.contains("draft.num_steps").all()
    shallow = cands[(cands["batch_size"] == 1) & (cands["mode"] == "linear") & (cands["budget"] <= 5)]
    assert not shallow["extrapolated"].str.contains("draft").any()
    assert Policy.load(out["policy"]).source["notes"] == res.notes


def test_plan_console_shows_the_plans_extrapolation_notes_once(tmp_path):
    # the notes of plan.md, one line each; the cost models' own warnings say the same: silenced
    path = _toy_bundle(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "simtree", "plan", "--costs", str(path), "--workload", "gsm8k",
                           "--batch-sizes", "1,64", "--out", str(tmp_path / "cli")], capture_output=True, text=True,
                          env={**__import__("os").environ, "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr
    notes = Policy.load(tmp_path / "cli" / "policy.json").source["notes"]
    assert len(notes) == 3 and any("draft cost model: num_steps measured in [1, 4]" in n for n in notes)
    printed = [line[len("note: "):] for line in proc.stdout.splitlines() if line.startswith("note: ")]
    assert printed == notes, proc.stdout
    assert "queried outside its measured range" not in proc.stdout + proc.stderr


def test_bucketed_adaptive_decisions_outside_the_measured_contexts_are_noted():
    # l0 = 135, N = 150: the rounds verify at contexts in [135, 285], inside the measured
    # [130, 285]; the adaptive modes decide budgets per 32-token bucket, at 128 (round(135 / 32)
    # * 32) and up to 288 (the last rounds, at 277..285, round to 9 * 32): both outside
    verify = BasisSurface("verify", [64.0], [900.0, 0.5, 40.0, 30.0, 0.01, 0.0005],
                          ("nodes_per_seq", "context_len", "batch_size"),
                          {"nodes_per_seq": [1, 64], "context_len": [130, 285], "batch_size": [1, 16]})
    draft = BasisSurface("draft", [64.0], [50.0, 2.0, 120.0, 0.1, 0.01, 0.5], ("topk", "num_steps", "batch_size"),
                         {"topk": [1, 8], "num_steps": [1, 15], "batch_size": [1, 16]})
    costs = CostBundle(VerifyCostModel(verify), DraftCostModel(draft), {"model": "toy", "device": "cpu"})
    wl = Workload("w", calibrate_linear(2.6, 4, name="w"), np.full(4, 135), 150)
    res = plan(costs, [wl], [4], SMALL)
    assert res.notes == ["verify cost model: context_len measured in [130, 285], the plan asks [128, 288]: "
                         "costs outside the measured range are extrapolated (non-decreasing), not measured"]
    cands = res.candidates
    adaptive = cands["mode"].isin(["cost_aware", "batch_alloc"])
    assert adaptive.any() and cands.loc[adaptive, "extrapolated"].str.contains("verify.context_len").all()
    assert not cands.loc[~adaptive, "extrapolated"].str.contains("verify.context_len").any()
    a = analytic_run(wl, CostAwareParams(max_budget=8, draft_depth=3), costs, 4)
    assert a["decision_ctx"] == (128.0, 288.0)


def test_adaptive_orders_are_shared_across_batch_sizes_with_the_same_scores():
    # the best-first orders and their scores depend on the acceptance model and the spec only:
    # built once per (model, draft depth, max budget), and a plan of two workloads scores each
    # as a plan of it alone does
    from simtree.planning import adaptive
    costs = load_costs(QWEN)
    w1 = Workload("a", calibrate_linear(2.6, 4, name="a"), np.full(4, 300), 200)
    w2 = Workload("b", calibrate_linear(3.2, 5, name="b"), np.full(4, 300), 200)
    res = plan(costs, [w1, w2], [1, 8], SMALL)
    _, specs = candidate_specs(SMALL)
    for wl in (w1, w2):
        cached = adaptive._LEVELS[wl.acceptance]
        assert set(cached) == {(s.draft_depth, s.max_nodes) for s in specs}
        one = plan(costs, [wl], [1, 8], SMALL).candidates
        assert adaptive._LEVELS[wl.acceptance] is cached
        both = res.candidates[res.candidates["workload"] == wl.name].reset_index(drop=True)
        pd.testing.assert_frame_equal(both, one)


def _cands(gain: float, tree_mode: str = "best_first") -> pd.DataFrame:
    rows = [("none", "none", "{}", 100.0), ("linear_d4", "linear", '{"budget": 4}', 200.0),
            ("t", tree_mode, "{}", 200.0 * gain)]
    return pd.DataFrame([{"workload": "w", "batch_size": 1, "policy": p, "mode": m, "params": pr, "tok_s": t}
                         for p, m, pr, t in rows])


@pytest.mark.parametrize("seed", range(3))
def test_a_tree_that_wins_by_less_than_the_fit_error_is_flagged(seed):
    rng = np.random.default_rng(seed)
    err = float(rng.uniform(0.005, 0.05))
    for gain, flagged in ((1 + err * 0.5, True), (1 + err * 1.5, False)):
        chosen = choose_policies(_cands(gain), err).iloc[0]
        assert chosen["mode"] == "best_first" and bool(chosen["within_model_error"]) is flagged
        assert not choose_policies(_cands(gain), None).iloc[0]["within_model_error"]
    # the choice itself never moves: a non-tree winner is never flagged
    chosen = choose_policies(_cands(0.9), err).iloc[0]
    assert chosen["mode"] == "linear" and not chosen["within_model_error"]


def test_heldout_error_is_the_kept_forms_or_the_decode_splits():
    info = json.load(open(QWEN))["verify"]["info"]
    kept = info["fit_error"]["heldout"]["grid_lin"]["median"]
    # a bundle with measured-cell corrections: the corrected held-out error (its folds never correct a
    # point by its own measurement), else the kept form's
    want = info["verify_cells"]["heldout"]["median"] if "verify_cells" in info else kept
    assert load_costs(QWEN).verify.heldout_median_error == pytest.approx(want)
    bare = {k: v for k, v in info.items() if k != "verify_cells"}
    assert VerifyCostModel(None, bare).heldout_median_error == pytest.approx(kept)
    split = VerifyCostModel(None, {"form": "basis", "fit_error": {"heldout": {"basis": {"median": 0.3}}},
                                   "decode_split": {"kept": True, "heldout_split": {"median": 0.04}}})
    assert split.heldout_median_error == 0.04
    assert VerifyCostModel(None, {}).heldout_median_error is None


def test_within_model_error_reaches_plan_md_and_the_policy_file(tmp_path):
    # a flat verify cost: trees win by a hair over linear; with a 50% "fit error" every tree is flagged
    path = _toy_bundle(tmp_path)
    d = json.loads(path.read_text())
    d["verify"]["info"]["fit_error"]["heldout"]["basis"]["median"] = 0.5
    path.write_text(json.dumps(d))
    out = plan_and_write([str(path)], ["sharegpt"], [1, 4], str(tmp_path / "p"), space=SMALL)[0]
    pol = Policy.load(out["policy"])
    md = (tmp_path / "p" / "plan.md").read_text()
    assert "held-out median error (50.0%)" in md
    for e in pol.entries:
        assert e.within_model_error == (e.tree_on and e.gain_vs_linear < 1.5)
        line = [x for x in md.splitlines() if x.startswith(f"| sharegpt | {e.batch_max} |")][0]
        assert ("(within model error)" in line) == e.within_model_error
    assert any(e.within_model_error for e in pol.entries)
    # the console table marks them too (a short "on*" plus a caption naming the error)
    proc = subprocess.run([sys.executable, "-m", "simtree", "plan", "--costs", str(path), "--workload", "sharegpt",
                           "--batch-sizes", "1", "--out", str(tmp_path / "cli")], capture_output=True, text=True,
                          env={**__import__("os").environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    flagged = Policy.load(tmp_path / "cli" / "policy.json").entries[0].within_model_error
    assert flagged and "on*" in proc.stdout and "* within model error" in proc.stdout and "(50.0%)" in proc.stdout


def test_two_workloads_or_two_bundles_with_one_name_are_refused(tmp_path):
    trace = tmp_path / "t.jsonl"
    rec = {"workload": "gsm8k", "batch_size": 1, "parents": [-1, 0, 1], "log_probs": [0, -0.1, -0.2],
           "accepted_node": 1}
    trace.write_text("\n".join(json.dumps(rec) for _ in range(3)) + "\n")
    with pytest.raises(SimtreeError, match=r"two workloads named 'gsm8k' \(gsm8k and .*t\.jsonl\)"):
        plan_and_write([QWEN], ["gsm8k", str(trace)], [1], str(tmp_path / "a"), space=SMALL)
    wl = Workload("w", calibrate_linear(2.5, 4, name="w"), np.full(4, 300), 32)
    with pytest.raises(SimtreeError, match="two workloads named 'w'"):
        plan(load_costs(QWEN), [wl, wl], [1], SMALL)
    a, b = _toy_bundle(tmp_path, "same"), tmp_path / "copy.json"
    b.write_text(a.read_text())
    with pytest.raises(SimtreeError, match="two cost bundles for the same model and device"):
        plan_and_write([str(a), str(b)], ["gsm8k"], [1], str(tmp_path / "b"), space=SMALL)
    assert not (tmp_path / "b").exists()   # refused before anything was written


def _two_model_plan(tmp_path):
    a, b = _toy_bundle(tmp_path, "m1"), _toy_bundle(tmp_path, "m2", "gpu")
    d = json.loads(b.read_text())
    d["verify"]["surface"]["coef"][0] = 3000.0    # a different model: other predictions
    b.write_text(json.dumps(d))
    plan_and_write([str(a), str(b)], ["gsm8k"], [1, 8], str(tmp_path / "plan"), space=SMALL)
    return tmp_path / "plan"


def test_report_renders_every_per_model_folder_and_refuses_an_empty_one(tmp_path):
    root = _two_model_plan(tmp_path)
    before = {md: md.read_text() for md in root.glob("*/plan.md")}
    tables = {c: c.read_bytes() for c in root.glob("*/candidates.csv")}
    for md in before:
        md.unlink()
    paths = render_plan_dir(root)
    assert sorted(p["markdown"].parent.name for p in paths) == ["m1_cpu", "m2_gpu"]
    # the same report, and the candidates table written back byte for byte
    assert {md: md.read_text() for md in before} == before
    assert {c: c.read_bytes() for c in tables} == tables
    assert len(render_plan_dir(root / "m1_cpu")) == 1   # a leaf folder still works
    (tmp_path / "empty").mkdir()
    with pytest.raises(SimtreeError, match="holds no plan"):
        render_plan_dir(tmp_path / "empty")
    proc = subprocess.run([sys.executable, "-m", "simtree", "report", str(root)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.count("report: ") == 2, proc.stderr


@pytest.mark.parametrize("content, fragment", [
    ("", "not a readable candidates table"),
    ("workload,batch_size,policy,mode,params,budget,tokens_per_round,nodes_per_seq,tok_s\n", "no candidate rows"),
    ('workload,batch_size\n"gsm8k,1\n', "not a readable candidates table"),
    ("a,b\n1,2\n", "missing column 'workload'"),
])
def test_report_refuses_a_broken_candidates_table(tmp_path, content, fragment):
    root = _two_model_plan(tmp_path)
    (root / "m1_cpu" / "candidates.csv").write_text(content)
    proc = subprocess.run([sys.executable, "-m", "simtree", "report", str(root / "m1_cpu")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr


def test_report_refuses_a_policy_from_another_plan(tmp_path):
    root = _two_model_plan(tmp_path)
    (root / "m1_cpu" / "policy.json").write_text((root / "m2_gpu" / "policy.json").read_text())
    with pytest.raises(SimtreeError, match="are not from one plan"):
        render_plan_dir(root / "m1_cpu")


def test_cli_plan_rejects_bad_batch_size_lists(tmp_path):
    for text, fragment in (("1,,2", "no empty entry"), ("99999999999999999999", "[1, 1000000]"), ("0", "[1, 1000000]")):
        proc = subprocess.run([sys.executable, "-m", "simtree", "plan", "--batch-sizes", text, "--out",
                               str(tmp_path / "o")], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr
