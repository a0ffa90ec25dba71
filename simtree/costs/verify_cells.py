"""Measured-cell corrections of the fitted verify cost: C_v where the convex fit misses a kernel choice.

The bf16 GEMMs of a verify step pick kernels by M = batch x nodes, so the measured C_v is not
convex in n at some (b, n): Qwen3.6-27B on an H100 verifies 64 x 5 nodes in 49.4 ms at context
256 and 64 x 6 in 47.7 ms; the convex fit prices 64 x 5 at 44.9 ms.  Where padding does not
reach such a cell (5 -> 6 saves under 2% at some context, :mod:`simtree.costs.verify_pad`) the
planner and the runtime's bucket choice would price it 9% low.

:func:`cell_corrections` compares, at every measured (b, n >= 2) cell of the fitted rows (the
pad envelope's), the measured latency with the fitted one at each context the cell was timed
at.  Where measured / fitted is on the same side of 1 by at least ``min_excess`` (default 2%,
above the profiler's repeat-to-repeat noise) at EVERY context, the cell is corrected by an
ADDITIVE offset: the per-context measured - fitted difference nearest 0 (the conservative one).
The excess is the GEMM kernel's, chosen by M = b x n whatever the context, so it is carried to
contexts the cell was not timed at as the same microseconds (a ratio would grow with the
context's attention cost: a 9% miss at 256 and 2048 is not 9% of a 32768-context step).
A cell the pad map pads has its padded target's latencies (the envelope's rows: what the
runtime, verifying n' nodes, pays), so its own offset is the padded n''s measured cost minus
the fitted C_v at n; where n' itself is corrected, n is priced as n' (below): either way the
cell is priced after padding.  As with the pad map, nothing is carried to batch sizes or node
counts the table did not time: the kernel choice depends on M exactly.

:func:`corrected_predict` is C_v with the corrections.  At an integer (b, n) the pad map sends
to a corrected n': C_v at n' (the runtime verifies n' nodes); else the surface plus the cell's
own offset where it has one; a count within 1e-9 of an integer (a mean summed in floating point)
is that integer's cell.  At a fractional n (the mean nodes a sequence of a batch-allocated round,
C_v(1 + K/b)) the corrections d of the integer cells floor(n) and ceil(n) (the corrected C_v
there minus the surface there) are blended linearly and added to the surface at n, so the price is
continuous in n: no isolated spike or dip at the exact integer, and no drop just above it (a mean
of 5.0001 nodes is not priced below both 5 and 6).  The surface as fitted everywhere else (other node counts, other
batch sizes).  The offsets are context-free, so C_v stays non-decreasing in l; it is no longer
convex (nor, at a cell corrected up, non-decreasing) in n, and a corrected batch size may cost
more than the surface between it and the next measured one: the model says ``convex_in_n`` False.

:func:`heldout_corrected` keeps the k-fold held-out error honest: a held-out point is corrected
only from its cell's (or its padded target's) points in the training folds at its other
contexts, never from its own measurement; the fit holds a padded cell out with its target at
each (b, l) (``fold_key`` of :func:`simtree.costs.surface_fit.fit_surface`), so neither is the
envelope's copy of it.

The record is stored as ``verify.info["verify_cells"]`` (:data:`CELLS_KEY`):
``{"min_excess": e, "offset_us": {"64": {"5": 4200.0, ...}}, "ratio": {"64": {"5": {"256": 1.09,
"2048": 1.08}}}, "heldout": {...}, "in_sample": {...}}`` (JSON keys are strings; ``ratio``:
measured / fitted at each context the cell was timed at; ``heldout`` / ``in_sample``: the error
stats of the corrected C_v, the held-out ones as above).  A record of the earlier form,
``by_batch`` of ratios (bundles fitted before offsets), is still read and applied as ratios
until the bundle is refitted.  A bundle without the key corrects nothing.
"""
from __future__ import annotations

import math

import numpy as np

from simtree.costs.verify_pad import pad_sends, padded_into, padded_nodes
from simtree.errors import SimtreeError

__all__ = ["CELLS_KEY", "CELLS_MIN_EXCESS", "cell_corrections", "corrected_predict", "heldout_corrected",
           "check_cells_record", "check_min_excess", "has_corrections"]

CELLS_KEY = "verify_cells"
CELLS_MIN_EXCESS = 0.02


def check_min_excess(min_excess: float) -> None:
    """One line unless 0 < ``min_excess`` < 1 (a zero excess would correct timing noise)."""
    if not (isinstance(min_excess, (int, float)) and 0 < min_excess < 1):
        raise SimtreeError(f"verify cell corrections: the minimum excess must be in (0, 1), got {min_excess}")


def _correction(ratios, diffs, min_excess: float) -> float | None:
    """The difference (measured - fitted, us) nearest 0 when every ratio (measured / fitted) is at
    least ``min_excess`` on the same side of 1."""
    r, d = np.asarray(ratios, dtype=float), np.asarray(diffs, dtype=float)
    if r.size == 0 or not (np.all(r >= 1 + min_excess) or np.all(r <= 1 - min_excess)):
        return None
    return float(d[np.argmin(np.abs(d))])


def cell_corrections(points, fitted, min_excess: float = CELLS_MIN_EXCESS) -> dict:
    """The record's ``min_excess``, ``offset_us`` and ``ratio`` from the fitted points (x = n,
    y = l, z = b, latency: :attr:`simtree.costs.surface_fit.FitResult.points`) and the fitted C_v
    there."""
    check_min_excess(min_excess)
    x, y, z, lat = (np.asarray(a, dtype=float) for a in points)
    fitted = np.asarray(fitted, dtype=float)
    ratio = lat / fitted
    offset: dict = {}
    ratios: dict = {}
    for b, n in sorted({(bb, nn) for bb, nn in zip(z, x) if nn >= 2 and float(nn).is_integer()}):
        at = (z == b) & (x == n)
        c = _correction(ratio[at], lat[at] - fitted[at], min_excess)
        if c is not None:
            offset.setdefault(str(int(b)), {})[str(int(n))] = round(c, 1)
            ratios.setdefault(str(int(b)), {})[str(int(n))] = {
                f"{l:g}": round(float(r), 4) for l, r in sorted(zip(y[at], ratio[at]))}
    return {"min_excess": min_excess, "offset_us": offset, "ratio": ratios}


def heldout_corrected(points, fold_of, fold_pred, heldout_pred, pad: dict | None = None,
                      min_excess: float = CELLS_MIN_EXCESS) -> np.ndarray:
    """The k-fold held-out predictions ``heldout_pred`` [N] as :func:`corrected_predict` makes them
    with the corrections fold f's training points give (``fold_pred`` [k, N]: each fold's surface
    at every point): point i of fold f is priced at its padded target n' plus n''s offset where
    it has one, else plus its own cell's, each from the cell's training points at contexts other
    than point i's (the fit holds a padded point out with its target's, ``fold_key``)."""
    x, y, z, lat = (np.asarray(a, dtype=float) for a in points)
    out = np.array(heldout_pred, dtype=float, copy=True)
    index = {p: i for i, p in enumerate(zip(x, y, z))}

    def correction(f, n, l, b):
        train = (fold_of != f) & (z == b) & (x == n) & (y != l)
        return _correction(lat[train] / fold_pred[f][train], lat[train] - fold_pred[f][train], min_excess)

    for i in range(len(lat)):
        if x[i] < 2 or not float(x[i]).is_integer():
            continue
        f, target = fold_of[i], float(padded_nodes(pad, int(x[i]), int(z[i])))
        c = correction(f, target, y[i], z[i]) if target != x[i] else None
        j = index.get((target, y[i], z[i]))
        if c is not None and j is not None:
            out[i] = fold_pred[f][j] + c
        elif (c := correction(f, x[i], y[i], z[i])) is not None:
            out[i] += c
    return out


def _table(record) -> tuple[dict, bool]:
    """({batch: {nodes: correction}}, whether additive): ``offset_us``, else an earlier record's
    ``by_batch`` ratios."""
    if "offset_us" in record:
        return record["offset_us"], True
    return record.get("by_batch") or {}, False


def has_corrections(record) -> bool:
    """Whether a bundle's ``verify_cells`` record corrects any cell."""
    return isinstance(record, dict) and bool(_table(record)[0])


INTEGER_TOL = 1e-9   # a node count this close to an integer is that integer (a mean summed in floating point)


def _deltas(surface, table: dict, additive: bool, pad: dict | None, m, context_len, b):
    """Per element, the corrected C_v of integer cell (b, m) minus the surface there (0 where no cell
    is corrected): at its padded target where that is corrected, else its own (``m``, ``b``: float
    arrays of integer values, broadcast with ``context_len``)."""
    out = np.zeros(m.shape)
    base = None
    for bs, cells in table.items():
        at_b = b == float(bs)
        if not at_b.any():
            continue
        padmap = pad_sends(pad, bs)
        for key in set(cells) | {str(k) for t in cells for k in padded_into(pad, t, bs)}:
            sel = at_b & (m == float(key))
            if not sel.any():
                continue
            target = str(padmap.get(key, key))
            use = target if target != key and target in cells else key
            if use not in cells:
                continue
            at = np.where(sel, float(use), m)
            price = surface.predict(at, context_len, b)
            price = price + cells[use] if additive else price * cells[use]
            base = surface.predict(m, context_len, b) if base is None else base
            out = np.where(sel, price - base, out)
    return out


def corrected_predict(surface, record: dict, pad: dict | None, nodes_per_seq, context_len, batch_size):
    """C_v with the record's corrections (module doc); scalar in, float out as the surface's.

    An additive record (``offset_us``): n within INTEGER_TOL of an integer is that integer cell; a
    fractional n between two cells takes their corrections blended linearly (the surface at n plus
    (1 - t) d(floor n) + t d(ceil n), t = n - floor n, d the cell's corrected C_v minus the surface),
    so the price is continuous in n: no spike or drop at either side of a corrected integer.  An
    earlier record of ratios (``by_batch``) corrects exact integers only, as when it was fitted (a
    bundle frozen with one predicts as it did)."""
    table, additive = _table(record)
    if not table:
        return surface.predict(nodes_per_seq, context_len, batch_size)
    if np.ndim(nodes_per_seq) == 0 and np.ndim(batch_size) == 0 and np.ndim(context_len) == 0:
        return _scalar(surface, table, additive, pad, float(nodes_per_seq), context_len, float(batch_size),
                       nodes_per_seq, batch_size)
    n, b = np.broadcast_arrays(np.asarray(nodes_per_seq, dtype=float), np.asarray(batch_size, dtype=float))
    finite = np.isfinite(n) & (n > 1)
    if additive:
        near = np.round(n)
        n = np.where(finite & (np.abs(n - near) < INTEGER_TOL), near, n)
        lo = np.where(finite, np.floor(n), 1.0)
        hi = np.where(finite, np.ceil(n), 1.0)
        t = np.where(finite, n - lo, 0.0)
        d_lo = np.where(lo >= 2, _deltas(surface, table, True, pad, lo, context_len, b), 0.0)
        d_hi = np.where(hi >= 2, _deltas(surface, table, True, pad, hi, context_len, b), 0.0)
        delta = (1.0 - t) * d_lo + t * d_hi
    else:
        exact = finite & (n == np.floor(n))
        m = np.where(exact, n, 1.0)
        delta = np.where(exact, _deltas(surface, table, False, pad, m, context_len, b), 0.0)
    if not np.any(delta):
        return surface.predict(nodes_per_seq, context_len, batch_size)
    return surface.predict(n, context_len, b) + delta


def _scalar(surface, table: dict, additive: bool, pad: dict | None, n: float, context_len, b: float,
            nodes_per_seq, batch_size):
    """:func:`corrected_predict` of one (n, l, b), by dictionary lookups: the planner and the
    simulator ask C_v one point at a time, where a batch size without corrections must cost what
    the surface alone does."""
    cells = table.get(str(int(b))) if b.is_integer() and 1 < n < math.inf else None
    if not cells:
        return surface.predict(nodes_per_seq, context_len, batch_size)
    sends = pad_sends(pad, b)

    def delta(m: float) -> float:     # the cell's corrected C_v minus the surface there (0: none)
        if m < 2:
            return 0.0
        key = str(int(m))
        target = str(sends.get(key, key))
        use = target if target != key and target in cells else key
        if use not in cells:
            return 0.0
        price = surface.predict(float(use), context_len, batch_size)
        price = price + cells[use] if additive else price * cells[use]
        return float(price - surface.predict(m, context_len, batch_size))

    if additive:
        if abs(n - round(n)) < INTEGER_TOL:
            n = float(round(n))
        lo, hi = math.floor(n), math.ceil(n)
        d = delta(lo) if lo == hi else (hi - n) * delta(lo) + (n - lo) * delta(hi)
    else:
        d = delta(n) if n.is_integer() else 0.0
    if d == 0.0:
        return surface.predict(nodes_per_seq, context_len, batch_size)
    return surface.predict(n, context_len, batch_size) + d


def _stats_ok(err) -> bool:
    return isinstance(err, dict) and all(
        isinstance(err.get(k), (int, float)) and not isinstance(err.get(k), bool) and math.isfinite(err[k])
        and err[k] >= 0 for k in ("median", "p90"))


def _canonical(key, least: int) -> bool:
    """A batch / node count key as the fit writes it: the decimal integer, no sign nor leading 0."""
    return isinstance(key, str) and key.isdigit() and str(int(key)) == key and int(key) >= least


def _number(c) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)


def check_cells_record(record, where: str) -> None:
    """One line for a malformed cell record (a bundle's ``verify.info["verify_cells"]``): the
    corrections ``offset_us`` (finite microseconds), or an earlier record's ``by_batch`` ratios
    (> 0), never both; batch and node keys canonical ("64", not "064": a key the lookups never
    match would correct nothing, silently)."""
    ok = isinstance(record, dict) and ("offset_us" in record) != ("by_batch" in record)
    additive = ok and "offset_us" in record
    table = record.get("offset_us" if additive else "by_batch") if ok else None
    excess = record.get("min_excess") if ok else None
    ok = ok and isinstance(table, dict) and _number(excess) and 0 < excess < 1
    if ok:
        for b, cells in table.items():
            ok = ok and _canonical(b, 1) and isinstance(cells, dict) and all(
                _canonical(n, 2) and _number(c) and (additive or c > 0) for n, c in cells.items())
    ratio = record.get("ratio", {}) if ok else None
    ok = ok and isinstance(ratio, dict) and all(
        isinstance(cells, dict) and all(isinstance(by_l, dict) and all(_number(r) and r > 0 for r in by_l.values())
                                        for by_l in cells.values()) for cells in ratio.values())
    ok = ok and all(_stats_ok(record[k]) for k in ("heldout", "in_sample") if k in record)
    if not ok:
        raise SimtreeError(f"{where}: {CELLS_KEY} must be {{'min_excess': e in (0, 1), 'offset_us': "
                           "{batch: {nodes >= 2: microseconds}}} (keys as integers are written: '64', not '064')")
