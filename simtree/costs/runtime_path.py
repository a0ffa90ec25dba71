"""Which runtime path a cost bundle's profile timed, against the path the runtime runs today.

A model's verify step is only as good as the code it was timed on: DeepSeek-V4's layer runs
forms (``kernels/layers/forms.py``: the CSA top-k, the hyper-connections, the compressors'
projections, the pool) and stores its attention's linears in a format (bf16, or FP8 as the
checkpoint ships them, ``v4.attn_proj_dtype``); when the runtime's defaults move on, a bundle
measured before prices a path the runtime no longer runs.  The profile sweep records the path
of every model it times (``runtime_paths`` in the table's ``.meta.json``, which ``simtree fit``
copies into the bundle's ``profile_meta``); a bundle without the record was timed before it
existed, on :data:`LEGACY_V4` for a V4 model.

    runtime_path(shape)              {"attn_proj_dtype": "fp8", "v4_topk": "fused", ...} ({} for Qwen)
    path_changes(bundle_meta)        ["attention linears bf16 (now fp8)", ...] or []
    path_note(bundle_meta)           one line for ``simtree plan`` / ``simulate``, or None
"""
from __future__ import annotations

__all__ = ["LEGACY_V4", "V4_FORMS", "runtime_path", "recorded_path", "path_changes", "path_note"]

V4_FORMS = ("v4_topk", "v4_hc", "v4_comp", "v4_pool", "v4_proj")   # v4_proj: recorded as attn_proj_dtype
# the V4 path every profile timed before the sweep recorded one (the runtime's defaults until 2026-12-08)
LEGACY_V4 = {"attn_proj_dtype": "bf16", "v4_topk": "sort", "v4_hc": "torch", "v4_comp": "fp32", "v4_pool": "whole"}
_LABELS = {"attn_proj_dtype": "attention linears"}


def runtime_path(shape, forms: dict | None = None) -> dict:
    """What the runtime runs for ``shape``: its V4 ``forms`` resolved (the profiler passes the
    forms in effect, kernels.layers.forms.v4_form; default the runtime's, quant.V4_AUTO); {} for a
    family whose path has no switches a bundle must match."""
    if shape.family != "v4":
        return {}
    from simtree.quant import V4_AUTO, runtime_attn_proj
    forms = V4_AUTO if forms is None else forms
    return {"attn_proj_dtype": runtime_attn_proj(shape.v4, forms["v4_proj"]),
            **{k: forms[k] for k in V4_FORMS if k != "v4_proj"}}


def _shape(model: str):
    from simtree.models import get_model
    try:
        return get_model(model)
    except Exception:  # noqa: BLE001 - a model this installation cannot name: nothing to compare
        return None


def recorded_path(meta: dict, shape=None) -> dict | None:
    """The path the bundle's profile timed its model on (None: the model is unknown here)."""
    model = str(meta.get("model", ""))
    shape = shape or _shape(model)
    if shape is None:
        return None
    paths = (meta.get("profile_meta") or {}).get("runtime_paths")
    if paths is not None:
        return dict(paths.get(model, {}))
    return dict(LEGACY_V4) if shape.family == "v4" else {}


def path_changes(meta: dict) -> list[str]:
    """Each switch whose recorded value is not what the runtime runs now, as "name was (now is)"."""
    shape = _shape(str(meta.get("model", "")))
    then = recorded_path(meta, shape)
    if then is None or meta.get("synthetic"):
        return []
    now = runtime_path(shape)
    return [f"{_LABELS.get(k, k)} {then.get(k, '?')} (now {v})" for k, v in now.items() if then.get(k) != v]


def path_note(meta: dict) -> str | None:
    """One line naming what changed since the bundle's profile was timed, or None."""
    changes = path_changes(meta)
    if not changes:
        return None
    recorded = "" if "runtime_paths" in (meta.get("profile_meta") or {}) else " (its profile records no path: timed before 2026-12-08)"
    return (f"{meta.get('model')}: its costs were timed on an earlier runtime path{recorded}: {', '.join(changes)}; "
            "the predictions price that path until the model is profiled again (simtree profile, simtree fit)")
