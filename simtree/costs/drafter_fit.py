"""C_d of the block-drafter families, fitted from their profile stages beside C_v and C_d.

    models, notes = fit_drafters(df, model="qwen3.6-27b", device=..., dtype=..., deployment="tp=1")

Per family with rows (``draft_block``, ``draft_tfm``, ``draft_dspark`` of the same model,
device, dtype and deployment as the verify rows): the surface over the family's axes
(:data:`~simtree.costs.model.DRAFTER_COLUMNS`: x, y, batch) with the same convex programs as
C_d (forms basis, grid, grid_lin; monotone in every axis, convex in x), the form with the
lowest k-fold held-out median relative error kept and that error reported.  A block drafter's
rows at several top-K are merged by median (the marginals' top-K is one top-k op).
The drafter's own block length (``drafter_config``) goes into the info: a policy asking for a
longer block is refused (:meth:`DrafterCostModel.check_block_len`).

Context is an axis where the rows hold several: the drafter's layers attend to its cached
context, work that grows with b x l (at batch 32 the rounds timed at context 1024 priced V4's
runs at ~260 7-10% high), so one surface is fitted per context timed and C_d at context l is
interpolated linearly between them (clamped to the timed range; the model's own surface, asked
without l, is the largest context's: :class:`~simtree.costs.model.DrafterCostModel`).

How a row was timed is its ``variant`` (``simtree.drafters``): ``round`` rows time the runtime's
own draft code (``kernels.layers.drafters.draft_round``) and are fitted as timed.  Older tables'
``layers`` rows of ``draft_block`` built the tree with ``kernels.layers.drafters.tree_from_marginals``,
n - 1 sequential steps of identical static-shape work, which the runtime's block round does not
run (it builds the tree sort-based in a few steps whatever n, ``kernels.layers.device_trees``,
as the MTP layer's best-first rounds do: 10-25 us over a linear chain's in the H100 modes runs);
priced with the steps, C_d grew about 43 us a node on the H100 at batch 8 that no round runs
(block_d8: 0.3 ms, block_d16: 0.65 ms of a 2.3 ms round; docs/validation.md).  Those rows get
the steps taken out (:func:`loop_free_block_rows`); ``round`` rows never do.  A table holding
both keeps the ``round`` rows of a family and says so.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from simtree.costs.model import DRAFTER_AXES, DRAFTER_COLUMNS, DRAFTER_FAMILIES, DRAFTER_STAGE, DrafterCostModel
from simtree.costs.surface_fit import fit_surface
from simtree.drafters import LOOP_BUILDER_VARIANT, ROUND_VARIANT, own_block_len
from simtree.errors import SimtreeError

__all__ = ["fit_drafters", "drafter_rows", "loop_free_block_rows", "timed_rows", "fitted_rows", "sweep_label",
           "DRAFTER_FORMS", "BUILDER_STEPS"]

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


BUILDER_STEPS = ("remove", "keep")     # fit_drafters: an older block row's tree-builder steps taken out, or kept


def timed_rows(rows: pd.DataFrame, family: str, builder_steps: str = "remove") -> tuple[pd.DataFrame, list[str]]:
    """(rows of one family as the runtime's round runs, notes): ``round`` rows as timed where the
    table has them (older ``layers`` rows of the same family dropped, the note says how many);
    else the ``layers`` rows, a block drafter's less its stage's tree-builder steps
    (:func:`loop_free_block_rows`; ``builder_steps="keep"``: as timed, the C_d the runs priced before
    the runtime built its tree sort-based).  Any other variant, or none known: one line."""
    if builder_steps not in BUILDER_STEPS:
        raise SimtreeError(f"builder_steps {builder_steps!r}: expected one of {', '.join(BUILDER_STEPS)}")
    variants = set(rows["variant"].unique())
    unknown = variants - {ROUND_VARIANT, LOOP_BUILDER_VARIANT}
    what = f"C_d of the {family} drafter from stage {DRAFTER_STAGE[family]}"
    if unknown:
        raise SimtreeError(f"{what}: unknown variant(s) {', '.join(sorted(unknown))} (known: {ROUND_VARIANT}, "
                           f"{LOOP_BUILDER_VARIANT})")
    if ROUND_VARIANT in variants:
        old = int((rows["variant"] != ROUND_VARIANT).sum())
        note = [f"{family} drafter: {old} older {LOOP_BUILDER_VARIANT!r} row(s) dropped beside the "
                f"{ROUND_VARIANT!r} rows (the runtime's round)"] if old else []
        return rows[rows["variant"] == ROUND_VARIANT], note
    if family != "block" or builder_steps == "keep":
        return rows, []
    rows, note = loop_free_block_rows(rows)
    return rows, [note] if note else []


def fit_drafters(df: pd.DataFrame, *, model: str, device: str, dtype: str, deployment: str, source: dict,
                 folds: int = 5, on_fit=None, builder_steps: str = "remove") -> tuple[dict, list[str]]:
    """({family: DrafterCostModel}, notes) for every family the table has rows of; a family
    whose rows cannot be fitted (too few points, one x value) is left out with a note, so a
    cut-short drafter sweep never stops the fit of C_v and C_d.  Rows at several contexts: one
    surface per context (module docstring); a context whose rows cannot be fitted is left out
    with a note.  ``builder_steps``: an older block row's tree-builder steps "remove"d (the
    runtime's round has none) or "keep"t (:func:`timed_rows`)."""
    out, notes = {}, []
    for fam in DRAFTER_FAMILIES:
        rows = drafter_rows(df, fam, model, device, dtype, deployment)
        if rows.empty:
            continue
        rows, fnotes = timed_rows(rows, fam, builder_steps)
        if fam == "block" and rows["topk"].nunique() > 1:
            fnotes.append(f"{fam} drafter rows at several topk merged by median")
        per_context = {}
        for ctx in sorted(rows["context_len"].unique()):
            sub = rows[rows["context_len"] == ctx]
            what = f"C_d of the {fam} drafter from stage {DRAFTER_STAGE[fam]}" + \
                (f" at context {int(ctx)}" if rows["context_len"].nunique() > 1 else "")
            try:
                per_context[int(ctx)] = _fit_one(sub, fam, what, source, folds, on_fit, fnotes)
            except SimtreeError as exc:   # too few points (a sweep cut short): the bundle goes without it
                notes.append(f"{fam} drafter not fitted: {exc}")
        if not per_context:
            continue
        top = per_context[max(per_context)]
        if len(per_context) > 1:
            top.by_context = tuple(sorted(per_context.items()))
            fnotes.append(f"{fam} drafter: C_d fitted at contexts {', '.join(map(str, sorted(per_context)))}, "
                          "interpolated linearly in l between them")
        top.info["notes"] = list(top.info["notes"]) + [n for n in fnotes if n not in top.info["notes"]]
        out[fam] = top
        notes.extend(fnotes)
        for ctx, m in sorted(per_context.items()):
            med = (m.info["fit_error"]["heldout"].get(m.info["form"]) or {}).get("median")
            at = f" at context {ctx}" if len(per_context) > 1 else ""
            notes.append(f"{fam} drafter{at}: form {m.info['form']}, held-out median error "
                         f"{'?' if med is None else f'{100 * med:.1f}%'} over {m.info['num_points']} points")
    return out, notes


def _fit_one(rows: pd.DataFrame, fam: str, what: str, source: dict, folds: int, on_fit, fnotes) -> DrafterCostModel:
    xc, yc, zc = DRAFTER_COLUMNS[fam]
    res = fit_surface(rows[xc], rows[yc], rows[zc], rows["latency_us_median"], "draft", DRAFTER_AXES[fam],
                      forms=DRAFTER_FORMS, folds=folds, what=what, on_fit=on_fit)
    info = {"form": res.form, "valid_range": res.surface.valid_range,
            "source": {**source, "stage": DRAFTER_STAGE[fam], "variant": rows["variant"].iloc[0],
                       "context_len": int(rows["context_len"].iloc[0])},
            "num_points": res.num_points, "columns": list(DRAFTER_COLUMNS[fam]),
            "fit_error": {"heldout": res.heldout, "in_sample": res.in_sample, "kept": res.form},
            "worst_residuals": res.worst, "worst_heldout_residuals": res.worst_heldout,
            "notes": list(res.notes) + list(fnotes), "convex_in_x": res.convex_in_x,
            "block_len": own_block_len(fam)}
    return DrafterCostModel(res.surface, info, fam)


def fitted_rows(df: pd.DataFrame, models: dict, *, model: str, device: str, dtype: str,
                deployment: str) -> pd.DataFrame:
    """The rows of ``df`` that ``models`` ({family: DrafterCostModel}, :func:`fit_drafters` with
    the same model, device, dtype and deployment) were fitted from: each family's stage at the
    variant its fit kept (:func:`timed_rows`) and the contexts it was fitted at."""
    parts = []
    for fam, m in models.items():
        rows = drafter_rows(df, fam, model, device, dtype, deployment)
        contexts = m.contexts or [int(m.info["source"]["context_len"])]
        parts.append(rows[(rows["variant"] == m.info["source"]["variant"]) & rows["context_len"].isin(contexts)])
    return pd.concat(parts) if parts else df.iloc[:0]


def sweep_label(rows: pd.DataFrame) -> str:
    """What names a drafter sweep beside its path: how its rows were timed, at which contexts and
    on which days (UTC, their timestamps), e.g. "variant round, contexts 256 and 1024, timed
    2026-12-07"."""
    if rows.empty:
        return "no rows"
    variants = sorted({str(v) for v in rows["variant"]})
    ctx = [str(c) for c in sorted({int(c) for c in rows["context_len"]})]
    days = sorted({str(t)[:10] for t in rows["timestamp"].dropna()}) if "timestamp" in rows else []
    text = (f"variant{'s' if len(variants) > 1 else ''} {', '.join(variants)}, "
            f"context{'s' if len(ctx) > 1 else ''} {', '.join(ctx[:-1]) + ' and ' if len(ctx) > 1 else ''}{ctx[-1]}")
    if days:
        text += f", timed {days[0]}" + (f" to {days[-1]}" if len(days) > 1 else "")
    return text


FIT_COLUMNS = ("model", "device", "drafter", "context_len", "form", "points", "heldout_median", "heldout_p90",
               "spread_median")


def fit_rows(profile) -> list[dict]:
    """Every (model, drafter family, context fitted) of a profile table: its kept form, points,
    held-out median and p90 relative error and the fitted rows' own timing spread
    ((p90 - p10) / median)."""
    from simtree.costs.profile_table import load_profile

    df = load_profile(profile)
    out = []
    for (model, device, dtype, dep), _ in df.groupby(["model", "device", "dtype", "deployment"]):
        models, _ = fit_drafters(df, model=model, device=device, dtype=dtype, deployment=dep,
                                 source={"profile": str(profile)})
        for fam, m in models.items():
            rows = fitted_rows(df, {fam: m}, model=model, device=device, dtype=dtype, deployment=dep)   # as timed
            for ctx, mc in (m.by_context or ((int(m.info["source"]["context_len"]), m),)):
                e = mc.info["fit_error"]["heldout"][mc.info["form"]]
                r = rows[rows["context_len"] == ctx] if m.by_context else rows
                spread = float(((r["latency_us_p90"] - r["latency_us_p10"]) / r["latency_us_median"]).median())
                out.append(dict(zip(FIT_COLUMNS, (model, device, fam, int(ctx), mc.info["form"], mc.info["num_points"],
                                                  float(e["median"]), float(e["p90"]), spread))))
    return out


def fit_table(profile) -> str:
    """Markdown: every (model, drafter family, context) of a profile table fitted, with its held-out error."""
    lines = ["| model | device | drafter | context | form | points | held-out median | held-out p90 | "
             "spread p10-p90 (median) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in fit_rows(profile):
        lines.append(f"| {r['model']} | {r['device']} | {r['drafter']} | {r['context_len']} | {r['form']} | "
                     f"{r['points']} | {100 * r['heldout_median']:.1f}% | {100 * r['heldout_p90']:.1f}% | "
                     f"{100 * r['spread_median']:.1f}% |")
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
