"""Tile-aware interpolation in n between a grid surface's measured node counts.

A verify step's matrix products run the batch's T = n * b token rows in M-tiles of ``tile``
rows (128 on an H100 in bf16); the attention kernel pads its rows likewise.  Their time is a
staircase in ceil(T / tile), not a line in T: on the H100 profile of qwen3.6-27b the composed
step at b = 32 costs 33.8 ms at n = 6 (T = 192) and 34.2 ms at n = 8 (T = 256, the same two
tiles), then 42.5 ms at n = 12 (T = 384, three tiles).  A straight line between two measured
node counts n_lo < n_hi prices a point in between by its share of the way in n; the tile rule
prices it by its share of the way in tiles:

    w = (g(n) - g(n_lo)) / (g(n_hi) - g(n_lo)),   g(m) = ceil(m b / tile) * tile

(the straight line's w when both ends fill the same tiles), so b = 32, n = 10 (T = 320, three
tiles) costs what n = 12 costs.  The value at a measured node is unchanged; w is non-decreasing
in n, so the surface stays non-decreasing, but it steps: NOT convex in n between the nodes
(``TILE_NONCONVEX_REASON``).  Outside the measured n range nothing changes.  Whether a profile
follows the rule, and with which tile, is decided on the profile itself by leaving out one node
count at a time (:func:`simtree.costs.tile_fit.choose_tile_rows`).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["TILE_CANDIDATES", "TILE_NONCONVEX_REASON", "tile_weight", "tile_x"]

TILE_CANDIDATES = (64, 128, 256)
TILE_NONCONVEX_REASON = ("GEMM M-tiles: between measured node counts C_v steps with "
                         "ceil(n b / tile_rows) (tile-aware interpolation)")
_FUZZ = 1e-9   # n b a float product: an exact multiple of the tile stays on its tile


def _tiles(m, z, tile: int):
    return np.ceil(np.asarray(m, dtype=float) * z / tile - _FUZZ) * tile


def tile_x(xs, x, z, tile: int) -> np.ndarray:
    """The node count at which the straight-line interpolation on the sorted node axis ``xs``
    gives the tile rule's value at (x, batch z); x outside [xs[0], xs[-1]] is returned as is."""
    xs = np.asarray(xs, dtype=float)
    x, z = np.broadcast_arrays(np.asarray(x, dtype=float), np.asarray(z, dtype=float))
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
    lo, hi = xs[i], xs[i + 1]
    g_lo, g_hi = _tiles(lo, z, tile), _tiles(hi, z, tile)
    steps = g_hi > g_lo
    w_tile = np.clip((_tiles(x, z, tile) - g_lo) / np.where(steps, g_hi - g_lo, 1.0), 0.0, 1.0)
    out = np.where(steps, lo + w_tile * (hi - lo), x)
    return np.where((x >= xs[0]) & (x <= xs[-1]), out, x)


def tile_weight(lo: float, hi: float, x: float, z: float, tile: int, w_line: float) -> float:
    """The tile rule's weight of x in (lo, hi] at batch z for one point in plain Python (the
    planner's inner loops); ``w_line``, the straight line's, when both ends fill the same tiles."""
    g_lo = math.ceil(lo * z / tile - _FUZZ)
    g_hi = math.ceil(hi * z / tile - _FUZZ)
    if g_hi <= g_lo:
        return w_line
    w = (math.ceil(x * z / tile - _FUZZ) - g_lo) / (g_hi - g_lo)
    return 0.0 if w < 0.0 else (1.0 if w > 1.0 else w)
