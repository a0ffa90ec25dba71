"""Trace records of the round an engine ran last: the one builder of live runs' traces.

    rec = engine.last_round()        # FullEngine or BlockEngine: the round's buffers on the host
    records = round_records(rec, workload="sharegpt", round_index=i, mode="eagle", context_lens=ctx)

``generate(..., trace=)`` writes every round's records to a ``TraceWriter``, or keeps them in a
:class:`RecordList`.

The round's trees lose their padding (and a DSpark chain the positions it did not verify: the
valid nodes are closed under parents); the host's greedy acceptance of those trees must give
the engine's accepted nodes, and the records (``simtree.trace/2``, :func:`simtree.runtime.trace.round_records`)
carry what the drafter adds: the MTP layer's top-K along its chain, a block drafter's marginals
(with the target token's rank in each), DSpark's confidences and verified prefix.
"""
from __future__ import annotations

import numpy as np

from simtree.errors import SimtreeError
from simtree.runtime.trace import round_records as trace_records
from simtree.trees.greedy import greedy_accept_batch
from simtree.trees.tree import DraftTree, TreeBatch

__all__ = ["round_trees", "round_records", "RecordList"]


class RecordList(list):
    """Trace records kept in memory: a trace sink for ``generate(..., trace=)`` (a TraceWriter's
    ``write_records``)."""

    def write_records(self, records) -> None:
        self.extend(records)


def round_trees(rec: dict) -> list[DraftTree]:
    """The round's trees without their padding (``rec``: ``last_round``)."""
    trees = []
    for b in range(rec["tokens"].shape[0]):
        keep = np.flatnonzero(rec["valid"][b])
        new = np.full(rec["valid"].shape[1], -1, np.int64)
        new[keep] = np.arange(keep.size)
        par = rec["parents"][b, keep]
        parents = np.where(par < 0, -1, new[np.maximum(par, 0)])
        score = rec["score"][b, keep].astype(np.float64)
        log_probs = score - np.where(par < 0, 0.0, rec["score"][b, np.maximum(par, 0)])
        log_probs[0] = 0.0
        trees.append(DraftTree(parents, rec["tokens"][b, keep], log_probs))
    return trees


def round_records(rec: dict, *, workload: str, round_index: int, mode: str, context_lens) -> list[dict]:
    """One trace record per sequence of the round ``rec`` (``last_round``) holds."""
    batch = TreeBatch(round_trees(rec))
    keep = [np.flatnonzero(v) for v in rec["valid"]]
    acc = greedy_accept_batch(batch, np.concatenate([rec["target_next"][b, k] for b, k in enumerate(keep)]))
    engine_nodes = [int(np.searchsorted(k, a)) for k, a in zip(keep, rec["accepted"])]
    if [int(x) for x in acc.last_node] != engine_nodes:    # the host's greedy acceptance is the engine's
        raise SimtreeError(f"round {round_index}: the engine accepted nodes {engine_nodes}, greedy acceptance of "
                           f"its trees gives {list(acc.last_node)}")
    topk = None
    if rec["marginals"] is not None:
        lp, ids = rec["marginals"]
        topk = (ids, np.exp(lp.astype(np.float64)))
    return trace_records(batch, acc, workload=workload, batch_size=len(keep), round_index=round_index, mode=mode,
                         context_lens=context_lens, topk=topk, drafter=rec["drafter"],
                         confidence=rec.get("confidence"), verified_len=rec.get("verified_len"))
