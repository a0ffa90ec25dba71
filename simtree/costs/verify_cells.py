"""Measured-cell corrections of the fitted verify cost: C_v where the convex fit misses a kernel choice.

The bf16 GEMMs of a verify step pick kernels by M = batch x nodes, so the measured C_v is not
convex in n at some (b, n): Qwen3.6-27B on an H100 verifies 64 x 5 nodes in 49.4 ms at context
256 and 64 x 6 in 47.7 ms; the convex fit prices 64 x 5 at 44.9 ms.  Where padding does not
reach such a cell (5 -> 6 saves under 2% at some context, :mod:`simtree.costs.verify_pad`) the
planner and the runtime's bucket choice would price it 9% low.

:func:`cell_corrections` compares, at every measured (b, n >= 2) cell of the fitted rows (the
pad envelope's), the measured latency with the fitted one at each context the cell was timed
at.  Where measured / fitted is on the same side of 1 by at least ``min_excess`` (default 2%,
above the profiler's repeat-to-repeat noise) at EVERY context, the ratio nearest 1 (the
conservative one) is the cell's correction.  A cell the pad map pads has its padded target's
latencies (the envelope's rows: what the runtime, verifying n' nodes, pays), so its own
correction is the padded n''s measured cost over the fitted C_v at n; where n' itself is
corrected, n is priced as n' (below): either way the cell is priced after padding.
As with the pad map, nothing is carried to batch sizes or node counts the table did not time:
the kernel choice depends on M exactly.

:func:`corrected_predict` is C_v with the corrections: at an integer (b, n) the pad map sends to
a corrected n', C_v at n' (the runtime verifies n' nodes); else the surface times the cell's own
correction where it has one; the surface as fitted everywhere else (between node counts, at
other batch sizes).  The corrections are context-free, so C_v stays non-decreasing in l; it is
no longer convex (nor, at a cell corrected up, non-decreasing) in n, and a corrected batch size
may cost more than the surface between it and the next measured one: the model says
``convex_in_n`` False.

:func:`heldout_corrected` keeps the k-fold held-out error honest: a held-out point is corrected
only from its cell's (or its padded target's) points in the training folds at its other
contexts, never from its own measurement nor from the envelope's copy of it.

The record is stored as ``verify.info["verify_cells"]`` (:data:`CELLS_KEY`):
``{"min_excess": e, "by_batch": {"64": {"5": 1.09, ...}}, "heldout": {...}, "in_sample": {...}}``
(JSON keys are strings; ``heldout`` / ``in_sample``: the error stats of the corrected C_v, the
held-out ones as above).  A bundle without the key corrects nothing.
"""
from __future__ import annotations

import math

import numpy as np

from simtree.costs.verify_pad import padded_nodes
from simtree.errors import SimtreeError

__all__ = ["CELLS_KEY", "CELLS_MIN_EXCESS", "cell_corrections", "corrected_predict", "heldout_corrected",
           "check_cells_record", "check_min_excess", "has_corrections"]

CELLS_KEY = "verify_cells"
CELLS_MIN_EXCESS = 0.02


def check_min_excess(min_excess: float) -> None:
    """One line unless 0 < ``min_excess`` < 1 (a zero excess would correct timing noise)."""
    if not (isinstance(min_excess, (int, float)) and 0 < min_excess < 1):
        raise SimtreeError(f"verify cell corrections: the minimum excess must be in (0, 1), got {min_excess}")


def _correction(ratios, min_excess: float) -> float | None:
    """The ratio nearest 1 when every ratio is at least ``min_excess`` on the same side of 1."""
    r = np.asarray(ratios, dtype=float)
    if r.size == 0:
        return None
    if np.all(r >= 1 + min_excess):
        return float(r.min())
    if np.all(r <= 1 - min_excess):
        return float(r.max())
    return None


def cell_corrections(points, fitted, min_excess: float = CELLS_MIN_EXCESS) -> dict:
    """The record's ``min_excess`` and ``by_batch`` from the fitted points (x = n, y = l, z = b,
    latency: :attr:`simtree.costs.surface_fit.FitResult.points`) and the fitted C_v there."""
    check_min_excess(min_excess)
    x, _, z, lat = (np.asarray(a, dtype=float) for a in points)
    ratio = lat / np.asarray(fitted, dtype=float)
    by_batch: dict = {}
    for b, n in sorted({(bb, nn) for bb, nn in zip(z, x) if nn >= 2 and float(nn).is_integer()}):
        c = _correction(ratio[(z == b) & (x == n)], min_excess)
        if c is not None:
            by_batch.setdefault(str(int(b)), {})[str(int(n))] = round(c, 6)
    return {"min_excess": min_excess, "by_batch": by_batch}


def heldout_corrected(points, fold_of, fold_pred, heldout_pred, pad: dict | None = None,
                      min_excess: float = CELLS_MIN_EXCESS) -> np.ndarray:
    """The k-fold held-out predictions ``heldout_pred`` [N] as :func:`corrected_predict` makes them
    with the corrections fold f's training points give (``fold_pred`` [k, N]: each fold's surface
    at every point): point i of fold f is priced at its padded target n' by n''s correction where
    it has one, else by its own cell's, each from the cell's training points at contexts other
    than point i's."""
    x, y, z, lat = (np.asarray(a, dtype=float) for a in points)
    out = np.array(heldout_pred, dtype=float, copy=True)
    index = {p: i for i, p in enumerate(zip(x, y, z))}

    def correction(f, n, l, b):
        train = (fold_of != f) & (z == b) & (x == n) & (y != l)
        return _correction(lat[train] / fold_pred[f][train], min_excess)

    for i in range(len(lat)):
        if x[i] < 2 or not float(x[i]).is_integer():
            continue
        f, target = fold_of[i], float(padded_nodes(pad, int(x[i]), int(z[i])))
        c = correction(f, target, y[i], z[i]) if target != x[i] else None
        j = index.get((target, y[i], z[i]))
        if c is not None and j is not None:
            out[i] = fold_pred[f][j] * c
        elif (c := correction(f, x[i], y[i], z[i])) is not None:
            out[i] *= c
    return out


def has_corrections(record) -> bool:
    """Whether a bundle's ``verify_cells`` record corrects any cell."""
    return isinstance(record, dict) and bool(record.get("by_batch"))


def corrected_predict(surface, record: dict, pad: dict | None, nodes_per_seq, context_len, batch_size):
    """C_v with the record's corrections (module doc); scalar in, float out as the surface's."""
    if isinstance(nodes_per_seq, (int, float)) and isinstance(batch_size, (int, float)) or (
            np.ndim(nodes_per_seq) == 0 and np.ndim(batch_size) == 0):
        n, b = float(nodes_per_seq), float(batch_size)
        cells = record["by_batch"].get(str(int(b))) if n >= 2 and n.is_integer() and b.is_integer() else None
        if cells:
            target = padded_nodes(pad, int(n), int(b))
            if str(target) in cells:
                return surface.predict(float(target), context_len, batch_size) * cells[str(target)]
            if str(int(n)) in cells:
                return surface.predict(nodes_per_seq, context_len, batch_size) * cells[str(int(n))]
        return surface.predict(nodes_per_seq, context_len, batch_size)
    n, b = np.broadcast_arrays(np.asarray(nodes_per_seq, dtype=float), np.asarray(batch_size, dtype=float))
    at, factor = n.copy(), np.ones(n.shape)
    for bs, cells in record["by_batch"].items():
        at_b = b == float(bs)
        if not at_b.any():
            continue
        for m, c in cells.items():
            factor[at_b & (n == float(m))] = c
        for m, target in ((pad or {}).get("by_batch") or {}).get(bs, {}).items():
            if str(target) in cells:
                hit = at_b & (n == float(m))
                at[hit], factor[hit] = target, cells[str(target)]
    return surface.predict(at, context_len, b) * factor


def _stats_ok(err) -> bool:
    return isinstance(err, dict) and all(
        isinstance(err.get(k), (int, float)) and not isinstance(err.get(k), bool) and math.isfinite(err[k])
        and err[k] >= 0 for k in ("median", "p90"))


def check_cells_record(record, where: str) -> None:
    """One line for a malformed cell record (a bundle's ``verify.info["verify_cells"]``)."""
    ok = isinstance(record, dict) and isinstance(record.get("by_batch"), dict)
    excess = record.get("min_excess") if ok else None
    ok = ok and isinstance(excess, (int, float)) and not isinstance(excess, bool) and 0 < excess < 1
    if ok:
        for b, cells in record["by_batch"].items():
            ok = ok and isinstance(cells, dict) and str(b).isdigit() and int(b) >= 1 and all(
                str(n).isdigit() and int(n) >= 2 and isinstance(c, (int, float)) and not isinstance(c, bool)
                and math.isfinite(c) and c > 0 for n, c in cells.items())
    ok = ok and all(_stats_ok(record[k]) for k in ("heldout", "in_sample") if k in record)
    if not ok:
        raise SimtreeError(f"{where}: {CELLS_KEY} must be {{'min_excess': e in (0, 1), 'by_batch': "
                           "{batch: {nodes >= 2: correction > 0}}}")
