"""DFlash-style block drafter: one backbone forward proposes ``block_len`` positions as
independent marginals, and a tree is built best-first from them on the device.

    lp, ids = block_marginals(w, hid, topk)                 # [B, L, K] each; row j: depth j + 1
    tree = tree_from_marginals(lp, ids, anchor, budget)     # DeviceTree [B, budget], root first

The round (``round.draft_round``) builds the tree with the sort-based ``device_trees.best_first``;
``tree_from_marginals`` is its step-by-step reference (``budget - 1`` sequential steps), which the
profiler's check of the ``draft_block`` stage (``profiler/drafter_pieces.check_drafter``) and the
tests compare the round's tree with.

Best-first over independent marginals: a path's score is the sum of its nodes' marginal
log-probabilities; each of the ``budget - 1`` iterations adds the best child not yet in the
tree - for node u at depth d its next unused rank at row d - over all nodes (ties: the lowest
node index, then the lower rank), so the tree is closed under parents and under better siblings
and node i is added at iteration i (static indices, no host sync).  Past the last reachable
node (depth ``block_len`` everywhere, or every rank used) a node is padding: ``valid`` False,
score -inf, a leaf under the root.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..head import logits_fp32, topk_logp

__all__ = ["DeviceTree", "block_marginals", "tree_from_marginals", "finish_tree"]


class DeviceTree(NamedTuple):
    """A batch of trees [B, N], root first, topological: tokens, parents (-1 at the root), depth,
    rank (the drafter's sibling rank: 0 its best), score (cumulative draft log-prob, float32),
    valid (False: padding)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    score: torch.Tensor
    valid: torch.Tensor


def block_marginals(w: dict, hid: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's per-position top-``topk`` (log-probabilities float32, ids) [B, L, topk] from the
    backbone's final-normed hidden states ``hid`` [B, L, h] through the (shared) LM head."""
    B, L, h = hid.shape
    lp, ids = topk_logp(logits_fp32(hid.reshape(B * L, h), w["lm_head"]), topk)
    return lp.view(B, L, topk), ids.view(B, L, topk)


def tree_from_marginals(lp: torch.Tensor, ids: torch.Tensor, anchor: torch.Tensor, budget: int) -> DeviceTree:
    """The best-first tree of ``budget`` nodes (root = ``anchor``) from marginals lp, ids [B, L, K]
    (module docstring)."""
    B, L, K = lp.shape
    N, dev = int(budget), lp.device
    z = lambda: torch.zeros(B, N, dtype=torch.int64, device=dev)  # noqa: E731
    tokens, parents, depth, rank, nchild = z(), z(), z(), z(), z()
    score = torch.zeros(B, N, dtype=torch.float32, device=dev)
    tokens[:, 0] = anchor
    parents[:, 0] = -1
    neg = torch.full((), float("-inf"), device=dev)     # a fill, not a host copy: capturable
    flat_lp, flat_ids = lp.reshape(B, L * K), ids.reshape(B, L * K)
    node = torch.arange(N, device=dev)
    for i in range(1, N):
        ok = (node[None, :] < i) & (depth < L) & (nchild < K)
        at = (depth.clamp(max=L - 1) * K + nchild.clamp(max=K - 1))
        cand = torch.where(ok, score + flat_lp.gather(1, at), neg)
        best = cand.argmax(1, keepdim=True)                                    # first max: lowest node
        at_b = at.gather(1, best)
        score[:, i:i + 1] = cand.gather(1, best)
        tokens[:, i:i + 1] = flat_ids.gather(1, at_b)
        parents[:, i:i + 1] = best
        depth[:, i:i + 1] = depth.gather(1, best) + 1
        rank[:, i:i + 1] = nchild.gather(1, best)
        nchild.scatter_add_(1, best, torch.ones_like(best))
    return finish_tree(tokens, parents, depth, rank, score, K)


def finish_tree(tokens, parents, depth, rank, score, pad_rank: int) -> DeviceTree:
    """Nodes of score -inf become padding: leaves under the root, rank ``pad_rank``, token 0."""
    valid = torch.isfinite(score)
    parents = torch.where(valid, parents, 0)
    parents[:, 0] = -1
    depth = torch.where(valid, depth, 1)
    depth[:, 0] = 0
    return DeviceTree(torch.where(valid, tokens, 0), parents, depth, torch.where(valid, rank, pad_rank), score, valid)
