"""The MoE forms of a latency surface f(x, y, z) in microseconds, plain numpy to predict.

``MoESurface`` / ``MoEGridSurface`` (forms "moe" / "moe_grid", MoE models only): the basis /
grid form (:mod:`simtree.costs.base_forms`) plus a saturating expert term,

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

import numpy as np

from simtree.costs.base_forms import SCALAR_TYPES, BasisSurface, GridSurface
from simtree.costs.tiles import TILE_NONCONVEX_REASON
from simtree.errors import SimtreeError, check_int, check_real

__all__ = ["MoESurface", "MoEGridSurface", "expert_feature", "touched_experts", "MOE_NONCONVEX_REASON",
           "MOE_NONCONVEX_REASONS", "MOE_FORMS", "GRID_FREE_REASON", "MOE_ROUTINGS"]

MOE_ROUTINGS = ("uniform", "balanced")
MOE_NONCONVEX_REASONS = {"uniform": "MoE expert saturation: E(1-(1-k/E)^T) experts touched (uniform routing)",
                         "balanced": "MoE expert saturation: min(T*k, E) experts touched (balanced routing)"}
MOE_NONCONVEX_REASON = MOE_NONCONVEX_REASONS["uniform"]
MOE_FORMS = ("moe", "moe_grid", "moe_grid_free")   # not convex in x: only for MoE models, reported when kept
GRID_FREE_REASON = ("grid values not constrained convex in n (moe_grid_free: GEMM tile steps and "
                    "expert saturation make the measured C_v non-convex)")

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
        self.alpha = check_real(float(alpha), f"{self.form} surface: expert coefficient alpha", 0)
        self.expert_kind = kind
        self.n_experts, self.experts_per_token = n_experts, experts_per_token
        if routing not in MOE_ROUTINGS:
            raise SimtreeError(f"{self.form} surface: MoE routing {routing!r} unknown: one of {', '.join(MOE_ROUTINGS)}")
        self.routing = routing
        self.nonconvex_reason = MOE_NONCONVEX_REASONS[routing]

    def predict(self, x, y, z):
        if type(x) in SCALAR_TYPES and type(y) in SCALAR_TYPES and type(z) in SCALAR_TYPES:
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
