"""Which cost-model axes a plan queries outside the measured range: per candidate row (the
``extrapolated`` column of candidates.csv and plan.md) and over the whole plan (its notes)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from simtree.acceptance import Workload

__all__ = ["queried_ranges", "extrapolated_axes", "range_notes"]


def _valid_range(model) -> dict:
    try:
        vr = getattr(model, "valid_range", None)
    except Exception:   # noqa: BLE001 - a duck-typed model without one
        vr = None
    return dict(vr) if isinstance(vr, dict) else {}


_VERIFY_AXES = ("nodes_per_seq", "context_len", "batch_size")
_DRAFT_AXES = ("topk", "num_steps", "batch_size")


def queried_ranges(df: pd.DataFrame, workload: Workload) -> dict:
    """Per candidate row, the [lo, hi] it asks of every cost-model axis (draft: drafted rows).
    Contexts: the row's ``ctx_lo`` / ``ctx_hi`` where the frame has them (the planner's: an
    adaptive row's budget decisions ask C_v at contexts rounded to buckets, which may lie
    outside the run's own), else the workload's [l0, l0 + output_len]."""
    l0 = workload.mean_prompt_len
    b = df["batch_size"].to_numpy(np.float64)
    if "ctx_lo" in df.columns and "ctx_hi" in df.columns:
        ctx = (df["ctx_lo"].to_numpy(np.float64), df["ctx_hi"].to_numpy(np.float64))
    else:
        ctx = (np.full(len(df), l0), np.full(len(df), l0 + workload.output_len))
    return {("verify", "nodes_per_seq"): (df["min_nodes"].to_numpy(), df["max_nodes"].to_numpy()),
            ("verify", "context_len"): ctx,
            ("verify", "batch_size"): (b, b),
            ("draft", "num_steps"): (df["draft_steps"].to_numpy(np.float64),) * 2,
            ("draft", "topk"): (df["draft_topk"].to_numpy(np.float64),) * 2,
            ("draft", "batch_size"): (b, b)}


def extrapolated_axes(df: pd.DataFrame, queries: dict, costs) -> np.ndarray:
    """Per row: the "model.axis" names (joined by "+") it queries outside the measured range."""
    out = np.full(len(df), "", dtype=object)
    drafted = df["draft_steps"].to_numpy() > 0
    ranges = {"verify": _valid_range(costs.verify), "draft": _valid_range(costs.draft)}
    for (model, axis), (lo, hi) in queries.items():
        if axis not in ranges[model]:
            continue
        a, z = (float(v) for v in ranges[model][axis])
        bad = (lo < a) | (hi > z)
        if model == "draft":
            bad &= drafted
        out[bad] = out[bad] + np.where(out[bad] == "", "", "+") + f"{model}.{axis}"
    return out


def range_notes(costs, spans: dict) -> list[str]:
    """One note per (model, axis) the plan queries outside its measured range."""
    notes = []
    for model in ("verify", "draft"):
        vr = _valid_range(getattr(costs, model))
        for axis in (_VERIFY_AXES if model == "verify" else _DRAFT_AXES):
            if axis not in vr or (model, axis) not in spans:
                continue
            (a, z), (lo, hi) = (float(v) for v in vr[axis]), spans[(model, axis)]
            if lo < a or hi > z:
                notes.append(f"{model} cost model: {axis} measured in [{a:g}, {z:g}], the plan asks [{lo:g}, {hi:g}]: "
                             "costs outside the measured range are extrapolated (non-decreasing), not measured")
    return notes
