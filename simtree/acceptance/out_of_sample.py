"""Acceptance predicted out of sample: a model fitted on some traces, scored on others.

The table (``reports/validation/acceptance_out_of_sample.csv``, written by
``python -m simtree.runtime.acceptance_oos``): one row per (drafter, policy, workload, split)
run, its measured mean accepted tokens per round (bonus included) beside the prediction of an
acceptance model (:func:`simtree.acceptance.predict.accepted_per_round`, or the predictor the
caller passes: the runtime's adds the adaptive modes' analytic decision): each run's model is a drafter calibration, fitted on linear
runs' outcomes (``calibrated_on``), applied to the drafter's confidences on the run's own
prompts (:mod:`simtree.acceptance.transfer`); other predictors go in further columns (``extras``).
``split`` (:data:`SPLITS`): ``policies`` (trees on prompts the calibration never saw, calibrated
on the same workload's linear runs), ``prompts`` (linear runs on such prompts), ``workload``
(another workload's prompts, every policy), ``workload_shift`` (the same, the calibration moved
by a few of the new workload's own rounds: :mod:`simtree.acceptance.workload_shift`) or
``in_sample`` (the calibrating runs); the families reported (:data:`FAMILIES`) are split x
workload.  ``prompts``: whether the run's prompts are ``fresh`` (no version of the model was
developed on them) or ``seen`` (the calibrating runs always: their outcomes were fitted).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.traces import sequence_ids

__all__ = ["COLUMNS", "SPLITS", "FAMILIES", "short_of", "measured_accepted", "measured_se", "oos_table", "oos_summary",
           "summary_markdown", "TARGETS"]

COLUMNS = ["drafter", "policy", "workload", "split", "measured_accepted", "predicted_accepted", "rel_err"]
TARGETS = {"median_abs_rel_err": 0.03, "max_abs_rel_err": 0.08}


def measured_accepted(records) -> float:
    """Mean tokens a sequence gains per round (accepted drafts + the bonus) over the records."""
    return float(np.mean([r.num_accepted + 1 for r in records])) if records else float("nan")


def measured_se(records, resamples: int = 400, seed: int = 0) -> float:
    """One standard error of :func:`measured_accepted` from resampling whole sequences (a
    sequence's rounds are correlated): how far another draw of as many prompts would land."""
    if not records:
        return float("nan")
    seq = sequence_ids(records)
    gained = np.array([r.num_accepted + 1 for r in records], np.float64)
    sums, counts = np.bincount(seq, gained), np.bincount(seq).astype(np.float64)
    pick = np.random.default_rng(seed).integers(0, sums.size, (resamples, sums.size))
    return float(np.std(sums[pick].sum(1) / counts[pick].sum(1), ddof=1))


def _fixed_shape(model, run: dict) -> float:
    return accepted_per_round(model, run["mode"], run["params"])


def oos_table(model, runs: list[dict], predict=_fixed_shape, extras: dict | None = None) -> pd.DataFrame:
    """Rows of :data:`COLUMNS` (and ``measured_se``, :func:`measured_se`) for ``runs`` (dicts:
    drafter, policy, mode, params, workload, split, records, and whatever ``predict`` reads),
    each predicted by the acceptance ``model``: ``predict(model, run)``, accepted tokens per round
    with the bonus (default :func:`simtree.acceptance.predict.accepted_per_round` of the run's
    mode and params; the adaptive modes' analytic decision needs the planner's, which the
    caller passes).  ``model``: one model
    for every run, or {key: model} picked by each run's ``drafts`` key (a model per split, from
    that split's drafter confidences).  ``extras``: {name: model or {key: model}}, other
    predictors whose predictions go in ``<name>_predicted`` / ``<name>_rel_err``."""
    extras = extras or {}

    def pick(acc, run):
        return acc[run["drafts"]] if isinstance(acc, dict) else acc

    rows = []
    for run in runs:
        measured = measured_accepted(run["records"])
        predicted = predict(pick(model, run), run)
        se = measured_se(run["records"])
        row = {"drafter": run["drafter"], "policy": run["policy"], "workload": run["workload"],
               "split": run["split"], "measured_accepted": measured, "predicted_accepted": predicted,
               "rel_err": predicted / measured - 1.0, "calibrated_on": run.get("calibrated_on", ""),
               "prompts": run.get("prompts", ""), "measured_se": se,
               "err_in_se": (predicted - measured) / se if se > 0 else float("nan")}
        for name, acc in extras.items():
            row[f"{name}_predicted"] = predict(pick(acc, run), run)
            row[f"{name}_rel_err"] = row[f"{name}_predicted"] / measured - 1.0
        rows.append(row)
    df = pd.DataFrame(rows, columns=[*COLUMNS, "calibrated_on", "prompts", "measured_se", "err_in_se", "err_in_joint_se",
                                     *[f"{n}_{c}" for n in extras for c in ("predicted", "rel_err")]])
    df["err_in_joint_se"] = df["rel_err"] / _joint_rel_se(df)
    return df


def _joint_rel_se(df: pd.DataFrame) -> pd.Series:
    """Per row: the relative standard error of measured against predicted when both are means of
    sampled prompts - the measured mean's and the calibrating runs' (the median relative s.e. of
    the ``in_sample`` rows of the ``calibrated_on`` workload), added in quadrature; the measured
    mean's alone where the table has no calibrating rows."""
    rel = df["measured_se"] / df["measured_accepted"]
    cal = rel[df["split"] == "in_sample"].groupby(df["workload"]).median()
    source = df["calibrated_on"].astype(str).str.partition("+")[0]      # a shifted calibration: its source's
    joint = np.sqrt(rel ** 2 + source.map(cal).fillna(0.0).astype(float) ** 2)
    return joint.where(joint > 0)         # no spread measured on either side: no error in its units


def short_of(median: float, worst: float) -> list[str]:
    """The targets (keys of :data:`TARGETS`) that a family's ``median`` and ``worst`` |rel_err| miss."""
    return [key for key, value in (("median_abs_rel_err", median), ("max_abs_rel_err", worst))
            if value > TARGETS[key]]


def _stats(err: pd.Series) -> dict:
    a = err.abs()
    out = {"rows": int(a.size), "median_abs_rel_err": float(a.median()), "max_abs_rel_err": float(a.max())}
    out["meets_targets"] = not short_of(out["median_abs_rel_err"], out["max_abs_rel_err"])
    return out


# the out-of-sample families (split, workload), each reported alone (never pooled into one figure),
# in words; SPLITS: the out-of-sample values of ``split``
FAMILIES = {("policies", "sharegpt"): "chat linear -> chat trees", ("prompts", "sharegpt"): "chat linear -> chat linear",
            ("policies", "sharegpt_code"): "code linear -> code trees (ShareGPT code)",
            ("prompts", "sharegpt_code"): "code linear -> code linear (ShareGPT code)",
            ("workload", "sharegpt_code"): "chat linear -> code, every policy (ShareGPT code)",
            ("workload_shift", "sharegpt_code"): "chat linear + a few code rounds -> code, every policy (ShareGPT code)",
            ("policies", "humaneval"): "code linear -> code trees (HumanEval)",
            ("prompts", "humaneval"): "code linear -> code linear (HumanEval)",
            ("workload", "humaneval"): "chat linear -> code, every policy (HumanEval)",
            ("workload_shift", "humaneval"): "chat linear + a few code rounds -> code, every policy (HumanEval)",
            ("policies", "sharegpt", "block"): "block tree of 8 -> block trees of 4 / 16 (chat)",
            ("prompts", "sharegpt", "block"): "block tree of 8 -> block tree of 8 (chat)",
            ("policies", "sharegpt", "dspark"): "DSpark chain of 7 -> chain of 3, survival thresholds (chat)",
            ("prompts", "sharegpt", "dspark"): "DSpark chain of 7 -> chain of 7 (chat)"}
SPLITS = tuple(dict.fromkeys(s for s, *_ in FAMILIES))


def _prompt_status(g: pd.DataFrame) -> str:
    """The family's prompts: fresh, seen, or mixed (a row without the column: unlabelled)."""
    vals = sorted(set(g["prompts"].fillna("").astype(str))) if "prompts" in g else [""]
    return vals[0] if len(vals) == 1 else "mixed"


def _who(df: pd.DataFrame) -> pd.Series:
    """The workload, with the drafter where it is not the MTP layer (``sharegpt block``): a block
    drafter's rows are never pooled with the MTP drafter's."""
    drafter = df["drafter"].astype(str)
    return df["workload"] + drafter.where(drafter == "mtp", " " + drafter).where(drafter != "mtp", "")


def _family(df: pd.DataFrame) -> pd.Series:
    return df["split"] + " " + _who(df)


def oos_summary(df: pd.DataFrame) -> dict:
    """|rel_err| per out-of-sample family (``split`` x ``workload``: :data:`SPLITS`) and per
    family x (drafter, policy family), each against the targets; the calibrating runs
    (``in_sample``) apart; the sampling error of the measured means; how far the same linear
    policy measured on a workload's two prompt halves lands apart."""
    oos = df[df["split"].isin(list(SPLITS))]
    fam = _family(oos)
    cal, mtp = df["split"] == "in_sample", df["drafter"] == "mtp"
    z = oos["err_in_se"].abs() if "err_in_se" in oos else None
    zj = oos["err_in_joint_se"].abs() if "err_in_joint_se" in oos else None
    shape = oos["policy"].str.extract(r"^(best_first|cost_aware|batch_alloc|[a-z]+)", expand=False)
    shape = shape.where(oos["drafter"] == "mtp", oos["policy"])     # a block drafter's shapes: each its own
    out = {"targets": TARGETS,
           "families": {k: {**_stats(g["rel_err"]), "what": FAMILIES.get(tuple(k.split()), k),
                            "prompts": _prompt_status(g),
                            **({} if z is None else {"median_abs_err_in_se": float(z[g.index].median()),
                                                     "max_abs_err_in_se": float(z[g.index].max())}),
                            **({} if zj is None else {"median_abs_err_in_joint_se": float(zj[g.index].median()),
                                                      "max_abs_err_in_joint_se": float(zj[g.index].max())})}
                        for k, g in oos.groupby(fam)},
           "by_drafter_shape": {f"{k} {f}" if d != "mtp" else f"{k} {d} {f}": _stats(g["rel_err"])
                                for (k, d, f), g in oos.groupby([fam, oos["drafter"], shape])},
           "in_sample": _stats(df.loc[cal & mtp, "rel_err"]) if (cal & mtp).any() else None,
           "in_sample_block_drafters": {d: _stats(g["rel_err"]) for d, g in df[cal & ~mtp].groupby("drafter")}}
    if "measured_se" in df:
        half = df["split"].map(lambda s: "calibration" if s == "in_sample" else "test")
        rel_se = df["measured_se"] / df["measured_accepted"]
        out["measured_se_rel"] = {f"{w} {h}": float(g.median()) for (w, h), g in rel_se.groupby([_who(df), half])}
    gaps = {}
    pairs = df[df["split"].isin(["in_sample", "prompts"])]
    for w, g in pairs.groupby(_who(pairs)):
        halves = g.pivot_table(index="policy", columns="split", values="measured_accepted")
        if {"in_sample", "prompts"} <= set(halves.columns):
            gap = (halves["prompts"] / halves["in_sample"] - 1.0).abs().dropna()
            gaps[w] = {"median": float(gap.median()), "max": float(gap.max()), "policies": int(gap.size)}
    out["prompt_halves_gap"] = gaps
    out["extras"] = {c[:-len("_rel_err")]: {"families": {k: _stats(g[c]) for k, g in oos.groupby(fam)}}
                     for c in df.columns if c.endswith("_rel_err")}
    out["meets_targets"] = bool(out["families"]) and all(f["meets_targets"] for f in out["families"].values())
    return out


def summary_markdown(df: pd.DataFrame, summary: dict, header: list[str]) -> str:
    """A short generated summary: the header lines, each family's errors against the targets,
    the shapes within each family, the worst rows."""
    def pct(x):
        return "-" if x != x else f"{100 * x:.2f}%"      # NaN: a predictor the row's drafter has not
    t, extras = summary["targets"], summary.get("extras") or {}
    fams = summary["families"]
    lines = [*header, "", f"Out of sample, each family against the targets (median {pct(t['median_abs_rel_err'])}, "
             f"worst {pct(t['max_abs_rel_err'])}): "
             + "; ".join(f"{k} ({v['what']}, {v.get('prompts') or 'unlabelled'} prompts): median "
                         f"{pct(v['median_abs_rel_err'])}, worst {pct(v['max_abs_rel_err'])} "
                         f"over {v['rows']} rows, {'met' if v['meets_targets'] else 'not met'}" for k, v in fams.items())
             + "."]
    if summary["in_sample"]:
        i = summary["in_sample"]
        lines += [f"In sample (the calibrating linear runs, {i['rows']} rows): median |error| "
                  f"{pct(i['median_abs_rel_err'])}, worst {pct(i['max_abs_rel_err'])}."]
    for d, i in (summary.get("in_sample_block_drafters") or {}).items():
        lines += [f"In sample, {d} (its calibrating run, {i['rows']} row): error {pct(i['median_abs_rel_err'])} "
                  "(zero by construction: the depth shift is fitted to make this run's prediction its measurement)."]
    lines.append("")
    if summary.get("measured_se_rel"):
        lines += ["Sampling error of the measured means (one standard error, whole sequences resampled), median: "
                  + ", ".join(f"{k} {pct(v)}" for k, v in summary["measured_se_rel"].items()) + "."]
    for w, g in (summary.get("prompt_halves_gap") or {}).items():
        lines += [f"The same calibrating policy measured on the two {w} prompt halves differs by a median {pct(g['median'])} "
                  f"(at most {pct(g['max'])}, {g['policies']} policies): no calibration on one half predicts the other "
                  "closer than the halves agree."]
    lines.append("")
    more = list(extras)

    def in_se(v, what):
        return (f"{v[f'median_abs_err_in_{what}']:.2f} / {v[f'max_abs_err_in_{what}']:.2f}"
                if f"median_abs_err_in_{what}" in v else "-")
    lines += ["| split family | what | prompts | rows | median abs err | worst | targets | median / worst abs err "
              "in measured s.e. | in joint s.e. |" + "".join(f" {n} median | {n} worst |" for n in more),
              "|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(more)]
    lines += [f"| {k} | {v['what']} | {v.get('prompts', '')} | {v['rows']} | {pct(v['median_abs_rel_err'])} | "
              f"{pct(v['max_abs_rel_err'])} | {'met' if v['meets_targets'] else 'not met'} | {in_se(v, 'se')} | "
              f"{in_se(v, 'joint_se')} |"
              + "".join(f" {pct(extras[n]['families'][k]['median_abs_rel_err'])} | "
                        f"{pct(extras[n]['families'][k]['max_abs_rel_err'])} |" for n in more) for k, v in fams.items()]
    lines += ["", "| split family x drafter x shape | rows | median abs err | worst |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['rows']} | {pct(v['median_abs_rel_err'])} | {pct(v['max_abs_rel_err'])} |"
              for k, v in summary["by_drafter_shape"].items()]
    lines.append("")
    worst = df[df["split"].isin(list(SPLITS)) & (df["drafter"] == "mtp")].assign(a=lambda d: d["rel_err"].abs()).nlargest(8, "a")
    lines += ["Worst rows:", "", "| policy | workload | split | prompts | calibrated on | measured | predicted | error |"
              + "".join(f" {n} | {n} error |" for n in more), "|---|---|---|---|---|---|---|---|" + "---|---|" * len(more)]
    lines += [f"| {r['policy']} | {r['workload']} | {r['split']} | {r.get('prompts', '')} | {r.get('calibrated_on', '')} | "
              f"{r['measured_accepted']:.3f} | {r['predicted_accepted']:.3f} | {100 * r['rel_err']:+.2f}% |"
              + "".join(f" {r[n + '_predicted']:.3f} | {100 * r[n + '_rel_err']:+.2f}% |" for n in more)
              for _, r in worst.iterrows()]
    blocks = df[df["drafter"] != "mtp"]
    if len(blocks):
        lines += ["", "Block drafters' rows (each calibrated on its own calibrating run, `in_sample`):", "",
                  "| drafter | policy | split | prompts | measured | predicted | error | in measured s.e. |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['drafter']} | {r['policy']} | {r['split']} | {r.get('prompts', '')} | {r['measured_accepted']:.3f} | "
                  f"{r['predicted_accepted']:.3f} | {100 * r['rel_err']:+.2f}% | {r['err_in_se']:+.2f} |"
                  for _, r in blocks.iterrows()]
    return "\n".join(lines) + "\n"
