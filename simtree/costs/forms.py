"""Model forms for a latency surface f(x, y, z) in microseconds, plain numpy to predict.

The base forms "basis" and "grid" (``BasisSurface``, ``GridSurface``: convex in x, non-decreasing
in x, y, z) are :mod:`simtree.costs.base_forms`; the MoE forms "moe" and "moe_grid"
(``MoESurface``, ``MoEGridSurface``: a base form plus a saturating expert term, not convex in x)
are :mod:`simtree.costs.moe_forms`.  Here: the two forms built from another surface
(``ScaledVerifyDraft``: a draft cost assumed from the verify model; ``DecodeSplitSurface``: plain
decoding on its own curve), ``surface_from_dict`` that rebuilds any form from its JSON, and every
form's name re-exported, so callers import them from this one module.
"""
from __future__ import annotations

import numpy as np

from simtree.costs.base_forms import SCALAR_TYPES, BasisSurface, GridSurface, RangeWarner
from simtree.costs.moe_forms import (GRID_FREE_REASON, MOE_FORMS, MOE_NONCONVEX_REASON, MOE_ROUTINGS, MoEGridSurface,
                                     MoESurface, expert_feature, touched_experts)
from simtree.errors import SimtreeError, check_real

__all__ = ["BasisSurface", "GridSurface", "MoESurface", "MoEGridSurface", "ScaledVerifyDraft", "DecodeSplitSurface",
           "RangeWarner", "surface_from_dict", "expert_feature", "touched_experts", "MOE_NONCONVEX_REASON",
           "MOE_FORMS", "GRID_FREE_REASON", "MOE_ROUTINGS", "check_draft_fraction"]


def check_draft_fraction(fraction: float) -> float:
    """``fraction`` (of a verify step, :class:`ScaledVerifyDraft`) as a finite float > 0, else one line."""
    if not (np.isfinite(fraction) and fraction > 0):
        raise SimtreeError(f"draft fraction must be > 0, got {fraction}")
    return float(fraction)


class ScaledVerifyDraft:
    """Draft cost assumed from the verify model when no draft_step rows were measured.

    C_d(s, k, b) = fraction * s * C_v(n=k, l=context_len, b): each of the s sequential draft
    steps runs b*k tokens through a draft network costing ``fraction`` of the target step
    (e.g. one draft layer + LM head of a many-layer target). An assumption, stored as such.
    Axes follow the draft surface convention: x = topk, y = num_steps, z = batch_size.
    """

    form = "scaled_verify"

    def __init__(self, verify, fraction: float, context_len: float):
        check_draft_fraction(fraction)
        check_real(context_len, "draft-from-verify context length", 0)
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
        if type(x) in SCALAR_TYPES and type(y) in SCALAR_TYPES and type(z) in SCALAR_TYPES:
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
                               d.get("tile_rows"), d.get("grid_convex", True))
        if form == "decode_split":
            return DecodeSplitSurface(surface_from_dict(d["main"]), surface_from_dict(d["decode"]))
        if form == "scaled_verify":
            return ScaledVerifyDraft(surface_from_dict(d["verify"]), d["fraction"], d["context_len"])
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, SimtreeError):
            raise
        raise SimtreeError(f"cost model JSON: bad surface ({type(exc).__name__}: {exc})") from None
    raise SimtreeError(f"cost model JSON: unknown form {form!r}")
