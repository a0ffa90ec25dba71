"""A chat calibration carried to code with a few of code's rounds (simtree.acceptance.workload_shift).

The synthetic code text is one where the target takes the drafter's top-1 far more often than
chat's calibration gives it at the same draft probability (as the trained target's MTP drafter
on code, docs/acceptance.md section 5, decision 9): a per-rank logit shift fitted on a share of
code's own linear rounds brings the transfer onto code runs it never read.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import expit

from simtree.acceptance.fit import fit_calibration
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.transfer import parse_drafts, transfer_model
from simtree.acceptance.workload_shift import (_base_logits, fit_workload_shift, sample_rounds,
                                               shifted_calibration)
from simtree.errors import SimtreeError
from test_acceptance_transfer import K, P, _drafts, _linear_records, _measured


def _text(rng, seqs: int, positions: int, top1_boost: float):
    """[seqs, positions, P, K] sorted draft probs and the target's rank at each (K: none); the
    target takes rank 0 with 0.15 + 1.3 q + ``top1_boost`` (capped), the others with 0.1 + q."""
    raw = rng.dirichlet(np.full(K + 1, 0.5), (seqs, positions + P))[..., :K]
    q = -np.sort(-raw, -1)
    acc = np.minimum(0.1 + q, 0.9) * (q > 0)
    acc[..., 0] = np.minimum(0.15 + 1.3 * q[..., 0] + top1_boost, 0.95)
    acc = np.minimum(acc, np.maximum(1.0 - np.concatenate([np.zeros((*acc.shape[:-1], 1)),
                                                           np.cumsum(acc, -1)[..., :-1]], -1), 0.0))
    u = rng.random((seqs, positions + P))[..., None]
    cum = np.cumsum(acc, -1)
    rank = np.where(u[..., 0] < cum[..., -1], (u >= cum).sum(-1), K)
    idx = np.arange(positions)[:, None] + np.arange(P)[None, :]
    return q[:, idx], rank[:, idx]


@pytest.fixture(scope="module")
def texts():
    rng = np.random.default_rng(5)      # fixed: statistical tolerances, a failure reproduces
    return _text(rng, 32, 40, 0.0), _text(rng, 32, 40, 0.3), _text(rng, 32, 40, 0.3)   # chat, code cal, code test


def test_a_few_code_rounds_carry_a_chat_calibration_to_code(texts):
    chat, code_cal, code_test = texts
    cal = fit_calibration(_linear_records(*chat), context=False)
    few = sample_rounds(_linear_records(*code_cal, "code"), 4, 0)
    shift = fit_workload_shift(cal, few, cells="rank")
    test = _linear_records(*code_test, "code")
    drafts = parse_drafts(_drafts(code_test[0]))
    measured = _measured(test)
    before = accepted_per_round(transfer_model(cal, drafts), "linear", {"budget": P + 1})
    after = accepted_per_round(transfer_model(shifted_calibration(cal, shift), drafts), "linear", {"budget": P + 1})
    assert before < 0.9 * measured                      # chat's calibration: code far too low
    assert abs(after / measured - 1) < 0.05             # shifted on a quarter of code's rounds
    assert shift.delta[0, 0] > 0.5 and shift.delta[1, 0] < 0     # the top-1 up; rank 1 down (what it leaves)
    assert shift.trials[0, 0] > 0 and shift.hits[0, 0] <= shift.trials[0, 0]


def test_the_shift_matches_the_hits_of_its_rounds_and_shrinks_where_thin(texts):
    chat, code_cal, _ = texts
    cal = fit_calibration(_linear_records(*chat), context=False)
    rounds = _linear_records(*code_cal, "code")
    for cells in ("global", "rank", "rank_lookup"):
        shift = fit_workload_shift(cal, rounds, cells=cells, prior_trials=0.0)
        trials, groups, _, base = _base_logits(cal, rounds)
        expected = expit(base + shift.delta[groups, 0])
        if cells == "global":
            assert np.allclose(shift.delta, shift.delta[0, 0])
            assert expected.sum() == pytest.approx(trials.hit.sum(), rel=1e-4)
        else:
            for g in range(shift.delta.shape[0]):
                assert expected[groups == g].sum() == pytest.approx(trials.hit[groups == g].sum(), rel=1e-3)
        shrunk = fit_workload_shift(cal, rounds, cells=cells, prior_trials=1e6)
        assert np.abs(shrunk.delta).max() < 0.05 * max(np.abs(shift.delta).max(), 1e-9) + 1e-3
    # no rounds: no shift; the shifted calibration is the calibration
    none = fit_workload_shift(cal, [], cells="rank")
    assert not none.delta.any()
    q = np.tile(np.linspace(0.05, 0.6, K)[::-1], (3, 1))
    assert np.allclose(shifted_calibration(cal, none)(np.array([1, 2, 3]), q), cal(np.array([1, 2, 3]), q), atol=1e-9)


def test_rounds_are_sampled_deterministically_and_bad_settings_refused(texts):
    rounds = _linear_records(*texts[1], "code")
    a, b = sample_rounds(rounds, 4, 0), sample_rounds(rounds, 4, 0)
    assert [id(r) for r in a] == [id(r) for r in b] and 0.15 * len(rounds) < len(a) < 0.35 * len(rounds)
    assert len({r.seq for r in a}) > 0.6 * len({r.seq for r in rounds})     # spread over the prompts, not the first
    cal = fit_calibration(_linear_records(*texts[0]), context=False)
    with pytest.raises(SimtreeError, match="unknown shift cells"):
        fit_workload_shift(cal, rounds, cells="depth")
    with pytest.raises(SimtreeError, match="share"):
        sample_rounds(rounds, 0)
    other = fit_workload_shift(fit_calibration(_linear_records(*texts[0]), context=False, rank_groups=2), rounds)
    with pytest.raises(SimtreeError, match="does not fit"):
        shifted_calibration(cal, other)
