"""A chain drafter's nodes below an off-chain node (simtree/acceptance/off_chain.py) and the
context's text state (simtree/acceptance/text_state.py), on synthetic traces:

- linear runs measure how often the chain's candidates after an off-chain bonus are the next
  token: the fitted share recovers the rate the traces were drawn with; a tree scored with the
  share predicts what the sampler draws; True (never) is a share of 0; a marginal tree gains
  with it, a chain does not;
- a calibration with the text state recovers how acceptance moves with it, and carries to
  drafts whose text state differs what a calibration without it cannot; drafts without the
  state are refused by it; the share of non-word tokens is read over the last tokens."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from scipy.special import expit, logit

from simtree.acceptance.fit import fit_calibration
from simtree.acceptance.mixture import AcceptanceModel
from simtree.acceptance.off_chain import fit_off_chain_scale, off_chain_trials
from simtree.acceptance.phi import expected_accepted_ranked, rank_tokens, sample_accepted_length
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.text_state import context_nonword_share
from simtree.acceptance.traces import parse_record
from simtree.acceptance.transfer import parse_drafts, transfer_model
from simtree.errors import SimtreeError
from simtree.trees.tree import DraftTree

Q = np.array([0.6, 0.3])        # the drafter's top-2 at every depth; calibrated: the target takes rank r w.p. Q[r]


def _round(seq, rnd, ids, n_acc, bonus):
    P = ids.shape[0]
    return parse_record({
        "schema": "simtree.trace/2", "workload": "chat", "batch_size": 1, "round": rnd, "seq": seq, "mode": "linear",
        "context_len": 50 + rnd, "parents": list(range(-1, P)), "tokens": [0, *ids[:, 0].tolist()],
        "log_probs": [0.0] + [float(np.log(Q[0]))] * P, "accepted_node": n_acc,
        "target_tokens": [*ids[:n_acc, 0].tolist(), int(bonus)], "topk_tokens": ids.tolist(),
        "topk_probs": np.tile(Q, (P, 1)).tolist()}, "synthetic")


def _off_chain_runs(rng, rho: float, seqs: int = 40, rounds: int = 60, P: int = 3):
    """Linear runs of chains of P: the target takes rank r w.p. Q[r] at each depth; after a bonus
    that is the drafter's rank-1 candidate, the next token is the chain's rank-r candidate at the
    next depth w.p. rho * Q[r] (what a node below that off-chain node would have met)."""
    out = []
    for s in range(seqs):
        forced = None
        for r in range(rounds):
            ids = 100 * (1000 * s + r) + 10 * np.arange(1, P + 1)[:, None] + np.arange(2)[None, :]
            if forced is not None:     # the token after an off-chain bonus: not this round's candidate
                n_acc, bonus, forced = 0, forced, None
            else:
                pick = rng.choice(3, P, p=[*Q, 1 - Q.sum()])      # rank taken per depth (2: none of them)
                n_acc = int(np.argmax(pick != 0)) if (pick != 0).any() else P
                bonus = 7 if n_acc == P else (ids[n_acc, pick[n_acc]] if pick[n_acc] < 2 else 9)
            out.append(_round(s, r, ids, n_acc, bonus))
            if n_acc + 1 < P and bonus == ids[n_acc, 1]:
                after = rng.choice(3, p=[*(rho * Q), 1 - rho * Q.sum()])
                forced = int(ids[n_acc + 1, after]) if after < 2 else 8
    return out


def test_linear_runs_measure_the_share_below_an_off_chain_node():
    rng = np.random.default_rng(5)
    runs = _off_chain_runs(rng, rho=0.4)
    where, hits = off_chain_trials(runs, 2)
    assert len(where) > 300 and hits.shape == (len(where), 2)
    assert all(d == rec.num_accepted + 2 for rec, d in where)
    cal = fit_calibration(runs, context=False, topk=2)
    fitted = fit_off_chain_scale(cal, runs, topk=2)
    assert fitted.trials == len(where)
    assert fitted.scale == pytest.approx([0.4, 0.4], abs=0.12)        # the rate the runs were drawn with
    assert np.all(fitted.hits == hits.sum(0))
    # nothing follows an off-chain bonus that the chain proposed: share 0
    none = fit_off_chain_scale(cal, _off_chain_runs(np.random.default_rng(6), rho=0.0), topk=2)
    assert none.scale == pytest.approx([0.0, 0.0], abs=0.03)


def test_a_share_below_off_chain_nodes_scores_a_tree_as_the_sampler_draws_it():
    # root - chain 0 - 0 ; an off-chain rank-1 node at depth 1 with children of ranks 0 and 1
    tree = DraftTree(np.array([-1, 0, 1, 0, 3, 3]), np.array([0, 0, 0, 1, 0, 1]))
    table = np.array([[0.5, 0.3], [0.6, 0.2], [0.6, 0.2]])
    scale = np.array([0.25, 0.5])
    exact = expected_accepted_ranked(tree, table, scale)
    assert exact == pytest.approx(0.5 + 0.5 * 0.6 + 0.3 + 0.3 * (0.25 * 0.6 + 0.5 * 0.2))
    drawn = sample_accepted_length(tree, np.random.default_rng(0), 200_000, marginal_tokens=rank_tokens(table),
                                   marginal_probs=table, chain_marginals=scale).mean()
    assert drawn == pytest.approx(exact, abs=0.005)
    never = expected_accepted_ranked(tree, table, True)
    assert never == pytest.approx(expected_accepted_ranked(tree, table, np.zeros(2))) == pytest.approx(1.1)
    drawn_never = sample_accepted_length(tree, np.random.default_rng(0), 100_000, marginal_tokens=rank_tokens(table),
                                         marginal_probs=table, chain_marginals=True).mean()
    assert drawn_never == pytest.approx(never, abs=0.005)
    # a model with the share: marginal trees gain, chains are unchanged
    tables = np.tile(table[None, :, :], (1, 1, 1))
    base = AcceptanceModel("m", tables, np.ones(1), chain_marginals=True)
    shared = AcceptanceModel("m", tables, np.ones(1), chain_marginals=True, off_chain_scale=scale)
    bf = {"budget": 6, "width": 1, "draft_depth": 3}
    assert accepted_per_round(shared, "best_first", bf) > accepted_per_round(base, "best_first", bf)
    assert accepted_per_round(shared, "linear", {"budget": 4}) == accepted_per_round(base, "linear", {"budget": 4})
    with pytest.raises(SimtreeError, match="off_chain_scale"):
        AcceptanceModel("m", tables, np.ones(1), chain_marginals=True, off_chain_scale=np.array([1.5, 0.0]))


def _text_runs(rng, feature: np.ndarray, beta: float, rounds: int = 40, P: int = 4):
    """Linear runs whose top-1 is taken w.p. expit(logit(q) + beta * feature[seq]) (else rank 1
    w.p. its q): a drafter less sure than it is right where the text state is high."""
    out, qs = [], []
    for s, c in enumerate(feature):
        for r in range(rounds):
            q0 = rng.uniform(0.35, 0.85, P)
            q = np.stack([q0, 0.5 * (1 - q0)], 1)
            take0 = rng.random(P) < expit(logit(q0) + beta * c)
            take1 = ~take0 & (rng.random(P) < q[:, 1])
            pick = np.where(take0, 0, np.where(take1, 1, 2))
            ids = 100 * (1000 * s + r) + 10 * np.arange(1, P + 1)[:, None] + np.arange(2)[None, :]
            n_acc = int(np.argmax(pick != 0)) if (pick != 0).any() else P
            bonus = 7 if n_acc == P else (ids[n_acc, pick[n_acc]] if pick[n_acc] < 2 else 9)
            out.append(parse_record({
                "schema": "simtree.trace/2", "workload": "w", "batch_size": 1, "round": r, "seq": s,
                "mode": "linear", "context_len": 50 + r, "parents": list(range(-1, P)), "tokens": [0, *ids[:, 0].tolist()],
                "log_probs": [0.0, *np.log(q0).tolist()], "accepted_node": n_acc,
                "target_tokens": [*ids[:n_acc, 0].tolist(), int(bonus)], "topk_tokens": ids.tolist(),
                "topk_probs": q.tolist()}, "synthetic"))
            qs.append((s, r, q))
    return out, qs


def test_the_text_state_carries_acceptance_to_text_the_calibration_saw_little_of():
    rng = np.random.default_rng(3)
    chat_feature = np.where(np.arange(60) < 48, 0.1, 0.9)      # chat: a few sequences of code-like text
    chat, _ = _text_runs(rng, chat_feature, beta=1.2)
    text = lambda rec: float(chat_feature[rec.seq])            # noqa: E731
    with_text = fit_calibration(chat, context=False, topk=2, text=text)
    plain = fit_calibration(chat, context=False, topk=2)
    assert plain.text_terms is None and with_text.text_terms.shape == (2, 2)
    assert with_text.text_terms[0, 1] == pytest.approx(1.2, abs=0.45)       # the slope it was drawn with
    # code: every sequence code-like; its drafts carry the state, no outcome
    code_feature = np.full(30, 0.9)
    code, qs = _text_runs(rng, code_feature, beta=1.2)
    drafts = parse_drafts([{"schema": "simtree.drafts/1", "workload": "code", "seq": s, "position": r,
                            "topk_probs": q.tolist()} for s, r, q in qs])
    drafts = replace(drafts, text=np.full(drafts.size, 0.9))
    measured = float(np.mean([r.num_accepted + 1 for r in code]))
    # the round starts of the drafts here are the synthetic rounds: every position is one
    err_plain = accepted_per_round(transfer_model(plain, drafts), "linear", {"budget": 5}) / measured - 1
    err_text = accepted_per_round(transfer_model(with_text, drafts), "linear", {"budget": 5}) / measured - 1
    assert err_plain < -0.05 and abs(err_text) < abs(err_plain) / 2
    with pytest.raises(SimtreeError, match="text state"):
        transfer_model(with_text, replace(drafts, text=None))


def test_the_share_of_non_words_is_read_over_the_last_tokens():
    is_word = np.array([True, True, False])           # token 2 is not a word; ids past the mask are not either
    share = context_nonword_share([0, 1, 2, 2, 5, 0], is_word, np.arange(7), window=2)
    assert share == pytest.approx([0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 0.5])


def test_two_linear_runs_of_one_chain_length_are_each_read_by_their_name():
    """Runs given by name are grouped per run: two runs of the same chain length (one seq each)
    both count, where one file's records of both repeat a round and were dropped."""
    a, b = _off_chain_runs(np.random.default_rng(7), rho=0.4), _off_chain_runs(np.random.default_rng(8), rho=0.4)
    one, two = off_chain_trials({"a": a}, 2)[1], off_chain_trials({"b": b}, 2)[1]
    both = off_chain_trials({"a": a, "b": b}, 2)[1]
    assert len(both) == len(one) + len(two) > 0
    assert len(off_chain_trials([*a, *b], 2)[1]) == 0          # one file: the repeated rounds dropped
    with pytest.raises(SimtreeError, match="repeats a round of sequence 0"):
        off_chain_trials({"ab": [*a, *b]}, 2)


def test_the_text_state_reads_the_linear_runs_tokens_only_when_they_are_the_drafting_passs():
    """acceptance_oos_text.text_features rebuilds each context from the linear run's tokens: with
    the half's lossless check (linear run and drafting pass equal to plain decoding) it gives every
    drafted position's text state; without it, one line."""
    from types import SimpleNamespace

    from simtree.acceptance.transfer import DrafterConfidences
    from simtree.runtime.acceptance_oos_text import text_features
    is_word = np.array([True, False] * 4)            # odd tokens are not words
    # one sequence, prompt [0, 0]; rounds at context 2 and 4: roots 1 then 3, each round's targets
    recs = [SimpleNamespace(seq=0, round_index=0, context_len=2, tree=SimpleNamespace(tokens=np.array([1])),
                            target_tokens=np.array([2, 3])),
            SimpleNamespace(seq=0, round_index=1, context_len=4, tree=SimpleNamespace(tokens=np.array([3])),
                            target_tokens=np.array([5]))]
    drafts = DrafterConfidences("w", np.array([0, 0]), np.array([0, 2]), np.zeros((2, 1, 1)), np.array([2, 4]))
    half = {"runs": {"linear_d16": {"records": recs}}, "drafts": drafts,
            "lossless": {"linear_d16": True, "drafting_pass": True}}
    at, with_text = text_features(half, [[0, 0]], is_word, "linear_d16", window=4)
    # context [0, 0, 1, 2, 3, 5]: the cache's tokens and the root, the last 4 of them
    assert with_text.text.tolist() == [pytest.approx(1 / 3), pytest.approx(2 / 4)]
    assert at(recs[1]) == with_text.text[1]
    half["lossless"]["drafting_pass"] = False
    with pytest.raises(SimtreeError, match="both must equal plain decoding"):
        text_features(half, [[0, 0]], is_word, "linear_d16")
