"""Physical plausibility of a cost surface read from a bundle (:func:`check_physical`) and
the model name its out-of-range warnings carry (:func:`set_range_label`).

A fit only ever writes surfaces that pass (latencies >= 0, monotone by constraint); these
checks stop a hand-edited, corrupted or foreign bundle from giving negative or infinite
throughputs downstream."""
from __future__ import annotations

import warnings

import numpy as np

from simtree.costs.forms import (BasisSurface, DecodeSplitSurface, GridSurface, MoESurface, RangeWarner,
                                  ScaledVerifyDraft, expert_feature)
from simtree.errors import SimtreeError

__all__ = ["check_physical", "set_range_label"]

_MONO_RTOL = 1e-6   # decreases below this share of the largest value are solver round-off


def _where(names, axes, idx) -> str:
    return ", ".join(f"{n}={a[i]:g}" for n, a, i in zip(names, axes, idx))


def check_physical(surface, kind: str) -> None:
    """SimtreeError naming the problem when ``surface`` cannot be a latency in microseconds of
    ``kind`` ("verify" or "draft"):

    - verify latencies must be > 0 everywhere (a verify step always takes time, and it is the
      denominator of every predicted throughput); draft latencies >= 0 (0 is meaningful: a
      drafter whose work is already inside the measured verify step adds nothing per round);
    - grid axes strictly increasing (checked on construction) and values non-decreasing along
      every axis (the fit's promise: more nodes / context / sequences / steps / top-k never
      cost less), up to solver round-off (1e-6 of the largest value);
    - the valid range: [lo, hi] pairs of finite numbers with lo <= hi.

    Convexity in x is not required: a grid that claims it (``convex_in_x``) but is not convex
    beyond round-off is flagged instead (``convex_in_x = False`` on the instance, with a
    ``nonconvex_reason``, and a RuntimeWarning), so budget rules take the global argmax.
    """
    if isinstance(surface, DecodeSplitSurface):
        check_physical(surface.main, kind)
        check_physical(surface.decode, kind)
        return
    if isinstance(surface, ScaledVerifyDraft):
        check_physical(surface.verify, "verify")
        return
    for name, pair in (getattr(surface, "valid_range", None) or {}).items():
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2
        ok = ok and all(not isinstance(v, bool) and isinstance(v, (int, float)) and np.isfinite(v) for v in pair)
        if not ok or pair[0] > pair[1]:
            raise SimtreeError(f"valid range of {name} must be [lo, hi] with finite lo <= hi, got {pair!r}")
    if isinstance(surface, BasisSurface):
        if kind == "verify":   # the smallest physical query: one node, no context, one sequence
            low = float(BasisSurface.features(surface.kind, surface.knots, 1.0, 0.0, 1.0) @ np.asarray(surface.coef))
            if isinstance(surface, MoESurface):
                low += surface.alpha * float(expert_feature("verify", surface.n_experts, surface.experts_per_token,
                                                            1.0, 0.0, 1.0, surface.routing))
            if not low > 0:
                raise SimtreeError(f"latency {low:g} us at one node, one sequence: a verify step must take > 0 us")
        return   # coef >= 0 (checked on construction): non-decreasing by construction
    if not isinstance(surface, GridSurface):
        return
    V, names = surface.values, surface.axis_names
    axes = (surface.xs, surface.ys, surface.zs)
    low = float(V.min())
    if (kind == "verify" and not low > 0) or low < 0:
        iz, iy, ix = np.unravel_index(int(np.argmin(V)), V.shape)
        need = "> 0 us (a verify step always takes time)" if kind == "verify" else ">= 0 us"
        raise SimtreeError(f"latency {low:g} us at {_where(names, axes, (ix, iy, iz))}: latencies must be {need}")
    tol = _MONO_RTOL * float(np.abs(V).max())
    for axis, name in ((2, names[0]), (1, names[1]), (0, names[2])):
        d = np.diff(V, axis=axis)
        if np.any(d < -tol):
            iz, iy, ix = np.unravel_index(int(np.argmin(d)), d.shape)
            nxt = [ix, iy, iz]
            nxt[2 - axis] += 1
            a, b = V[iz, iy, ix], V[nxt[2], nxt[1], nxt[0]]
            raise SimtreeError(f"latency decreases along {name}: {a:g} us at {_where(names, axes, (ix, iy, iz))} "
                               f"but {b:g} us at {name}={axes[2 - axis][nxt[2 - axis]]:g} (must be non-decreasing)")
    if getattr(surface, "convex_in_x", False) and len(surface.xs) >= 3:
        dx = np.diff(np.asarray(surface.xs))
        slopes = np.diff(V, axis=2) / dx
        if np.any(np.diff(slopes, axis=2) * (dx[:-1] + dx[1:]) < -tol):
            surface.convex_in_x = False
            surface.nonconvex_reason = f"grid values not convex in {names[0]}"
            warnings.warn(f"{surface.range_label}: grid values are not convex in {names[0]}; budget rules take "
                          "the global argmax", RuntimeWarning, stacklevel=2)


def set_range_label(surface, label: str) -> None:
    """Name the model in the surface's (and its parts') out-of-range warnings."""
    if isinstance(surface, RangeWarner):
        surface.range_label = label
    for part in ("main", "decode", "verify"):
        if hasattr(surface, part):
            set_range_label(getattr(surface, part), label)
