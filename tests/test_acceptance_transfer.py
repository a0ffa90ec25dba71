"""Acceptance on a workload from the drafter's confidences there (simtree/acceptance/transfer.py):
a calibration fitted on one workload's linear traces, applied to another's drafts (no outcome),
predicts that workload's chain within its sampling error where the fit of the first workload
alone does not; the round-start weights are the renewal process's; a drafts record that holds
an outcome is refused; the planner's workload spec DRAFTS.jsonl@TRACES.jsonl reads it; the
context lookup proposes what followed the latest occurrence of the text's end, and a calibration
by it separates the candidates it proposes.

Synthetic drafter: at each position the drafter's top-K probabilities q come from a Dirichlet
(its concentration sets how confident the drafter is on the workload); the target takes rank r
with probability cal(q_r) (a fixed calibration the drafter does not know, the same on every
workload), else a token outside the top-K."""
from __future__ import annotations

import json

import numpy as np
import pytest

from simtree.acceptance.fit import fit_calibration, fit_confidence
from simtree.acceptance.model import get_workload
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.traces import parse_record
from simtree.acceptance.transfer import (DRAFTS_SCHEMA, context_match, parse_drafts, read_drafts, round_starts,
                                         transfer_model)
from simtree.errors import SimtreeError

P, K = 7, 4


def _cal(q):
    """The target's acceptance of a candidate of draft probability q (the drafter is underconfident)."""
    return np.minimum(0.15 + 1.3 * q, 0.97) * (q > 0)


def _text(rng, seqs: int, positions: int, concentration: float):
    """[seqs, positions, P, K] sorted draft probs and the target's rank at each (K: none of them);
    chains from neighbouring positions see the same text (the rank of the target at depth d from
    position t is the rank at depth d - 1 from t + 1)."""
    raw = rng.dirichlet(np.full(K + 1, concentration), (seqs, positions + P))[..., :K]
    q = -np.sort(-raw, -1)
    acc = _cal(q)
    u = rng.random((seqs, positions + P))[..., None]
    cum = np.cumsum(acc, -1)
    rank = np.where(u[..., 0] < cum[..., -1], (u >= cum).sum(-1), K)
    idx = np.arange(positions)[:, None] + np.arange(P)[None, :]
    return q[:, idx], rank[:, idx]                          # [S, T, P, K], [S, T, P]


def _linear_records(q, rank, workload="chat"):
    """Linear runs (budget P + 1) over the text, as the runtime traces them: a round from position
    t accepts while the target takes the top-1, the next begins after the bonus token."""
    out = []
    for s in range(q.shape[0]):
        t, r = 0, 0
        while t < q.shape[1]:
            hits = rank[s, t] == 0
            n_acc = int(np.argmin(hits)) if not hits.all() else P
            top = 1000 * np.arange(1, P + 1)[:, None] + np.arange(K)[None, :]    # token ids, [P, K]
            tokens = [0] + top[:, 0].tolist()
            miss = rank[s, t, n_acc] if n_acc < P else 0
            bonus = 7 if n_acc == P else (int(top[n_acc, miss]) if miss < K else 999)
            target = [*top[:n_acc, 0].tolist(), bonus]
            out.append(parse_record({
                "schema": "simtree.trace/2", "workload": workload, "batch_size": q.shape[0], "round": r, "seq": s,
                "mode": "linear", "context_len": 50 + t, "parents": list(range(-1, P)), "tokens": tokens,
                "log_probs": [0.0] + np.log(q[s, t, :, 0]).tolist(), "accepted_node": n_acc, "target_tokens": target,
                "topk_tokens": top.tolist(), "topk_probs": q[s, t].tolist()}, "synthetic"))
            t, r = t + n_acc + 1, r + 1
    return out


def _drafts(q, workload="code", with_outcome=False):
    recs = []
    for s in range(q.shape[0]):
        for t in range(q.shape[1]):
            rec = {"schema": DRAFTS_SCHEMA, "workload": workload, "seq": s, "position": t, "context_len": 50 + t,
                   "topk_probs": (np.floor(q[s, t] * 1e6) / 1e6).tolist()}
            if with_outcome:
                rec["num_accepted"] = 1
            recs.append(rec)
    return recs


def _measured(records):
    return float(np.mean([r.num_accepted + 1 for r in records]))


@pytest.fixture(scope="module")
def workloads():
    rng = np.random.default_rng(11)   # fixed: statistical tolerances, a failure reproduces
    chat = _text(rng, 32, 48, 0.5)       # an unsure drafter
    code = _text(rng, 32, 48, 0.12)      # a confident one: peaked probabilities
    return chat, code


def test_the_drafters_confidence_carries_the_acceptance_to_another_workload(workloads):
    (qc, rc), (qx, rx) = workloads
    chat, code = _linear_records(qc, rc), _linear_records(qx, rx, "code")
    assert _measured(code) > 1.15 * _measured(chat)          # the workloads differ
    cal = fit_calibration(chat)
    model = transfer_model(cal, parse_drafts(_drafts(qx)))
    predicted = accepted_per_round(model, "linear", {"budget": P + 1})
    fitted_on_chat = accepted_per_round(fit_confidence(chat), "linear", {"budget": P + 1})
    # within a few sampling errors of the code workload's own measurement; the chat fit is not
    assert abs(predicted / _measured(code) - 1) < 0.1
    assert abs(fitted_on_chat / _measured(code) - 1) > abs(predicted / _measured(code) - 1)
    # the same calibration on the chat workload's own drafts reproduces chat
    own = transfer_model(cal, parse_drafts(_drafts(qc, "chat")))
    assert abs(accepted_per_round(own, "linear", {"budget": P + 1}) / _measured(chat) - 1) < 0.1
    assert model.meta["positions"] == qx.shape[0] * qx.shape[1] and model.num_states > 1


def test_the_model_reads_drafter_confidences_alone(workloads):
    """Two draws of the target's verdicts on the same drafter confidences: the measured runs
    differ, the model the calibration makes of the drafts is one (it is given no verdict); a
    drafts record that holds an outcome is refused."""
    (qc, rc), (qx, _) = workloads
    cal = fit_calibration(_linear_records(qc, rc))
    rng = np.random.default_rng(12)   # fixed: statistical tolerances, a failure reproduces
    seen = {}
    for draw in range(2):
        acc = _cal(qx)
        cum = np.cumsum(acc, -1)
        u = rng.random(qx.shape[:3])[..., None]
        rank = np.where(u[..., 0] < cum[..., -1], (u >= cum).sum(-1), K)
        seen[draw] = (_measured(_linear_records(qx, rank, "code")),
                      accepted_per_round(transfer_model(cal, parse_drafts(_drafts(qx))), "linear", {"budget": P + 1}))
    assert seen[0][0] != seen[1][0] and seen[0][1] == seen[1][1]
    with pytest.raises(SimtreeError, match="holds no acceptance outcome, found num_accepted"):
        parse_drafts(_drafts(qx[:1, :2], with_outcome=True))
    bad = {"schema": DRAFTS_SCHEMA, "workload": "w", "seq": 0, "position": 0, "topk_probs": [[0.1, 0.5]]}
    with pytest.raises(SimtreeError, match="descending"):
        parse_drafts([bad])
    twice = _drafts(qx[:1, :2])
    with pytest.raises(SimtreeError, match="appears twice"):
        parse_drafts([*twice, twice[0]])


def test_round_starts_are_the_renewal_process_of_the_chain():
    rng = np.random.default_rng(13)   # fixed: statistical tolerances, a failure reproduces
    n_seq, T, p = 3, 12, 4
    a = rng.uniform(0.2, 0.95, (n_seq * T, p))
    survive = np.cumprod(a, 1)
    drafts = parse_drafts([{"schema": DRAFTS_SCHEMA, "workload": "w", "seq": s, "position": t,
                            "topk_probs": [[0.5]] * p} for s in range(n_seq) for t in range(T)])
    v = round_starts(drafts, survive).reshape(n_seq, T)
    sims = np.zeros((n_seq, T))
    runs = 4000
    for s in range(n_seq):
        for _ in range(runs):
            t = 0
            while t < T:
                sims[s, t] += 1
                u = rng.random(p)
                k = int(np.argmin(u < a[s * T + t])) if not (u < a[s * T + t]).all() else p
                t += k + 1
    assert np.allclose(v, sims / runs, atol=4 * np.sqrt(0.25 / runs))
    assert np.allclose(v[:, 0], 1.0)


def test_plan_reads_drafts_calibrated_on_another_workloads_traces(workloads, tmp_path):
    (qc, rc), (qx, _) = workloads
    traces, drafts = tmp_path / "chat.jsonl", tmp_path / "code_drafts.jsonl"
    chat = _linear_records(qc[:6], rc[:6])
    lines = []
    for r in chat:   # written back as the runtime writes them
        lines.append(json.dumps({"schema": "simtree.trace/2", "workload": "chat", "batch_size": r.batch_size,
                                 "round": r.round_index, "seq": r.seq, "mode": "linear", "context_len": r.context_len,
                                 "parents": r.tree.parents.tolist(), "tokens": r.tree.tokens.tolist(),
                                 "log_probs": r.tree.log_probs.tolist(), "accepted_node": r.accepted_node,
                                 "target_tokens": r.target_tokens.tolist(), "topk_tokens": r.topk_tokens.tolist(),
                                 "topk_probs": r.topk_probs.tolist()}))
    traces.write_text("\n".join(lines) + "\n")
    drafts.write_text("".join(json.dumps(d) + "\n" for d in _drafts(qx[:6])))
    w = get_workload(f"{drafts}@{traces}")
    assert w.name == "code" and w.acceptance.meta["calibrated_on"]["workload"] == "chat"
    assert w.mean_prompt_len == pytest.approx(50.0, rel=0.05)
    assert 1.0 < accepted_per_round(w.acceptance, "eagle", {"num_steps": 3, "topk": 2, "budget": 6}) < 6.0
    assert read_drafts(drafts).size == 6 * qx.shape[1]
    with pytest.raises(SimtreeError, match="without outcomes"):
        get_workload(str(drafts))
    from simtree.acceptance.bootstrap import bootstrap_models
    boot = bootstrap_models(f"{drafts}@{traces}", 2, seed=1)
    assert len(boot) == 2 and boot[0].name == "code#b0"


def test_context_lookup_proposes_what_followed_the_latest_occurrence():
    rng = np.random.default_rng(14)   # fixed: statistical tolerances, a failure reproduces
    text = rng.integers(10, 60, 40).tolist()
    context = text + [1, 2, 3] + text[:5] + [4, 5]                   # the text, then a repeat of its start
    repeat = np.array(text[5:9])                                     # what the repeat goes on with
    top = np.stack([rng.permutation(np.r_[t, rng.integers(100, 200, 3)]) for t in repeat])   # [4, 4]
    ranks = context_match(context[:-2], top)                         # the text ends with text[:5]
    expected = np.array([int(np.flatnonzero(row == t)[0]) for row, t in zip(top, repeat)])
    # depth 1 looks up the text; deeper positions extend it with the chain's own top-1 tokens
    assert ranks[0] == expected[0]
    copied = top.copy()
    copied[:, 0], copied[np.arange(4), expected] = repeat, top[:, 0]  # the drafter's top-1 copies the text
    assert context_match(context[:-2], copied).tolist() == [0, 0, 0, 0]
    assert context_match([1, 2], copied).tolist() == [4, 4, 4, 4]     # nothing to look up


def test_the_calibration_separates_candidates_the_context_proposes():
    """Three lookup states, each its own curve: the lookup proposes this candidate, another of
    the drafter's candidates (evidence against this one), or none of them.  Pooling the last two
    mixed text whose share differs between where rounds begin and elsewhere (docs/acceptance.md,
    section 5)."""
    from simtree.acceptance.fit import LOOKUP_NONE, LOOKUP_OTHER, LOOKUP_THIS, lookup_states
    assert lookup_states([0, 2, 4, 3], 0, 4).tolist() == [LOOKUP_THIS, LOOKUP_OTHER, LOOKUP_NONE, LOOKUP_OTHER]
    assert lookup_states(np.array([[1], [4]]), np.arange(3), 4).tolist() == [
        [LOOKUP_OTHER, LOOKUP_THIS, LOOKUP_OTHER], [LOOKUP_NONE] * 3]
    rng = np.random.default_rng(15)   # fixed: statistical tolerances, a failure reproduces
    q, rank = _text(rng, 16, 30, 0.5)
    u = rng.random(q.shape[:3])
    proposed = np.where(u < 0.3, 0, np.where(u < 0.6, 1, K))       # the lookup's rank: top-1, rank 1, none
    v = rng.random(q.shape[:3])
    rank = np.where(proposed == 0, np.where(v < 0.9, 0, np.maximum(rank, 1)),
                    np.where(proposed == 1, np.where(v < 0.6, 1, np.where(v < 0.65, 0, K)), rank))
    records = _linear_records(q, rank)
    with_match = []
    for rec in records:
        s, t = rec.seq, rec.context_len - 50
        with_match.append(type(rec)(**{**rec.__dict__, "context_match": proposed[s, t]}))
    cal = fit_calibration(with_match)
    assert cal.matched and cal.curves.shape[1] == 3
    row, one = np.array([[0.35, 0.1, 0.05, 0.0]]), np.ones(1, np.int64)
    a_this, a_other, a_none = (cal(one, row, lookup_states(np.array([[m]]), np.arange(K), K))[0, 0] for m in (0, 1, K))
    assert a_this > a_none + 0.15 and a_other < a_none - 0.1       # the drafter's 0.35 means three things
    assert not fit_calibration(with_match, context=False).matched
    with pytest.raises(SimtreeError, match="context_match"):
        transfer_model(cal, parse_drafts(_drafts(q[:2])))


def test_a_chain_drafters_marginal_mode_never_accepts_below_an_off_chain_node(workloads):
    """The marginal modes of a chain drafter (the MTP drafting pass) read every position's
    candidates along the drafter's top-1 chain: a node below a rank >= 1 node was drafted after
    the chain's token, and the model never accepts it - in predict, the simulator's analytic
    and Monte-Carlo rounds and the adaptive rounds alike; EAGLE trees are scored as before."""
    from simtree.acceptance.phi import expected_accepted_ranked, node_accept_probs_ranked, off_chain, \
        sample_accepted_length
    from simtree.planning.simulate import static_round
    from simtree.planning.modes import PolicySpec
    from simtree.trees.tree import DraftTree
    # root - a(r0) - b(r0); root - c(r1) - d(r0); a - e(r1)
    tree = DraftTree(np.array([-1, 0, 1, 0, 3, 1]), np.array([0, 0, 0, 1, 0, 1]), np.zeros(6))
    assert off_chain(tree.parents, tree.tokens).tolist() == [False, False, False, True, True, True]
    table = np.full((3, 2), 0.4)
    free, chained = node_accept_probs_ranked(tree, table), node_accept_probs_ranked(tree, table, True)
    assert chained.tolist() == [1.0, 0.4, 0.4, 0.4, 0.0, 0.4] and free[4] == 0.4
    assert expected_accepted_ranked(tree, table, True) == pytest.approx(0.4 + 0.16 + 0.4 + 0.16)
    lengths = sample_accepted_length(tree, np.random.default_rng(0), 4000, marginal_tokens=np.tile([0, 1], (3, 1)),
                                     marginal_probs=table, chain_marginals=True)
    assert lengths.max() == 2 and lengths.mean() == pytest.approx(expected_accepted_ranked(tree, table, True), abs=0.03)
    (qc, rc), (qx, _) = workloads
    model = transfer_model(fit_calibration(_linear_records(qc, rc)), parse_drafts(_drafts(qx)))
    assert model.chain_marginals
    for mode, params in (("best_first", {"budget": 12, "width": 1, "draft_depth": 5}),
                         ("eagle", {"num_steps": 4, "topk": 2, "budget": 8})):
        shape = static_round(model, PolicySpec.from_dict(mode, dict(params)))
        assert shape.tokens_per_round == pytest.approx(accepted_per_round(model, mode, params))
    from simtree.control.controller import tier_shape
    from simtree.runtime.full.acceptance import joint_depth_pmf
    from simtree.runtime.full.drafting import round_shape
    bf_spec = PolicySpec.from_dict("best_first", {"budget": 12, "width": 1, "draft_depth": 5})
    shape = static_round(model, bf_spec)
    tier = tier_shape(model, bf_spec)          # the controller's accepted-length distribution
    mean = (1.0 - tier.cdf[:, :-1]).sum(1)
    assert np.allclose(mean, shape.accepted)
    joint = joint_depth_pmf(model, round_shape(bf_spec))      # the runtime's replay of the same rounds
    assert joint.sum() == pytest.approx(1.0)
    assert np.arange(joint.shape[0]) @ joint.sum(1) == pytest.approx(float(shape.weights @ shape.accepted))
    unchained = type(model)(model.name, model.tables, model.weights, draft_probs=model.draft_probs, state=model.state,
                            state_share=model.state_share)
    bf = {"budget": 12, "width": 1, "draft_depth": 5}
    assert accepted_per_round(model, "best_first", bf) < accepted_per_round(unchained, "best_first", bf)
    eagle = {"num_steps": 4, "topk": 2, "budget": 8}
    assert accepted_per_round(model, "eagle", eagle) == pytest.approx(accepted_per_round(unchained, "eagle", eagle))


def test_the_lookup_calibrates_wherever_logged_and_every_rank_has_its_curve(workloads):
    from simtree.acceptance.transfer import uses_lookup
    (qc, rc), (qx, _) = workloads
    chat = _linear_records(qc[:4], rc[:4])
    drafts = parse_drafts(_drafts(qx[:4]))
    assert fit_calibration(chat).curves.shape[0] == K and fit_calibration(chat, rank_groups=3).curves.shape[0] == 3
    assert fit_calibration(chat, topk=2).curves.shape[0] == 2          # the call's top-K, each rank its own
    with_match = [r for r in chat]
    assert not uses_lookup(with_match, drafts)          # the synthetic records carry no lookup
    object.__setattr__(drafts, "context_match", np.zeros(drafts.probs.shape[:2], np.int64))
    for r in with_match:
        object.__setattr__(r, "context_match", np.zeros(r.topk_tokens.shape[0], np.int64))
    assert uses_lookup(with_match, drafts)               # chat traces calibrating code drafts
    same = parse_drafts([{**d, "workload": "chat"} for d in _drafts(qx[:4])])
    object.__setattr__(same, "context_match", np.zeros(same.probs.shape[:2], np.int64))
    assert uses_lookup(with_match, same)                 # and chat drafts: wherever both carry it


def _looked_up_text(rng, seqs: int, positions: int, informative: bool):
    """As :func:`_text`, and a lookup that proposes the top-1 at a third of the positions
    (``context_match`` [S, T, P]: 0 there, K elsewhere); ``informative``: the target takes a
    proposed top-1 almost always and an unproposed one half as often as the drafter's calibration
    says (a target that repeats its context), else the lookup says nothing of the target."""
    raw = rng.dirichlet(np.full(K + 1, 0.5), (seqs, positions + P))[..., :K]
    q = -np.sort(-raw, -1)
    looked = rng.random((seqs, positions + P)) < 1 / 3
    acc = _cal(q)
    if informative:
        acc[..., 0] = np.where(looked, 0.95, 0.5 * acc[..., 0])
    u = rng.random((seqs, positions + P))[..., None]
    cum = np.cumsum(acc, -1)
    rank = np.where(u[..., 0] < cum[..., -1], (u >= cum).sum(-1), K)
    idx = np.arange(positions)[:, None] + np.arange(P)[None, :]
    return q[:, idx], rank[:, idx], np.where(looked, 0, K)[:, idx]


def test_the_calibrating_runs_folds_say_whether_the_lookup_helps():
    """lookup_folds: folds of the calibrating sequences, predicted from the others, are predicted
    closer with the lookup where it carries the target's verdicts, and not where it carries none."""
    from simtree.acceptance.lookup_folds import lookup_cv
    rng = np.random.default_rng(21)   # fixed: statistical tolerances, a failure reproduces
    seen = {}
    for informative in (True, False):
        q, rank, match = _looked_up_text(rng, 24, 40, informative)
        recs = _linear_records(q, rank, "chat")
        for r in recs:
            t = r.context_len - 50
            object.__setattr__(r, "context_match", match[r.seq, t].astype(np.int64))
        drafts = parse_drafts(_drafts(q, "chat"))
        object.__setattr__(drafts, "context_match", match.reshape(-1, P).astype(np.int64))
        errs = lookup_cv(recs, drafts)
        assert len(errs[True]) == len(errs[False]) == 4        # 4 folds x one linear budget
        seen[informative] = (np.mean(errs[True]), np.mean(errs[False]))
    assert seen[True][0] < 0.7 * seen[True][1]                  # the lookup predicts the folds closer
    assert seen[False][0] >= seen[False][1] and seen[False][0] - seen[False][1] < 0.5 * seen[True][1]
