"""The block drafters' rounds on the full runtime (runtime/full/block_engine.py): trees from a
DFlash-style drafter's marginals, a TfM-style adapter's tree, DSpark's chain with its
confidence-scheduled verify - lossless for both families, bad input refused in one line, their
rounds' marginals and confidences in the traces."""
import numpy as np
import pytest
import torch

from simtree.acceptance.traces import parse_record
from simtree.costs.synthetic import synthetic_costs
from simtree.errors import SimtreeError
from simtree.planning.modes import PolicySpec
from simtree.runtime.full.block_engine import BlockEngine, feature_layers, make_engine
from simtree.runtime.full.round_trace import round_records
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.lossless import check_lossless
from simtree.trees.builders import best_first_order

from full_helpers import FAMILIES, PROMPTS, drafter_costs, tiny_model

TINY = {"sizes": {"layers": 1, "cand_k": 32, "adapter_dim": 16, "markov_rank": 32}}
SPECS = [PolicySpec.from_dict("block", {"budget": 8, "block_len": 7}),
         PolicySpec.from_dict("tfm", {"budget": 8, "width": 2, "block_len": 5}),
         PolicySpec.from_dict("dspark", {"block_len": 6, "threshold": 0.05}),
         PolicySpec.from_dict("dspark", {"block_len": 7})]


COSTS = drafter_costs()


def _engine(name, spec, batch=3, costs=COSTS, dtype=torch.float64, trace_topk=0):
    return make_engine(tiny_model(name, dtype=dtype), round_shape(spec), batch, 256, costs=costs,
                       trace_topk=trace_topk, **TINY)


@pytest.mark.parametrize("name", FAMILIES)
def test_block_drafter_modes_output_equals_plain_greedy(name):
    """In float32, batch 3 (prompts of different lengths; batch 4 from checkpoints:
    test_checkpoint_parity, test_v4_checkpoint): block marginals, the TfM tree, DSpark's
    fixed-threshold and scheduled prefixes decode plain greedy decoding's tokens, and their
    drafts are accepted and rejected."""
    rows = check_lossless(tiny_model(name, dtype=torch.float32), PROMPTS, SPECS, 16, costs=COSTS, drafter=TINY)
    assert [r["policy"] for r in rows] == [s.name for s in SPECS]
    for r in rows:
        assert r["match"], r
        assert 1.1 < r["accepted_tokens_per_round"] < 4.0, r


def test_the_block_tree_is_best_first_over_the_drafters_marginals():
    """After a round each tree holds the planner's best-first tree over the round's marginals
    (the same rank paths), each node scored with its path's summed marginal log-probs."""
    engine = _engine("tiny-gdn", SPECS[0], trace_topk=8)     # traced: the round's marginals kept
    engine.prefill(PROMPTS)
    engine.run(rounds=2)
    t, lp = engine.tree, engine.marginal_lp.double()
    L, K = lp.shape[1:]
    for b in range(engine.B):
        order = best_first_order(np.tile(np.arange(K), (L, 1)), lp[b].exp().numpy(), 8)
        want, got = set(), set()
        for j in range(1, order.num_nodes):
            path, cur = [], j
            while cur > 0:
                path.append(int(order.tokens[cur]))
                cur = int(order.parents[cur])
            want.add(tuple(reversed(path)))
        for j in range(1, 8):
            path, cur, total = [], j, 0.0
            while cur > 0:
                path.append(int(t.rank[b, cur]))
                total += float(lp[b, t.depth[b, cur] - 1, t.rank[b, cur]])
                cur = int(t.parents[b, cur])
            got.add(tuple(reversed(path)))
            assert float(t.score[b, j]) == pytest.approx(total, abs=1e-4)
        assert got == want


def test_dspark_verifies_the_prefix_that_clears_the_threshold():
    spec = PolicySpec.from_dict("dspark", {"block_len": 7, "threshold": 0.2})
    engine = _engine("tiny-v4", spec)
    engine.prefill(PROMPTS)
    for _ in range(3):
        engine.run(rounds=1)
        surv = torch.cumprod(engine.confidence, 1)
        want = (surv >= 0.2).sum(1)
        assert engine.verified_len.tolist() == want.tolist()
        assert (engine.tree.valid.sum(1) - 1).tolist() == want.tolist()


def test_the_schedule_verifies_less_under_load():
    """No threshold: batch_alloc's rule over the confidences' survivals - cheap verify takes the
    whole chain, verify that costs per token takes less (the threshold rises with the load)."""
    spec = PolicySpec.from_dict("dspark", {"block_len": 7})
    verified = {}
    for per_token in (0.001, 400.0):
        engine = _engine("tiny-gdn", spec, costs=drafter_costs(per_token))
        engine.prefill(PROMPTS)
        engine.run(rounds=1)
        verified[per_token] = int(engine.verified_len.sum())
    assert verified[0.001] == 3 * 7 and verified[400.0] < verified[0.001]


def test_a_dspark_bucket_caps_the_chain_and_stays_lossless():
    """A bucket of 3 nodes (the planner's cut under load): the chain holds 2 drafts, at most 2
    verified, and the output is still plain greedy decoding's."""
    from simtree.runtime.full.lossless import _decode
    model = tiny_model("tiny-v4", dtype=torch.float32)
    rs = round_shape(SPECS[3], nodes=3)
    engine = make_engine(model, rs, 3, 256, costs=COSTS, **TINY)
    engine.prefill(PROMPTS)
    engine.run(max_new_tokens=12)
    assert engine.tree.tokens.shape == (3, 3) and int(engine.verified_len.max()) <= 2
    plain = _decode(model, PROMPTS, PolicySpec.from_dict("none"), 12, 256)[0]
    assert [o[:12] for o in engine.outputs()] == plain


def test_round_records_carry_marginal_ranks_and_confidence():
    for spec in (SPECS[0], SPECS[1], SPECS[2]):
        engine = _engine("tiny-gdn", spec, batch=2, trace_topk=8)
        engine.prefill(PROMPTS[:2])
        ctx = engine.st.lengths.tolist()
        engine.run(rounds=1)
        records = round_records(engine.last_round(), workload="w", round_index=0, mode=spec.mode, context_lens=ctx)
        for b, rec in enumerate(records):
            parsed = parse_record(rec, f"record {b}")
            assert parsed.drafter == spec.mode and (parsed.marginal_ranks is None) == (spec.mode == "tfm")
            assert len(rec["parents"]) == int(engine.tree.valid[b].sum())
            assert rec["num_accepted"] == int(engine._acc_len[b])
            if spec.mode == "dspark":
                assert parsed.confidence.shape == (6,) and parsed.verified_len == int(engine.verified_len[b])
                assert len(rec["parents"]) == parsed.verified_len + 1


def test_a_random_context_replay_runs_every_drafter():
    for spec in SPECS:
        engine = _engine("tiny-v4", spec, batch=2)
        engine.fill_context(24, seed=0)
        assert engine.drafter.state.lengths.tolist() == [23, 23]
        stats = engine.run(rounds=3)
        assert stats.rounds == 3 and (engine.drafter.state.lengths + engine.drafter.n_new).tolist() == \
            engine.st.lengths.tolist()


def test_feature_layers_spread_over_the_target():
    assert feature_layers(64) == (1, 16, 31, 46, 61)
    assert feature_layers(4) == (0, 1, 2, 3)
    assert len(feature_layers(43)) == 5


def test_bad_drafter_policies_are_refused_in_one_line():
    model = tiny_model("tiny-gdn")
    with pytest.raises(SimtreeError, match="no cost for drafter 'tfm'"):
        make_engine(model, round_shape(SPECS[1]), 1, 64, costs=drafter_costs(families=("block",)), **TINY)
    with pytest.raises(SimtreeError, match="no cost for drafter 'block'"):
        make_engine(model, round_shape(SPECS[0]), 1, 64, costs=synthetic_costs(), **TINY)
    with pytest.raises(SimtreeError, match="block length 9 is beyond the block drafter's 7"):
        make_engine(model, round_shape(PolicySpec.from_dict("block", {"budget": 8, "block_len": 9})), 1, 64, **TINY)
    for bad in (1.5, -0.1):
        with pytest.raises(SimtreeError, match=r"outside \[0, 1\]"):
            PolicySpec.from_dict("dspark", {"block_len": 7, "threshold": bad})
    with pytest.raises(SimtreeError, match="not a number"):
        PolicySpec.from_dict("dspark", {"threshold": "high"})
    with pytest.raises(SimtreeError, match="needs a cost model"):
        make_engine(model, round_shape(SPECS[3]), 1, 64, **TINY)
    with pytest.raises(SimtreeError, match="not drafted by a block drafter"):
        BlockEngine(model, round_shape(PolicySpec.from_dict("linear", {"budget": 3})), 1, 64)


def test_a_given_prompts_run_writes_traces_the_acceptance_model_reads(tmp_path):
    """simtree run --model --prompt-ids with a block drafter: traces.jsonl beside run.json, read
    back by read_traces; chain_trials reads every marginal rank, calibrate_confidence the head."""
    from simtree.acceptance.confidence_head import calibrate_confidence
    from simtree.acceptance.traces import chain_trials, read_traces
    from simtree.runtime.full.decode import decode_prompts
    model = tiny_model("tiny-gdn", dtype=torch.float32)
    spec = PolicySpec.from_dict("dspark", {"block_len": 5, "threshold": 0.02})
    report = decode_prompts(model, PROMPTS[:2], spec, 12, device="cpu", out=tmp_path)
    plain = decode_prompts(model, PROMPTS[:2], PolicySpec.from_dict("none"), 12, device="cpu")
    assert report["outputs"] == plain["outputs"]
    records = read_traces(report["files"]["traces"])
    assert len(records) == 2 * report["rounds"] and all(r.drafter == "dspark" for r in records)
    assert all(r.confidence.shape == (5,) and r.marginal_ranks is not None for r in records)
    trials = chain_trials(records, topk=4)
    read = [r for r in records if r.topk_tokens is not None and r.target_tokens is not None]
    # every marginal position is one trial per rank, whatever the path took before it
    assert read and len(trials.depth) == sum(r.marginal_ranks.shape[0] * min(4, r.topk_tokens.shape[1]) for r in read)
    assert trials.hit.sum() == sum(int(((r.marginal_ranks >= 0) & (r.marginal_ranks < 4)).sum()) for r in read)
    cal = calibrate_confidence(records)
    assert np.all(np.diff(cal.rate) >= 0)


def test_only_a_traced_block_engine_copies_its_marginals():
    """The marginals' copies last_round reads are made in traced engines alone; a block
    drafter's engine takes no other round shapes (one line)."""
    untraced, traced = (_engine("tiny-gdn", SPECS[0], batch=2, trace_topk=k) for k in (0, 8))
    for engine in (untraced, traced):
        engine.prefill(PROMPTS[:2])
        engine.run(rounds=1)
    assert not untraced.marginal_lp.any() and traced.marginal_lp.any()
    assert traced.last_round()["marginals"][0].shape == tuple(traced.marginal_lp.shape)
    plain = round_shape(PolicySpec.from_dict("none"))
    with pytest.raises(SimtreeError, match="runs its own round shape alone"):
        make_engine(tiny_model("tiny-gdn"), round_shape(SPECS[0]), 1, 64, shapes=[plain], **TINY)


def test_dspark_replay_at_batch_one_accepts_what_its_prediction_expects():
    """A sequence draws its acceptance level every round, at batch 1 as at any batch: the
    replayed DSpark rounds accept the expectation over the levels, and so must the prediction
    (it once gave a batch of b sequences to the heaviest levels, b at a time - at batch 1 every
    round at the likeliest level: the modes runs at full scale replayed 2.8 tokens a round where
    3.25 were predicted, docs/validation.md)."""
    from simtree.runtime.full.measure import full_run
    specs = [PolicySpec.from_dict("dspark", {"block_len": 7}),
             PolicySpec.from_dict("dspark", {"block_len": 7, "threshold": 0.3})]
    res = full_run(tiny_model("tiny-gdn"), device="cpu", costs=COSTS, batch_sizes=[1], acceptance="gsm8k",
                   context_len=16, rounds=96, warmup_rounds=0, extra=[("dspark", s) for s in specs])
    for spec in specs:
        row = next(r for r in res["rows"] if r["policy"] == f"dspark:{spec.name}")
        # 96 stratified draws: the replayed mean is the model's within (deepest depth 3) x 2 / 96
        assert row["measured_accepted"] == pytest.approx(row["predicted_accepted"], abs=0.07), (spec.name, row)
