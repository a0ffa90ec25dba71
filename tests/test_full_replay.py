"""Replay rounds commit exactly the accepted lengths the acceptance source asks for."""
import json

import numpy as np
import pytest
import torch

from simtree.acceptance.model import AcceptanceModel
from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.acceptance import ModelReplay, StratifiedReplay, TraceReplay
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.engine import FullEngine

from full_helpers import FAMILIES, tiny_model

EAGLE = PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6})


def _trace(path, depths):
    """A JSONL trace whose records accept ``depths`` (chains of 6 nodes)."""
    with open(path, "w") as fh:
        for i, d in enumerate(depths):
            fh.write(json.dumps({"workload": "w", "batch_size": 3, "round": i // 3, "seq": i % 3,
                                 "parents": [-1, 0, 1, 2, 3, 4], "log_probs": [0.0] + [-0.5] * 5,
                                 "accepted_node": int(d)}) + "\n")


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("spec", [PolicySpec.from_dict("linear", {"budget": 4}), EAGLE], ids=["linear", "eagle"])
def test_trace_replay_commits_the_requested_lengths(tmp_path, name, spec):
    """Each round commits min(requested depth, the tree's depth) tokens + the bonus, per sequence."""
    rng = np.random.default_rng(3)
    depths = rng.integers(0, 6, size=3 * 5)          # some deeper than any tree here: capped at its depth
    _trace(tmp_path / "t.jsonl", depths)
    engine = FullEngine(tiny_model(name), round_shape(spec), 3, 96, TraceReplay(tmp_path / "t.jsonl", 3, "cpu"))
    engine.fill_context(20, seed=1)
    before = engine.st.lengths.clone()
    want, got = [], []
    for r in range(5):
        got.append(engine.run(rounds=1).accepted[0])
        deepest = torch.where(engine.tree.valid, engine.tree.depth, 0).amax(1).numpy()
        want.append(np.minimum(depths[3 * r:3 * r + 3], deepest))
    want = np.array(want)
    assert np.array_equal(np.array(got), want)
    assert torch.equal(engine.st.lengths - before, torch.as_tensor((want + 1).sum(0)))
    assert torch.equal(engine.ds.lengths, engine.st.lengths)       # the MTP layer caught up on every path
    assert engine.out_len.tolist() == (1 + (want + 1).sum(0)).tolist()


def test_trace_replay_picks_the_best_scored_node_at_that_depth(tmp_path):
    _trace(tmp_path / "t.jsonl", [2])
    engine = FullEngine(tiny_model("tiny-gdn"), round_shape(EAGLE), 1, 64, TraceReplay(tmp_path / "t.jsonl", 1, "cpu"))
    engine.fill_context(10, seed=2)
    engine.run(rounds=1)
    t, acc = engine.tree, int(engine._accepted[0])
    at_two = (t.depth[0] == 2) & t.valid[0]
    assert int(t.depth[0, acc]) == 2
    assert float(t.score[0, acc]) == float(t.score[0][at_two].max())


def _model(alpha):
    return AcceptanceModel("m", np.array([[[alpha, 0.0]]] * 4).reshape(4, 2), np.ones(1))


@pytest.mark.parametrize("alpha, expected", [(0.0, 0.0), (1.0, 3.0), (0.5, 0.5 + 0.25 + 0.125)])
def test_model_replay_samples_the_chain_acceptance(alpha, expected):
    rs = round_shape(PolicySpec.from_dict("linear", {"budget": 4}))
    engine = FullEngine(tiny_model("tiny-gdn"), rs, 8, 256, ModelReplay(_model(alpha), rs, "cpu", seed=0))
    engine.fill_context(8, seed=0)
    stats = engine.run(rounds=30)
    assert stats.accepted.mean() == pytest.approx(expected, abs=0.12)


def test_model_replay_accepts_only_children_of_accepted_nodes():
    """Rank 1 only accepted (P = 1): the tree's second child at each depth, i.e. a path whose
    every node has rank 1."""
    rs = round_shape(EAGLE)
    acc = AcceptanceModel("r1", np.tile([[0.0, 1.0]], (3, 1)), np.ones(1))
    engine = FullEngine(tiny_model("tiny-gdn"), rs, 2, 64, ModelReplay(acc, rs, "cpu"))
    engine.fill_context(8, seed=0)
    engine.run(rounds=1)
    for b in range(2):
        path = engine._path[b, 1:int(engine._acc_len[b]) + 1]
        assert int(engine._acc_len[b]) >= 1
        assert bool((engine.tree.rank[b, path] == 1).all())


@pytest.mark.parametrize("spec", [EAGLE, PolicySpec.from_dict("eagle", {"num_steps": 4, "topk": 3, "budget": 9})],
                         ids=["s3k2d6", "s4k3d9"])
def test_replayed_rounds_build_the_trees_the_simulator_scores(spec):
    """A replay shapes its trees by its acceptance model, not by the random drafter's flat
    log-probabilities: the tree of every sequence is static_round's tree for its level."""
    from simtree.acceptance.model import calibrate_linear
    from simtree.planning.simulate import static_round
    acc = calibrate_linear(2.6, 4, spread=0.0)        # one level: every sequence's tree is the same
    rs = round_shape(spec)
    engine = FullEngine(tiny_model("tiny-gdn"), rs, 3, 64, ModelReplay(acc, rs, "cpu"))
    engine.fill_context(8, seed=0)
    engine._draft()
    want = static_round(acc, spec).trees[0]
    for b in range(3):
        assert engine.tree.parents[b].tolist() == want.parents.tolist()


def test_replay_scores_and_levels_are_the_simulators():
    """A replay's draft scores are the drafter's probabilities (draft_table) and its levels are
    drawn as the policy's rounds spread over them (round_weights), as the simulator scores the
    same policy."""
    from simtree.acceptance.model import get_workload
    from simtree.planning.simulate import static_round
    from simtree.runtime.full.acceptance import DraftScores

    acc = get_workload("sharegpt").acceptance
    spec = PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6})
    rs = round_shape(spec)
    scores = DraftScores(acc, rs, "cpu")
    want = np.log(np.maximum(np.stack([acc.draft_table(lv, 3) for lv in range(acc.num_levels)]), 1e-300))
    assert np.allclose(scores.logp[:, :, :acc.topk].numpy(), want, atol=1e-5)
    weights = static_round(acc, spec).weights
    assert np.allclose(scores.level_cum.numpy(), np.cumsum(weights)[:-1], atol=1e-6)
    draws = torch.cat([scores.draw(4096).clone() for _ in range(8)])
    freq = np.bincount(draws.numpy(), minlength=acc.num_levels) / draws.numel()
    assert np.abs(freq - weights).max() < 0.01


def test_stratified_draws_come_up_in_proportion():
    """Every outcome comes up n x P times within 2 (one point per stratum), for any pmf."""
    from simtree.runtime.full.acceptance import stratified_draws
    rng = np.random.default_rng(5)
    for _ in range(20):
        pmf = rng.dirichlet(np.full(int(rng.integers(2, 12)), 0.5))
        n = int(rng.integers(1, 400))
        counts = np.bincount(stratified_draws(pmf, n, rng), minlength=pmf.size)
        assert counts.sum() == n and np.all(np.abs(counts - n * pmf) <= 2)


@pytest.mark.parametrize("bad", [(np.array([0.5, 0.5]), 0), (np.array([0.0, 0.0]), 4), (np.array([np.nan, 1.0]), 4)])
def test_stratified_draws_refuse_bad_input(bad):
    from simtree.errors import SimtreeError
    from simtree.runtime.full.acceptance import stratified_draws
    with pytest.raises(SimtreeError, match="stratified draws"):
        stratified_draws(*bad, np.random.default_rng(0))


@pytest.mark.parametrize("name, spec", [("tiny-gdn", PolicySpec.from_dict("linear", {"budget": 4})),
                                        ("tiny-gdn", EAGLE), ("tiny-v4", EAGLE)], ids=["gdn-linear", "gdn-eagle", "v4-eagle"])
def test_stratified_replay_accepts_the_models_mean_within_a_token(name, spec):
    """A stratified replay's rounds commit the depths of its table (every tree deep enough), the
    table's levels shape the trees, and 24 rounds of one sequence accept the simulator's mean
    tokens per round within (deepest depth) / 24 - where independent draws err by ~0.25."""
    from simtree.acceptance.model import get_workload
    from simtree.planning.simulate import static_round
    from simtree.runtime.full.acceptance import joint_depth_pmf

    acc = get_workload("gsm8k").acceptance
    rs = round_shape(spec)
    rounds = 24
    src = StratifiedReplay(acc, rs, "cpu", batch_size=1, rows=rounds, seed=3)
    engine = FullEngine(tiny_model(name), rs, 1, 256, src)
    engine.fill_context(8, seed=0)
    engine.run(rounds=3)                        # warm-up rounds read rows 0..2
    src.rewind()
    stats = engine.run(rounds=rounds)
    assert np.array_equal(stats.accepted[:, 0], src.table[:, 0].numpy())
    sr = static_round(acc, spec)
    want = float(sr.weights @ sr.accepted)      # the simulator's accepted draft tokens per round
    joint = joint_depth_pmf(acc, rs)
    assert np.isclose(joint.sum(), 1.0) and np.isclose(joint.sum(1) @ np.arange(joint.shape[0]), want)
    assert abs(stats.accepted.mean() - want) <= rs.max_depth / rounds + 1e-9
    # the table's levels drafted the trees: the last round's tree is static_round's for its level
    level = int(src.levels[rounds - 1, 0])
    assert engine.tree.parents[0][engine.tree.valid[0]].tolist() == sr.trees[level].parents.tolist()


def test_a_stratified_replay_needs_a_batch_and_a_round():
    from simtree.errors import SimtreeError
    with pytest.raises(SimtreeError, match="needs a batch and a round"):
        StratifiedReplay(_model(0.5), round_shape(EAGLE), "cpu", batch_size=0, rows=4)


def test_the_sampling_figures_docs_quote_are_the_models():
    """docs/full_runtime.md's figures for gsm8k, linear D=4 and EAGLE s3 k2 D6: the accepted
    depth's standard deviation, the iid standard error at N = 24 and 96 draws and the stratified
    bound (deepest depth) / N, as shares of the accepted tokens per round."""
    from simtree.acceptance.model import get_workload
    from simtree.runtime.full.acceptance import joint_depth_pmf

    acc = get_workload("gsm8k").acceptance
    sd, se, bound = [], [], []
    for spec in (PolicySpec.from_dict("linear", {"budget": 4}), EAGLE):
        rs = round_shape(spec)
        pmf = joint_depth_pmf(acc, rs).sum(1)
        d = np.arange(pmf.size)
        mean = pmf @ d
        sd.append(np.sqrt(pmf @ (d - mean) ** 2))
        se += [sd[-1] / np.sqrt(n) / (mean + 1) for n in (24, 96)]
        bound += [rs.max_depth / n / (mean + 1) for n in (24, 96)]
    assert 0.695 <= min(sd) and max(sd) <= 1.05                       # "about 0.7-1.0 / sqrt(N)"
    assert 0.02 <= min(se) and max(se) <= 0.075                       # "2-7.5%"
    assert 0.0355 <= min(bound[0::2]) and max(bound[0::2]) <= 0.0595   # "3.8-5.9% at N = 24"
    assert 0.0095 <= min(bound[1::2]) and max(bound[1::2]) <= 0.0155   # "1.0-1.5% at N = 96"
