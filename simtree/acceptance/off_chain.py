"""How a chain drafter's node below an off-chain node is accepted, measured on linear runs.

A chain drafter (the MTP layer) drafts the marginal modes' trees from its marginals along its
own top-1 chain: a node below an off-chain node (a rank >= 1 candidate) carries a candidate the
drafter proposed after the chain's token, not after its parent's.  It is still accepted now and
then - after a variant of a name or a quote, the next token is often the same - and how often
is measured without any tree: in a linear run, a round whose bonus token is the drafter's
rank-r candidate (r >= 1) at depth n + 1 is such an off-chain node accepted, and the next round's
first target token is the token that followed it; the chain's candidates at depth n + 2 (drafted
after the chain's own token) are the nodes below it.  :func:`fit_off_chain_scale` compares
their hits with what the calibration gives the same candidates on the chain: the share per rank
that the transfer model keeps of its table below an off-chain node
(:attr:`simtree.acceptance.mixture.AcceptanceModel.off_chain_scale`).  It reads the linear runs'
outcomes only, as the calibration does.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np

from simtree.acceptance.fit import ChainCalibration, lookup_states
from simtree.acceptance.traces import TraceRecord
from simtree.errors import SimtreeError

__all__ = ["OffChainScale", "off_chain_trials", "fit_off_chain_scale", "PRIOR_EXPECTED_HITS"]

PRIOR_EXPECTED_HITS = 5.0    # each rank's share shrinks towards the pooled one with this many expected hits


@dataclass(frozen=True)
class OffChainScale:
    """``scale [K]``: the share of the calibrated acceptance a node below an off-chain node keeps,
    per rank; ``hits`` and ``expected [K]`` (the calibration's) it rests on; ``trials``: rounds
    whose bonus was an off-chain candidate with a drafted position after it."""

    scale: np.ndarray
    hits: np.ndarray
    expected: np.ndarray
    trials: int

    def as_dict(self) -> dict:
        return {"scale": np.round(self.scale, 4).tolist(), "hits": self.hits.astype(int).tolist(),
                "expected": np.round(self.expected, 2).tolist(), "trials": self.trials}


def _runs(records) -> list[list[TraceRecord]]:
    """Linear runs' records as sequences of consecutive rounds, sorted by round.  ``records``:
    {run name: its records} (one group per run and seq; a run repeating a round of a sequence
    stops the fit, one line), or one file's records (one group per (workload, chain length, seq);
    a group with a repeated round, two runs alike in one file, is dropped)."""
    named = isinstance(records, Mapping)
    groups = defaultdict(list)
    for name, recs in (records.items() if named else [(None, records)]):
        for r in recs:
            if r.topk_tokens is None or r.target_tokens is None or r.seq is None or r.round_index is None:
                continue
            groups[(name, r.seq) if named else (r.workload, r.topk_tokens.shape[0], r.seq)].append(r)
    out = []
    for key, g in groups.items():
        g.sort(key=lambda r: r.round_index)
        if len({r.round_index for r in g}) == len(g):
            out.append(g)
        elif named:
            raise SimtreeError(f"linear run {key[0]!r} repeats a round of sequence {key[1]}: two runs under one name")
    return out


Runs = Iterable[TraceRecord] | Mapping[str, Iterable[TraceRecord]]   # one file's records, or {run name: records}


def off_chain_trials(records: Runs, topk: int) -> tuple[list, np.ndarray]:
    """([(record, depth)], hits bool [T, topk]): for each round whose bonus token was the
    drafter's rank 1..topk-1 candidate at depth n + 1 and whose chain drafted depth n + 2, the
    chain's candidates at depth n + 2 against the token that followed the bonus (the next round's
    first target token)."""
    where, hits = [], []
    for run in _runs(records):
        for a, b in zip(run, run[1:]):
            if b.round_index != a.round_index + 1:
                continue
            n, toks = a.num_accepted, a.topk_tokens
            if n + 1 >= toks.shape[0]:
                continue
            rank = np.flatnonzero(toks[n, :topk] == a.target_tokens[n])
            if rank.size == 0 or rank[0] == 0:
                continue
            where.append((a, n + 2))
            hit = np.zeros(topk, bool)
            k = min(topk, toks.shape[1])
            hit[:k] = toks[n + 1, :k] == b.target_tokens[0]
            hits.append(hit)
    return where, np.array(hits, bool).reshape(-1, topk)


def fit_off_chain_scale(calibration: ChainCalibration, records: Runs, topk: int = 4,
                        text: Callable[[TraceRecord], float] | None = None) -> OffChainScale:
    """The share per rank (:class:`OffChainScale`) from linear ``records`` (:func:`_runs`; with the drafter's
    top-K, the target's tokens, ``seq`` and ``round``): hits below an off-chain node over what
    ``calibration`` expects of the same candidates on the chain (their draft probability,
    depth and lookup state; ``text``: each round's text feature where the calibration reads
    one), each rank shrunk towards the pooled share (:data:`PRIOR_EXPECTED_HITS`), at most 1.
    No such round: every share 0 (never accepted, the rule before)."""
    where, hits = off_chain_trials(records, topk)
    if not where:
        z = np.zeros(topk)
        return OffChainScale(z, z, z, 0)
    q = np.zeros((len(where), topk))
    match = np.zeros((len(where), topk), np.int64)
    for i, (rec, d) in enumerate(where):
        k = min(topk, rec.topk_probs.shape[1])
        q[i, :k] = rec.topk_probs[d - 1, :k]
        if calibration.matched:
            if rec.context_match is None:
                raise SimtreeError("the calibration reads the context lookup: every linear round needs context_match")
            match[i] = lookup_states(np.full(topk, rec.context_match[d - 1]), np.arange(topk), rec.topk_tokens.shape[1])
    depth = np.array([d for _, d in where])
    feature = None if text is None else np.array([text(rec) for rec, _ in where])
    expected = np.where(q > 0, calibration(depth, q, match if calibration.matched else None, text=feature), 0.0)
    e, h = expected.sum(0), hits.sum(0).astype(np.float64)
    pooled = h.sum() / max(e.sum(), 1e-12)
    scale = np.clip((h + PRIOR_EXPECTED_HITS * pooled) / (e + PRIOR_EXPECTED_HITS), 0.0, 1.0)
    return OffChainScale(scale, h, e, len(where))
