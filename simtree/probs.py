"""One check for tables of probabilities whose rows are disjoint events (rows sum to <= 1).

Shared by :mod:`simtree.acceptance.phi`, :mod:`simtree.acceptance.model` and :mod:`simtree.trees.builders` so that
all of them reject the same malformed input with the same one-line :class:`SimtreeError`.
"""
from __future__ import annotations

import numpy as np

from simtree.errors import SimtreeError

__all__ = ["ROW_SUM_TOL", "check_prob_rows"]

ROW_SUM_TOL = 1e-6  # rows may sum to 1 + ROW_SUM_TOL (float rounding of normalised rows)


def _index(idx: tuple) -> str:
    return str(idx[0]) if len(idx) == 1 else "[" + ", ".join(str(i) for i in idx) + "]"


def check_prob_rows(array, what: str, axis: int = -1) -> np.ndarray:
    """Return ``array`` as float64 after checking that every entry is finite and >= 0 and that
    it sums to <= 1 + 1e-6 along ``axis`` (each row a set of disjoint events).

    Raises :class:`SimtreeError` with one line ``"{what}: ..."`` naming the first offending
    entry (non-finite or negative) or row (sum above 1).  Shapes are the caller's business.
    """
    try:
        a = np.asarray(array, np.float64)
    except (TypeError, ValueError):
        raise SimtreeError(f"{what}: not an array of numbers") from None
    bad = ~np.isfinite(a)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise SimtreeError(f"{what}: entry {_index(idx)} is {a[idx]} (must be finite)")
    bad = a < 0
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise SimtreeError(f"{what}: entry {_index(idx)} is {a[idx]:.6g} (must be >= 0)")
    if a.ndim == 0:
        sums = a
    else:
        sums = a.sum(axis=axis)
    over = sums > 1 + ROW_SUM_TOL
    if over.any():
        idx = tuple(int(i) for i in np.argwhere(over)[0])
        row = f"row {_index(idx)} " if idx else ""
        raise SimtreeError(f"{what}: {row}sums to {float(sums[idx]):.6g} (must sum to <= 1)")
    return a
