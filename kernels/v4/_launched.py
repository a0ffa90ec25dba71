"""The V4 tree verify with its optional fused launches (``FUSIONS``: the compressors'
projections in one launch, the CSA top-k with its attention list): chosen by the layer forms
(``simtree.kernels.layers.forms.v4_fusions``) and timed by the benchmark
(``profiler/bench/v4_floor.py``); the public entry ``verify.tree_verify`` runs none of them."""
from __future__ import annotations

from .verify import FUSIONS, _tree_verify

__all__ = ["tree_verify_fused", "FUSIONS"]


def tree_verify_fused(cache, w, inp, plan, fusions: tuple, attention: str = "triton"):
    """``verify.tree_verify`` running ``fusions`` (of FUSIONS) where they apply."""
    return _tree_verify(cache, w, inp, plan, attention, tuple(fusions))
