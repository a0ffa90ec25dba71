"""Greedy (temperature 0) acceptance of a verified draft tree.

``target_next[i]`` is the target's greedy next token after the path root..i.  The accepted
path is the longest root path whose every draft token equals the target's prediction at its
parent; among siblings carrying the same token the lowest-index child wins.  The bonus token
is the target's prediction at the last accepted node, so every round yields
``num_accepted + 1`` tokens, exactly those plain greedy decoding would produce (lossless).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simtree.errors import SimtreeError
from simtree.trees.tree import DraftTree, TreeBatch

__all__ = ["AcceptResult", "BatchAcceptResult", "greedy_accept", "greedy_accept_batch"]


@dataclass(frozen=True, eq=False)
class AcceptResult:
    """path int64 [a+1] (root..last accepted node), accepted_tokens int64 [a] (root excluded),
    bonus_token = target_next[path[-1]], num_accepted = a."""

    path: np.ndarray
    accepted_tokens: np.ndarray
    bonus_token: int
    num_accepted: int

    @property
    def last_node(self) -> int:
        return int(self.path[-1])


def _check_targets(target_next, n: int, what: str) -> np.ndarray:
    t = np.asarray(target_next)
    if t.ndim != 1 or t.shape[0] != n:
        raise SimtreeError(f"target_next has shape {t.shape}, expected [{n}] (one token per {what})")
    if t.dtype.kind not in "iu":
        raise SimtreeError(f"target_next must be integer token ids, got dtype {t.dtype}")
    return t.astype(np.int64)


def greedy_accept(tree: DraftTree, target_next) -> AcceptResult:
    """Walk from the root, at each node taking the first child whose token is target_next[node].

    tree: n nodes; target_next int [n].  Uses the tree's first-child / next-sibling links.
    """
    target = _check_targets(target_next, tree.num_nodes, "tree node")
    first, sibling, tokens = tree.next_token, tree.next_sibling, tree.tokens
    path = [0]
    node = 0
    while True:
        child = int(first[node])
        while child >= 0 and tokens[child] != target[node]:
            child = int(sibling[child])
        if child < 0:
            break
        path.append(child)
        node = child
    path_arr = np.asarray(path, np.int64)
    return AcceptResult(path_arr, tokens[path_arr[1:]].copy(), int(target[node]), len(path) - 1)


@dataclass(frozen=True, eq=False)
class BatchAcceptResult:
    """Greedy acceptance of a :class:`TreeBatch`.

    accepted_mask bool [N]  flat rows on an accepted path (roots included)
    num_accepted  int64 [B] accepted draft tokens per sequence
    last_node     int64 [B] local index of the last accepted node (0 = root only)
    last_row      int64 [B] its flat row
    bonus_tokens  int64 [B] target_next at the last accepted row
    """

    batch: TreeBatch
    accepted_mask: np.ndarray
    num_accepted: np.ndarray
    last_node: np.ndarray
    last_row: np.ndarray
    bonus_tokens: np.ndarray

    def result(self, b: int) -> AcceptResult:
        """The per-sequence :class:`AcceptResult` of sequence ``b``."""
        lo, hi = self.batch.cu_nodes[b], self.batch.cu_nodes[b + 1]
        path = np.flatnonzero(self.accepted_mask[lo:hi])  # one node per depth, topological
        tokens = self.batch.trees[b].tokens
        return AcceptResult(path, tokens[path[1:]].copy(), int(self.bonus_tokens[b]), int(self.num_accepted[b]))


def greedy_accept_batch(batch: TreeBatch, target_next) -> BatchAcceptResult:
    """Greedy acceptance for every tree of a batch at once; target_next int [N] (flat rows).

    Vectorised per depth level: a row is a winner when its token matches the target at its
    parent and no lower-index sibling matched; it is accepted when it wins and its parent
    was accepted.
    """
    N = batch.total_nodes
    target = _check_targets(target_next, N, "flat tree row")
    par, depth, tokens = batch.parents_global, batch.depth, batch.tokens
    rows = np.arange(N)
    child = rows[par >= 0]
    matched = child[tokens[child] == target[par[child]]]
    first_match = np.full(N, N, np.int64)
    np.minimum.at(first_match, par[matched], matched)
    winner = np.zeros(N, bool)
    winner[first_match[first_match < N]] = True
    accepted = par < 0  # roots
    for d in range(1, int(depth.max()) + 1):
        level = np.flatnonzero(depth == d)
        accepted[level] = winner[level] & accepted[par[level]]
    num_accepted = np.zeros(batch.batch_size, np.int64)
    np.maximum.at(num_accepted, batch.seq_ids[accepted], depth[accepted])
    last_row = np.flatnonzero(accepted & (depth == num_accepted[batch.seq_ids]))
    return BatchAcceptResult(batch, accepted, num_accepted, last_row - batch.cu_nodes[:-1], last_row,
                             target[last_row])
