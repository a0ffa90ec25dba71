"""Cost models the simulator and planner call: verify and draft latency of a whole batch.

    VerifyCostModel.predict(nodes_per_seq, context_len, batch_size) -> us
        one verify step of the batch: every sequence verifies n tree nodes at context l;
        a plain decode step is predict(1, l, b). Non-decreasing in n, l and b everywhere
        (also outside the fitted range); convex in n unless ``convex_in_n`` is False (an MoE
        model whose experts saturate, form "moe"/"moe_grid", or plain decoding fitted on its
        own curve, form "decode_split", where the profile's n = 1 is a cheaper step: budget
        rules then take the global argmax instead of the first stop).  A bundle with measured-cell
        corrections (``info["verify_cells"]``, :mod:`simtree.costs.verify_cells`) adds each
        corrected (b, n) cell's measured excess (microseconds, at every context; at a fractional n
        floor(n)'s and ceil(n)'s blended linearly): there it is neither convex nor, where a cell is
        corrected up, non-decreasing in
        n (``convex_in_n`` False).
    DraftCostModel.predict(num_steps, topk, batch_size) -> us
        one drafting round: s sequential draft steps of top-k over the batch.
    CostBundle(verify, draft, meta) with save(path) / load_costs(path): small JSON.

Inputs broadcast as numpy arrays (float or ndarray out); Python scalars take a pure-Python
fast path (a few microseconds). The fitted parameters live in a surface from
:mod:`simtree.costs.forms` (form "basis", "grid", "moe", "moe_grid" or "decode_split", see there;
the fit form "grid_lin" gives a "grid" surface, the info's "form" names the fit form); this
module adds the names, the provenance (source profile and its hash) and the held-out fit error.

The simulator, planner and runtime take the protocols :class:`VerifyCost`, :class:`DraftCost`
and :class:`Costs`, not these classes: the fitted models here, the SYNTHETIC roofline
(:mod:`simtree.costs.synthetic`) and test doubles all satisfy them.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from simtree.costs.checks import check_physical, set_range_label
from simtree.costs.forms import surface_from_dict
from simtree.costs.verify_cells import CELLS_KEY, check_cells_record, corrected_predict, has_corrections
from simtree.costs.verify_pad import PAD_KEY, check_pad_record, padded_nodes
from simtree.drafters import DRAFTER_FAMILIES
from simtree.errors import SimtreeError
from simtree.fileio import read_json, write_text_atomic

__all__ = ["VerifyCost", "DraftCost", "Costs", "VerifyCostModel", "DraftCostModel", "DrafterCostModel", "CostBundle",
           "load_costs", "VERIFY_AXES", "DRAFT_AXES", "COSTS_SCHEMA",
           "DRAFTER_FAMILIES", "DRAFTER_STAGE", "DRAFTER_COLUMNS", "DRAFTER_AXES"]

COSTS_SCHEMA = "simtree.costs/1"
VERIFY_AXES = ("nodes_per_seq", "context_len", "batch_size")   # surface x, y, z
DRAFT_AXES = ("topk", "num_steps", "batch_size")                # surface x, y, z
# The block drafters' rounds (docs/drafters.md): per family its profile stage, the profile
# table columns that hold its axes (surface x, y, z) and what those axes mean.
DRAFTER_STAGE = {"block": "draft_block", "tfm": "draft_tfm", "dspark": "draft_dspark"}
DRAFTER_COLUMNS = {"block": ("nodes_per_seq", "num_steps", "batch_size"),
                   "tfm": ("nodes_per_seq", "num_steps", "batch_size"),
                   "dspark": ("topk", "num_steps", "batch_size")}
DRAFTER_AXES = {"block": ("tree_nodes", "block_len", "batch_size"),
                "tfm": ("tree_nodes", "adapter_steps", "batch_size"),
                "dspark": ("topk", "block_len", "batch_size")}


@runtime_checkable
class VerifyCost(Protocol):
    """C_v(n, l, b): one verify step of a batch of b sequences, n tree nodes each at context l."""

    def predict(self, nodes_per_seq, context_len, batch_size):
        """Microseconds for the whole batch; numpy broadcasting, float for scalar inputs.
        Non-decreasing in every argument, also outside the measured range (but in n at the
        measured cells a fitted model corrects, :mod:`simtree.costs.verify_cells`)."""
        ...

    @property
    def convex_in_n(self) -> bool:
        """False when C_v may be concave in n (MoE expert saturation, a separately fitted
        decode step): budget rules then take the global argmax instead of the first stop."""
        ...

    @property
    def valid_range(self) -> Mapping[str, Sequence[float]]:
        """{axis: (lo, hi)} over :data:`VERIFY_AXES` where it was measured; {} for an analytic
        model (nothing is then reported as extrapolated)."""
        ...

    @property
    def heldout_median_error(self) -> float | None:
        """Held-out median relative error of the fit, None when there is no fit: a tree
        chosen for a smaller predicted gain is flagged ``within_model_error``."""
        ...


@runtime_checkable
class DraftCost(Protocol):
    """C_d(s, k, b): one drafting round of s sequential steps of top-k over b sequences."""

    def predict(self, num_steps, topk, batch_size):
        """Microseconds for the whole batch; numpy broadcasting, float for scalar inputs."""
        ...

    @property
    def valid_range(self) -> Mapping[str, Sequence[float]]:
        """{axis: (lo, hi)} over :data:`DRAFT_AXES` where it was measured; {} when analytic."""
        ...


@runtime_checkable
class Costs(Protocol):
    """The cost models of one (model, device): what the simulator, planner and runtime take.

    meta: {"model": str, "device": str, "synthetic": bool, "source": ..., ...}; the planner
    keeps it in the policy file."""

    @property
    def verify(self) -> VerifyCost: ...

    @property
    def draft(self) -> DraftCost: ...

    @property
    def meta(self) -> Mapping[str, Any]: ...


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
        if not isinstance(d, dict):
            raise SimtreeError(f"must be an object with a surface, got {type(d).__name__}")
        info = d.get("info", {})
        if not isinstance(info, dict):
            raise SimtreeError(f"info must be an object, got {type(info).__name__}")
        for key in ("convex_in_n", "convex_in_topk"):
            if key in info and not isinstance(info[key], bool):
                raise SimtreeError(f"info.{key} must be true or false, got {info[key]!r}")
        return cls(surface_from_dict(d["surface"]), dict(info))


@dataclass
class VerifyCostModel(_SurfaceModel):
    """C_v(n, l, b) in microseconds for the whole batch's verify step.

    surface: a fitted surface over (x=n, y=l, z=b); info: form, valid_range, source
    (profile path, sha256, stage, variant, model, device), fit_error (held-out and
    in-sample median/p90 relative error per form), worst_residuals, convex_in_n (and
    nonconvex_reason when False); verify_pad (:mod:`simtree.costs.verify_pad`) and verify_cells
    (:mod:`simtree.costs.verify_cells`: measured cells the surface misses, corrected in predict).
    """

    @property
    def convex_in_n(self) -> bool:
        """False when C_v may be concave in n (MoE saturation, a measured cell corrected off the
        convex surface): first-stop budget rules break."""
        return self._convex_in_x("convex_in_n") and not has_corrections(self.info.get(CELLS_KEY))

    @property
    def heldout_median_error(self) -> float | None:
        """The held-out median relative error of the kept form's fit (or of the decode split's),
        None when the info carries none."""
        split, cells = self.info.get("decode_split"), self.info.get(CELLS_KEY)
        if has_corrections(cells) and isinstance(cells.get("heldout"), dict):
            err = cells["heldout"]          # the corrected C_v's, corrections from the training folds only
        elif isinstance(split, dict) and split.get("kept") and isinstance(split.get("heldout_split"), dict):
            err = split["heldout_split"]
        else:
            err = ((self.info.get("fit_error") or {}).get("heldout") or {}).get(self.info.get("form"))
        med = err.get("median") if isinstance(err, dict) else None
        ok = isinstance(med, (int, float)) and not isinstance(med, bool) and math.isfinite(med) and med >= 0
        return float(med) if ok else None

    def predict(self, nodes_per_seq, context_len, batch_size):
        cells = self.info.get(CELLS_KEY)
        if not has_corrections(cells):
            return self.surface.predict(nodes_per_seq, context_len, batch_size)
        return corrected_predict(self.surface, cells, self.info.get(PAD_KEY), nodes_per_seq, context_len,
                                 batch_size)

    def padded_nodes(self, nodes: int, batch_size: int) -> int:
        """The node count a round of ``nodes`` per sequence at ``batch_size`` is verified at: the
        fit's pad map (``info["verify_pad"]``, :mod:`simtree.costs.verify_pad`), else ``nodes``."""
        return padded_nodes(self.info.get(PAD_KEY), nodes, batch_size)


@dataclass
class DraftCostModel(_SurfaceModel):
    """C_d(s, k, b) in microseconds for one drafting round of the batch (s steps, top-k)."""

    @property
    def convex_in_topk(self) -> bool:
        return self._convex_in_x("convex_in_topk")

    def predict(self, num_steps, topk, batch_size):
        return self.surface.predict(topk, num_steps, batch_size)


@dataclass
class DrafterCostModel(_SurfaceModel):
    """C_d of one block-drafter family's round in microseconds for the whole batch, over the
    family's axes (:data:`DRAFTER_AXES`): block C(tree_nodes, block_len, b), tfm C(tree_nodes,
    adapter_steps, b), dspark C(topk, block_len, b).  info adds ``family`` and ``block_len`` (the
    drafter's own block: a policy may not ask for more).

    ``by_context``: ((context_len, DrafterCostModel), ...) ascending where the rounds were timed
    at several contexts (the drafter attends to its cached context): ``predict(..., context_len=l)``
    interpolates linearly between the two nearest, clamped to the timed contexts and made
    non-decreasing in l; without l, C_d at the largest context (the same path: at least every
    smaller context's); with one context timed, the model's own surface."""

    family: str = "block"
    by_context: tuple = ()

    def predict(self, x, y, batch_size, context_len=None):
        if len(self.by_context) < 2:
            return self.surface.predict(x, y, batch_size)
        ls = [float(c) for c, _ in self.by_context]
        if context_len is None:      # the largest context's, through the same path (its running maximum)
            context_len = ls[-1]
        preds = [m.surface.predict(x, y, batch_size) for _, m in self.by_context]
        scalar = all(isinstance(v, (int, float)) for v in (x, y, batch_size, context_len))
        out = prev = preds[0]
        for i in range(1, len(ls)):      # clamped piecewise-linear in l, each context's at least the last's
            cur = max(preds[i], prev) if scalar else np.maximum(preds[i], prev)
            t = (min(max((context_len - ls[i - 1]) / (ls[i] - ls[i - 1]), 0.0), 1.0) if scalar
                 else np.clip((np.asarray(context_len, np.float64) - ls[i - 1]) / (ls[i] - ls[i - 1]), 0.0, 1.0))
            out = out + t * (cur - prev)
            prev = cur
        return float(out) if scalar else out

    @property
    def contexts(self) -> list[int]:
        """The contexts C_d was fitted at (one: []), ascending."""
        return [int(c) for c, _ in self.by_context]

    @property
    def block_len(self) -> int | None:
        v = self.info.get("block_len")
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

    def check_block_len(self, block_len: int) -> int:
        """``block_len`` if the drafter drafts that many positions, else a one-line error."""
        own = self.block_len
        if not isinstance(block_len, int) or block_len < 1 or (own is not None and block_len > own):
            raise SimtreeError(f"block length {block_len!r} is beyond the {self.family} drafter's "
                               f"{own if own is not None else '?'} positions")
        return block_len

    def to_dict(self) -> dict:
        out = {"family": self.family, **super().to_dict()}
        if self.by_context:
            out["by_context"] = [{"context_len": int(c), **_SurfaceModel.to_dict(m)} for c, m in self.by_context]
        return out

    @classmethod
    def from_dict(cls, d: dict):
        fam = d.get("family")
        if fam not in DRAFTER_FAMILIES:
            raise SimtreeError(f"unknown drafter family {fam!r} (known: {', '.join(DRAFTER_FAMILIES)})")
        base = _SurfaceModel.from_dict(d)
        per = d.get("by_context") or []
        if not isinstance(per, list):
            raise SimtreeError("by_context must be a list of {context_len, surface, info}")
        by = []
        for e in per:
            c = e.get("context_len") if isinstance(e, dict) else None
            if not isinstance(c, int) or isinstance(c, bool) or c < 0:
                raise SimtreeError(f"by_context: context_len must be an integer >= 0, got {c!r}")
            m = _SurfaceModel.from_dict(e)
            check_physical(m.surface, "draft")
            by.append((c, cls(m.surface, m.info, fam)))
        if [c for c, _ in by] != sorted({c for c, _ in by}):
            raise SimtreeError("by_context: contexts must be distinct and ascending")
        return cls(base.surface, base.info, fam, tuple(by))


@dataclass
class CostBundle:
    """Verify + draft cost models of one (model, device) with meta, and optionally ``drafters``:
    {family: :class:`DrafterCostModel`} of the block-drafter families the profile timed (the key
    is absent from bundles without them, which load as before).

    meta: {"model": str, "device": str, "source": str | dict, "synthetic": bool, ...}.
    """

    verify: VerifyCostModel
    draft: DraftCostModel
    meta: dict = field(default_factory=dict)
    drafters: dict = field(default_factory=dict)

    def drafter(self, family: str) -> DrafterCostModel:
        """The cost of ``family``'s round, or a one-line error naming what the bundle has."""
        if family not in self.drafters:
            have = ", ".join(sorted(self.drafters)) or "none"
            raise SimtreeError(f"the cost bundle of {self.meta.get('model', '?')} has no cost for drafter "
                               f"{family!r} (drafters with costs: {have})")
        return self.drafters[family]

    def decode_step_us(self, context_len, batch_size):
        """Plain (non-speculative) decode step: verify one token per sequence."""
        return self.verify.predict(1, context_len, batch_size)

    def to_dict(self) -> dict:
        for name in ("verify", "draft"):
            if not hasattr(getattr(self, name), "to_dict"):
                raise SimtreeError(f"cost bundle: the {name} model cannot be saved (no to_dict)")
        out = {"schema": COSTS_SCHEMA, "meta": self.meta, "verify": self.verify.to_dict(),
               "draft": self.draft.to_dict()}
        if self.drafters:
            out["drafters"] = {f: m.to_dict() for f, m in sorted(self.drafters.items())}
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write the bundle as JSON (floats round-trip exactly: predictions are bit-identical)."""
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "cost bundle") -> "CostBundle":
        """Rebuild a bundle (JSON of :meth:`to_dict`), checked for physically possible values
        (:func:`simtree.costs.checks.check_physical`); errors name ``where`` and the model."""
        if not isinstance(d, dict) or d.get("schema") != COSTS_SCHEMA:
            got = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise SimtreeError(f"{where}: not a simtree cost bundle (schema {got!r}, expected {COSTS_SCHEMA!r})")
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise SimtreeError(f"{where}: meta must be an object, got {type(meta).__name__}")
        if "synthetic" in meta and not isinstance(meta["synthetic"], bool):
            raise SimtreeError(f"{where}: meta.synthetic must be true or false, got {meta['synthetic']!r}")
        models = {}
        for name, model_cls in (("verify", VerifyCostModel), ("draft", DraftCostModel)):
            try:
                models[name] = model_cls.from_dict(d[name])
                check_physical(models[name].surface, name)
                if PAD_KEY in models[name].info:
                    check_pad_record(models[name].info[PAD_KEY], name + " model")
                if CELLS_KEY in models[name].info:
                    check_cells_record(models[name].info[CELLS_KEY], "info")
            except (KeyError, TypeError) as exc:
                raise SimtreeError(f"{where}: {name} model: missing or malformed field {exc}") from None
            except SimtreeError as exc:
                raise SimtreeError(f"{where}: {name} model: {exc}") from None
            set_range_label(models[name].surface, f"{meta.get('model', '?')} {name} cost model")
        drafters = d.get("drafters") or {}
        if not isinstance(drafters, dict):
            raise SimtreeError(f"{where}: drafters must be an object of drafter families")
        out = {}
        for fam, md in drafters.items():
            try:
                if not isinstance(md, dict) or md.get("family") != fam:
                    raise SimtreeError(f"entry {fam!r} must be an object with family {fam!r}")
                out[fam] = DrafterCostModel.from_dict(md)
                check_physical(out[fam].surface, "draft")
            except (KeyError, TypeError) as exc:
                raise SimtreeError(f"{where}: drafter {fam!r}: missing or malformed field {exc}") from None
            except SimtreeError as exc:
                raise SimtreeError(f"{where}: drafter {fam!r}: {exc}") from None
            set_range_label(out[fam].surface, f"{meta.get('model', '?')} {fam} drafter cost model")
        return cls(models["verify"], models["draft"], dict(meta), out)


def load_costs(path: str | os.PathLike) -> CostBundle:
    """Read a CostBundle JSON written by :meth:`CostBundle.save` (or ``simtree fit``); a
    bundle with physically impossible values is a one-line error naming the file."""
    return CostBundle.from_dict(read_json(path, "cost model"), f"cost bundle {path}")
