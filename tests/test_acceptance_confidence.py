"""fit_confidence recovers a known drafter from linear traces alone and predicts its trees.

The generating process is the model's own class: at every depth the drafter is sure or unsure
(independently), its top-K probabilities follow the state, and the target takes rank r with a
probability that is a known function of the drafter's probability (calibrated or not).  The
truth for any tree is then exact: enumerate the states, build the tree from the drafter's
probabilities, score it with the true acceptance.
"""
import itertools
import json

import numpy as np
import pytest

from simtree.acceptance.fit import fit_confidence
from simtree.acceptance.phi import expected_accepted_positional
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.traces import read_traces
from simtree.errors import SimtreeError
from simtree.trees.builders import batched_best_first_tree, eagle_tree
from simtree.trees.tree import DraftTree

DEPTH, K = 5, 4
SURE, UNSURE = np.array([0.85, 0.08, 0.03, 0.02]), np.array([0.35, 0.25, 0.12, 0.08])


def _truth_rows(calibrate):
    return {True: (SURE, calibrate(SURE)), False: (UNSURE, calibrate(UNSURE))}


def _records(rng, n, share, calibrate):
    rows = _truth_rows(calibrate)
    recs = []
    for i in range(n):
        states = rng.random(DEPTH) < share
        topk = [[10 * d + r for r in range(K)] for d in range(DEPTH)]
        target, accepted = [], 0
        for d in range(DEPTH):
            acc = rows[bool(states[d])][1]
            rank = int(np.searchsorted(np.cumsum(acc), rng.random(), side="right"))   # K: none of the K
            target.append(topk[d][rank] if rank < K else 99)
            if rank != 0:
                break
            accepted += 1
        if accepted == DEPTH:
            target.append(7)   # the bonus after a fully accepted chain
        chain = [t[0] for t in topk]
        q = np.array([rows[bool(s)][0] for s in states])
        recs.append({"schema": "simtree.trace/2", "workload": "syn", "batch_size": 1, "round": i, "seq": 0,
                     "mode": "linear", "parents": list(range(-1, DEPTH)), "tokens": [1] + chain,
                     "log_probs": [0.0] + np.log(q[:, 0]).tolist(), "accepted_node": accepted,
                     "num_accepted": accepted, "target_tokens": target[:accepted + 1], "topk_tokens": topk,
                     "topk_probs": q.tolist()})
    return recs


def _truth(share, calibrate, mode, params):
    """Exact expected accepted tokens per round of the generating process."""
    rows, total = _truth_rows(calibrate), 0.0
    for states in itertools.product((True, False), repeat=DEPTH):
        w = np.prod([share if s else 1 - share for s in states])
        q = np.array([rows[s][0] for s in states])
        a = np.array([rows[s][1] for s in states])
        if mode == "linear":
            tree = DraftTree.chain(params["budget"])
        elif mode == "eagle":
            scores = np.log(q)

            def propose(parents, tokens, frontier, k=params["topk"]):
                depth = np.zeros(parents.shape[0], np.int64)
                for i in range(1, parents.shape[0]):
                    depth[i] = depth[parents[i]] + 1
                return np.tile(np.arange(k), (frontier.shape[0], 1)), scores[depth[frontier], :k]
            tree = eagle_tree(propose, params["num_steps"], params["topk"], params["budget"])
        else:
            p = params["draft_depth"]
            tree = batched_best_first_tree(np.tile(np.arange(K), (p, 1)), q[:p], params["budget"], 1)[0]
        total += w * expected_accepted_positional(tree, a)
    return 1.0 + total


def _fit(tmp_path, recs):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    return fit_confidence(read_traces(path), topk=K)


@pytest.mark.parametrize("calibrate", [lambda q: q, lambda q: q ** 1.5], ids=["calibrated", "overconfident"])
def test_linear_traces_predict_trees_of_a_known_drafter(tmp_path, calibrate):
    rng = np.random.default_rng(11)
    share = 0.5
    model = _fit(tmp_path, _records(rng, 4000, share, calibrate))
    for mode, params in [("linear", {"budget": 6}), ("eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
                         ("eagle", {"num_steps": 3, "topk": 3, "budget": 9}),
                         ("best_first", {"budget": 7, "width": 1, "draft_depth": 3})]:
        truth = _truth(share, calibrate, mode, params)
        assert accepted_per_round(model, mode, params) == pytest.approx(truth, rel=0.03), (mode, params)


def test_fit_separates_acceptance_from_the_drafters_probabilities(tmp_path):
    rng = np.random.default_rng(12)
    model = _fit(tmp_path, _records(rng, 4000, 0.5, lambda q: q ** 2))
    sure = int(np.argmax(model.draft_probs[:, 0, 0]))   # the level that is sure at depth 1
    # equal-count bins: the sure half of the rounds, give or take the sampling of the states
    assert model.draft_probs[sure, 0] == pytest.approx(SURE, abs=0.02)
    assert model.tables[sure, 0, :2] == pytest.approx(SURE[:2] ** 2, abs=0.04)
    assert model.num_levels == 8 and model.weights.sum() == pytest.approx(1.0)
    curves = np.array(list(model.meta["states"][0]["calibration"].values()))
    assert np.all(np.diff(curves, axis=1) >= -1e-12)  # monotone in q


def test_depth_effect_beyond_confidence_is_kept(tmp_path):
    # same drafter probabilities everywhere, but the target agrees more deep in a run (easy
    # stretches): the per-depth offsets must carry that, or the chain would be mispredicted
    rng = np.random.default_rng(13)
    recs = _records(rng, 3000, 1.0, lambda q: q)
    for r in recs:   # rewrite acceptance: depth 1 at 0.5, deeper depths at 0.9
        acc = 0
        while acc < DEPTH and rng.random() < (0.5 if acc == 0 else 0.9):
            acc += 1
        r["accepted_node"] = r["num_accepted"] = acc
        r["target_tokens"] = [t[0] for t in r["topk_tokens"][:acc]] + [99]
    model = _fit(tmp_path, recs)
    expected = 1 + sum(np.prod([0.5] + [0.9] * (d - 1)) for d in range(1, DEPTH + 1))
    assert accepted_per_round(model, "linear", {"budget": DEPTH + 1}) == pytest.approx(expected, rel=0.03)


def test_confidence_fit_needs_top_k(tmp_path):
    path = tmp_path / "v1.jsonl"
    path.write_text(json.dumps({"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": [0, -1],
                                "accepted_node": 1}) + "\n")
    with pytest.raises(SimtreeError, match="top-K"):
        fit_confidence(read_traces(path))


def test_round_weights_spend_fewer_rounds_where_a_policy_gains_more():
    from simtree.acceptance.mixture import AcceptanceModel
    tables = np.array([[[0.9, 0.05]] * 4, [[0.3, 0.2]] * 4])
    acc = AcceptanceModel("two", tables, [0.2, 0.8], state=[0, 1], state_share=[0.5, 0.5])
    g = np.array([4.0, 1.5])
    w = acc.round_weights(g)
    # half the text in each state: rounds there in proportion 0.5 / g
    assert w == pytest.approx(np.array([0.5 / 4.0, 0.5 / 1.5]) / (0.5 / 4.0 + 0.5 / 1.5))
    assert w @ g == pytest.approx(1.0 / (0.5 / 4.0 + 0.5 / 1.5))
    one = AcceptanceModel("one", tables, [0.2, 0.8])
    assert np.array_equal(one.round_weights(g), one.weights)
    with pytest.raises(SimtreeError, match="every state with a level"):
        AcceptanceModel("bad", tables, [0.5, 0.5], state=[0, 0], state_share=[0.5, 0.5])


def test_easy_and_hard_requests_weigh_by_their_text(tmp_path):
    # half the sequences are easy (the target takes the chain token with 0.95), half hard (0.3):
    # a policy's rounds per token differ by state, so its mean tokens per round is the
    # text-weighted harmonic mean of the states', not the mean over the fitted run's rounds
    rng = np.random.default_rng(14)
    recs, rounds = [], 0
    for s in range(16):
        p = 0.95 if s % 2 else 0.3
        for i in range(120):
            r = _records(rng, 1, 1.0, lambda q: q)[0]
            acc = 0
            while acc < DEPTH and rng.random() < p:
                acc += 1
            r.update(seq=s, round=i, accepted_node=acc, num_accepted=acc,
                     target_tokens=[t[0] for t in r["topk_tokens"][:acc]] + [99])
            recs.append(r)
    model = _fit(tmp_path, recs)

    def chain(p, budget):
        return 1 + sum(p ** d for d in range(1, budget))

    assert sum(m["sequences"] for m in model.meta["states"]) == 16
    # the easy and the hard requests never share a state
    for m in model.meta["states"]:
        assert min(abs(m["tokens_per_round"] - chain(p, DEPTH + 1)) for p in (0.3, 0.95)) < 0.5

    # the traced text: per sequence, as many tokens as its rounds gained
    share = np.array([chain(0.3, DEPTH + 1), chain(0.95, DEPTH + 1)])
    for budget in (3, 6):
        g = np.array([chain(0.3, budget), chain(0.95, budget)])
        truth = 1.0 / np.sum(share / share.sum() / g)
        assert accepted_per_round(model, "linear", {"budget": budget}) == pytest.approx(truth, rel=0.03)


def test_ease_groups_split_at_the_gaps():
    from simtree.acceptance.fit import ease_groups
    rng = np.random.default_rng(15)
    x = np.concatenate([rng.normal(0.0, 0.05, 7), rng.normal(1.0, 0.05, 5), rng.normal(2.5, 0.05, 9)])
    perm = rng.permutation(x.size)
    groups = ease_groups(x[perm], np.ones(x.size), 3)
    assert sorted(len(g) for g in groups) == [5, 7, 9]
    for g in groups:   # each group is one cluster
        assert np.ptp(x[perm][g]) < 0.5
    assert [len(g) for g in ease_groups(x, np.ones(x.size), 1)] == [x.size]


def _easy_and_hard_model(tmp_path, calibrate):
    """A fit of 16 sequences, half easy and half hard (several text states), whose drafter is
    ``calibrate``d: its draft probabilities are not its acceptance."""
    rng = np.random.default_rng(16)
    recs = []
    for s in range(16):
        for i, r in enumerate(_records(rng, 80, 0.8 if s % 2 else 0.2, calibrate)):
            r.update(seq=s, round=i)
            recs.append(r)
    return _fit(tmp_path, recs)


@pytest.mark.parametrize("mode, params", [("linear", {"budget": 5}), ("eagle", {"num_steps": 3, "topk": 2, "budget": 7}),
                                          ("best_first", {"budget": 8, "width": 1, "draft_depth": 4})])
def test_simulator_reads_a_fitted_model_as_the_model_predicts(tmp_path, mode, params):
    # several states and an overconfident drafter: the simulator weighs levels by the policy's
    # rounds, builds trees from the drafter's probabilities and scores them with acceptance
    from simtree.acceptance.model import Workload
    from simtree.planning.modes import PolicySpec
    from simtree.planning.simulate import simulate, static_round
    from simtree.costs.synthetic import synthetic_costs

    model = _easy_and_hard_model(tmp_path, lambda q: q ** 1.5)
    assert model.num_states > 1 and not np.allclose(model.draft_probs, model.tables)
    spec = PolicySpec.from_dict(mode, params)
    shape = static_round(model, spec)
    assert shape.tokens_per_round == pytest.approx(accepted_per_round(model, mode, params), abs=1e-12)
    assert not np.allclose(shape.weights, model.weights)   # a policy's rounds are not the traced run's
    wl = Workload("syn", model, np.full(4, 100), 64)
    ana = simulate(synthetic_costs(), wl, 4, spec)
    mc = simulate(synthetic_costs(), wl, 4, spec, mc_runs=30, seed=2)
    lo, hi = mc.ci95["accepted_tokens_per_round"]
    assert lo <= ana.accepted_tokens_per_round <= hi
