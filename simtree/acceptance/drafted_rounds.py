"""Accepted tokens per round of a block drafter's run, from what it drafted and a calibration.

A block drafter (``block``, ``dspark``) drafts every position of its block at once: the
marginals at positions 1..P (``topk_tokens`` / ``topk_probs`` of a trace record) do not depend
on the drafted prefix, and the round's tree is built from them (best-first over the marginals;
DSpark: the verified prefix of its greedy chain, ``verified_len`` chosen by its confidences).
So a round's drafter-side state - its tree and its marginals, held before verification - is
in the record, and a calibration fitted on other prompts' outcomes
(:func:`simtree.acceptance.fit.fit_calibration`: a(d, r, q), the acceptance of the rank-r
candidate of draft probability q at position d given its parent was accepted; a block
drafter's records are observed at every position their ``marginal_ranks`` cover) turns it into
the round's expected accepted drafts:

    E[accepted] = sum over drafted nodes of prod over their path of a(depth, rank, q)

the ranks of one node's children made disjoint events (each takes at most what the
higher-ranked siblings leave: the target takes one token).  With :func:`fit_depth_shift` the
calibration's logits past the first depth move by one shift fitted on the calibrating run's own
outcomes (a round's positions are accepted together more often than the product says).  The
run's prediction is the mean over its rounds plus the bonus token; nothing of the round's outcome is read (``target_tokens``,
``accepted_node``, ``marginal_ranks``).  The rounds are the run's own: where a round begins
depends on the rounds before it (a drafting pass over plain decoding, as the MTP rows use,
would remove that).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from simtree.acceptance.fit import ChainCalibration
from simtree.acceptance.traces import TraceRecord
from simtree.errors import SimtreeError

__all__ = ["round_expected_accepted", "drafted_accepted_per_round", "fit_depth_shift"]


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-9, 1 - 1e-9)
    return np.log(p) - np.log1p(-p)


class _Rounds:
    """Every drafted node of ``records`` flattened: its round's root, parent, depth and calibrated
    logit (a(d, r, q); -inf for a token outside its marginal's top-K), siblings by rank."""

    def __init__(self, calibration: ChainCalibration, records: Sequence[TraceRecord]):
        parents, depths, logits, ranks, base = [], [], [], [], 0
        for rec in records:
            tree, toks, probs = rec.tree, rec.topk_tokens, rec.topk_probs
            if toks is None:
                raise SimtreeError("a block drafter's trace record carries no topk_tokens: nothing to score its tree with")
            P, K = toks.shape
            if int(tree.max_depth) > P:
                raise SimtreeError(f"a round's tree reaches depth {int(tree.max_depth)} past its {P} drafted marginals")
            depth = np.asarray(tree.depth, np.int64)
            match = toks[np.maximum(depth, 1) - 1] == np.asarray(tree.tokens)[:, None]      # [N, K]
            rank = np.where(match.any(1), match.argmax(1), K)
            rows = _logit(calibration(np.arange(1, P + 1), probs))                      # [P, K]
            lg = np.where(rank < K, rows[np.maximum(depth, 1) - 1, np.minimum(rank, K - 1)], -np.inf)
            parents.append(np.where(np.arange(tree.num_nodes) > 0, np.asarray(tree.parents) + base, -1))
            depths.append(depth)
            logits.append(lg)
            ranks.append(rank)
            base += tree.num_nodes
        self.rounds = len(records)
        self.parent, self.depth = np.concatenate(parents), np.concatenate(depths)
        self.logit, rank = np.concatenate(logits), np.concatenate(ranks)
        self.order = np.lexsort((rank, self.parent))          # siblings together, by rank

    def reach(self, shift: np.ndarray | None = None) -> np.ndarray:
        """[N]: each node's chance to be on the accepted path (roots 1), the calibrated logit
        moved by ``shift[depth - 1]``."""
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


def round_expected_accepted(calibration: ChainCalibration, record: TraceRecord, shift: np.ndarray | None = None
                            ) -> float:
    """Expected accepted drafts of one round (bonus not counted): its tree's nodes scored by the
    calibration from the round's marginals (a node's rank: its token's place in the marginal at
    its depth; a token outside the top-K is never accepted); ``shift``: :func:`fit_depth_shift`'s."""
    return float(_Rounds(calibration, [record]).by_depth(shift).sum())


def drafted_accepted_per_round(calibration: ChainCalibration, records: Sequence[TraceRecord],
                               shift: np.ndarray | None = None) -> float:
    """Mean tokens a sequence gains per round (expected accepted drafts + the bonus) over the
    run's ``records``, each round scored by :func:`round_expected_accepted`."""
    if not records:
        raise SimtreeError("no trace records to predict")
    return 1.0 + float(_Rounds(calibration, records).by_depth(shift).sum())


def fit_depth_shift(calibration: ChainCalibration, records: Sequence[TraceRecord], iters: int = 50) -> np.ndarray:
    """[D] logit shifts (0 at depth 1, one value ``s`` past it) with which the calibrating run's
    own rounds gain what they measured: the positions of a round are accepted together more
    often than the product of their calibrated acceptances says (an easy stretch of text is easy
    at every position; the calibration fits each position given its parent was accepted, pooled
    over rounds), which one shift past the first depth carries.  Reads the calibrating run's
    outcomes only."""
    rounds = _Rounds(calibration, records)
    D = int(rounds.depth.max(initial=0))
    if D < 2:                                     # no depth past the first drafted: nothing to shift
        return np.zeros(D)
    target = float(np.mean([r.num_accepted for r in records]))
    lo, hi = -8.0, 8.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rounds.by_depth(np.r_[0.0, np.full(D - 1, mid)]).sum() < target else (lo, mid)
    return np.r_[0.0, np.full(D - 1, 0.5 * (lo + hi))]
