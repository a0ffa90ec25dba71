"""Model forms for a latency surface f(x, y, z) in microseconds, plain numpy to predict.

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

``MoESurface`` / ``MoEGridSurface`` (forms "moe" / "moe_grid", MoE models only): the basis /
grid form plus a saturating expert term,

    verify  f = basis + alpha touched(T) / E          draft  f = basis + alpha s touched(t) / E

(E routed experts, k_e picked per token, alpha >= 0; each touched expert's weights are read
once).  ``touched`` follows the routing the profile timed: ``uniform`` (what fits write: each
token's k_e experts a uniform draw, as the runtime's softmax gate over random weights routes and
the profiler's MoE piece times) touches E (1 - (1 - k_e / E)^T) experts in expectation;
``balanced`` (bundles fitted before the routing was recorded) min(T k_e, E).  Non-decreasing in
x, y, z but CONCAVE in x as the experts saturate, so these carry ``convex_in_x = False`` and
``nonconvex_reason``; every other form has ``convex_in_x = True``.  The fit form "moe_grid_free"
also gives a MoEGridSurface, with ``grid_convex = False``: its grid values are monotone but not
constrained convex in x (see :mod:`simtree.costs.surface_fit`).
"""
from __future__ import annotations

import bisect
import warnings

import numpy as np

from simtree.costs.tiles import TILE_NONCONVEX_REASON, tile_weight, tile_x
from simtree.errors import ExtrapolationWarning, SimtreeError, check_int

__all__ = ["BasisSurface", "GridSurface", "MoESurface", "MoEGridSurface", "ScaledVerifyDraft",
           "surface_from_dict", "expert_feature", "touched_experts", "MOE_NONCONVEX_REASON", "MOE_FORMS",
           "GRID_FREE_REASON",
           "MOE_ROUTINGS"]

RANGE_TOLERANCE = 1e-9     # relative slack of the measured-range check (round-off is not extrapolation)
MOE_ROUTINGS = ("uniform", "balanced")
MOE_NONCONVEX_REASONS = {"uniform": "MoE expert saturation: E(1-(1-k/E)^T) experts touched (uniform routing)",
                         "balanced": "MoE expert saturation: min(T*k, E) experts touched (balanced routing)"}
MOE_NONCONVEX_REASON = MOE_NONCONVEX_REASONS["uniform"]
MOE_FORMS = ("moe", "moe_grid", "moe_grid_free")   # not convex in x: only for MoE models, reported when kept
GRID_FREE_REASON = ("grid values not constrained convex in n (moe_grid_free: GEMM tile steps and "
                    "expert saturation make the measured C_v non-convex)")

_SCALAR = (int, float, np.float64, np.int64)   # types that take the pure-Python fast path


class _RangeWarner:
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


class BasisSurface(_RangeWarner):
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
        if type(x) in _SCALAR and type(y) in _SCALAR and type(z) in _SCALAR:
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


def touched_experts(tokens, n_experts: int, experts_per_token: int, routing: str = "uniform"):
    """Experts T tokens touch: E (1 - (1 - k/E)^T) in expectation under uniform routing (each
    token's k experts a uniform draw), min(T k, E) balanced (module docstring)."""
    if routing == "uniform":
        return n_experts * (1.0 - (1.0 - experts_per_token / n_experts) ** np.asarray(tokens, dtype=float))
    if routing == "balanced":
        return np.minimum(np.asarray(tokens, dtype=float) * experts_per_token, n_experts)
    raise SimtreeError(f"MoE routing {routing!r} unknown: one of {', '.join(MOE_ROUTINGS)}")


def expert_feature(kind: str, n_experts: int, experts_per_token: int, x, y, z, routing: str = "uniform") -> np.ndarray:
    """Fraction of the E experts touched, touched(T) / E (verify, T = x z), or s times it
    (draft: y = s sequential steps of t = x z tokens each)."""
    x, y, z = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (x, y, z)))
    frac = touched_experts(x * z, n_experts, experts_per_token, routing) / n_experts
    return frac if kind == "verify" else y * frac


class _ExpertTerm:
    """Mixin: the convex surface of the base class + alpha * expert_feature (see the module doc)."""

    convex_in_x = False
    nonconvex_reason = MOE_NONCONVEX_REASON

    def _set_experts(self, kind: str, alpha: float, n_experts: int, experts_per_token: int,
                     routing: str = "uniform") -> None:
        n_experts = check_int(n_experts, f"{self.form} surface: n_experts")
        experts_per_token = check_int(experts_per_token, f"{self.form} surface: experts_per_token")
        if experts_per_token > n_experts:
            raise SimtreeError(f"{self.form} surface: experts_per_token exceeds n_experts")
        self.alpha = float(alpha)
        if not (np.isfinite(self.alpha) and self.alpha >= 0):
            raise SimtreeError(f"{self.form} surface: expert coefficient alpha must be finite and >= 0")
        self.expert_kind = kind
        self.n_experts, self.experts_per_token = n_experts, experts_per_token
        if routing not in MOE_ROUTINGS:
            raise SimtreeError(f"{self.form} surface: MoE routing {routing!r} unknown: one of {', '.join(MOE_ROUTINGS)}")
        self.routing = routing
        self.nonconvex_reason = MOE_NONCONVEX_REASONS[routing]

    def predict(self, x, y, z):
        if type(x) in _SCALAR and type(y) in _SCALAR and type(z) in _SCALAR:
            return self._predict_scalar(float(x), float(y), float(z))
        out = super().predict(x, y, z) + self.alpha * expert_feature(
            self.expert_kind, self.n_experts, self.experts_per_token, x, y, z, self.routing)
        return out if np.ndim(out) else float(out)

    def _predict_scalar(self, x: float, y: float, z: float) -> float:
        # touched_experts / E in plain floats (the planner's inner loops call this per candidate);
        # tests pin it to the array path
        if self.routing == "uniform":
            frac = 1.0 - (1.0 - self.experts_per_token / self.n_experts) ** (x * z)
        else:
            e = x * z * self.experts_per_token
            frac = (e if e < self.n_experts else self.n_experts) / self.n_experts
        extra = self.alpha * (frac if self.expert_kind == "verify" else y * frac)
        return super()._predict_scalar(x, y, z) + extra

    def to_dict(self) -> dict:
        return {**super().to_dict(), "expert_kind": self.expert_kind, "alpha": self.alpha,
                "n_experts": self.n_experts, "experts_per_token": self.experts_per_token,
                "routing": self.routing, "convex_in_x": False, "nonconvex_reason": self.nonconvex_reason}


class MoESurface(_ExpertTerm, BasisSurface):
    """Form "moe": basis form (coef >= 0) + alpha * expert_feature. Monotone, NOT convex in x."""

    form = "moe"

    def __init__(self, kind: str, knots, coef, alpha: float, n_experts: int, experts_per_token: int,
                 axis_names=("x", "y", "z"), valid_range=None, routing: str = "uniform"):
        super().__init__(kind, knots, coef, axis_names, valid_range)
        self._set_experts(kind, alpha, n_experts, experts_per_token, routing)


def _locate(axis: np.ndarray, q: np.ndarray, extrapolate: bool):
    """Segment index i and weight w (value = (1 - w) v[i] + w v[i+1]) of q on a sorted axis."""
    i = np.clip(np.searchsorted(axis, q, side="right") - 1, 0, len(axis) - 2)
    w = (q - axis[i]) / (axis[i + 1] - axis[i])
    return i, (np.maximum(w, 0.0) if extrapolate else np.clip(w, 0.0, 1.0))


class GridSurface(_RangeWarner):
    """Multilinear interpolation of V[z, y, x] on sorted axes (each with >= 2 values).

    ``tile_rows``: interpolate in x between the grid's x values by the M-tiles the x * z token
    rows fill (:mod:`simtree.costs.tiles`); then the surface is NOT convex in x."""

    form = "grid"
    convex_in_x = True

    def __init__(self, xs, ys, zs, values, axis_names=("x", "y", "z"), valid_range=None,
                 tile_rows: int | None = None):
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

    def predict(self, x, y, z):
        if type(x) in _SCALAR and type(y) in _SCALAR and type(z) in _SCALAR:
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
        return out


class MoEGridSurface(_ExpertTerm, GridSurface):
    """Form "moe_grid": grid form + alpha * expert_feature (kind: verify or draft, which sets
    the expert term's shape). Monotone, NOT convex in x.  ``grid_convex=False``: the grid values
    were fitted monotone but not convex in x (form "moe_grid_free"), recorded in the reason."""

    form = "moe_grid"

    def __init__(self, kind: str, xs, ys, zs, values, alpha: float, n_experts: int,
                 experts_per_token: int, axis_names=("x", "y", "z"), valid_range=None, routing: str = "uniform",
                 tile_rows: int | None = None, grid_convex: bool = True):
        if kind not in ("verify", "draft"):
            raise SimtreeError(f"moe_grid surface kind must be verify or draft, got {kind!r}")
        super().__init__(xs, ys, zs, values, axis_names, valid_range, tile_rows)
        self._set_experts(kind, alpha, n_experts, experts_per_token, routing)
        self.grid_convex = bool(grid_convex)
        if not self.grid_convex:
            self.nonconvex_reason = f"{self.nonconvex_reason}; {GRID_FREE_REASON}"
        if self.tile_rows is not None:
            self.nonconvex_reason = f"{self.nonconvex_reason}; {TILE_NONCONVEX_REASON}"

    def to_dict(self) -> dict:
        out = super().to_dict()
        if not self.grid_convex:
            out["grid_convex"] = False
        return out


class ScaledVerifyDraft:
    """Draft cost assumed from the verify model when no draft_step rows were measured.

    C_d(s, k, b) = fraction * s * C_v(n=k, l=context_len, b): each of the s sequential draft
    steps runs b*k tokens through a draft network costing ``fraction`` of the target step
    (e.g. one draft layer + LM head of a many-layer target). An assumption, stored as such.
    Axes follow the draft surface convention: x = topk, y = num_steps, z = batch_size.
    """

    form = "scaled_verify"

    def __init__(self, verify, fraction: float, context_len: float):
        if not (np.isfinite(fraction) and fraction > 0):
            raise SimtreeError(f"draft fraction must be > 0, got {fraction}")
        if not (np.isfinite(context_len) and context_len >= 0):
            raise SimtreeError(f"draft-from-verify context length must be >= 0, got {context_len}")
        self.verify, self.fraction, self.context_len = verify, float(fraction), float(context_len)
        self.valid_range = {}
        self.convex_in_x = bool(getattr(verify, "convex_in_x", True))   # C_v's shape in n, scaled
        self.nonconvex_reason = getattr(verify, "nonconvex_reason", None)

    def predict(self, x, y, z):
        return self.fraction * y * self.verify.predict(x, self.context_len, z)

    def to_dict(self) -> dict:
        return {"form": self.form, "fraction": self.fraction, "context_len": self.context_len,
                "verify": self.verify.to_dict()}


class DecodeSplitSurface:
    """C_v with plain decoding (n = 1) on its own curve: a runtime or composition that runs a
    different, cheaper step when nothing is drafted (a fused decode step, no tree) makes C_v
    jump from n = 1 to n = 2, which no convex-in-n surface follows.

    ``main``: a verify surface over (n, l, b) fitted on n >= 2 (smallest fitted n: n0);
    ``decode``: one over (x = b, y = l, z = n = 1) fitted on the n = 1 points.
    predict(1, l, b) = min(decode, main(n0)), linear between n = 1 and n0, main from n0:
    non-decreasing in n, l and b, convex in n from n0 on but not across the jump, so
    ``convex_in_x`` is False and budget searches take the global argmax (the jump is the fixed
    price of drafting at all)."""

    form = "decode_split"
    convex_in_x = False
    nonconvex_reason = ("plain decoding (n = 1) is its own, cheaper step: C_v jumps from n = 1 "
                        "to n = 2")

    def __init__(self, main, decode):
        self.main, self.decode = main, decode
        vr = dict(getattr(main, "valid_range", {}) or {})
        names = list(vr)
        self.n0 = max(2.0, float(vr[names[0]][0])) if names else 2.0
        if names:   # the n axis now starts at 1
            vr[names[0]] = [1.0, float(vr[names[0]][1])]
        self.valid_range = vr

    def predict(self, x, y, z):
        n0 = self.n0
        if type(x) in _SCALAR and type(y) in _SCALAR and type(z) in _SCALAR:
            x = float(x)
            if x >= n0:
                return self.main.predict(x, y, z)
            m0 = self.main.predict(n0, y, z)
            d = min(self.decode.predict(float(z), y, 1.0), m0)
            return d if x <= 1.0 else d + (x - 1.0) / (n0 - 1.0) * (m0 - d)
        x, y, z = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (x, y, z)))
        m = np.asarray(self.main.predict(np.maximum(x, n0), y, z), dtype=float)
        m0 = np.asarray(self.main.predict(np.full(x.shape, n0), y, z), dtype=float)
        d = np.minimum(np.asarray(self.decode.predict(z, y, np.ones(x.shape)), dtype=float), m0)
        out = np.where(x >= n0, m, d + np.clip((x - 1.0) / (n0 - 1.0), 0.0, 1.0) * (m0 - d))
        return out if out.ndim else float(out)

    def to_dict(self) -> dict:
        return {"form": self.form, "main": self.main.to_dict(), "decode": self.decode.to_dict()}


def surface_from_dict(d: dict):
    """Rebuild a surface from :meth:`to_dict` output (JSON); SimtreeError on bad content."""
    try:
        form = d["form"]
        names = d.get("axis_names", ("x", "y", "z"))
        if form == "basis":
            return BasisSurface(d["kind"], d["knots"], d["coef"], names, d.get("valid_range"))
        if form == "moe":
            # bundles without a routing were fitted before it was recorded: balanced
            return MoESurface(d["kind"], d["knots"], d["coef"], d["alpha"], d["n_experts"],
                              d["experts_per_token"], names, d.get("valid_range"), d.get("routing", "balanced"))
        if form == "moe_grid":
            return MoEGridSurface(d["expert_kind"], d["xs"], d["ys"], d["zs"], d["values"], d["alpha"],
                                  d["n_experts"], d["experts_per_token"], names, d.get("valid_range"),
                                  d.get("routing", "balanced"), d.get("tile_rows"), d.get("grid_convex", True))
        if form == "grid":
            return GridSurface(d["xs"], d["ys"], d["zs"], d["values"], names, d.get("valid_range"),
                               d.get("tile_rows"))
        if form == "decode_split":
            return DecodeSplitSurface(surface_from_dict(d["main"]), surface_from_dict(d["decode"]))
        if form == "scaled_verify":
            return ScaledVerifyDraft(surface_from_dict(d["verify"]), d["fraction"], d["context_len"])
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, SimtreeError):
            raise
        raise SimtreeError(f"cost model JSON: bad surface ({type(exc).__name__}: {exc})") from None
    raise SimtreeError(f"cost model JSON: unknown form {form!r}")
