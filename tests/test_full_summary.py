"""The full-scale run's outputs (summary.csv and friends) and the weight-size check."""
import csv
import json

import pytest
import torch

from simtree.errors import SimtreeError
from simtree.models import get_model
from simtree.runtime.full.build import check_fits, weight_bytes
from simtree.runtime.full.measure import EXTRA_COLUMNS, SUMMARY_COLUMNS, full_run

from full_helpers import tiny_model

COSTS = "simtree/data/costs/h200_qwen3.6-27b_tp1.json"
REQUIRED = ("model", "deployment", "policy", "batch_size", "acceptance", "measured_tok_s", "predicted_tok_s",
            "rel_err", "measured_round_ms", "predicted_round_ms", "draft_ms", "verify_ms", "commit_ms", "host_ms")


def _policy(path, mode, params):
    entry = {"workload": "gsm8k", "batch_min": 1, "batch_max": 64, "mode": mode, "params": params,
             "tree_on": mode in ("eagle", "best_first", "cost_aware", "batch_alloc"), "predicted_tok_s": 1.0,
             "gain_vs_linear": 1.0, "gain_vs_none": 1.0}
    path.write_text(json.dumps({"schema": "simtree.policy/1", "model": "tiny-gdn", "device": "cpu",
                                "entries": [entry]}))
    return path


def test_summary_has_the_required_columns_and_one_row_per_run(tmp_path):
    pol = _policy(tmp_path / "p.json", "eagle", {"num_steps": 2, "topk": 2, "budget": 4})
    res = full_run(tiny_model("tiny-gdn"), device="cpu", costs=COSTS, policy=pol, batch_sizes=[1, 2],
                   acceptance="gsm8k", out=tmp_path / "out", context_len=16, rounds=3, warmup_rounds=1)
    with open(tmp_path / "out" / "summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0].keys()) == SUMMARY_COLUMNS + EXTRA_COLUMNS
    assert SUMMARY_COLUMNS == REQUIRED
    assert [(r["policy"], r["batch_size"]) for r in rows] == [
        ("plain:none", "1"), ("linear_d4:linear_d4", "1"), ("plan:eagle_s2_k2_d4", "1"),
        ("plain:none", "2"), ("linear_d4:linear_d4", "2"), ("plan:eagle_s2_k2_d4", "2")]
    for r in rows:
        assert r["acceptance"] == "replay:gsm8k" and r["deployment"] == "1 CPU"      # one GPU on CUDA
        assert float(r["measured_tok_s"]) > 0 and float(r["predicted_tok_s"]) > 0
        # the CSV's 6 significant digits: the ratio of two rounded rates is good to ~2e-6
        assert float(r["rel_err"]) == pytest.approx(float(r["predicted_tok_s"]) / float(r["measured_tok_s"]) - 1,
                                                    rel=1e-4, abs=1e-5)
    assert (tmp_path / "out" / "summary.md").read_text().startswith("# simtree run: tiny-gdn")
    assert (tmp_path / "out" / "predicted_vs_measured.png").stat().st_size > 1000
    assert any("extrapolating" in n for n in res["prediction_notes"])   # an H200 bundle asked about a tiny context


def test_stratified_replay_measures_the_predicted_acceptance(tmp_path):
    """The default replay draws the run's accepted depths stratified: every run's measured
    tokens per round is the prediction's within (deepest depth) / (rounds x batch); the config
    and the notes say how the replay drew."""
    rounds, B = 6, 2
    res = full_run(tiny_model("tiny-gdn"), device="cpu", costs=COSTS, batch_sizes=[B], acceptance="gsm8k",
                   context_len=16, rounds=3, min_draws=rounds * B, warmup_rounds=2)
    assert res["config"]["sampling"] == "stratified" and res["config"]["min_draws"] == rounds * B
    assert all(r["rounds"] == rounds for r in res["rows"])      # ceil(min_draws / B) > rounds=3
    assert any(n.startswith("replay sampling: stratified") for n in res["notes"])
    spec = [r for r in res["rows"] if not r["policy"].startswith("plain")]
    assert spec
    for r in spec:
        assert abs(r["predicted_accepted"] - r["measured_accepted"]) <= 4 / (rounds * B) + 1e-9, r
    iid = full_run(tiny_model("tiny-gdn"), device="cpu", costs=COSTS, batch_sizes=[B], acceptance="gsm8k",
                   context_len=16, rounds=rounds, warmup_rounds=2, sampling="iid")
    assert iid["config"]["sampling"] == "iid"
    with pytest.raises(SimtreeError, match="replay sampling 'halton' unknown"):
        full_run(tiny_model("tiny-gdn"), device="cpu", batch_sizes=[B], acceptance="gsm8k", sampling="halton")


def test_the_plans_cost_aware_choice_is_measured_and_predicted(tmp_path):
    """The shipped plans choose cost_aware: the full runtime runs it (its budgets from the
    bundle), after plain and linear, replayed and predicted by the simulator for the same mode."""
    pol = _policy(tmp_path / "p.json", "cost_aware", {"max_budget": 6})
    res = full_run(tiny_model("tiny-gdn"), device="cpu", costs=COSTS, policy=pol, batch_sizes=[1],
                   acceptance="gsm8k", context_len=8, rounds=2, warmup_rounds=0)
    assert [r["policy"] for r in res["rows"]] == ["plain:none", "linear_d4:linear_d4", "plan:cost_aware_max6_p3"]
    plan = res["rows"][2]
    assert "verifies its bucket" in plan["note"] and plan["measured_accepted"] >= 1.0
    assert plan["predicted_accepted"] > 1.0


def test_modes_the_runtime_cannot_build_are_noted_and_skipped(tmp_path, monkeypatch):
    import simtree.runtime.full.measure as measure
    monkeypatch.setattr(measure, "RUNTIME_MODES", ("none", "linear", "eagle"))
    pol = _policy(tmp_path / "p.json", "cost_aware", {"max_budget": 6})
    res = full_run(tiny_model("tiny-gdn"), device="cpu", costs=COSTS, policy=pol, batch_sizes=[1],
                   acceptance="gsm8k", context_len=8, rounds=1, warmup_rounds=0)
    assert [r["policy"] for r in res["rows"]] == ["plain:none", "linear_d4:linear_d4"]
    assert any("cost_aware entry is not built on the device" in n for n in res["notes"])


def test_a_failed_run_is_a_row_and_the_next_runs_go_on(tmp_path, monkeypatch):
    # a run that fails inside (its measurement raises) is a row that says why, and the next runs go on
    # (a bad --context-len is refused before any run: full_run checks it)
    from simtree.runtime.full import measure as measure_mod

    def refuse(model, rs, B, *a, **k):
        raise SimtreeError(f"refused at batch {B}")
    monkeypatch.setattr(measure_mod, "measure_policy", refuse)
    res = full_run(tiny_model("tiny-gdn"), device="cpu", costs=COSTS, batch_sizes=[1, 2], acceptance="gsm8k",
                   context_len=32, rounds=1, warmup_rounds=0)
    assert len(res["rows"]) == 4
    assert all(r["note"].startswith("failed: SimtreeError: refused at batch") for r in res["rows"])
    with pytest.raises(SimtreeError, match="--context-len must be an integer"):
        full_run(tiny_model("tiny-gdn"), device="cpu", costs=COSTS, batch_sizes=[1], context_len=-3, rounds=1)


def test_weight_bytes_are_what_the_model_allocates():
    for name in ("tiny-gdn", "tiny-v4"):
        model = tiny_model(name)
        held = sum(t.numel() * t.element_size() for t in model.w.values())
        assert weight_bytes(get_model(name), torch.float64) == held
    # the full sizes: Qwen3.6-27B ~27B parameters + its MTP layer; a V4-Flash EP rank: 32 routed
    # experts x 44 layers (MTP included) x 3 x 4096 x 2048 (~35 GB in FP8) + the attention's linears in
    # FP8, embeddings in bf16 (44.4 GB)
    assert 53e9 < weight_bytes(get_model("qwen3.6-27b")) < 56e9
    assert 40e9 < weight_bytes(get_model("deepseek-v4-flash")) < 50e9


def test_a_model_that_does_not_fit_is_a_one_line_error():
    with pytest.raises(SimtreeError) as err:
        check_fits(get_model("qwen3.6-27b"), "cuda", available_bytes=40 * 10 ** 9)
    msg = str(err.value)
    assert "\n" not in msg and "qwen3.6-27b needs 54.6 GB" in msg and "40.0 GB" in msg
    assert check_fits(get_model("tiny-gdn"), "cpu", available_bytes=10 ** 9) > 0


def test_cli_batch_sizes(tmp_path):
    from typer.testing import CliRunner

    from simtree.cli import app
    r = CliRunner().invoke(app, ["run", "--model", "tiny-gdn", "--batch-size", "1,x", "--costs", COSTS])
    assert isinstance(r.exception, SimtreeError) and "comma-separated integers" in str(r.exception)
    r = CliRunner().invoke(app, ["run", "--batch-size", "2,3"])
    assert isinstance(r.exception, SimtreeError) and "needs --model" in str(r.exception)


def test_repredict_keeps_the_measurements_and_changes_the_predictions(tmp_path):
    from simtree.runtime.full.measure import repredict, runs_json
    res = full_run(tiny_model("tiny-gdn"), device="cpu", costs=COSTS, batch_sizes=[2], acceptance="gsm8k",
                   context_len=12, rounds=2, warmup_rounds=0)
    saved = json.loads(json.dumps({**res, "runs": runs_json(res["runs"])}, default=str))
    same = repredict(saved, COSTS)
    other = repredict(saved, "tests/data/costs/v4_flash_one_gpu.json", tmp_path / "again")
    for a, b, c in zip(res["rows"], same["rows"], other["rows"]):
        assert b["measured_tok_s"] == a["measured_tok_s"] == c["measured_tok_s"]
        assert b["predicted_tok_s"] == pytest.approx(a["predicted_tok_s"])
        assert c["predicted_round_ms"] != pytest.approx(a["predicted_round_ms"])
    assert (tmp_path / "again" / "summary.csv").exists()


def test_runs_after_the_deadline_are_skipped_rows():
    res = full_run(tiny_model("tiny-gdn"), device="cpu", costs=COSTS, batch_sizes=[1], acceptance="gsm8k",
                   context_len=8, rounds=1, warmup_rounds=0, deadline=0.0)
    assert [r["note"] for r in res["rows"]] == ["skipped: the session's time was up"] * 2
