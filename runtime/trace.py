"""Acceptance traces: JSONL, one record per decode round per sequence.

Each line is a JSON object:

    schema          "simtree.trace/1"
    workload        str   workload name (e.g. "sharegpt", "humaneval")
    batch_size      int   sequences in the batch that round
    round           int   decode round index (0-based)
    seq             int   sequence index within the batch
    mode            str   policy mode that built the tree (none/linear/eagle/...)
    context_len     int   tokens in the target cache before the round (root excluded)
    parents         [int] the draft tree's parent array (topological, parents[0] = -1)
    log_probs       [float] draft log-prob of each node given its parent (root 0.0): the
                    draft scores; cumulative sums along a path give the EAGLE score
    accepted_node   int   local index of the last accepted node (0 = only the root)
    num_accepted    int   accepted draft tokens = depth of accepted_node (root and bonus
                    token excluded); ``accepted_length`` repeats it
    accepted_path   [int] node indices root..accepted_node
    marginal_probs  [[float]] optional, marginal modes only: the drafter's top-K probabilities
                    per position [P][K] (rows sorted desc) that the tree was built from

This is the format simtree.acceptance.model.read_traces validates (fit_positional reads parents,
log_probs, accepted_node; fit_marginals reads marginal_probs); use that reader.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from simtree.fileio import file_mode_for


__all__ = ["TraceWriter", "TRACE_SCHEMA"]

TRACE_SCHEMA = "simtree.trace/1"


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

    def write_round(self, batch, acc, *, workload: str, batch_size: int, round_index: int, mode: str,
                    context_lens, marginal_probs=None) -> None:
        """batch: TreeBatch; acc: simtree.trees.greedy.BatchAcceptResult of that batch;
        marginal_probs: optional float [B, P, K]."""
        for b, tree in enumerate(batch.trees):
            res = acc.result(b)
            rec = {"schema": TRACE_SCHEMA, "workload": workload, "batch_size": int(batch_size),
                   "round": int(round_index), "seq": b, "mode": mode, "context_len": int(context_lens[b]),
                   "parents": tree.parents.tolist(), "log_probs": [round(float(x), 6) for x in tree.log_probs],
                   "accepted_node": int(acc.last_node[b]), "num_accepted": int(res.num_accepted),
                   "accepted_length": int(res.num_accepted), "accepted_path": res.path.tolist()}
            if marginal_probs is not None:
                rec["marginal_probs"] = [[round(float(x), 6) for x in row] for row in marginal_probs[b]]
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
