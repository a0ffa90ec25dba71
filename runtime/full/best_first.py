"""Best-first (DDTree) trees on the device from the MTP layer's marginals, in static shapes.

    lp, ids = draft_marginals(model, ds, rs, first_logp, first_ids, first_hidden, own_bits)
    cand = marginal_candidates(lp, ids, rs)             # every node a best-first tree can hold
    best = best_first(cand, rs)                         # [B, m] best-first order (pop order)
    lay_out(out, roots, cand, best, rs.topk, valid=None)
    lay_chain(out, roots, lp[..., 0], ids[..., 0])      # a linear round's chain, its marginals kept (traces)

The marginal modes draft a top-1 chain: step 1's distribution comes from the MTP layer's
catch-up, step i = 2..P runs the MTP layer on the chain's top-1 token of step i - 1; the top-K
of each position is its marginal (log-probabilities ``lp``, tokens ``ids`` [B, P, K]).  A node
of depth d is a choice of one candidate per position 1..d, scored by the sum of their
log-probabilities (the log of its prefix probability, ``simtree.trees.builders.best_first_order``).

A tree of D nodes holds at most D - 1 nodes of any one depth, and those are the best-scored of
that depth (a child scores at most its parent), so depth d + 1's candidates are the K children
of depth d's best D - 1: K + (P - 1) min(., D - 1) K of them (``RoundShape.candidates``).
Sorting them by score (stable: a child whose score ties its parent's comes after it) gives the
best-first order - every prefix of it is a tree, the one the planner's builder pops.  The
tree laid out is its first m = min(D - 1, candidates) nodes in candidate order (topological:
a depth's candidates come after its parents'); ``valid`` [B] keeps each sequence's first
``valid[b]`` of them in best-first order (cost_aware, batch_alloc: :mod:`.allocation`), the
rest stay in the tree, never accepted (``valid`` False), as padding nodes do.  The build and
the layout are ``simtree.kernels.layers.device_trees``' (the block drafters' rounds and the
profiler's stages that time them run the same code); here they take the round's shape.
"""
from __future__ import annotations

import torch

from simtree.kernels.layers import device_trees
from simtree.kernels.layers.device_trees import lay_chain, lay_out
from simtree.kernels.layers.head import topk_logp

from .drafting import RoundShape

__all__ = ["draft_marginals", "marginal_candidates", "best_first", "lay_out", "lay_chain"]


def draft_marginals(model, ds, rs: RoundShape, first_logp, first_ids, first_hidden, own_bits, rescore=None):
    """(lp float32 [B, P, K], ids int64 [B, P, K]): the top-K along the drafter's top-1 chain;
    ``rescore(step, lp)`` replaces the scores (replays, ``acceptance.DraftScores``), the chain
    still follows the MTP layer's own top-1.  No host sync."""
    B, K = first_ids.shape
    dev = first_ids.device
    lps, idss = [first_logp if rescore is None else rescore(0, first_logp)], [first_ids]
    tok, hid = first_ids[:, :1], first_hidden[:, None]
    bits = torch.zeros(B, 1, own_bits[0].shape[1] if own_bits else 1, dtype=torch.int64, device=dev)
    for i in range(1, rs.num_steps):
        bits = bits | own_bits[i - 1]
        rows = torch.full((B, 1), i - 1, dtype=torch.int64, device=dev)
        pos = ds.lengths[:, None] + (i - 1)             # the depth-i node's MTP entry: position L + i - 1
        hid = model.draft_forward(ds, tok, hid, pos, rows, bits)
        lp, ids = topk_logp(model.draft_logits(hid), K)                     # [B, 1, K]
        tok = ids[:, :, 0]
        lps.append((lp if rescore is None else rescore(i, lp))[:, 0])
        idss.append(ids[:, 0])
    return torch.stack(lps, 1), torch.stack(idss, 1)


def marginal_candidates(lp: torch.Tensor, ids: torch.Tensor, rs: RoundShape) -> tuple:
    """(score, token, parent candidate (-1: the root), rank, depth), each [B, C]: the nodes a
    best-first tree of ``rs.tree_nodes`` nodes can hold (module docstring)."""
    return device_trees.marginal_candidates(lp, ids, rs.tree_nodes)


def best_first(cand: tuple, rs: RoundShape) -> torch.Tensor:
    """int64 [B, m]: the candidates of the best-first tree in pop order, m = min(tree_nodes - 1, C)."""
    return device_trees.best_first(cand, rs.tree_nodes)
