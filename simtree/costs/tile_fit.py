"""Decide on the profile itself whether C_v between measured node counts follows GEMM M-tiles.

Leave one node count out: for every n strictly inside the measured range, refit the kept grid
form without that n's points and predict them from the neighbouring node counts, once with the
straight line in n and once with the tile rule (:mod:`simtree.costs.tiles`) for each candidate
tile.  A tile is kept only when its held-out mean |relative error| is at least
``TILE_MIN_GAIN`` below the straight line's and its worst is not above it; the record of every
candidate goes into the bundle.  The node counts held out are measured ones, so the check never
looks at anything but the profile; the cells the pad map sends to a held-out n (copies of its
latency in the fit's envelope) leave the refit with it.
"""
from __future__ import annotations

import numpy as np

from simtree.costs.forms import GridSurface, surface_from_dict
from simtree.costs.surface_fit import FitResult, _fit_form, error_stats
from simtree.costs.tiles import TILE_CANDIDATES
from simtree.costs.verify_pad import padded_into
from simtree.errors import SimtreeError

__all__ = ["TILE_MIN_GAIN", "choose_tile_rows", "with_tile_rows"]

TILE_MIN_GAIN = 0.10      # a tile must cut the held-out-node mean error by a tenth
HUBER_REL = 0.05          # fit_surface's default


def with_tile_rows(surface, tile: int | None):
    """A copy of a grid surface interpolating in x by ``tile``-row M-tiles (None: straight)."""
    if not isinstance(surface, GridSurface):
        raise SimtreeError(f"tile-aware interpolation needs a grid surface, not form {surface.form!r}")
    d = surface.to_dict()
    for key in ("tile_rows", "convex_in_x", "nonconvex_reason"):
        d.pop(key, None)
    if tile is not None:
        d["tile_rows"] = int(tile)
    return surface_from_dict(d)


def _pad_twins(x, z, pad: dict | None, n: float) -> np.ndarray:
    """Rows that are copies of node count ``n``'s: the cells the pad map sends to n at their batch
    (the fit's envelope gives them n's latency, :func:`simtree.costs.verify_pad.envelope_rows`)."""
    twins = np.zeros(np.shape(x), dtype=bool)
    for b in (pad or {}).get("by_batch") or {}:
        for m in padded_into(pad, n, b):
            twins |= (z == float(b)) & (x == float(m))
    return twins


def choose_tile_rows(result: FitResult, kind: str, axis_names, moe=None,
                     candidates=TILE_CANDIDATES, on_fit=None, pad: dict | None = None) -> tuple[int | None, dict | None]:
    """(kept tile or None, record) for a fitted verify surface ``result`` (x = n, z = b); None,
    None when the kept form is not a grid or fewer than one node count lies inside the range.
    ``pad``: the fit's pad map - a held-out n's copies in padded cells leave the training too, so
    no refit sees the latency it is asked to predict."""
    if not isinstance(result.surface, GridSurface) or result.points is None:
        return None, None
    x, y, z, lat = result.points
    nodes = np.unique(x)
    inner = nodes[1:-1]
    if len(inner) == 0:
        return None, None
    valid_range = result.surface.valid_range
    preds = {c: np.empty(0) for c in (None, *candidates)}
    measured = np.empty(0)
    for n in inner:
        held = x == n
        keep = ~held & ~_pad_twins(x, z, pad, n)
        fold = _fit_form(result.form, x[keep], y[keep], z[keep], lat[keep], kind, axis_names,
                         valid_range, HUBER_REL, moe)
        if on_fit is not None:
            on_fit()
        measured = np.concatenate([measured, lat[held]])
        for c in preds:
            s = with_tile_rows(fold, c)
            preds[c] = np.concatenate([preds[c], np.asarray(s.predict(x[held], y[held], z[held]), dtype=float)])
    stats = {("none" if c is None else str(c)): error_stats(p, measured) for c, p in preds.items()}
    line = stats["none"]
    best = min(candidates, key=lambda c: stats[str(c)]["mean"])
    b = stats[str(best)]
    kept = best if (b["mean"] <= (1 - TILE_MIN_GAIN) * line["mean"] and b["max"] <= line["max"]) else None
    record = {"kept": kept, "held_out": [float(n) for n in inner], "heldout_node": stats,
              "rule": f"a tile is kept when its held-out-node mean |error| is >= {TILE_MIN_GAIN:.0%} "
                      "below the straight line's and its worst is not above it"}
    return kept, record
