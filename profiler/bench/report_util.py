"""Markdown pieces shared by the benchmark report scripts (report_gdn, report_v4)."""
from __future__ import annotations

import numpy as np
import pandas as pd


def markdown_table(frame: pd.DataFrame, float_fmt: str | None = None, with_index: bool = False) -> str:
    """A pipe table without the optional tabulate dependency; NaN cells are left blank."""
    if with_index:
        frame = frame.reset_index()

    def cell(v) -> str:
        if isinstance(v, float) and np.isnan(v):
            return ""
        return float_fmt.format(v) if float_fmt and isinstance(v, float) else str(v)

    rows = [" | ".join(map(str, frame.columns)), " | ".join("---" for _ in frame.columns)]
    rows += [" | ".join(cell(v) for v in r) for r in frame.itertuples(index=False)]
    return "\n".join(f"| {r} |" for r in rows)
