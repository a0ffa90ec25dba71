"""Launches the public V4 entries do not take.  The tree verify with its optional launches
(``FUSIONS``: "topk" the CSA top-k with its attention list; "pool_live" / "pool_split" the
compressors' pooling without its padding rows, and split over (window, channels)): chosen by
the layer forms (``simtree.kernels.layers.forms.v4_fusions``) and timed by the benchmark
(``profiler/bench/v4_floor.py``); the public entry ``verify.tree_verify`` runs none of them.
The sparse attention core with its launch switches (block sizes, warps, splits and their rule,
``swap``, ``skip``); the public ``attention.sparse_attention`` runs the defaults."""
from __future__ import annotations

from .attention import _sparse_attention
from .verify import FUSIONS, _tree_verify

__all__ = ["tree_verify_fused", "sparse_attention_launched", "FUSIONS"]


def tree_verify_fused(cache, w, inp, plan, fusions: tuple, attention: str = "triton"):
    """``verify.tree_verify`` running ``fusions`` (of FUSIONS) where they apply."""
    return _tree_verify(cache, w, inp, plan, attention, tuple(fusions))


def sparse_attention_launched(q, idx, sources, sink, scale: float, block_k: int = 32, block_h: int | None = None,
                              num_warps: int = 8, num_splits: int | None = None, swap: bool = False,
                              stages: int = 2, split_rule: str = "waves2", skip: bool = True):
    """``attention.sparse_attention`` under the launch (block_k, block_h, num_warps, num_splits),
    with ``swap`` (the products with the rows as their M side, the row loop pipelined over
    ``stages`` blocks), ``split_rule`` ("waves2", "wave1": the splits when num_splits is None),
    and ``skip`` (the unswapped kernel's blocks of -1 entries only run no product; off: every
    block runs)."""
    return _sparse_attention(q, idx, sources, sink, scale, block_k, block_h, num_warps, num_splits, swap, stages,
                             split_rule, skip)
