"""Launches the public hyper-connection entries (``fused_mhc``) do not take: row blocks, K
steps, programs, products' precision, channels a program and warps, which only the launch
benchmark (``profiler/bench/v4_launch.py``) varies; the public entries run the tuned ones."""
from __future__ import annotations

from .fused_mhc import _hc_collapse, _hc_merge, _hc_mix_partials

__all__ = ["hc_mix_partials_launched", "hc_collapse_launched", "hc_merge_launched"]


def hc_mix_partials_launched(x, fn, bt: int, bk: int, programs: int, precision: str, num_warps: int = 4):
    """``fused_mhc.hc_mix_partials`` under the launch (row block, K step, programs aimed at,
    precision of the products, warps)."""
    return _hc_mix_partials(x, fn, bt, bk, programs, precision, num_warps)


def hc_collapse_launched(x, pre, block: int | None = None, num_warps: int = 4):
    """``fused_mhc.hc_collapse`` with ``block`` channels a program and ``num_warps``."""
    return _hc_collapse(x, pre, block, num_warps)


def hc_merge_launched(x, out, post, comb, block: int | None = None, num_warps: int = 4):
    """``fused_mhc.hc_merge`` with ``block`` channels a program and ``num_warps``."""
    return _hc_merge(x, out, post, comb, block, num_warps)
