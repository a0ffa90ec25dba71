"""Acceptance traces: JSONL, one record per decode round per sequence (format v2).

Each line is a JSON object (docs/acceptance.md has the full table and an example):

    schema          "simtree.trace/2"
    workload        str   workload name (e.g. "sharegpt", "humaneval")
    batch_size      int   sequences in the batch that round
    round, seq      int   decode round index (0-based) and sequence index within the batch
    mode            str   policy mode that built the tree (none/linear/eagle/...)
    context_len     int   tokens in the target cache before the round (root excluded)
    parents         [int] the draft tree's parent array (topological, parents[0] = -1)
    tokens          [int] draft token id of each node (tokens[0]: the root, the last output token)
    log_probs       [float] draft log-prob of each node given its parent (root 0.0)
    ranks           [int] each node's rank among its siblings by draft log-prob (0 = the
                    drafter's best candidate; root 0)
    accepted_path   [int] node indices root..accepted_node
    accepted_node   int   the last accepted node (0 = only the root)
    num_accepted    int   accepted draft tokens = depth of accepted_node (bonus excluded)
    target_tokens   [int] the target's greedy token at each node of accepted_path: the next
                    accepted draft token, and last the token the target wanted at the first
                    mismatch (the bonus token); len = num_accepted + 1
    topk_tokens     [[int]] optional [P][K]: the drafter's top-K token ids at each drafted
    topk_probs      [[float]] position 1..P of its greedy chain (linear and marginal modes), probs
                    sorted desc; with target_tokens they say which rank a wider tree would
                    have needed at every depth the chain reached
    drafter         str   optional: the drafter family (mtp, block, tfm, dspark)
    marginal_ranks  [int] optional, block drafters: the rank of the target's token in the marginal
                    of position 1..m (m = positions whose target token is known; K: not in the top-K)
    confidence      [float] optional, DSpark: the confidence head's prediction per block position
    verified_len    int   optional, DSpark: the positions the round verified

Version 1 records (``simtree.trace/1``: no tokens / ranks / target_tokens / topk, optional
``marginal_probs``) are still read by :func:`simtree.acceptance.traces.read_traces`.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from simtree.acceptance.phi import sibling_rank
from simtree.acceptance.traces import marginal_ranks_of
from simtree.fileio import file_mode_for


__all__ = ["TraceWriter", "TRACE_SCHEMA", "round_records"]

TRACE_SCHEMA = "simtree.trace/2"


def round_records(batch, acc, *, workload: str, batch_size: int, round_index: int, mode: str, context_lens,
                  topk=None, drafter: str | None = None, confidence=None, verified_len=None) -> list[dict]:
    """One record per sequence of a round (module docstring).  batch: TreeBatch; acc:
    simtree.trees.greedy.BatchAcceptResult of that batch; topk: optional (token ids int [B, P, K],
    probs float [B, P, K]) of the drafter's chain, or of a block drafter's marginals (``drafter``
    "block", "tfm" or "dspark": the record then carries the target token's rank in each
    position's marginal); confidence: optional float [B, P] of DSpark's confidence head,
    verified_len int [B] its verified prefix."""
    out = []
    for b, tree in enumerate(batch.trees):
        res = acc.result(b)
        rec = {"schema": TRACE_SCHEMA, "workload": workload, "batch_size": int(batch_size),
               "round": int(round_index), "seq": b, "mode": mode, "context_len": int(context_lens[b]),
               "parents": tree.parents.tolist(), "tokens": tree.tokens.tolist(),
               "log_probs": [round(float(x), 6) for x in tree.log_probs],
               "ranks": sibling_rank(tree).tolist(), "accepted_path": res.path.tolist(),
               "accepted_node": int(acc.last_node[b]), "num_accepted": int(res.num_accepted),
               "target_tokens": [*res.accepted_tokens.tolist(), int(res.bonus_token)]}
        if topk is not None:
            rec["topk_tokens"] = topk[0][b].tolist()
            rec["topk_probs"] = [[round(float(x), 6) for x in row] for row in topk[1][b]]
        if drafter is not None:
            rec["drafter"] = drafter
            if topk is not None and drafter != "mtp":
                rec["marginal_ranks"] = marginal_ranks_of(np.asarray(topk[0][b]),
                                                          np.asarray(rec["target_tokens"])).tolist()
        if confidence is not None:
            rec["confidence"] = [min(max(round(float(x), 6), 0.0), 1.0) for x in confidence[b]]
        if verified_len is not None:
            rec["verified_len"] = int(verified_len[b])
        out.append(rec)
    return out


class TraceWriter:
    """Append-only JSONL writer; use as a context manager.

    ``staged=True``: the records go to a hidden temp file beside ``path`` (``tmp_path``) and
    reach ``path`` only on :meth:`commit` (an atomic rename), so an interrupted run never
    leaves a partial trace file where a finished run's results are read; :meth:`discard`
    (and leaving the context with an exception) removes the temp file."""

    def __init__(self, path, staged: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if staged:   # a name of its own: two runs into one folder do not share a temp file
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".partial", dir=self.path.parent)
            self.tmp_path = Path(tmp)
            os.fchmod(fd, file_mode_for(self.path))   # mkstemp's 0o600 would reach the final file
            self._fh = os.fdopen(fd, "w", encoding="utf-8")
        else:
            self.tmp_path = self.path
            self._fh = open(self.tmp_path, "w", encoding="utf-8")

    def write_records(self, records) -> None:
        for rec in records:
            self._fh.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()

    def commit(self) -> Path:
        """Close and move the staged records to ``path`` (atomic); returns ``path``."""
        self.close()
        if self.tmp_path != self.path:
            os.replace(self.tmp_path, self.path)
        return self.path

    def discard(self) -> None:
        """Close and remove the staged records (a no-op for an unstaged writer's file)."""
        self._fh.close()
        if self.tmp_path != self.path:
            self.tmp_path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None and self.tmp_path != self.path:
            self.discard()
        else:
            self.close()
