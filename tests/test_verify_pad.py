"""Padding a verify round to a cheaper measured bucket (simtree.costs.verify_pad): the pad map and
envelope from a profile table, the fit on the envelope with the map kept in the bundle, and the
full runtime verifying in the padded bucket, losslessly (float32, the tiny runtime)."""
import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from simtree.costs.model import load_costs
from simtree.costs.profile_fit import fit_profile
from simtree.costs.verify_pad import PAD_KEY, envelope_rows, pad_map, padded_into, padded_nodes
from simtree.errors import SimtreeError
from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.drafting import pad_round, round_shape

from full_helpers import PROMPTS, tiny_model

NODES = (1, 2, 4, 8, 10, 12, 14, 16)


def _cost_us(b: int, n: int) -> float:
    """A smooth verify cost with a slow kernel at batch 32 x 14 nodes (+30%); 8 x 10 costs 1% over 8 x 12."""
    if (b, n) == (8, 10):
        return 1.01 * _cost_us(8, 12)
    us = 20000 + 40 * b * n + 300 * n
    return 1.3 * us if (b, n) == (32, 14) else us


def verify_row(b: int, n: int, l: int, us: float) -> dict:
    """One composed model_verify_step row of Qwen3.6-27B on an H100 (tp=1), +-1% p10 / p90."""
    return {"stage": "model_verify_step", "model": "qwen3.6-27b", "device": "NVIDIA H100 80GB HBM3",
            "dtype": "bf16", "variant": "composed", "batch_size": b, "nodes_per_seq": n,
            "total_tokens": b * n, "context_len": l, "tree_shape": "eagle", "num_steps": 0,
            "topk": 0, "latency_us_median": us, "latency_us_p10": us * 0.99,
            "latency_us_p90": us * 1.01, "repeats": 8, "torch_version": "x", "triton_version": "x",
            "timestamp": "2026-01-01T00:00:00+00:00", "deployment": "tp=1", "message_bytes": 0}


def _table(path=None) -> pd.DataFrame:
    df = pd.DataFrame([verify_row(b, n, l, _cost_us(b, n) + 0.5 * l * b)
                       for b in (8, 32) for n in NODES for l in (256, 2048)])
    if path is not None:
        df.to_csv(path, index=False)
    return df


def test_the_pad_map_takes_only_clear_savings_at_every_context():
    rec = pad_map(_table())
    # 32 x 14 costs 30% over 16 at both contexts; 8 x 10's 1% bump is noise (below 2%); n = 1 never pads
    assert rec["by_batch"] == {"32": {"14": 16}}
    assert 0.02 < rec["saving"]["32"]["14"] < 0.3
    assert padded_nodes(rec, 14, 32) == 16 and padded_nodes(rec, 14, 8) == 14 and padded_nodes(rec, 13, 32) == 13
    assert padded_nodes(None, 14, 32) == 14
    assert pad_map(_table(), min_saving=0.005)["by_batch"] == {"8": {"10": 12}, "32": {"14": 16}}
    with pytest.raises(SimtreeError, match="minimum saving"):
        pad_map(_table(), min_saving=1.5)
    with pytest.raises(SimtreeError, match="minimum saving"):      # a zero saving would pad at equal cost
        pad_map(_table(), min_saving=0)


def test_the_pad_map_inverted_names_every_count_padded_into_a_target_at_its_batch():
    rec = {"by_batch": {"32": {"5": 8, "6": 8, "7": 8, "14": 16}, "64": {"6": 7}}}
    assert sorted(padded_into(rec, 8, 32)) == [5, 6, 7] and padded_into(rec, 16.0, 32) == [14]
    assert padded_into(rec, 8, 64) == [] and padded_into(rec, 7, 64) == [6] and padded_into(rec, 14, 32) == []
    assert padded_into(None, 8, 32) == [] and padded_into({"by_batch": {}}, 8, 32) == []
    for b in (32, 64):     # the inverse of padded_nodes at every count it moves
        for n in range(2, 20):
            assert all(padded_nodes(rec, m, b) == n for m in padded_into(rec, n, b))
            assert (padded_nodes(rec, n, b) != n) == any(n in padded_into(rec, t, b) for t in range(2, 20))


def test_a_target_timed_at_fewer_contexts_pads_nothing_and_the_envelope_keeps_the_rows():
    """The map takes no context and the runtime pads at any: 32 x 14 pads to 16 only where 16 was
    timed at every context 14 was (here 16 only at 256), and the envelope then changes no row."""
    df = _table()
    df = df[~((df["batch_size"] == 32) & (df["nodes_per_seq"] == 16) & (df["context_len"] == 2048))]
    rec = pad_map(df)
    assert rec["by_batch"] == {} and padded_nodes(rec, 14, 32) == 14
    assert envelope_rows(df, rec)["latency_us_median"].tolist() == df["latency_us_median"].tolist()
    # n timed at fewer contexts than n' still pads: n' is measured wherever n is
    less = _table()
    less = less[~((less["batch_size"] == 32) & (less["nodes_per_seq"] == 14) & (less["context_len"] == 2048))]
    assert pad_map(less)["by_batch"] == {"32": {"14": 16}}
    # a record that pads a cell whose target was not timed there is one line, not a silent mix
    with pytest.raises(SimtreeError, match="not timed"):
        envelope_rows(df, {"by_batch": {"32": {"14": 16}}})


def test_the_envelope_prices_a_padded_row_at_its_target():
    df = _table()
    env = envelope_rows(df, pad_map(df))
    key = (env["batch_size"] == 32) & (env["context_len"] == 256)
    at = lambda n: float(env.loc[key & (env["nodes_per_seq"] == n), "latency_us_median"].iloc[0])  # noqa: E731
    assert at(14) == at(16)
    assert at(12) == pytest.approx(_cost_us(32, 12) + 0.5 * 256 * 32)
    unchanged = env["nodes_per_seq"] != 14
    assert np.array_equal(env.loc[unchanged, "latency_us_median"], df.loc[unchanged, "latency_us_median"])


def test_fit_on_the_envelope_keeps_the_pad_map_in_the_bundle(tmp_path):
    table = tmp_path / "p.csv"
    _table(table)
    report = fit_profile(table, forms=("grid",), folds=2, reference_forms=(), draft_from_verify=True)
    info = report.bundle.verify.info
    assert info[PAD_KEY]["by_batch"] == {"32": {"14": 16}}
    assert any("lower envelope" in n for n in report.notes)
    measured_14 = _cost_us(32, 14) + 0.5 * 256 * 32
    # the budget of 14 nodes is priced at the padded bucket's cost, not the slow kernel's
    assert report.bundle.verify.predict(14, 256, 32) < 0.9 * measured_14
    assert report.bundle.verify.predict(14, 256, 32) <= report.bundle.verify.predict(16, 256, 32) + 1e-6
    out = report.bundle.save(tmp_path / "b.json")
    loaded = load_costs(out)
    assert loaded.verify.padded_nodes(14, 32) == 16 and loaded.verify.padded_nodes(12, 32) == 12
    # without padding: fitted as measured, no key, no padding
    plain = fit_profile(table, forms=("grid",), folds=2, reference_forms=(), draft_from_verify=True, verify_pad=False)
    assert PAD_KEY not in plain.bundle.verify.info and plain.bundle.verify.padded_nodes(14, 32) == 14
    # a malformed map is one line
    d = json.loads(out.read_text())
    d["verify"]["info"][PAD_KEY]["by_batch"]["32"]["14"] = 12
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(SimtreeError, match=PAD_KEY):
        load_costs(tmp_path / "bad.json")


def _costs(by_batch: dict):
    rec = {"by_batch": by_batch}
    return SimpleNamespace(verify=SimpleNamespace(padded_nodes=lambda n, b: padded_nodes(rec, n, b)))


EAGLE = PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6})
BEST_FIRST = PolicySpec.from_dict("best_first", {"budget": 5, "width": 1, "draft_depth": 4})


def test_pad_round_pads_the_bucket_and_keeps_the_trees():
    costs = _costs({"2": {"6": 9, "5": 8}, "8": {"4": 6}})
    rs = pad_round(round_shape(EAGLE), 2, costs)
    assert (rs.nodes, rs.padded_from, rs.tree_nodes, rs.name) == (9, 6, 6, round_shape(EAGLE).name)
    assert pad_round(round_shape(EAGLE), 4, costs) == round_shape(EAGLE)         # no map at this batch
    assert pad_round(round_shape(EAGLE), 2, None) == round_shape(EAGLE)
    assert pad_round(round_shape(PolicySpec.from_dict("none")), 2, costs).nodes == 1
    adaptive = round_shape(PolicySpec.from_dict("cost_aware", {"max_budget": 8, "draft_depth": 4}), 4)
    padded = pad_round(adaptive, 8, costs)
    assert (padded.nodes, padded.tree_nodes, padded.spec) == (6, 4, adaptive.spec)   # the rule's cap stays 4
    block = round_shape(PolicySpec.from_dict("block", {"budget": 6, "block_len": 7}))
    padded_block = pad_round(block, 2, costs)      # priced on the envelope, so padded like the rest
    assert (padded_block.nodes, padded_block.tree_nodes, padded_block.spec) == (9, 6, block.spec)
    # the full runtime's runs take the padded bucket (measure's round shape, no acceptance model)
    from simtree.runtime.full.measure import AcceptanceSource, run_shape
    shape = AcceptanceSource(None, None, "cpu", 0).round_shape(EAGLE, 2, costs, 256.0)
    assert (shape.nodes, shape.padded_from) == (9, 6)
    run = {"mode": "eagle", "params": EAGLE.to_dict(), "nodes": 9, "padded_from": 6}
    assert run_shape(run) == shape


def _decode(engine, max_new_tokens: int):
    """(the outputs of PROMPTS[:2], the run's stats, each round's accepted path lengths)."""
    accepted = []
    if not engine.rs.plain:
        accept = engine.source.accept

        def recording(t, target_next, shape):
            acc = accept(t, target_next, shape)
            accepted.append(acc.clone())
            return acc
        engine.source.accept = recording
    engine.prefill(PROMPTS[:2])
    stats = engine.run(max_new_tokens=max_new_tokens)
    return [o[:max_new_tokens] for o in engine.outputs()], stats, accepted


@pytest.mark.parametrize("spec", [EAGLE, BEST_FIRST], ids=lambda s: s.mode)
def test_padded_buckets_are_lossless_and_padding_is_never_accepted(spec):
    from simtree.runtime.full.engine import FullEngine

    model = tiny_model("tiny-gdn", dtype=torch.float32)
    decode = lambda rs: _decode(FullEngine(model, rs, 2, 160), 20)  # noqa: E731
    plain, _, _ = decode(round_shape(PolicySpec.from_dict("none")))
    rs = round_shape(spec)
    padded = pad_round(rs, 2, _costs({"2": {str(rs.nodes): rs.nodes + 5}}))
    assert padded.nodes == rs.nodes + 5
    outs, stats, accepted = decode(padded)
    ref, ref_stats, _ = decode(rs)
    assert outs == plain == ref
    assert stats.accepted.tolist() == ref_stats.accepted.tolist()
    assert 1.2 < stats.accepted_tokens_per_round          # drafts were accepted, not only rejected
    assert accepted and max(int(a.max()) for a in accepted) < rs.nodes   # no padding node accepted


def test_the_committed_bucket_table_pads_the_measured_spikes():
    """The H100 bucket profile (simtree/data/profiles/h100/buckets_qwen3.6-27b_tp1.csv): its pad map
    and the generated summary name the spikes and the piece behind them."""
    from simtree.costs.pad_report import bucket_summary
    from simtree.costs.profile_table import load_profile
    from simtree.data import data_path

    table = data_path("profiles") / "h100" / "buckets_qwen3.6-27b_tp1.csv"
    rows = load_profile(table)
    rec = pad_map(rows[rows["stage"] == "model_verify_step"])
    assert rec["by_batch"] == {"16": {"20": 24}, "32": {"10": 11, "14": 16}, "64": {"13": 14}}
    text = bucket_summary(table)
    assert "Pad map: 10 -> 11, 14 -> 16." in text and "slowest piece mlp_step" in text
    # the committed table's saving (batch 32, 14 -> 16 nodes), pinned; the summary prints the stored value
    assert rec["saving"]["32"]["14"] == pytest.approx(0.1946) and "| 16 | 19.5% |" in text


def test_simtree_fit_pads_unless_told_not_to(tmp_path):
    from typer.testing import CliRunner

    from simtree.cli import app

    table = tmp_path / "p.csv"
    _table(table)
    args = ["fit", str(table), "--draft-from-verify", "--form", "grid", "--folds", "2", "--no-png"]
    ok = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "a.json")])
    assert ok.exit_code == 0, ok.output
    assert load_costs(tmp_path / "a.json").verify.padded_nodes(14, 32) == 16
    off = CliRunner().invoke(app, [*args, "--no-verify-pad", "-o", str(tmp_path / "b.json")])
    assert off.exit_code == 0 and load_costs(tmp_path / "b.json").verify.padded_nodes(14, 32) == 14
    bad = CliRunner().invoke(app, [*args, "--pad-min-saving", "1.5", "-o", str(tmp_path / "c.json")])
    # one line (the CLI's entry prints a SimtreeError as `error: ...`, exit 2), nothing written
    assert isinstance(bad.exception, SimtreeError) and "minimum saving" in str(bad.exception)
    assert not (tmp_path / "c.json").exists()


def test_the_shipped_h100_qwen_bundle_pads_the_measured_spikes():
    """The shipped H100 Qwen3.6-27B bundle (its rank profile times every node count 1-16 at batch >= 16):
    batch 32's 14-node round, measured 61.7 ms against 50.8 at 15 nodes (context 256), pads to 15 and
    is priced near the 15-node cost, not the slow kernel's; so does batch 64's 7-node round (67.2 ms
    against 56.4 at 8)."""
    from simtree.data import data_path

    bundle = load_costs(data_path("costs") / "h100_qwen3.6-27b_tp1.json")
    assert bundle.verify.padded_nodes(14, 32) == 15 and bundle.verify.padded_nodes(13, 64) == 14
    assert bundle.verify.padded_nodes(7, 64) == 8
    assert bundle.verify.padded_nodes(12, 32) == 12 and bundle.verify.padded_nodes(14, 8) == 14
    assert bundle.verify.predict(14, 256, 32) < 0.9 * 61669.0
    assert bundle.verify.predict(7, 256, 64) < 0.9 * 67196.0


def test_merging_bucket_rows_fills_only_the_cells_a_rank_profile_lacks(tmp_path):
    from simtree.costs.pad_report import merge_verify_rows
    from simtree.costs.profile_table import load_profile

    full = _table(tmp_path / "buckets.csv")
    dst = tmp_path / "rank.csv"
    full[~full["nodes_per_seq"].isin([10, 14, 16])].to_csv(dst, index=False)   # its node range ends at 12
    assert merge_verify_rows(tmp_path / "buckets.csv", dst) == 2 * 2 * 1       # n = 10 at 2 batches x 2 contexts
    merged = load_profile(dst)
    assert sorted(merged["nodes_per_seq"].unique()) == [1, 2, 4, 8, 10, 12]
    with pytest.raises(SimtreeError, match="lacks"):
        merge_verify_rows(tmp_path / "buckets.csv", dst)


BLOCK_SPECS = [PolicySpec.from_dict("block", {"budget": 6, "block_len": 7}),
               PolicySpec.from_dict("tfm", {"budget": 6, "width": 2, "block_len": 5}),
               PolicySpec.from_dict("dspark", {"block_len": 5, "threshold": 0.05})]


@pytest.mark.parametrize("spec", BLOCK_SPECS, ids=lambda s: s.mode)
def test_padded_block_drafter_rounds_are_lossless(spec):
    """The block drafters' rounds in a padded bucket (float32, tiny drafters): plain greedy's
    tokens, the unpadded round's acceptance, no padding node accepted."""
    from simtree.runtime.full.block_engine import make_engine

    from full_helpers import drafter_costs

    model = tiny_model("tiny-gdn", dtype=torch.float32)
    tiny = {"sizes": {"layers": 1, "cand_k": 32, "adapter_dim": 16, "markov_rank": 32}}
    decode = lambda rs: _decode(make_engine(model, rs, 2, 200, costs=drafter_costs(), **tiny), 16)  # noqa: E731
    plain, _, _ = decode(round_shape(PolicySpec.from_dict("none")))
    rs = round_shape(spec)
    padded = pad_round(rs, 2, _costs({"2": {str(rs.nodes): rs.nodes + 3}}))
    assert (padded.nodes, padded.padded_from, padded.tree_nodes) == (rs.nodes + 3, rs.nodes, rs.tree_nodes)
    outs, stats, paths = decode(padded)
    ref, ref_stats, _ = decode(rs)
    assert outs == plain == ref
    assert stats.accepted.tolist() == ref_stats.accepted.tolist() and stats.accepted_tokens_per_round > 1.1
    assert paths and max(int(a.max()) for a in paths) < rs.nodes


def test_an_adaptive_run_in_a_padded_bucket_is_predicted_with_the_unpadded_cap():
    """cost_aware in a bucket of 4 padded to 6: its trees are the rule's capped at 4 (as the runtime
    caps them at ``padded_from``), every round priced at C_v of 6 nodes."""
    from simtree.acceptance.model import Workload, get_workload
    from simtree.costs.synthetic import synthetic_costs
    from simtree.planning.simulate import analytic_run
    from simtree.runtime.full.measure import predict

    costs = synthetic_costs(weights_us=0.0, per_token_us=10.0)
    spec = PolicySpec.from_dict("cost_aware", {"max_budget": 8, "draft_depth": 4})
    acc = get_workload("gsm8k").acceptance
    rs = dataclasses.replace(round_shape(spec, 4), nodes=6, padded_from=4)
    stats = SimpleNamespace(context_lens=[64.0], tokens=2 * 40, accepted_tokens_per_round=2.0)
    out = predict(costs, acc, spec, rs, 2, stats, "gsm8k")
    wl = Workload("gsm8k", acc, np.array([64]), 40, "full runtime")
    capped, wide = analytic_run(wl, spec, costs, 2, bucket=4), analytic_run(wl, spec, costs, 2, bucket=6)
    padded = analytic_run(wl, spec, costs, 2, bucket=6, tree_cap=4)
    assert padded["g"] == capped["g"] != wide["g"] and padded["tree_nodes"] <= 4 + 1e-9
    assert out["predicted_accepted"] == padded["g"]
    assert padded["verify_us"] == pytest.approx(wide["verify_us"], rel=0.02)    # C_v of the 6 nodes verified
    assert padded["verify_us"] > capped["verify_us"]


def test_generate_decodes_in_the_padded_bucket_the_plan_priced(monkeypatch):
    """`simtree run` / the live runtime (generate) pad as the measured runs do: a bundle that pads
    the policy's bucket at the batch decodes there, and the output stays plain greedy's."""
    from simtree.runtime.full import generate as gen

    model = tiny_model("tiny-gdn", dtype=torch.float32)
    built = []
    real = gen.make_engine
    monkeypatch.setattr(gen, "make_engine", lambda m, rs, *a, **k: built.append(rs) or real(m, rs, *a, **k))
    rs = round_shape(EAGLE)
    padded = gen.generate(model, PROMPTS[:2], 12, EAGLE, costs=_costs({"2": {str(rs.nodes): rs.nodes + 3}}))
    plain = gen.generate(model, PROMPTS[:2], 12, PolicySpec.from_dict("none"))
    assert (built[0].nodes, built[0].padded_from) == (rs.nodes + 3, rs.nodes)
    assert padded.outputs == plain.outputs


class _PaddingCosts:
    """A cost bundle whose verify model also pads: ``costs`` with the pad map ``by_batch``."""

    def __init__(self, costs, by_batch: dict):
        self._costs, self._rec = costs, {"by_batch": by_batch}
        self.verify = SimpleNamespace(predict=costs.verify.predict,
                                      padded_nodes=lambda n, b: padded_nodes(self._rec, n, b))

    def __getattr__(self, name):
        return getattr(self._costs, name)


ADAPTIVE = [PolicySpec.from_dict("cost_aware", {"max_budget": 16, "draft_depth": 3}),
            PolicySpec.from_dict("batch_alloc", {"max_budget_per_seq": 16, "draft_depth": 3})]


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
@pytest.mark.parametrize("spec", ADAPTIVE, ids=lambda s: s.mode)
def test_padded_adaptive_rounds_are_lossless(spec, name):
    """cost_aware / batch_alloc as the measured runs shape them (float32, batch 2): the bucket of
    the analytic decision (sharegpt: fewer than the max 16 nodes), padded by the bundle's map by 3;
    each round's budgets still the rule's under the decision's cap, the output plain greedy's."""
    from simtree.costs.synthetic import synthetic_costs
    from simtree.runtime.full.engine import FullEngine
    from simtree.runtime.full.measure import AcceptanceSource

    costly = synthetic_costs(weights_us=0.0, per_token_us=10.0)     # nodes cost: the budgets move
    source = AcceptanceSource(None, "sharegpt", "cpu", 0)
    decision = source.round_shape(spec, 2, costly, 16.0)
    assert decision.padded_from == 0 and 2 < decision.nodes < decision.budget   # the rule's bucket, not the max
    costs = _PaddingCosts(costly, {"2": {str(decision.nodes): decision.nodes + 3}})
    padded = source.round_shape(spec, 2, costs, 16.0)
    assert (padded.nodes, padded.padded_from, padded.tree_nodes) == (decision.nodes + 3, decision.nodes,
                                                                      decision.nodes)
    model = tiny_model(name, dtype=torch.float32)
    decode = lambda rs: _decode(FullEngine(model, rs, 2, 160, costs=costs), 20)  # noqa: E731
    plain, _, _ = decode(round_shape(PolicySpec.from_dict("none")))
    outs, stats, accepted = decode(padded)
    ref, ref_stats, _ = decode(decision)
    assert outs == plain == ref
    # the same budgets (the cap is the decision's, not the padded bucket's), the same acceptance
    assert stats.nodes.tolist() == ref_stats.nodes.tolist()
    assert stats.accepted.tolist() == ref_stats.accepted.tolist() and stats.accepted_tokens_per_round > 1.2
    assert 1 < int(stats.nodes.max()) <= decision.nodes
    assert accepted and max(int(a.max()) for a in accepted) < decision.nodes   # no padding node accepted
