"""The adaptive budget against the best fixed one, per (workload, batch size) of a plan.

cost_aware decides every round's nodes (:mod:`simtree.planning.allocation`); a fixed policy
verifies the same shape every round.  :func:`adaptive_vs_fixed` sets the best cost_aware
candidate (over its drafted depths) beside the best fixed-shape candidate (none, linear, EAGLE
and best-first over budget and depth): the table `simtree plan` writes as
``adaptive_vs_fixed.csv``.
"""
from __future__ import annotations

import pandas as pd

from simtree.errors import SimtreeError

__all__ = ["FIXED_MODES", "ADAPTIVE_VS_FIXED_COLUMNS", "adaptive_vs_fixed"]

FIXED_MODES = ("none", "linear", "eagle", "best_first")
ADAPTIVE_VS_FIXED_COLUMNS = ("workload", "batch_size", "best_fixed_policy", "best_fixed_tok_s", "adaptive_policy",
                             "adaptive_tok_s")


def adaptive_vs_fixed(candidates: pd.DataFrame, adaptive_mode: str = "cost_aware") -> pd.DataFrame:
    """One row per (workload, batch size) with both kinds of candidate: the best fixed-shape
    policy and the best ``adaptive_mode`` policy with their predicted tok/s (columns
    ``ADAPTIVE_VS_FIXED_COLUMNS``).  Empty when the plan scored no adaptive candidate."""
    if adaptive_mode not in ("cost_aware", "batch_alloc"):
        raise SimtreeError(f"adaptive mode must be cost_aware or batch_alloc, got {adaptive_mode!r}")
    rows = []
    for (workload, b), grp in candidates.groupby(["workload", "batch_size"], sort=False):
        fixed, adaptive = grp[grp["mode"].isin(FIXED_MODES)], grp[grp["mode"] == adaptive_mode]
        if fixed.empty or adaptive.empty:
            continue
        f, a = fixed.loc[fixed["tok_s"].idxmax()], adaptive.loc[adaptive["tok_s"].idxmax()]
        rows.append((workload, int(b), f["policy"], float(f["tok_s"]), a["policy"], float(a["tok_s"])))
    return pd.DataFrame(rows, columns=list(ADAPTIVE_VS_FIXED_COLUMNS))
