"""The draft part of a block drafter's round after its backbone forward: the one function the
runtime's block round (``runtime/full/block_engine.py``) runs and the profiler's drafter stages
(``profiler/drafter_pieces.py``) time.

    hid = backbone_forward(w, cfg, state, rope, feats, n_new, anchor)
    out = draft_round("block", w, cfg, hid, roots, tree, DraftShape(8))                # tree laid in ``tree``
    out = draft_round("dspark", w, cfg, hid, roots, tree, DraftShape(L + 1), keep=threshold_keep(0.3))

    block   top-``topk`` marginals per position (one LM-head GEMM), the best-first tree over them
            built sort-based (:mod:`..device_trees`: a fixed number of sorts whatever the budget)
    tfm     the adapter's best-first tree over its conditionals, ``width`` expansions a step
            (:mod:`.tfm`), copied into ``tree`` and padded
    dspark  the Markov head's chain and the confidence head (:mod:`.dspark`); each sequence keeps
            the chain's prefix ``keep`` decides from the survivals (:func:`.dspark.threshold_keep`
            of a threshold, or a rule such as batch_alloc's), the rest stays in the tree, never
            accepted (``valid`` False)

``rescore(depth [B, n], lp [B, n, m])`` (a replay's acceptance model, ``DraftScores.rescore_at``):
the marginals' (block, dspark) or the adapter's children's (tfm) log-probs replaced before the
tree is built; a dspark replay's survival is then its rescored chain's.  Static shapes, no host
sync: capturable in a CUDA graph.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from simtree.drafters import MARGINAL_TOPK

from ..device_trees import TreeBuffers, best_first, lay_chain, lay_out, marginal_candidates, pad_tree
from .block import DeviceTree, block_marginals
from .dspark import dspark_draft, survival
from .tfm import tfm_tree, tfm_tree_rescored

__all__ = ["DraftedRound", "DraftShape", "draft_round", "MARGINAL_TOPK", "set_tree"]


class DraftShape(NamedTuple):
    """A round's static draft shape: ``tree_nodes`` the most nodes a tree holds (root included;
    dspark: the chain's bucket, its first tree_nodes - 1 positions), ``width`` tfm's expansions a
    step, ``topk`` the marginals kept per position."""

    tree_nodes: int
    width: int = 1
    topk: int = MARGINAL_TOPK


class DraftedRound(NamedTuple):
    """What a round drafted besides its tree: the marginals as drafted, before any rescoring
    (block, dspark: log-probs float32 and ids [B, L, topk]), dspark's confidences [B, L] and
    verified prefix lengths [B]; None where the family has none."""

    lp: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    verified_len: torch.Tensor | None = None


def set_tree(tree: TreeBuffers, dt: DeviceTree, pad_rank: int) -> None:
    """A drafter's DeviceTree into the round's buffers; the bucket's nodes past it padding."""
    N = dt.tokens.shape[1]
    for name in ("tokens", "parents", "depth", "rank", "score", "valid"):
        getattr(tree, name)[:, :N] = getattr(dt, name)
    pad_tree(tree, N, pad_rank)


def draft_round(family: str, w: dict, cfg, hid: torch.Tensor, roots: torch.Tensor, tree: TreeBuffers,
                shape: DraftShape, *, rescore=None,
                keep: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DraftedRound:
    """Draft one round's trees from the backbone's block rows ``hid`` [B, L, h] into ``tree``
    (module docstring).  ``roots`` [B]: the anchors (the target's next tokens); ``shape``: the
    round's :class:`DraftShape`; ``keep`` (dspark): survivals [B, m] -> int64 [B] prefix lengths
    (:func:`.dspark.threshold_keep` for a fixed threshold); called while a CUDA graph is captured,
    so it must make no host sync (Python scalars are captured as constants)."""
    tree_nodes, width, topk = shape
    if family == "tfm":
        args = (w, hid, roots, cfg.cand_k, tree_nodes, width)
        set_tree(tree, tfm_tree(*args) if rescore is None else tfm_tree_rescored(*args, rescore), max(cfg.cand_k, 1))
        return DraftedRound()
    if family == "block":
        lp, ids = block_marginals(w, hid, topk)
        conf = None
    elif family == "dspark":
        lp, ids, conf = dspark_draft(w, hid, roots, topk)
    else:
        raise ValueError(f"unknown drafter family {family!r}")
    drafted = (lp, ids)
    B = hid.shape[0]
    if rescore is not None:   # every position's row of the round's level at once
        lp = rescore(torch.arange(lp.shape[1], device=lp.device).expand(B, -1), lp)
    if family == "block":
        cand = marginal_candidates(lp, ids, tree_nodes)
        lay_out(tree, roots, cand, best_first(cand, tree_nodes), topk)
        return DraftedRound(*drafted)
    if not callable(keep):
        raise ValueError("a dspark round needs keep: a prefix rule (threshold_keep for a threshold)")
    m = tree_nodes - 1     # the chain's drafts the bucket holds
    surv = (survival(lp[..., 0].exp()) if rescore is not None else survival(conf))[:, :m]
    n = keep(surv)
    lay_chain(tree, roots, lp[:, :m, 0], ids[:, :m, 0], n)
    return DraftedRound(*drafted, conf, n)
