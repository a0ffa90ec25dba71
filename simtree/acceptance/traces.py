"""Acceptance traces: read and check JSONL written by the runtime (``simtree run``), and turn
them into per-depth, per-rank acceptance trials.

One record per decode round per sequence; the format (versions 1 and 2) is in
docs/acceptance.md and in ``runtime/trace.py``, which writes version 2.  Version 2 adds the
draft token ids and ranks, the target's greedy token along the accepted path up to and at its
first mismatch (``target_tokens``) and, for runs that draft a greedy chain (linear and the
marginal modes), the drafter's top-K at every drafted position (``topk_tokens``,
``topk_probs``).  A linear record with top-K then says, for every depth its chain reached,
which rank of the drafter's candidates the target took: what a tree would have accepted
there (Sequoia's positional acceptance vectors).

Unknown keys are ignored; a malformed record raises a one-line SimtreeError naming the line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from simtree.acceptance.phi import sibling_rank
from simtree.errors import SimtreeError, TreeError, check_whole
from simtree.fileio import read_jsonl
from simtree.probs import check_prob_rows
from simtree.trees.tree import DraftTree

__all__ = ["TraceRecord", "Trials", "read_traces", "parse_record", "chain_trials", "tree_trials", "sequence_ids",
           "MAX_CONTEXT_LEN", "SCHEMAS", "DRAFTERS", "marginal_ranks_of"]

SCHEMAS = ("simtree.trace/1", "simtree.trace/2")
DRAFTERS = ("mtp", "block", "tfm", "dspark")   # who drafted a record's tree (optional field)
# 1M tokens is beyond today's longest context windows; larger values are typing errors
MAX_CONTEXT_LEN = 1 << 20


@dataclass(frozen=True, eq=False)
class TraceRecord:
    """One round of one sequence.  ``tree.tokens`` are zeros in version 1 records.

    target_tokens int64 [num_accepted + 1] or None   the target's greedy token at each accepted node
    topk_tokens   int64 [P, K] or None               the drafter's top-K per drafted chain position
    topk_probs    float64 [P, K] or None             their draft probabilities (rows sorted desc)
    drafter       str or None                        the drafter family (mtp, block, tfm, dspark)
    marginal_ranks int64 [m] or None                 block drafters: the rank of the target's token in
                                                     the marginal of position 1..m (K: not in its top-K)
    confidence    float64 [P] or None                DSpark: the confidence head's prediction per position
    verified_len  int or None                        DSpark: the positions the round verified
    context_match int64 [P] or None                  the rank among topk_tokens of the token a lookup
                                                     of the context proposes at each chain position
                                                     (K: none; :func:`simtree.acceptance.transfer.context_match`)
    """

    workload: str
    batch_size: int
    tree: DraftTree
    accepted_node: int
    context_len: int | None
    marginal_probs: np.ndarray | None
    round_index: int | None = None   # the record's "round" (0 = first round after the prompt)
    version: int = 1
    mode: str | None = None
    seq: int | None = None
    target_tokens: np.ndarray | None = None
    topk_tokens: np.ndarray | None = None
    topk_probs: np.ndarray | None = None
    drafter: str | None = None
    marginal_ranks: np.ndarray | None = None
    confidence: np.ndarray | None = None
    verified_len: int | None = None
    context_match: np.ndarray | None = None

    @property
    def num_accepted(self) -> int:
        return int(self.tree.depth[self.accepted_node])


def _int_list(obj, key: str, where: str, low: int | None = None) -> np.ndarray:
    """A list of integers (whole floats such as 4.0 included, as every integer of a record)."""
    value = obj[key]
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                          or not abs(v) < 2 ** 53 or v != int(v) for v in value):
        raise SimtreeError(f"{where}: {key} must be a list of integers")
    arr = np.asarray(value, np.float64).astype(np.int64)
    if low is not None and arr.size and arr.min() < low:
        raise SimtreeError(f"{where}: {key} holds {int(arr.min())} (must be >= {low})")
    return arr


def _table(obj, key: str, where: str, dtype) -> np.ndarray:
    try:
        arr = np.asarray(obj[key], dtype)
    except (TypeError, ValueError, OverflowError):
        raise SimtreeError(f"{where}: {key} is not a [P][K] table of numbers") from None
    if arr.ndim != 2 or arr.size == 0:
        raise SimtreeError(f"{where}: {key} must be a non-empty [P][K] table, got shape {arr.shape}")
    return arr


def _v2_fields(obj: dict, tree: DraftTree, node: int, where: str) -> dict:
    """The version 2 additions, checked against the tree and its accepted path."""
    out = {}
    if "tokens" in obj:
        tokens = _int_list(obj, "tokens", where, 0)
        if tokens.shape[0] != tree.num_nodes:
            raise SimtreeError(f"{where}: {tokens.shape[0]} tokens for a {tree.num_nodes}-node tree")
        out["tokens"] = tokens
    if "accepted_path" in obj:
        path = _int_list(obj, "accepted_path", where)
        if path.tolist() != tree.path_to(node).tolist():
            raise SimtreeError(f"{where}: accepted_path {path.tolist()} is not the tree path to accepted_node {node}")
    if "target_tokens" in obj:
        target = _int_list(obj, "target_tokens", where, 0)
        depth = int(tree.depth[node])
        if target.shape[0] != depth + 1:
            raise SimtreeError(f"{where}: target_tokens has {target.shape[0]} entries, expected num_accepted + 1 "
                               f"= {depth + 1} (one per accepted-path node)")
        if "tokens" in out and target[:-1].tolist() != out["tokens"][tree.path_to(node)[1:]].tolist():
            raise SimtreeError(f"{where}: target_tokens disagree with the accepted draft tokens")
        out["target_tokens"] = target
    if ("topk_tokens" in obj) != ("topk_probs" in obj):
        raise SimtreeError(f"{where}: topk_tokens and topk_probs come together")
    if "topk_tokens" in obj:
        toks = _table(obj, "topk_tokens", where, np.int64)
        probs = check_prob_rows(_table(obj, "topk_probs", where, np.float64), f"{where}: topk_probs", axis=1)
        if toks.shape != probs.shape:
            raise SimtreeError(f"{where}: topk_tokens {toks.shape} and topk_probs {probs.shape} differ in shape")
        if np.any(np.diff(probs, axis=1) > 1e-9):
            raise SimtreeError(f"{where}: topk_probs rows must be sorted in descending order (rank 0 first)")
        out["topk_tokens"], out["topk_probs"] = toks, probs
    out.update(_drafter_fields(obj, out, where))
    return out


def _drafter_fields(obj: dict, v2: dict, where: str) -> dict:
    """The block drafters' additions (docs/acceptance.md), checked against the top-K they came from."""
    out = {}
    if "drafter" in obj:
        if obj["drafter"] not in DRAFTERS:
            raise SimtreeError(f"{where}: drafter {obj['drafter']!r} is not one of {', '.join(DRAFTERS)}")
        out["drafter"] = obj["drafter"]
    if "marginal_ranks" in obj:
        ranks = _int_list(obj, "marginal_ranks", where, 0)
        target, toks = v2.get("target_tokens"), v2.get("topk_tokens")
        if target is not None and ranks.shape[0] > target.shape[0]:
            raise SimtreeError(f"{where}: {ranks.shape[0]} marginal_ranks but the target's token is known at "
                               f"{target.shape[0]} positions")
        if toks is not None:
            if ranks.shape[0] > toks.shape[0] or (ranks.size and ranks.max() > toks.shape[1]):
                raise SimtreeError(f"{where}: marginal_ranks beyond the {toks.shape[0]} x top-{toks.shape[1]} marginals")
            if target is not None and ranks.tolist() != marginal_ranks_of(toks, target)[:ranks.shape[0]].tolist():
                raise SimtreeError(f"{where}: marginal_ranks disagree with topk_tokens and target_tokens")
        out["marginal_ranks"] = ranks
    if "confidence" in obj:
        conf = obj["confidence"]
        ok = isinstance(conf, list) and conf and all(
            not isinstance(c, bool) and isinstance(c, (int, float)) and 0.0 <= c <= 1.0 for c in conf)
        if not ok:
            raise SimtreeError(f"{where}: confidence must be a non-empty list of numbers in [0, 1]")
        out["confidence"] = np.asarray(conf, np.float64)
    if "verified_len" in obj:
        n = len(out.get("confidence", ())) or None
        out["verified_len"] = check_whole(obj["verified_len"], f"{where}: verified_len", 0, n)
    if "context_match" in obj:
        ranks = _int_list(obj, "context_match", where, 0)
        toks = v2.get("topk_tokens")
        if toks is None or ranks.shape[0] != toks.shape[0] or (ranks.size and ranks.max() > toks.shape[1]):
            raise SimtreeError(f"{where}: context_match needs topk_tokens and one rank (0..K) per chain position")
        out["context_match"] = ranks
    return out


def marginal_ranks_of(topk_tokens: np.ndarray, target_tokens: np.ndarray) -> np.ndarray:
    """int64 [m]: rank of the target's token in each position's top-K (K: not there), for the
    m = min(P, len(target)) positions whose target token is known."""
    m = min(topk_tokens.shape[0], target_tokens.shape[0])
    hit = topk_tokens[:m] == target_tokens[:m, None]
    return np.where(hit.any(1), hit.argmax(1), topk_tokens.shape[1]).astype(np.int64)


def parse_record(obj, where: str) -> TraceRecord:
    """One trace record (a parsed JSON object) checked; ``where`` names it in errors."""
    if not isinstance(obj, dict):
        raise SimtreeError(f"{where}: a trace record must be a JSON object")
    schema = obj.get("schema", SCHEMAS[0])
    if schema not in SCHEMAS:
        raise SimtreeError(f"{where}: schema {schema!r} is not one of {', '.join(SCHEMAS)}")
    for key in ("workload", "batch_size", "parents", "log_probs", "accepted_node"):
        if key not in obj:
            raise SimtreeError(f"{where}: trace record lacks the field {key!r}")
    if not isinstance(obj["workload"], str) or not obj["workload"]:
        raise SimtreeError(f"{where}: workload {obj['workload']!r} must be a non-empty string")
    for key in ("parents", "log_probs"):
        if not isinstance(obj[key], list):
            raise SimtreeError(f"{where}: {key} must be a list (one entry per draft tree node), got {obj[key]!r}")
    try:
        tree = DraftTree(obj["parents"], None, obj["log_probs"])
    except TreeError as exc:
        raise SimtreeError(f"{where}: {exc}") from None
    # every integer field: an integer, or a float with an integral value (4.0) as JSON written
    # by other tools gives it
    node = check_whole(obj["accepted_node"], f"{where}: accepted_node (a node of the {tree.num_nodes}-node tree)",
                       0, tree.num_nodes - 1)
    batch = check_whole(obj["batch_size"], f"{where}: batch_size", 1)
    if "num_accepted" in obj and obj["num_accepted"] != int(tree.depth[node]):
        raise SimtreeError(f"{where}: num_accepted {obj['num_accepted']!r} != depth {int(tree.depth[node])} "
                           f"of accepted_node {node}")
    marg = obj.get("marginal_probs")
    if marg is not None:
        marg = check_prob_rows(_table(obj, "marginal_probs", where, np.float64), f"{where}: marginal_probs", axis=1)
    extra = _v2_fields(obj, tree, node, where)
    if "tokens" in extra:
        tree = DraftTree(tree.parents, extra["tokens"], tree.log_probs)
    if marg is None and extra.get("topk_probs") is not None and obj.get("mode") not in (None, "linear", "none"):
        marg = extra["topk_probs"]   # the marginal modes' trees were built from these
    ctx, rnd, seq = obj.get("context_len"), obj.get("round"), obj.get("seq")
    if rnd is not None:
        rnd = check_whole(rnd, f"{where}: round", 0)
    if seq is not None:
        seq = check_whole(seq, f"{where}: seq", 0)
    if ctx is not None:
        ctx = check_whole(ctx, f"{where}: context_len (tokens)", 1, MAX_CONTEXT_LEN)
    mode = obj.get("mode")
    return TraceRecord(obj["workload"], batch, tree, node, ctx, marg, rnd, int(schema.rsplit("/", 1)[1]),
                       mode if isinstance(mode, str) else None, seq, extra.get("target_tokens"),
                       extra.get("topk_tokens"), extra.get("topk_probs"), extra.get("drafter"),
                       extra.get("marginal_ranks"), extra.get("confidence"), extra.get("verified_len"),
                       extra.get("context_match"))


def read_traces(path: str | Path, workload: str | None = None) -> list[TraceRecord]:
    """Parse and validate a JSONL trace file, versions 1 and 2 (optionally keep one workload)."""
    path = Path(path)
    records = []
    for i, obj in read_jsonl(path, "trace file"):
        rec = parse_record(obj, f"{path}:{i}")
        if workload is None or rec.workload == workload:
            records.append(rec)
    if not records:
        raise SimtreeError(f"{path}: no trace records" + (f" for workload {workload!r}" if workload else ""))
    return records


@dataclass(frozen=True, eq=False)
class Trials:
    """Acceptance trials, one per (drafted candidate whose parent was accepted), flat arrays [m]:
    depth (1 = child of the root), rank (0 = drafter's best), draft_prob, hit (the target took
    it), and round_id (index of the record it came from, for resampling whole rounds)."""

    depth: np.ndarray
    rank: np.ndarray
    draft_prob: np.ndarray
    hit: np.ndarray
    round_id: np.ndarray

    @property
    def size(self) -> int:
        return int(self.depth.shape[0])


def _trials(parts: list[tuple]) -> Trials:
    if not parts:
        empty = np.zeros(0)
        return Trials(empty.astype(np.int64), empty.astype(np.int64), empty, empty.astype(bool),
                      empty.astype(np.int64))
    cols = list(zip(*parts))
    return Trials(*(np.concatenate(c) for c in cols))


def chain_trials(records: Iterable[TraceRecord], topk: int) -> Trials:
    """Trials from records with the drafter's top-K along its greedy chain (version 2).

    Depth d is observed while the accepted path is the chain's own top-1 prefix up to d - 1
    (always, for a linear run): the target's token there (``target_tokens[d - 1]``) is then
    compared with each of the drafter's first ``topk`` candidates at position d.  Depths past
    the first mismatch are unobserved (the target never saw the right prefix with them).
    A block drafter's record with ``marginal_ranks`` is observed at every position they cover
    (independent marginals: the rank of the target's token there is known whatever the path).
    """
    parts = []
    for i, rec in enumerate(records):
        if rec.topk_tokens is None or rec.target_tokens is None:
            continue
        toks, probs, target = rec.topk_tokens, rec.topk_probs, rec.target_tokens
        P, K = toks.shape
        k = min(topk, K)
        if rec.marginal_ranks is not None:
            # a block drafter's marginals do not depend on the drafted prefix: every position
            # whose target token is known is observed, whatever rank the path took before it
            depths = np.arange(1, rec.marginal_ranks.shape[0] + 1)
            hit = rec.marginal_ranks[:, None] == np.arange(k)
        else:
            # observed depths: 1..m+1 where the accepted path follows the chain's top-1 tokens
            follows = np.cumprod(np.r_[True, target[:-1] == toks[:target.shape[0] - 1, 0]]).astype(bool)
            depths = np.flatnonzero(follows[:P]) + 1
            hit = toks[depths - 1, :k] == target[depths - 1, None]
        if depths.size == 0:
            continue
        d = np.repeat(depths, k)
        parts.append((d, np.tile(np.arange(k), depths.size), probs[depths - 1, :k].reshape(-1),
                      hit.reshape(-1), np.full(d.shape[0], i)))
    return _trials(parts)


def tree_trials(records: Iterable[TraceRecord], topk: int) -> Trials:
    """Trials from the drafted trees themselves (any version): every child of an accepted node
    with sibling rank < ``topk`` is one trial at (its depth, its rank, exp(its log-prob)), a hit
    when it is on the accepted path."""
    parts = []
    for i, rec in enumerate(records):
        tree = rec.tree
        if tree.num_nodes < 2:
            continue
        rank = sibling_rank(tree)
        on_path = np.zeros(tree.num_nodes, bool)
        on_path[tree.path_to(rec.accepted_node)] = True
        child = np.flatnonzero((np.arange(tree.num_nodes) > 0) & on_path[np.maximum(tree.parents, 0)])
        child = child[rank[child] < topk]
        parts.append((tree.depth[child], rank[child], np.exp(tree.log_probs[child]), on_path[child],
                      np.full(child.shape[0], i)))
    return _trials(parts)


def sequence_ids(records: Sequence[TraceRecord]) -> np.ndarray:
    """int64 [len(records)]: which generated sequence each record belongs to.

    Records of one run come batch by batch, round by round; a batch starts where the round
    index falls back, and within a batch ``seq`` tells the sequences apart.  Records without
    round / seq count as sequences of their own.
    """
    ids, batch, last_round, seen = np.zeros(len(records), np.int64), 0, -1, {}
    for i, rec in enumerate(records):
        if rec.round_index is None or rec.seq is None:
            ids[i] = seen.setdefault(("record", i), len(seen))
            continue
        if rec.round_index < last_round:
            batch += 1
        last_round = rec.round_index
        ids[i] = seen.setdefault((rec.workload, batch, rec.seq), len(seen))
    return ids
