"""Accepted tokens per round of a block drafter's run, from what it drafted and a fitted model.

A block drafter (``block``, ``dspark``) drafts every position of its block at once: the
marginals at positions 1..P (``topk_tokens`` / ``topk_probs`` of a trace record) do not depend
on the drafted prefix, and the round's tree is built from them (best-first over the marginals;
DSpark: the verified prefix of its greedy chain, ``verified_len`` chosen by its confidences).
So a round's drafter-side state - its tree and its marginals (and DSpark's confidence head),
held before verification - is in the record, and a model fitted on other prompts' outcomes
turns it into the round's expected accepted drafts:

    E[accepted] = sum over drafted nodes of prod over their path of a(node)

the ranks of one node's children made disjoint events (each takes at most what the
higher-ranked siblings leave: the target takes one token).  The run's prediction is the mean
over its rounds plus the bonus token; nothing of the round's outcome is read (``target_tokens``,
``accepted_node``, ``marginal_ranks``).  The rounds are the run's own: where a round begins
depends on the rounds before it.

``a(node)`` (:func:`fit_drafted_model`, docs/acceptance.md section 5, "the block drafters"):

- the calibration a(d, r, q) (:class:`simtree.acceptance.fit.ChainCalibration`: depth, rank in
  the marginal, draft probability), with a curve per *parent state*: whether the node's parent
  is the drafter's top-1 at its position (or the root) or another of its candidates.  The
  marginals are the drafter's over every prefix: after a runner-up token the next position's
  top-1 continues the text the drafter thought likelier, and the target takes it far less often;
- the round's ease as its marginals show it (``FEATURES``): the node's *margin* (the log ratio of
  its draft probability to the best other candidate's at its position: a top-1 far ahead of the
  runner-up is text the drafter knows) and DSpark's *confidence head* at the node's depth where
  the records carry it; one logit coefficient per feature and rank group, with the depth cells
  refitted beside them, by logistic regression on the calibrating run's positions (the
  calibration's logit the offset);
- one logit shift past the first depth, fitted so that the calibrating run's own rounds gain what
  they measured (:func:`fit_depth_shift`): what of the positions' joint acceptance within a round
  the features do not carry.

All of it is fitted on the calibrating run's outcomes alone (a block drafter's records are
observed at every position their ``marginal_ranks`` cover).  A bare calibration (any
``calibration(depth, q)`` callable) is the model without parent states, features and shift.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from simtree.acceptance.fit import ChainCalibration, fit_calibration
from simtree.acceptance.mixture import DEFAULT_DEPTH, DEFAULT_TOPK
from simtree.acceptance.text_state import offset_logistic
from simtree.acceptance.traces import TraceRecord, chain_trials
from simtree.errors import SimtreeError

__all__ = ["DraftedRoundModel", "fit_drafted_model", "round_expected_accepted", "drafted_accepted_per_round",
           "fit_depth_shift", "FEATURES"]

FEATURES = ("margin", "confidence")
_GROUPS = 3             # rank groups of the feature coefficients and depth cells: 0, 1, 2+
_RIDGE = 1.0            # L2 on the regression's coefficients (thousands of positions: a tie-breaker)
_EPS = 1e-6


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-9, 1 - 1e-9)
    return np.log(p) - np.log1p(-p)


@dataclass
class DraftedRoundModel:
    """a(node) = expit(logit calibration(depth, rank, q | parent state) + beta[g] . (x - x_mean)
    + cells[g, depth] + shift[depth]) for rank group g (module docstring); ``x``: the node's
    ``features``.  ``calibration``: any ``calibration(depth [R], q [R, K], match=None) -> [R, K]``
    (with ``parent_states`` it takes the parent state as its ``match``)."""

    calibration: object
    parent_states: bool = False
    features: tuple = ()
    feature_mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    beta: np.ndarray = field(default_factory=lambda: np.zeros((_GROUPS, 0)))
    cells: np.ndarray = field(default_factory=lambda: np.zeros((_GROUPS, 1)))
    shift: np.ndarray | None = None

    def logits(self, depth, rank, q, parent_off, x) -> np.ndarray:
        """[n] logits of drafted positions inside their marginal's top-K (depth >= 1; rank in the
        marginal; q its draft probability; parent_off: the parent is not the drafter's top-1 at
        its position; x [n, F]: the ``features``), the shift not applied."""
        K = int(rank.max(initial=0)) + 1
        Q = np.repeat(q[:, None], K, 1)
        match = np.repeat(parent_off.astype(np.int64)[:, None], K, 1) if self.parent_states else None
        a = self.calibration(depth, Q, match)[np.arange(depth.size), rank]
        g = np.minimum(rank, _GROUPS - 1)
        lg = _logit(a) + self.cells[g, np.minimum(depth, self.cells.shape[1]) - 1]
        if self.features:
            lg = lg + ((x - self.feature_mean) * self.beta[g]).sum(1)
        return lg


def _features(names, probs: np.ndarray, depth: np.ndarray, rank: np.ndarray, conf: np.ndarray | None) -> np.ndarray:
    """[n, F]: per position, the ``names`` of :data:`FEATURES` (``probs`` [n, P, K]: the round's
    marginals; ``conf`` [n, P] or None: DSpark's confidence head)."""
    n = depth.size
    ix, d0 = np.arange(n), depth - 1
    cols = []
    for name in names:
        if name == "margin":
            K = probs.shape[2]
            own = probs[ix, d0, np.minimum(rank, K - 1)]
            other = probs[ix, d0, 1] if K > 1 else np.zeros(n)
            other = np.where(rank == 0, other, probs[ix, d0, 0])
            cols.append(np.log(np.maximum(own, _EPS) / np.maximum(other, _EPS)))
        elif name == "confidence":
            cols.append(_logit(np.clip(conf[ix, d0], 1e-4, 1 - 1e-4)))
        else:
            raise SimtreeError(f"unknown feature {name!r}: expected one of {', '.join(FEATURES)}")
    return np.stack(cols, 1) if cols else np.zeros((n, 0))


def _confidences(records, rows) -> np.ndarray | None:
    """[len(rows), P]: DSpark's confidence head of each row's record; None where one carries none."""
    if any(records[i].confidence is None for i in np.unique(rows)):
        return None
    return np.stack([records[i].confidence for i in rows]) if len(rows) else np.zeros((0, 1))


class _Rounds:
    """Every drafted node of ``records`` flattened: its round, parent, depth and logit under
    ``model`` (-inf for a token outside its marginal's top-K), siblings by rank."""

    def __init__(self, model: DraftedRoundModel, records: Sequence[TraceRecord]):
        parents, depths, ranks, qs, offs, rids, base = [], [], [], [], [], [], 0
        for i, rec in enumerate(records):
            tree, toks, probs = rec.tree, rec.topk_tokens, rec.topk_probs
            if toks is None:
                raise SimtreeError("a block drafter's trace record carries no topk_tokens: nothing to score its tree with")
            P, K = toks.shape
            if int(tree.max_depth) > P:
                raise SimtreeError(f"a round's tree reaches depth {int(tree.max_depth)} past its {P} drafted marginals")
            depth = np.asarray(tree.depth, np.int64)
            match = toks[np.maximum(depth, 1) - 1] == np.asarray(tree.tokens)[:, None]      # [N, K]
            rank = np.where(match.any(1), match.argmax(1), K)
            par = np.asarray(tree.parents)
            parents.append(np.where(np.arange(tree.num_nodes) > 0, par + base, -1))
            depths.append(depth)
            ranks.append(rank)
            qs.append(np.where(rank < K, probs[np.maximum(depth, 1) - 1, np.minimum(rank, K - 1)], 0.0))
            offs.append((depth > 1) & (rank[np.maximum(par, 0)] > 0))
            rids.append(np.full(tree.num_nodes, i))
            base += tree.num_nodes
        self.rounds = len(records)
        self.parent, self.depth, rank = np.concatenate(parents), np.concatenate(depths), np.concatenate(ranks)
        self.round_id = np.concatenate(rids)
        self.order = np.lexsort((rank, self.parent))          # siblings together, by rank
        drafted = np.flatnonzero(self.depth > 0)
        d, r = self.depth[drafted], rank[drafted]
        K = max(int(records[0].topk_tokens.shape[1]), 1) if records else 1
        x = np.zeros((drafted.size, len(model.features)))
        if model.features:
            rows = self.round_id[drafted]
            conf = _confidences(records, rows) if "confidence" in model.features else None
            if "confidence" in model.features and conf is None:
                raise SimtreeError("the model reads the drafter's confidence head, and a record carries none")
            x = _features(model.features, np.stack([records[i].topk_probs for i in rows]), d, np.minimum(r, K - 1),
                          conf)
        self.logit = np.full(self.depth.size, np.inf)          # the roots: always there
        inside = r < K
        lg = np.full(drafted.size, -np.inf)
        if inside.any():
            lg[inside] = model.logits(d[inside], r[inside], np.concatenate(qs)[drafted][inside],
                                      np.concatenate(offs)[drafted][inside], x[inside])
        self.logit[drafted] = lg

    def reach(self, shift: np.ndarray | None = None) -> np.ndarray:
        """[N]: each node's chance to be on the accepted path (roots 1), the logit moved by
        ``shift[depth - 1]``."""
        lg = self.logit if shift is None else self.logit + np.r_[0.0, shift][np.minimum(self.depth, len(shift))]
        a = np.where(self.depth > 0, 1.0 / (1.0 + np.exp(-lg)), 1.0)
        # disjoint siblings: each takes at most what the higher-ranked ones leave
        o = self.order
        sa, sp = a[o], self.parent[o]
        cum = np.cumsum(sa)
        first = np.r_[True, sp[1:] != sp[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(sa.size), 0))
        above = cum - sa - (cum[start] - sa[start])
        capped = np.empty_like(a)
        capped[o] = np.minimum(sa, np.maximum(1.0 - np.minimum(above, 1.0), 0.0))
        capped[self.depth == 0] = 1.0
        out = capped.copy()
        for d in range(1, int(self.depth.max(initial=0)) + 1):
            at = np.flatnonzero(self.depth == d)
            out[at] = out[self.parent[at]] * capped[at]
        return out

    def by_depth(self, shift: np.ndarray | None = None) -> np.ndarray:
        """[D]: mean over the rounds of the chance to accept a draft at depth 1..D."""
        r = self.reach(shift)
        return np.bincount(self.depth, r, minlength=2)[1:] / max(self.rounds, 1)


def _as_model(model) -> DraftedRoundModel:
    return model if isinstance(model, DraftedRoundModel) else DraftedRoundModel(model)


def round_expected_accepted(model, record: TraceRecord, shift: np.ndarray | None = None) -> float:
    """Expected accepted drafts of one round (bonus not counted): its tree's nodes scored by
    ``model`` (a :class:`DraftedRoundModel` or a bare calibration) from the round's marginals (a
    node's rank: its token's place in the marginal at its depth; a token outside the top-K is
    never accepted); ``shift``: in place of the model's."""
    return float(drafted_accepted_per_round(model, [record], shift) - 1.0)


def drafted_accepted_per_round(model, records: Sequence[TraceRecord], shift: np.ndarray | None = None) -> float:
    """Mean tokens a sequence gains per round (expected accepted drafts + the bonus) over the
    run's ``records``, each round scored by :func:`round_expected_accepted`."""
    if not records:
        raise SimtreeError("no trace records to predict")
    model = _as_model(model)
    return 1.0 + float(_Rounds(model, records).by_depth(model.shift if shift is None else shift).sum())


def fit_depth_shift(model, records: Sequence[TraceRecord], iters: int = 50) -> np.ndarray:
    """[D] logit shifts (0 at depth 1, one value ``s`` past it) with which the calibrating run's
    own rounds gain what they measured under ``model`` (its own shift ignored): the positions of
    a round are accepted together more often than the product of their acceptances says (an easy
    stretch of text is easy at every position) as far as the model's features do not carry it.
    Reads the calibrating run's outcomes only."""
    rounds = _Rounds(_as_model(model), records)
    D = int(rounds.depth.max(initial=0))
    if D < 2:                                     # no depth past the first drafted: nothing to shift
        return np.zeros(D)
    target = float(np.mean([r.num_accepted for r in records]))
    lo, hi = -8.0, 8.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rounds.by_depth(np.r_[0.0, np.full(D - 1, mid)]).sum() < target else (lo, mid)
    return np.r_[0.0, np.full(D - 1, 0.5 * (lo + hi))]


def fit_drafted_model(records: Sequence[TraceRecord], *, parent_states: bool = True, features=FEATURES,
                      shift: bool = True, topk: int = DEFAULT_TOPK) -> DraftedRoundModel:
    """The model of the module docstring from one calibrating run's ``records`` (a block drafter's,
    with ``marginal_ranks``): ``parent_states`` (a calibration curve per parent state), the
    ``features`` of :data:`FEATURES` (``confidence`` only where every record carries the drafter's
    confidence head), ``shift`` (:func:`fit_depth_shift`).  Without parent states and features it
    is :func:`simtree.acceptance.fit.fit_calibration` (and the shift)."""
    records = list(records)
    if not records:
        raise SimtreeError("no calibrating records to fit a block drafter's model on")
    if any(r.marginal_ranks is None for r in records):
        raise SimtreeError("a calibrating record carries no marginal_ranks: not a block drafter's run")
    features = tuple(f for f in features if f != "confidence" or all(r.confidence is not None for r in records))
    trials = chain_trials(records, topk)
    if trials.size == 0:
        raise SimtreeError("the calibrating run holds no observed position: nothing to calibrate")
    # the parent state of each observed position: the target's token at the position before it
    # was not the drafter's top-1 there
    off = np.array([bool(d > 1 and records[i].marginal_ranks[d - 2] > 0) for i, d in zip(trials.round_id, trials.depth)],
                   bool)
    if parent_states:
        # the calibration's state slot (``match``) holds the parent state
        model = DraftedRoundModel(ChainCalibration(trials, DEFAULT_DEPTH, 20.0, off, topk), parent_states=True)
    else:
        model = DraftedRoundModel(fit_calibration(records, context=False, topk=topk))
    if features:
        x = _features(features, np.stack([records[i].topk_probs for i in trials.round_id]), trials.depth, trials.rank,
                      _confidences(records, trials.round_id) if "confidence" in features else None)
        mean = x.mean(0)
        base = model.logits(trials.depth, trials.rank, trials.draft_prob, off, np.zeros((trials.size, 0)))
        g = np.minimum(trials.rank, _GROUPS - 1)
        D = int(trials.depth.max())
        X = np.concatenate([(x - mean) * (g == k)[:, None] for k in range(_GROUPS)]
                           + [((g == k)[:, None] & (trials.depth[:, None] - 1 == np.arange(D))).astype(np.float64)
                              for k in range(_GROUPS)], 1)
        b = offset_logistic(base, trials.hit.astype(np.float64), X, _RIDGE)
        F = len(features)
        model = DraftedRoundModel(model.calibration, model.parent_states, features, mean,
                                  b[:_GROUPS * F].reshape(_GROUPS, F), b[_GROUPS * F:].reshape(_GROUPS, D))
    if shift:
        model.shift = fit_depth_shift(model, records)
    return model
