"""C_d of the block-drafter families, fitted from their profile stages beside C_v and C_d.

    models, notes = fit_drafters(df, model="qwen3.6-27b", device=..., dtype=..., deployment="tp=1")

Per family with rows (``draft_block``, ``draft_tfm``, ``draft_dspark`` of the same model,
device, dtype and deployment as the verify rows): the surface over the family's axes
(:data:`~simtree.costs.model.DRAFTER_COLUMNS`: x, y, batch) with the same convex programs as
C_d (forms basis, grid, grid_lin; monotone in every axis, convex in x), the form with the
lowest k-fold held-out median relative error kept and that error reported.  Rows at several
context lengths are merged by median (the drafter's context adds little and C_d takes no l),
and so are a block drafter's rows at several top-K (the marginals' top-K is one top-k op).
The drafter's own block length (``drafter_config``) goes into the info: a policy asking for a
longer block is refused (:meth:`DrafterCostModel.check_block_len`).

The block family's C_d is the stage's round without its tree builder (:func:`loop_free_block_rows`):
the ``draft_block`` stage builds the tree with ``kernels.layers.drafters.tree_from_marginals``,
n - 1 sequential steps of identical static-shape work, while the runtime's block round builds it
sort-based in a few steps whatever n (``runtime/full/best_first.py``, as the MTP layer's
best-first rounds do: 10-25 us over a linear chain's in the H100 modes runs).  Priced with the
steps, C_d grew about 43 us a node on the H100 at batch 8 that no round runs (block_d8: 0.3 ms,
block_d16: 0.65 ms of a 2.3 ms round; docs/validation.md).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from simtree.costs.model import DRAFTER_AXES, DRAFTER_COLUMNS, DRAFTER_FAMILIES, DRAFTER_STAGE, DrafterCostModel
from simtree.costs.surface_fit import fit_surface
from simtree.drafters import own_block_len
from simtree.errors import SimtreeError

__all__ = ["fit_drafters", "drafter_rows", "loop_free_block_rows", "DRAFTER_FORMS"]

DRAFTER_FORMS = ("basis", "grid", "grid_lin")   # dense: the drafter's layers have no experts here


def drafter_rows(df: pd.DataFrame, family: str, model: str, device: str, dtype: str,
                 deployment: str) -> pd.DataFrame:
    """The table's rows of ``family``'s stage for one (model, device, dtype, deployment)."""
    return df[(df["stage"] == DRAFTER_STAGE[family]) & (df["model"] == model) & (df["device"] == device)
              & (df["dtype"] == dtype) & (df["deployment"] == deployment)]


def loop_free_block_rows(rows: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """(``draft_block`` rows, each latency less the stage's tree-builder steps, a note): the rows
    of one (block length, batch, top-K, context) lie on a line in n - 1 (the builder's steps,
    module docstring) whose slope is one step's time; a row less (n - 1) steps keeps its own
    timing noise, so the fit's held-out error still measures the rows.  What remains is the
    backbone and the marginals.  A group timed at one n only (n > 1) cannot be split and is kept
    as timed (the note says how many)."""
    out = rows.copy()
    keys = ["num_steps", "batch_size", "topk", "context_len"]
    steps_us, kept = [], 0
    for _, g in out.groupby(keys):
        steps = g["nodes_per_seq"].to_numpy(np.float64) - 1
        lat = g["latency_us_median"].to_numpy(np.float64)
        if np.unique(steps).size < 2:     # one n: timed at n = 1 it has no builder steps
            kept += int((steps > 0).any())
            continue
        slope = max(float(np.polyfit(steps, lat, 1)[0]), 0.0)
        out.loc[g.index, "latency_us_median"] = np.maximum(lat - slope * steps, 1e-3)   # each row its own noise
        steps_us.append(slope)
    notes = []
    if steps_us:
        notes.append(f"block drafter: the stage's tree-builder steps taken out (the runtime builds its tree "
                     f"sort-based): {np.median(steps_us):.1f} us a node (median over {len(steps_us)} "
                     "(block length, batch) lines)")
    if kept:
        notes.append(f"block drafter: {kept} (block length, batch) group(s) timed at one n > 1 only, their "
                     "builder steps kept in")
    return out, "; ".join(notes) or None


def fit_drafters(df: pd.DataFrame, *, model: str, device: str, dtype: str, deployment: str, source: dict,
                 folds: int = 5, on_fit=None) -> tuple[dict, list[str]]:
    """({family: DrafterCostModel}, notes) for every family the table has rows of; a family
    whose rows cannot be fitted (too few points, one x value) is left out with a note, so a
    cut-short drafter sweep never stops the fit of C_v and C_d."""
    out, notes = {}, []
    for fam in DRAFTER_FAMILIES:
        rows = drafter_rows(df, fam, model, device, dtype, deployment)
        if rows.empty:
            continue
        what = f"C_d of the {fam} drafter from stage {DRAFTER_STAGE[fam]}"
        if rows["variant"].nunique() > 1:
            raise SimtreeError(f"{what}: several variants ({', '.join(sorted(rows['variant'].unique()))})")
        fnotes = []
        for col in ("context_len", "topk") if fam == "block" else ("context_len",):
            if rows[col].nunique() > 1:
                fnotes.append(f"{fam} drafter rows at several {col} merged by median")
        if fam == "block":
            rows, note = loop_free_block_rows(rows)
            fnotes += [note] if note else []
        xc, yc, zc = DRAFTER_COLUMNS[fam]
        try:
            res = fit_surface(rows[xc], rows[yc], rows[zc], rows["latency_us_median"], "draft", DRAFTER_AXES[fam],
                              forms=DRAFTER_FORMS, folds=folds, what=what, on_fit=on_fit)
        except SimtreeError as exc:   # too few points (a sweep cut short): the bundle goes without it
            notes.append(f"{fam} drafter not fitted: {exc}")
            continue
        info = {"form": res.form, "valid_range": res.surface.valid_range,
                "source": {**source, "stage": DRAFTER_STAGE[fam], "variant": rows["variant"].iloc[0]},
                "num_points": res.num_points, "columns": list(DRAFTER_COLUMNS[fam]),
                "fit_error": {"heldout": res.heldout, "in_sample": res.in_sample, "kept": res.form},
                "worst_residuals": res.worst, "worst_heldout_residuals": res.worst_heldout,
                "notes": list(res.notes) + fnotes, "convex_in_x": res.convex_in_x,
                "block_len": own_block_len(fam)}
        out[fam] = DrafterCostModel(res.surface, info, fam)
        med = (res.heldout.get(res.form) or {}).get("median")
        notes.extend(fnotes)
        notes.append(f"{fam} drafter: form {res.form}, held-out median error "
                     f"{'?' if med is None else f'{100 * med:.1f}%'} over {res.num_points} points")
    return out, notes


FIT_COLUMNS = ("model", "device", "drafter", "form", "points", "heldout_median", "heldout_p90", "spread_median")


def fit_rows(profile) -> list[dict]:
    """Every (model, drafter family) of a profile table fitted: its kept form, points, held-out
    median and p90 relative error and the rows' own timing spread ((p90 - p10) / median)."""
    from simtree.costs.profile_table import load_profile

    df = load_profile(profile)
    out = []
    for (model, device, dtype, dep), _ in df.groupby(["model", "device", "dtype", "deployment"]):
        models, _ = fit_drafters(df, model=model, device=device, dtype=dtype, deployment=dep,
                                 source={"profile": str(profile)})
        for fam, m in models.items():
            e = m.info["fit_error"]["heldout"][m.info["form"]]
            rows = drafter_rows(df, fam, model, device, dtype, dep)
            spread = float(((rows["latency_us_p90"] - rows["latency_us_p10"]) / rows["latency_us_median"]).median())
            out.append(dict(zip(FIT_COLUMNS, (model, device, fam, m.info["form"], m.info["num_points"],
                                              float(e["median"]), float(e["p90"]), spread))))
    return out


def fit_table(profile) -> str:
    """Markdown: every (model, drafter family) of a profile table fitted, with its held-out error."""
    lines = ["| model | device | drafter | form | points | held-out median | held-out p90 | spread p10-p90 (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in fit_rows(profile):
        lines.append(f"| {r['model']} | {r['device']} | {r['drafter']} | {r['form']} | {r['points']} | "
                     f"{100 * r['heldout_median']:.1f}% | {100 * r['heldout_p90']:.1f}% | {100 * r['spread_median']:.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """``python -m simtree.costs.drafter_fit PROFILE [--out FIT.md | FIT.csv]``: the drafter families' fits."""
    import argparse
    import sys

    from simtree.fileio import write_text_atomic

    ap = argparse.ArgumentParser(prog="python -m simtree.costs.drafter_fit", description=main.__doc__)
    ap.add_argument("profile")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        if args.out and args.out.endswith(".csv"):   # the same table as data
            import pandas as pd
            text = pd.DataFrame(fit_rows(args.profile), columns=FIT_COLUMNS).to_csv(index=False, float_format="%.6g")
        else:
            text = fit_table(args.profile)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        write_text_atomic(args.out, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
