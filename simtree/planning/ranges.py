"""Which cost-model axes a plan queries outside the measured range: per candidate row (the
``extrapolated`` column of candidates.csv and plan.md) and over the whole plan (its notes)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from simtree.costs.model import DRAFT_AXES, VERIFY_AXES, Costs

__all__ = ["queried_ranges", "measured_ranges", "extrapolated_axes", "range_notes"]


def queried_ranges(df: pd.DataFrame) -> dict:
    """Per candidate row of the planner's frame, the [lo, hi] it asks of every cost-model axis
    (draft: drafted rows); contexts are the row's ``ctx_lo`` / ``ctx_hi`` (an adaptive row's
    budget decisions ask C_v at contexts rounded to buckets, which may lie outside the run's
    own [l0, l0 + output_len])."""
    b = df["batch_size"].to_numpy(np.float64)
    return {("verify", "nodes_per_seq"): (df["min_nodes"].to_numpy(), df["max_nodes"].to_numpy()),
            ("verify", "context_len"): (df["ctx_lo"].to_numpy(np.float64), df["ctx_hi"].to_numpy(np.float64)),
            ("verify", "batch_size"): (b, b),
            ("draft", "num_steps"): (df["draft_steps"].to_numpy(np.float64),) * 2,
            ("draft", "topk"): (df["draft_topk"].to_numpy(np.float64),) * 2,
            ("draft", "batch_size"): (b, b)}


def measured_ranges(costs: Costs) -> dict:
    """{"verify" | "draft": {axis: (lo, hi)}}: where each cost model was measured."""
    return {"verify": dict(costs.verify.valid_range), "draft": dict(costs.draft.valid_range)}


def extrapolated_axes(queries: dict, ranges: dict, drafted: np.ndarray) -> np.ndarray:
    """Per row: the "model.axis" names (joined by "+") it queries outside the measured
    ``ranges`` (``measured_ranges``); draft axes count only on ``drafted`` rows."""
    out = np.full(len(drafted), "", dtype=object)
    for (model, axis), (lo, hi) in queries.items():
        if axis not in ranges[model]:
            continue
        a, z = (float(v) for v in ranges[model][axis])
        bad = (lo < a) | (hi > z)
        if model == "draft":
            bad &= drafted
        out[bad] = out[bad] + np.where(out[bad] == "", "", "+") + f"{model}.{axis}"
    return out


def range_notes(ranges: dict, spans: dict) -> list[str]:
    """One note per (model, axis) the plan queries outside its measured ``ranges``."""
    notes = []
    for model in ("verify", "draft"):
        vr = ranges[model]
        for axis in (VERIFY_AXES if model == "verify" else DRAFT_AXES):
            if axis not in vr or (model, axis) not in spans:
                continue
            (a, z), (lo, hi) = (float(v) for v in vr[axis]), spans[(model, axis)]
            if lo < a or hi > z:
                notes.append(f"{model} cost model: {axis} measured in [{a:g}, {z:g}], the plan asks [{lo:g}, {hi:g}]: "
                             "costs outside the measured range are extrapolated (non-decreasing), not measured")
    return notes
