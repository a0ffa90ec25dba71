"""Draft trees laid out on the device in static shapes: the round's tree buffers and the
sort-based best-first build from per-position marginals, shared by the runtime's rounds (the MTP
layer's marginal modes, the block drafters') and the profiler's stages that time them.

    cand = marginal_candidates(lp, ids, tree_nodes)     # every node a best-first tree can hold
    best = best_first(cand, tree_nodes)                 # [B, m] best-first order (pop order)
    lay_out(out, roots, cand, best, pad_rank, valid=None)
    lay_chain(out, roots, lp[..., 0], ids[..., 0])      # a chain (linear, DSpark), its marginals kept

Marginals ``lp``, ``ids`` [B, P, K]: the top-K of each of P drafted positions.  A node of depth d
is a choice of one candidate per position 1..d, scored by the sum of their log-probabilities
(the log of its prefix probability, ``simtree.trees.builders.best_first_order``).

A tree of D nodes holds at most D - 1 nodes of any one depth, and those are the best-scored of
that depth (a child scores at most its parent), so depth d + 1's candidates are the K children
of depth d's best D - 1: K + (P - 1) min(., D - 1) K of them.  Sorting them by score (stable: a
child whose score ties its parent's comes after it) gives the best-first order - every prefix of
it is a tree, the one the planner's builder pops.  The tree laid out is its first
m = min(D - 1, candidates) nodes in candidate order (topological: a depth's candidates come
after its parents'); ``valid`` [B] keeps each sequence's first ``valid[b]`` of them in
best-first order, the rest stay in the tree, never accepted (``valid`` False), as padding
nodes do.  A fixed number of sorts and gathers whatever D: no per-node step.

Nodes past the tree, up to the bucket's width, are padding: leaves under the root that are never
accepted (``valid`` False), so no real node sees them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TreeBuffers", "marginal_candidates", "best_first", "lay_out", "lay_chain", "pad_tree"]


@dataclass
class TreeBuffers:
    """The round's trees, int64 [B, n] (score float32): tokens, parents (local, -1 root), depth,
    sibling rank (0 = the drafter's best child), valid (False: padding), cumulative draft score."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    valid: torch.Tensor
    score: torch.Tensor

    @classmethod
    def empty(cls, B: int, n: int, device) -> "TreeBuffers":
        z = lambda: torch.zeros(B, n, dtype=torch.int64, device=device)  # noqa: E731
        return cls(z(), z(), z(), z(), torch.zeros(B, n, dtype=torch.bool, device=device),
                   torch.zeros(B, n, dtype=torch.float32, device=device))


def marginal_candidates(lp: torch.Tensor, ids: torch.Tensor, tree_nodes: int) -> tuple:
    """(score, token, parent candidate (-1: the root), rank, depth), each [B, C]: the nodes a
    best-first tree of ``tree_nodes`` nodes can hold (module docstring)."""
    B, P, K = lp.shape
    dev = lp.device
    keep = max(int(tree_nodes) - 1, 1)
    ranks = torch.arange(K, device=dev)
    score, tok = lp[:, 0].float(), ids[:, 0]
    out = [(score, tok, torch.full_like(tok, -1), ranks.expand(B, K), torch.ones_like(tok))]
    offset = 0
    for d in range(1, P):
        w = min(score.shape[1], keep)
        f = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :w]
        cum = (score.gather(1, f)[:, :, None] + lp[:, d, None, :].float()).reshape(B, w * K)
        child_tok = ids[:, d, None, :].expand(B, w, K).reshape(B, w * K)
        parent = (offset + f).repeat_interleave(K, dim=1)
        offset += score.shape[1]
        score, tok = cum, child_tok
        out.append((cum, child_tok, parent, ranks.repeat(w).expand(B, w * K), torch.full_like(child_tok, d + 1)))
    return tuple(torch.cat(x, 1) for x in zip(*out))


def best_first(cand: tuple, tree_nodes: int) -> torch.Tensor:
    """int64 [B, m]: the candidates of the best-first tree in pop order, m = min(tree_nodes - 1, C)."""
    score = cand[0]
    m = min(int(tree_nodes) - 1, score.shape[1])
    return torch.sort(score, dim=1, descending=True, stable=True).indices[:, :m]


def lay_out(out: TreeBuffers, roots: torch.Tensor, cand: tuple, best: torch.Tensor, pad_rank: int,
            valid: torch.Tensor | None = None) -> None:
    """The tree of the candidates ``best`` [B, m] (any order closed under parents) into ``out``:
    the root, the m nodes in topological order, padding leaves under the root up to the
    bucket.  ``valid`` [B]: only the first valid[b] of ``best`` (its order) may be accepted."""
    score, tok, par_c, rnk, dep = cand
    B, m = best.shape
    dev = best.device
    idx, pos_in_best = best.sort(dim=1)                                      # topological order
    local = torch.arange(1, m + 1, device=dev).expand(B, m)
    pos_of = torch.zeros_like(score, dtype=torch.int64).scatter_(1, idx, local)
    pc = par_c.gather(1, idx)
    D = m + 1
    out.tokens[:, 0] = roots
    out.tokens[:, 1:D] = tok.gather(1, idx)
    out.parents[:, 0] = -1
    out.parents[:, 1:D] = torch.where(pc < 0, 0, pos_of.gather(1, pc.clamp(min=0)))
    out.depth[:, 0] = 0
    out.depth[:, 1:D] = dep.gather(1, idx)
    out.rank[:, 0] = 0
    out.rank[:, 1:D] = rnk.gather(1, idx)
    out.score[:, 0] = 0.0
    out.score[:, 1:D] = score.gather(1, idx)
    out.valid[:, 0] = True
    out.valid[:, 1:D] = True if valid is None else pos_in_best < valid[:, None]
    pad_tree(out, D, pad_rank)


def lay_chain(out: TreeBuffers, roots: torch.Tensor, lp: torch.Tensor, tok: torch.Tensor,
              keep: torch.Tensor | None = None) -> None:
    """The chain root -> tok[:, 0] -> ... -> tok[:, m - 1] (``lp``, ``tok`` [B, m]: the chain's
    log-probabilities and tokens) as the round's tree, each node scored by its prefix's summed
    log-probabilities; the bucket's nodes past it padding.  ``keep`` [B]: each sequence's chain
    is valid up to depth keep[b] (DSpark's verified prefix; the rest stays in the tree, never
    accepted); None: all of it (a linear round's chain)."""
    m = tok.shape[1]
    cols = torch.arange(m + 1, device=roots.device)
    out.tokens[:, 0] = roots
    out.tokens[:, 1:m + 1] = tok
    out.parents[:, :m + 1] = cols - 1
    out.depth[:, :m + 1] = cols
    out.rank[:, :m + 1] = 0
    out.score[:, 0] = 0.0
    out.score[:, 1:m + 1] = torch.cumsum(lp.float(), 1)
    out.valid[:, :m + 1] = True if keep is None else cols[None, :] <= keep[:, None]
    pad_tree(out, m + 1, 1)


def pad_tree(out: TreeBuffers, D: int, pad_rank: int) -> None:
    """Nodes D.. of the bucket: padding, leaves under the root that are never accepted."""
    if out.tokens.shape[1] > D:
        out.tokens[:, D:] = 0
        out.parents[:, D:] = 0
        out.depth[:, D:] = 1
        out.rank[:, D:] = pad_rank
        out.score[:, D:] = float("-inf")
        out.valid[:, D:] = False
