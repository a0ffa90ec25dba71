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
"""
from __future__ import annotations

import pandas as pd

from simtree.costs.model import DRAFTER_AXES, DRAFTER_COLUMNS, DRAFTER_FAMILIES, DRAFTER_STAGE, DrafterCostModel
from simtree.costs.surface_fit import fit_surface
from simtree.drafters import own_block_len
from simtree.errors import SimtreeError

__all__ = ["fit_drafters", "drafter_rows", "DRAFTER_FORMS"]

DRAFTER_FORMS = ("basis", "grid", "grid_lin")   # dense: the drafter's layers have no experts here


def drafter_rows(df: pd.DataFrame, family: str, model: str, device: str, dtype: str,
                 deployment: str) -> pd.DataFrame:
    """The table's rows of ``family``'s stage for one (model, device, dtype, deployment)."""
    return df[(df["stage"] == DRAFTER_STAGE[family]) & (df["model"] == model) & (df["device"] == device)
              & (df["dtype"] == dtype) & (df["deployment"] == deployment)]


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
