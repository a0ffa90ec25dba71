"""Expected accepted length Phi(T) of a draft tree, and Monte-Carlo samplers to check it.

Phi(T) = sum over non-root nodes of P(node accepted) = sum over non-root nodes of the product
of the per-node acceptance probabilities along its path (a node is accepted iff its parent is
and it matches the target).  Two acceptance models give the per-node probabilities:

- marginals (:func:`expected_accepted_marginals`): the target's token at depth d is drawn
  independently per position from a top-K marginal table ``[P, K]``; a node is accepted with
  the marginal prob of its token at its depth.  Siblings sharing a token: only the
  lowest-index one can be accepted (as in :func:`simtree.trees.greedy.greedy_accept`).
- positional (:func:`expected_accepted_positional`): ``accept_table[d, r]`` = probability that
  the rank-r child (by draft log-prob among siblings, 0 = best) at depth d+1 is accepted
  given its parent was; ranks are disjoint events, so each row sums to <= 1.

:func:`sample_accepted_length` draws accepted lengths (draft tokens, bonus excluded) from
either model, walking all samples down the tree one depth level at a time.
"""
from __future__ import annotations

import numpy as np

from simtree.errors import SimtreeError
from simtree.probs import check_prob_rows
from simtree.trees.tree import DraftTree

__all__ = ["expected_accepted", "node_accept_probs_marginals", "node_accept_probs_positional",
           "expected_accepted_marginals", "expected_accepted_positional", "expected_accepted_ranked", "node_accept_probs_ranked",
           "rank_tokens", "off_chain", "below_off_chain", "below_scale",
           "sibling_rank", "sample_accepted_length", "accepted_length_pmf"]


def _path_products(tree: DraftTree, node_prob: np.ndarray) -> np.ndarray:
    """float64 [n]: product of node_prob along the path (root's own factor taken as 1)."""
    out = np.asarray(node_prob, np.float64).copy()
    out[0] = 1.0
    for d in range(1, tree.max_depth + 1):  # one vectorised step per level
        nodes = np.flatnonzero(tree.depth == d)
        out[nodes] *= out[tree.parents[nodes]]
    return out


def expected_accepted(tree: DraftTree, node_accept_prob) -> float:
    """Phi(T) = sum_{i>0} prod_{j on root..i, j>0} node_accept_prob[j].  node_accept_prob [n]."""
    p = np.asarray(node_accept_prob, np.float64).reshape(-1)
    if p.shape[0] != tree.num_nodes:
        raise SimtreeError(f"{p.shape[0]} acceptance probs for a tree of {tree.num_nodes} nodes")
    if not np.all(np.isfinite(p[1:])) or np.any(p[1:] < 0) or np.any(p[1:] > 1 + 1e-9):
        raise SimtreeError("acceptance probs must be finite and in [0, 1] (found NaN, inf or out of range)")
    return float(_path_products(tree, p)[1:].sum())


def accepted_length_pmf(tree: DraftTree, node_accept_prob) -> np.ndarray:
    """float64 [max_depth + 1]: P(the round accepts exactly l draft tokens), l = 0..max_depth.

    Siblings are disjoint outcomes (at most one child of an accepted node is accepted: a rank
    or a token each), so the accepted path ends at node v with probability
    path(v) * (1 - sum of its children's acceptance probabilities); the mean of the result is
    :func:`expected_accepted`."""
    p = np.asarray(node_accept_prob, np.float64).reshape(-1)
    expected_accepted(tree, p)                                   # the same checks
    path = _path_products(tree, p)
    children = np.bincount(tree.parents[1:], weights=p[1:], minlength=tree.num_nodes)
    end = path * np.clip(1.0 - children, 0.0, 1.0)
    return np.bincount(tree.depth, weights=end, minlength=tree.max_depth + 1)


def _marginal_table(marginal_tokens, marginal_probs) -> tuple[np.ndarray, np.ndarray]:
    toks = np.asarray(marginal_tokens)
    probs = np.asarray(marginal_probs, np.float64)
    if probs.ndim != 2 or toks.shape != probs.shape or probs.size == 0:
        raise SimtreeError(f"marginal tokens {toks.shape} and probs {probs.shape} must be equal [P, K] arrays")
    if toks.dtype.kind not in "iu":
        raise SimtreeError(f"marginal tokens must be integers, got dtype {toks.dtype}")
    check_prob_rows(probs, "marginal probs", axis=1)
    srt = np.sort(toks, axis=1)
    if np.any(srt[:, 1:] == srt[:, :-1]):
        raise SimtreeError("marginal tokens repeat within a position; list each token once")
    return toks.astype(np.int64), probs


def _marginal_rank(tree: DraftTree, toks: np.ndarray) -> np.ndarray:
    """int64 [n]: column of each node's token in its depth's marginal row; K if absent/too deep."""
    P, K = toks.shape
    col = np.full(tree.num_nodes, K, np.int64)
    d = tree.depth
    inside = np.flatnonzero((d >= 1) & (d <= P))
    hit = toks[d[inside] - 1] == tree.tokens[inside, None]  # [m, K]
    found = hit.any(1)
    col[inside[found]] = hit[found].argmax(1)
    return col


def _first_with_same_token(tree: DraftTree) -> np.ndarray:
    """bool [n]: node is the lowest-index child of its parent carrying its token."""
    n = tree.num_nodes
    first = np.ones(n, bool)
    key = np.stack([tree.parents[1:], tree.tokens[1:]], 1)
    _, idx = np.unique(key, axis=0, return_index=True)  # first occurrence of each (parent, token)
    first[1:] = False
    first[idx + 1] = True
    return first


def node_accept_probs_marginals(tree: DraftTree, marginal_tokens, marginal_probs) -> np.ndarray:
    """float64 [n]: P(node accepted | parent accepted) under independent per-position marginals."""
    toks, probs = _marginal_table(marginal_tokens, marginal_probs)
    col = _marginal_rank(tree, toks)
    padded = np.hstack([probs, np.zeros((probs.shape[0], 1))])  # column K: token not listed
    rows = np.clip(tree.depth - 1, 0, probs.shape[0] - 1)
    p = padded[rows, col]
    p[~_first_with_same_token(tree)] = 0.0
    p[0] = 1.0
    return p


def expected_accepted_marginals(tree: DraftTree, marginal_tokens, marginal_probs) -> float:
    """Phi(T) under per-position marginals ``[P, K]`` (tokens and probs)."""
    return expected_accepted(tree, node_accept_probs_marginals(tree, marginal_tokens, marginal_probs))


def rank_tokens(accept_table) -> np.ndarray:
    """int64 [P, K]: the rank ids 0..K-1 at every depth, as the marginal tokens of a positional
    table (trees built from an acceptance model's numbers carry rank ids as tokens)."""
    table = np.asarray(accept_table)
    return np.tile(np.arange(table.shape[-1], dtype=np.int64), (table.shape[0], 1))


def off_chain(parents, tokens) -> np.ndarray:
    """bool [n]: nodes of a rank-id tree (topological ``parents``, ``tokens`` = rank ids) that
    leave the drafter's chain - the node or an ancestor (not the root) is not rank 0."""
    parents, tokens = np.asarray(parents), np.asarray(tokens)
    out = np.zeros(parents.shape[0], bool)
    for i in range(1, parents.shape[0]):
        out[i] = tokens[i] != 0 or out[parents[i]]
    return out


def below_off_chain(parents, tokens) -> np.ndarray:
    """bool [n]: nodes whose parent is :func:`off_chain` (the root never): under a chain drafter's
    marginals (MTP) such a node was drafted after the chain's token, not its parent's, and is
    never accepted."""
    parents = np.asarray(parents)
    out = np.zeros(parents.shape[0], bool)
    out[1:] = off_chain(parents, tokens)[parents[1:]]
    return out


def below_scale(chain_marginals, width: int) -> np.ndarray | None:
    """float64 [width] or None: what a chain drafter's node below an off-chain node keeps of its
    table entry, per rank id (``chain_marginals``: False / None - not a chain drafter's tree;
    True - nothing, never accepted; an array per rank - that share, fitted from linear runs:
    :func:`simtree.acceptance.off_chain.fit_off_chain_scale`; ranks past it take its last)."""
    if chain_marginals is None or chain_marginals is False:
        return None
    if chain_marginals is True:
        return np.zeros(width)
    scale = np.clip(np.asarray(chain_marginals, np.float64).reshape(-1), 0.0, 1.0)
    if scale.size == 0:
        return np.zeros(width)
    return scale[np.minimum(np.arange(width), scale.size - 1)]


def node_accept_probs_ranked(tree: DraftTree, accept_table, chain_marginals=False) -> np.ndarray:
    """float64 [n]: ``accept_table[depth-1, token]`` of a tree whose tokens are rank ids, 0
    beyond the table.  ``chain_marginals``: the tree was built from marginals a drafter read
    along its own top-1 chain (the marginal modes of a chain drafter: MTP), so a node below an
    off-chain node was drafted after the chain's token, not its parent's: never accepted
    (True), or accepted with a share of its entry per rank (an array, :func:`below_scale`)."""
    table = _check_accept_table(accept_table)
    D, R = table.shape
    d, r = tree.depth - 1, tree.tokens
    ok = (d >= 0) & (d < D) & (r >= 0) & (r < R)
    p = np.zeros(tree.num_nodes)
    p[ok] = table[d[ok], r[ok]]
    p[0] = 1.0
    scale = below_scale(chain_marginals, R)
    if scale is not None:
        below = below_off_chain(tree.parents, tree.tokens) & ok
        p[below] *= scale[r[below]]
    return p


def expected_accepted_ranked(tree: DraftTree, accept_table, chain_marginals=False) -> float:
    """Phi(T) of a tree whose tokens are rank ids (the trees built from an acceptance model's
    numbers): a node with token r at depth d is accepted with ``accept_table[d - 1, r]`` given
    its parent (``chain_marginals``: :func:`node_accept_probs_ranked`).  Equal to
    :func:`expected_accepted_positional` where sibling order is rank order (EAGLE and chains);
    a best-first tree built from draft probabilities that are not in rank order keeps each
    candidate's own entry."""
    return expected_accepted(tree, node_accept_probs_ranked(tree, accept_table, chain_marginals))


def sibling_rank(tree: DraftTree) -> np.ndarray:
    """int64 [n]: rank of each node among its siblings by draft log-prob desc (ties: lower
    index first); 0 for the root."""
    n = tree.num_nodes
    order = np.lexsort((np.arange(n), -tree.log_probs, tree.parents))  # group by parent
    par = tree.parents[order]
    starts = np.flatnonzero(np.r_[True, par[1:] != par[:-1]])
    group_start = np.repeat(starts, np.diff(np.r_[starts, n]))
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n) - group_start
    return rank


def _check_accept_table(accept_table) -> np.ndarray:
    table = np.asarray(accept_table, np.float64)
    if table.ndim != 2 or table.size == 0:
        raise SimtreeError(f"accept_table must be a non-empty [depth, rank] array, got shape {table.shape}")
    check_prob_rows(table, "accept_table", axis=1)
    return table


def node_accept_probs_positional(tree: DraftTree, accept_table) -> np.ndarray:
    """float64 [n]: accept_table[depth-1, sibling rank], 0 beyond the table."""
    table = _check_accept_table(accept_table)
    D, R = table.shape
    d, r = tree.depth - 1, sibling_rank(tree)
    ok = (d >= 0) & (d < D) & (r < R)
    p = np.zeros(tree.num_nodes)
    p[ok] = table[d[ok], r[ok]]
    p[0] = 1.0
    return p


def expected_accepted_positional(tree: DraftTree, accept_table) -> float:
    """Phi(T) under the positional model ``accept_table [depth, rank]``."""
    return expected_accepted(tree, node_accept_probs_positional(tree, accept_table))


def sample_accepted_length(tree: DraftTree, rng: np.random.Generator, n: int, *,
                           marginal_tokens=None, marginal_probs=None, accept_table=None,
                           chain_marginals=False) -> np.ndarray:
    """int64 [n] accepted lengths drawn from ONE model: marginals or ``accept_table``
    (``chain_marginals``: a rank-id tree whose nodes below an off-chain node are never accepted,
    or accepted with a share of their entry per rank: :func:`node_accept_probs_ranked`).

    Each level draws one outcome per sample: a column of the depth's marginal row (K = a token
    outside the list) or a sibling rank (R = none accepted); ``step[node, outcome]`` maps it to
    the child it accepts (-1 if none).
    """
    use_marginals = marginal_tokens is not None or marginal_probs is not None
    if use_marginals == (accept_table is not None):
        raise SimtreeError("give either marginal_tokens+marginal_probs or accept_table, not both/neither")
    if use_marginals:
        toks, probs = _marginal_table(marginal_tokens, marginal_probs)
        col = _marginal_rank(tree, toks)
        first = _first_with_same_token(tree)
    else:
        probs = _check_accept_table(accept_table)
        col = sibling_rank(tree)
        first = np.ones(tree.num_nodes, bool)
    rows, width = probs.shape
    step = np.full((tree.num_nodes, width + 1), -1, np.int64)
    child = np.flatnonzero(first & (col < width))
    child = child[child > 0]
    step[tree.parents[child], col[child]] = child
    scale = below_scale(chain_marginals, width)
    off = off_chain(tree.parents, tree.tokens) if scale is not None else np.zeros(tree.num_nodes, bool)
    cur = np.zeros(int(n), np.int64)
    length = np.zeros(int(n), np.int64)
    for d in range(min(rows, tree.max_depth)):
        cdf = np.cumsum(probs[d])
        u = rng.random(cur.shape[0])
        outcome = np.searchsorted(cdf, u, side="right")  # width = none
        if scale is not None:   # below an off-chain node: each rank keeps its share of the row
            below = off[np.maximum(cur, 0)] & (cur >= 0)
            outcome[below] = np.searchsorted(np.cumsum(probs[d] * scale), u[below], side="right")
        nxt = np.where(cur >= 0, step[np.maximum(cur, 0), np.minimum(outcome, width)], -1)
        length += nxt >= 0
        cur = nxt
    return length
