"""Cost models the simulator and planner call: verify and draft latency of a whole batch.

    VerifyCostModel.predict(nodes_per_seq, context_len, batch_size) -> us
        one verify step of the batch: every sequence verifies n tree nodes at context l;
        a plain decode step is predict(1, l, b). Non-decreasing in n, l and b everywhere
        (also outside the fitted range); convex in n unless ``convex_in_n`` is False (an MoE
        model whose experts saturate, form "moe"/"moe_grid", or plain decoding fitted on its
        own curve, form "decode_split", where the profile's n = 1 is a cheaper step: budget
        rules then take the global argmax instead of the first stop).
    DraftCostModel.predict(num_steps, topk, batch_size) -> us
        one drafting round: s sequential draft steps of top-k over the batch.
    CostBundle(verify, draft, meta) with save(path) / load_costs(path): small JSON.

Inputs broadcast as numpy arrays (float or ndarray out); Python scalars take a pure-Python
fast path (a few microseconds). The fitted parameters live in a surface from
:mod:`simtree.costfit` (form "basis", "grid", "moe", "moe_grid" or "decode_split", see there; the fit form "grid_lin"
gives a "grid" surface, the info's "form" names the fit form); this module adds the names, the
provenance (source profile and its hash) and the held-out fit error.
Any object with the same ``predict`` methods works in the simulator (duck typing).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from simtree.costfit.forms import surface_from_dict
from simtree.errors import SimtreeError
from simtree.fileio import read_json, write_text_atomic

__all__ = ["VerifyCostModel", "DraftCostModel", "CostBundle", "load_costs",
           "VERIFY_AXES", "DRAFT_AXES", "COSTS_SCHEMA"]

COSTS_SCHEMA = "simtree.costs/1"
VERIFY_AXES = ("nodes_per_seq", "context_len", "batch_size")   # surface x, y, z
DRAFT_AXES = ("topk", "num_steps", "batch_size")                # surface x, y, z


@dataclass
class _SurfaceModel:
    """A fitted monotone surface with its fit report; subclasses name the axes of predict."""

    surface: object
    info: dict = field(default_factory=dict)

    @property
    def valid_range(self) -> dict:
        return dict(self.surface.valid_range)

    def _convex_in_x(self, key: str) -> bool:
        # Conservative: not convex if either the surface or the stored info says so; bundles
        # written before the key existed hold convex forms only (True).
        return bool(getattr(self.surface, "convex_in_x", True)) and bool(self.info.get(key, True))

    def to_dict(self) -> dict:
        return {"surface": self.surface.to_dict(), "info": self.info}

    @classmethod
    def from_dict(cls, d: dict):
        return cls(surface_from_dict(d["surface"]), dict(d.get("info", {})))


@dataclass
class VerifyCostModel(_SurfaceModel):
    """C_v(n, l, b) in microseconds for the whole batch's verify step.

    surface: a fitted surface over (x=n, y=l, z=b); info: form, valid_range, source
    (profile path, sha256, stage, variant, model, device), fit_error (held-out and
    in-sample median/p90 relative error per form), worst_residuals, convex_in_n (and
    nonconvex_reason when False).
    """

    @property
    def convex_in_n(self) -> bool:
        """False when C_v may be concave in n (MoE saturation): first-stop budget rules break."""
        return self._convex_in_x("convex_in_n")

    def predict(self, nodes_per_seq, context_len, batch_size):
        return self.surface.predict(nodes_per_seq, context_len, batch_size)


@dataclass
class DraftCostModel(_SurfaceModel):
    """C_d(s, k, b) in microseconds for one drafting round of the batch (s steps, top-k)."""

    @property
    def convex_in_topk(self) -> bool:
        return self._convex_in_x("convex_in_topk")

    def predict(self, num_steps, topk, batch_size):
        return self.surface.predict(topk, num_steps, batch_size)


@dataclass
class CostBundle:
    """Verify + draft cost models of one (model, device) with meta.

    meta: {"model": str, "device": str, "source": str | dict, "synthetic": bool, ...}.
    """

    verify: object
    draft: object
    meta: dict = field(default_factory=dict)

    def decode_step_us(self, context_len, batch_size):
        """Plain (non-speculative) decode step: verify one token per sequence."""
        return self.verify.predict(1, context_len, batch_size)

    def to_dict(self) -> dict:
        for name in ("verify", "draft"):
            if not hasattr(getattr(self, name), "to_dict"):
                raise SimtreeError(f"cost bundle: the {name} model cannot be saved (no to_dict)")
        return {"schema": COSTS_SCHEMA, "meta": self.meta, "verify": self.verify.to_dict(),
                "draft": self.draft.to_dict()}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the bundle as JSON (floats round-trip exactly: predictions are bit-identical)."""
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> "CostBundle":
        if not isinstance(d, dict) or d.get("schema") != COSTS_SCHEMA:
            got = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise SimtreeError(f"not a simtree cost bundle (schema {got!r}, expected {COSTS_SCHEMA!r})")
        try:
            return cls(VerifyCostModel.from_dict(d["verify"]), DraftCostModel.from_dict(d["draft"]),
                       dict(d.get("meta", {})))
        except (KeyError, TypeError) as exc:
            raise SimtreeError(f"cost bundle: missing or malformed field {exc}") from None


def load_costs(path: str | os.PathLike) -> CostBundle:
    """Read a CostBundle JSON written by :meth:`CostBundle.save` (or ``simtree fit``)."""
    return CostBundle.from_dict(read_json(path, "cost model"))
