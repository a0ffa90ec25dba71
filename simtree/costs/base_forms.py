"""The base forms of a latency surface f(x, y, z) in microseconds, plain numpy to predict.

``BasisSurface`` (form "basis"): a nonnegative combination of fixed basis functions, each
convex and non-decreasing in x and non-decreasing in y and z on x, y, z >= 0, so any
theta >= 0 gives a valid model everywhere (also beyond the data, where it continues
linearly with its last slope). In tokens T = x * z:

    verify  f = c0 + a T + sum_j h_j (T - tau_j)_+ + beta_b b + beta_bl b l + beta_Tl T l
    draft   f = c0 + beta_b b + s (gamma + gamma_b b + a t + sum_j h_j (t - tau_j)_+),  t = k b

(flat in T while weight traffic dominates, hinges where compute takes over; b l is the
per-sequence KV/state read, T l the per-token attention work; draft = s sequential steps of
b k tokens).

``GridSurface`` (form "grid"): values V[z, y, x] on the measured axes, multilinear between
grid points. The fit constrains every x-slice convex and non-decreasing, V non-decreasing
along y and z, the last y-increment convex and non-decreasing in x and non-decreasing in z
(and the last z-increment likewise in x and y: longer contexts cost more per extra sequence,
bigger batches more per extra context token, as attention/state traffic ~ b l does); then the
interpolant is convex/monotone between grid points (weights in y, z do not depend on x) and
the extrapolation (last slope in x; last increment per unit in y and z) stays so beyond.
Below the smallest grid value of an axis the value is held constant (never decreasing).
The fit form "grid_lin" (see :mod:`simtree.costs.surface_fit`) also gives a GridSurface; it
differs only in the prior that fills cells without data.
With ``tile_rows`` a GridSurface interpolates in x between its grid values by the M-tiles the
x * z token rows fill (:mod:`simtree.costs.tiles`): monotone, NOT convex in x between grid values.
With ``grid_convex=False`` (fit form "grid_mono": plain decoding's cost over x = batch size) the
values are monotone in every axis but not convex in x: a staircase of kernel choices between the
profiled batch sizes is followed, linear between them and with the last slope beyond.

Both warn once per axis when queried outside the measured range (:class:`RangeWarner`).  The MoE
forms add an expert term to them (:mod:`simtree.costs.moe_forms`); :mod:`simtree.costs.forms`
gathers every form and rebuilds one from its JSON.
"""
from __future__ import annotations

import bisect
import warnings

import numpy as np

from simtree.costs.tiles import TILE_NONCONVEX_REASON, tile_weight, tile_x
from simtree.errors import ExtrapolationWarning, SimtreeError, check_int

__all__ = ["BasisSurface", "GridSurface", "RangeWarner", "SCALAR_TYPES", "RANGE_TOLERANCE", "GRID_MONO_REASON"]

GRID_MONO_REASON = ("grid values monotone but not constrained convex in x (grid_mono: the measured cost "
                    "steps between profiled batch sizes, e.g. kernel choices)")

RANGE_TOLERANCE = 1e-9     # relative slack of the measured-range check (round-off is not extrapolation)
SCALAR_TYPES = (int, float, np.float64, np.int64)   # types that take the pure-Python fast path


class RangeWarner:
    """Warns once per (model, axis) when a query leaves the measured range (an
    :class:`~simtree.errors.ExtrapolationWarning`, a RuntimeWarning).

    ``range_label`` names the model in the message (the cost bundle sets it, e.g.
    "deepseek-v4-flash draft cost model"); every axis that is left warns once, with the
    measured range and the first value asked outside it."""

    axis_names: tuple[str, str, str] = ("x", "y", "z")
    valid_range: dict
    range_label: str = "cost model"

    def _warned_axes(self) -> set:
        axes = self.__dict__.get("_warned_set")
        if axes is None:
            axes = self._warned_set = set()
        return axes

    def _range_bounds(self) -> tuple:
        """(lo_x, hi_x, lo_y, hi_y, lo_z, hi_z), cached: both checks run on every predict.  Each
        bound is widened by RANGE_TOLERANCE (relative): a query that misses it by float round-off
        (1 - 1e-16 nodes from an average) is inside."""
        bounds = self.__dict__.get("_bounds")
        if bounds is None:
            r, names = self.valid_range, self.axis_names
            raw = [float(v) for n in names for v in r.get(n, (-np.inf, np.inf))]
            bounds = self._bounds = tuple(v + (1 if i % 2 else -1) * RANGE_TOLERANCE * max(1.0, abs(v))
                                          if np.isfinite(v) else v for i, v in enumerate(raw))
        return bounds

    def _check_range(self, x, y, z) -> None:
        if not self.valid_range:
            return
        warned, bounds = self._warned_axes(), self._range_bounds()
        for i, (name, q) in enumerate(zip(self.axis_names, (x, y, z))):
            if i in warned:
                continue
            lo, hi = bounds[2 * i], bounds[2 * i + 1]
            q = np.asarray(q, dtype=float)
            if q.size and (q.min() < lo or q.max() > hi):   # two reductions, no mask, per call
                warned.add(i)
                flat = q.reshape(-1)
                asked = float(flat[np.flatnonzero((flat < lo) | (flat > hi))[0]])
                warnings.warn(f"{self.range_label} queried outside its measured range ({name} in "
                              f"[{lo:g}, {hi:g}], asked {asked:g}); extrapolating conservatively "
                              "(non-decreasing)", ExtrapolationWarning, stacklevel=4)

    def _scalar_out_of_range(self, x, y, z) -> bool:
        """True when an axis that has not warned yet is out of range (pure Python: fast)."""
        bounds = self._range_bounds()
        warned = self._warned_axes()
        return ((not bounds[0] <= x <= bounds[1] and 0 not in warned)
                or (not bounds[2] <= y <= bounds[3] and 1 not in warned)
                or (not bounds[4] <= z <= bounds[5] and 2 not in warned))


class BasisSurface(RangeWarner):
    """f = sum_i coef_i * phi_i(x, y, z), coef >= 0. kind: "verify" or "draft"."""

    form = "basis"
    convex_in_x = True

    def __init__(self, kind: str, knots, coef, axis_names=("x", "y", "z"), valid_range=None):
        if kind not in ("verify", "draft"):
            raise SimtreeError(f"basis surface kind must be verify or draft, got {kind!r}")
        self.kind = kind
        self.knots = [float(t) for t in knots]
        self.coef = [float(c) for c in coef]
        if len(self.coef) != self.num_features(kind, len(self.knots)):
            raise SimtreeError("basis surface: coefficient count does not match its knots")
        if any(not np.isfinite(c) or c < 0 for c in self.coef):
            raise SimtreeError("basis surface: coefficients must be finite and >= 0")
        if not all(np.isfinite(self.knots)):
            raise SimtreeError("basis surface: knots must be finite")
        self.axis_names = tuple(axis_names)
        self.valid_range = dict(valid_range or {})
        first = 2 if kind == "verify" else 5   # where the hinge coefficients start
        self._hinges = list(zip(self.knots, self.coef[first:first + len(self.knots)]))

    @staticmethod
    def num_features(kind: str, num_knots: int) -> int:
        return 5 + num_knots

    @staticmethod
    def features(kind: str, knots, x, y, z) -> np.ndarray:
        """Design matrix [N, 5 + len(knots)] of the basis functions at points (x, y, z)."""
        x, y, z = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (x, y, z)))
        t = x * z
        hinges = [np.maximum(t - tau, 0.0) for tau in knots]
        one = np.ones_like(t)
        if kind == "verify":
            cols = [one, t, *hinges, z, z * y, t * y]
        else:
            cols = [one, z, y, y * z, y * t, *(y * h for h in hinges)]
        return np.stack(cols, axis=-1)

    def predict(self, x, y, z):
        if type(x) in SCALAR_TYPES and type(y) in SCALAR_TYPES and type(z) in SCALAR_TYPES:
            return self._predict_scalar(float(x), float(y), float(z))
        self._check_range(x, y, z)
        out = self.features(self.kind, self.knots, x, y, z) @ np.asarray(self.coef)
        return out if out.ndim else float(out)

    def _predict_scalar(self, x: float, y: float, z: float) -> float:
        if self.valid_range and self._scalar_out_of_range(x, y, z):
            self._check_range(x, y, z)
        c, t = self.coef, x * z
        h = 0.0
        for tau, cj in self._hinges:
            if t > tau:
                h += cj * (t - tau)
        if self.kind == "verify":
            return c[0] + c[1] * t + h + c[-3] * z + c[-2] * z * y + c[-1] * t * y
        return c[0] + c[1] * z + y * (c[2] + c[3] * z + c[4] * t + h)

    def to_dict(self) -> dict:
        return {"form": self.form, "kind": self.kind, "knots": self.knots, "coef": self.coef,
                "axis_names": list(self.axis_names), "valid_range": self.valid_range}


def _locate(axis: np.ndarray, q: np.ndarray, extrapolate: bool):
    """Segment index i and weight w (value = (1 - w) v[i] + w v[i+1]) of q on a sorted axis."""
    i = np.clip(np.searchsorted(axis, q, side="right") - 1, 0, len(axis) - 2)
    w = (q - axis[i]) / (axis[i + 1] - axis[i])
    return i, (np.maximum(w, 0.0) if extrapolate else np.clip(w, 0.0, 1.0))


class GridSurface(RangeWarner):
    """Multilinear interpolation of V[z, y, x] on sorted axes (each with >= 2 values).

    ``tile_rows``: interpolate in x between the grid's x values by the M-tiles the x * z token
    rows fill (:mod:`simtree.costs.tiles`); then the surface is NOT convex in x.
    ``grid_convex=False``: the values were fitted monotone, not convex, in x (form grid_mono)."""

    form = "grid"
    convex_in_x = True

    def __init__(self, xs, ys, zs, values, axis_names=("x", "y", "z"), valid_range=None,
                 tile_rows: int | None = None, grid_convex: bool = True):
        self.xs, self.ys, self.zs = ([float(a) for a in ax] for ax in (xs, ys, zs))
        self.values = np.asarray(values, dtype=float)
        shape = (len(self.zs), len(self.ys), len(self.xs))
        if self.values.shape != shape or min(shape) < 2:
            raise SimtreeError(f"grid surface: values shape {self.values.shape} != {shape} "
                               "(every axis needs >= 2 values)")
        if not np.all(np.isfinite(self.values)):
            raise SimtreeError("grid surface: values must be finite")
        for name, ax in zip(axis_names, (self.xs, self.ys, self.zs)):
            if not (np.all(np.isfinite(ax)) and np.all(np.diff(ax) > 0)):
                raise SimtreeError(f"grid surface: the {name} axis {ax} must be finite and strictly increasing")
        self.axis_names = tuple(axis_names)
        self.valid_range = dict(valid_range or {})
        self._ax = [np.asarray(a) for a in (self.xs, self.ys, self.zs)]
        self._dy = self.values[:, -1, :] - self.values[:, -2, :]   # [nz, nx] last y-increment
        self._dz = self.values[-1, :, :] - self.values[-2, :, :]   # [ny, nx] last z-increment
        self._vl = self.values.tolist()
        self._dyl, self._dzl = self._dy.tolist(), self._dz.tolist()
        self.tile_rows = None
        if tile_rows is not None:
            self.tile_rows = check_int(tile_rows, "grid surface: tile_rows")
            if self.tile_rows < 1:
                raise SimtreeError(f"grid surface: tile_rows must be >= 1, got {tile_rows}")
            self.convex_in_x = False
            self.nonconvex_reason = TILE_NONCONVEX_REASON
        self.grid_convex = bool(grid_convex)   # (MoEGridSurface sets and words its own)
        if not self.grid_convex:
            self.convex_in_x = False
            self.nonconvex_reason = "; ".join(r for r in (GRID_MONO_REASON, getattr(self, "nonconvex_reason", None)) if r)

    def predict(self, x, y, z):
        if type(x) in SCALAR_TYPES and type(y) in SCALAR_TYPES and type(z) in SCALAR_TYPES:
            return self._predict_scalar(float(x), float(y), float(z))
        self._check_range(x, y, z)
        x, y, z = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (x, y, z)))
        if self.tile_rows is not None:
            x = tile_x(self._ax[0], x, z, self.tile_rows)
        (ix, wx), (iy, wy), (iz, wz) = (_locate(ax, q, e) for ax, q, e in
                                        zip(self._ax, (x, y, z), (True, False, False)))
        V = self.values
        out = np.zeros(x.shape)
        for cz, fz in ((0, 1 - wz), (1, wz)):
            for cy, fy in ((0, 1 - wy), (1, wy)):
                out += fz * fy * ((1 - wx) * V[iz + cz, iy + cy, ix] + wx * V[iz + cz, iy + cy, ix + 1])
        ys, zs = self.ys, self.zs
        ey = np.maximum(y - ys[-1], 0.0) / (ys[-1] - ys[-2])
        ez = np.maximum(z - zs[-1], 0.0) / (zs[-1] - zs[-2])
        if np.any(ey > 0):
            dy = sum(f * ((1 - wx) * self._dy[iz + c, ix] + wx * self._dy[iz + c, ix + 1])
                     for c, f in ((0, 1 - wz), (1, wz)))
            out = out + ey * dy
        if np.any(ez > 0):
            dz = sum(f * ((1 - wx) * self._dz[iy + c, ix] + wx * self._dz[iy + c, ix + 1])
                     for c, f in ((0, 1 - wy), (1, wy)))
            out = out + ez * dz
        return out if out.ndim else float(out)

    def _predict_scalar(self, x: float, y: float, z: float) -> float:
        # Pure Python, unrolled: a scalar call must stay a few microseconds (planner loops).
        if self.valid_range and self._scalar_out_of_range(x, y, z):
            self._check_range(x, y, z)
        xs, ys, zs = self.xs, self.ys, self.zs
        ix = bisect.bisect_right(xs, x) - 1
        ix = 0 if ix < 0 else (len(xs) - 2 if ix > len(xs) - 2 else ix)
        wx = (x - xs[ix]) / (xs[ix + 1] - xs[ix])
        wx = 0.0 if wx < 0.0 else wx                       # above the range: last slope
        if self.tile_rows is not None and 0.0 < wx <= 1.0:
            wx = tile_weight(xs[ix], xs[ix + 1], x, z, self.tile_rows, wx)
        iy = bisect.bisect_right(ys, y) - 1
        iy = 0 if iy < 0 else (len(ys) - 2 if iy > len(ys) - 2 else iy)
        wy = (y - ys[iy]) / (ys[iy + 1] - ys[iy])
        wy = 0.0 if wy < 0.0 else (1.0 if wy > 1.0 else wy)
        iz = bisect.bisect_right(zs, z) - 1
        iz = 0 if iz < 0 else (len(zs) - 2 if iz > len(zs) - 2 else iz)
        wz = (z - zs[iz]) / (zs[iz + 1] - zs[iz])
        wz = 0.0 if wz < 0.0 else (1.0 if wz > 1.0 else wz)
        ux, uy, uz = 1.0 - wx, 1.0 - wy, 1.0 - wz
        a0, a1 = self._vl[iz], self._vl[iz + 1]
        r00, r01, r10, r11 = a0[iy], a0[iy + 1], a1[iy], a1[iy + 1]
        out = (uz * (uy * (ux * r00[ix] + wx * r00[ix + 1]) + wy * (ux * r01[ix] + wx * r01[ix + 1]))
               + wz * (uy * (ux * r10[ix] + wx * r10[ix + 1]) + wy * (ux * r11[ix] + wx * r11[ix + 1])))
        if y > ys[-1]:
            d0, d1 = self._dyl[iz], self._dyl[iz + 1]
            dy = uz * (ux * d0[ix] + wx * d0[ix + 1]) + wz * (ux * d1[ix] + wx * d1[ix + 1])
            out += (y - ys[-1]) / (ys[-1] - ys[-2]) * dy
        if z > zs[-1]:
            d0, d1 = self._dzl[iy], self._dzl[iy + 1]
            dz = uy * (ux * d0[ix] + wx * d0[ix + 1]) + wy * (ux * d1[ix] + wx * d1[ix + 1])
            out += (z - zs[-1]) / (zs[-1] - zs[-2]) * dz
        return out

    def to_dict(self) -> dict:
        out = {"form": self.form, "xs": self.xs, "ys": self.ys, "zs": self.zs,
               "values": self.values.tolist(), "axis_names": list(self.axis_names),
               "valid_range": self.valid_range}
        if self.tile_rows is not None:
            out.update(tile_rows=self.tile_rows, convex_in_x=False, nonconvex_reason=self.nonconvex_reason)
        if not self.grid_convex and self.form == "grid":   # the MoE grid records its own
            out.update(grid_convex=False, convex_in_x=False, nonconvex_reason=self.nonconvex_reason)
        return out
