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
higher-ranked siblings leave: the target takes one token).  The run's prediction is the mean
over its rounds plus the bonus token; nothing of the round's outcome is read (``target_tokens``,
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

__all__ = ["round_expected_accepted", "drafted_accepted_per_round"]


def round_expected_accepted(calibration: ChainCalibration, record: TraceRecord) -> float:
    """Expected accepted drafts of one round (bonus not counted): its tree's nodes scored by the
    calibration from the round's marginals (a node's rank: its token's place in the marginal at
    its depth; a token outside the top-K is never accepted)."""
    tree, toks, probs = record.tree, record.topk_tokens, record.topk_probs
    if toks is None:
        raise SimtreeError("a block drafter's trace record carries no topk_tokens: nothing to score its tree with")
    P, K = toks.shape
    if tree.num_nodes < 2:
        return 0.0
    if int(tree.max_depth) > P:
        raise SimtreeError(f"a round's tree reaches depth {int(tree.max_depth)} past its {P} drafted marginals")
    rows = calibration(np.arange(1, P + 1), probs)                      # [P, K] a(d, r, q)
    depth = np.asarray(tree.depth, np.int64)
    node_toks = np.asarray(tree.tokens)
    match = toks[np.maximum(depth, 1) - 1] == node_toks[:, None]        # [N, K]
    rank = np.where(match.any(1), match.argmax(1), K)                   # K: outside the top-K
    reach, left = np.zeros(tree.num_nodes), np.ones(tree.num_nodes)     # left: what later siblings may take
    reach[0] = 1.0
    for n in np.lexsort((rank, depth)):                                 # parents first, siblings by rank
        if n == 0:
            continue
        parent, d = int(tree.parents[n]), int(depth[n])
        a = min(float(rows[d - 1, rank[n]]) if rank[n] < K else 0.0, left[parent])
        left[parent] -= a
        reach[n] = reach[parent] * a
    return float(reach[1:].sum())


def drafted_accepted_per_round(calibration: ChainCalibration, records: Sequence[TraceRecord]) -> float:
    """Mean tokens a sequence gains per round (expected accepted drafts + the bonus) over the
    run's ``records``, each round scored by :func:`round_expected_accepted`."""
    if not records:
        raise SimtreeError("no trace records to predict")
    return 1.0 + float(np.mean([round_expected_accepted(calibration, r) for r in records]))
