"""Acceptance predicted out of sample: a model fitted on some traces, scored on others.

The table (``reports/validation/acceptance_out_of_sample.csv``, written by
``python -m simtree.runtime.acceptance_oos``): one row per (drafter, policy, workload, split)
run, its measured mean accepted tokens per round (bonus included) beside the prediction of an
acceptance model (:func:`simtree.acceptance.predict.accepted_per_round` for every policy; the
adaptive modes' analytic decision): there, each split's model is the drafter's calibration,
fitted on one linear run's outcomes, applied to that split's own drafter confidences
(:mod:`simtree.acceptance.transfer`); other predictors go in further columns (``extras``).
``split``: ``fit`` (the prompts the calibration was fitted on: out of sample in the policy
unless the row is the fitted run itself, ``in_sample`` then) or ``heldout`` (prompts whose
acceptance outcomes no prediction read).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.traces import sequence_ids

__all__ = ["COLUMNS", "measured_accepted", "predicted_accepted", "oos_table", "oos_summary", "summary_markdown", "TARGETS"]

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


def predicted_accepted(model, mode: str, params: dict, costs=None, batch_size: int = 1,
                       context_len: float = 0.0) -> float:
    """Accepted tokens per round (bonus included) the acceptance ``model`` predicts for a policy;
    cost_aware and batch_alloc: the simulator's analytic decision at ``context_len`` for
    ``batch_size`` under ``costs`` (each level's budget, the levels weighed as its rounds spread)."""
    if mode not in ("cost_aware", "batch_alloc"):
        return accepted_per_round(model, mode, params)
    from simtree.planning.adaptive import AdaptiveRounds
    from simtree.planning.modes import PolicySpec
    ad = AdaptiveRounds(model, PolicySpec.from_dict(mode, dict(params)), costs, batch_size)
    nodes, weights = ad.decide(float(context_len))
    gain = 1.0 + np.array([ad.phi(lv, int(n)) for lv, n in enumerate(nodes)])
    return float(np.asarray(weights) @ gain)


def oos_table(model, runs: list[dict], costs=None, extras: dict | None = None) -> pd.DataFrame:
    """Rows of :data:`COLUMNS` (and ``measured_se``, :func:`measured_se`) for ``runs`` (dicts:
    drafter, policy, mode, params, workload, split, records, and for the adaptive modes
    batch_size and context_len), each predicted by the acceptance ``model``
    (:func:`predicted_accepted`; ``costs``: the adaptive modes' bundle).  ``model``: one model
    for every run, or {key: model} picked by each run's ``drafts`` key (a model per split, from
    that split's drafter confidences).  ``extras``: {name: model or {key: model}}, other
    predictors whose predictions go in ``<name>_predicted`` / ``<name>_rel_err``."""
    extras = extras or {}

    def pick(acc, run):
        return acc[run["drafts"]] if isinstance(acc, dict) else acc

    rows = []
    for run in runs:
        measured = measured_accepted(run["records"])
        args = (run["mode"], run["params"], costs, run.get("batch_size", 1), run.get("context_len", 0.0))
        predicted = predicted_accepted(pick(model, run), *args)
        row = {"drafter": run["drafter"], "policy": run["policy"], "workload": run["workload"],
               "split": run["split"], "measured_accepted": measured, "predicted_accepted": predicted,
               "rel_err": predicted / measured - 1.0, "measured_se": measured_se(run["records"])}
        for name, acc in extras.items():
            row[f"{name}_predicted"] = predicted_accepted(pick(acc, run), *args)
            row[f"{name}_rel_err"] = row[f"{name}_predicted"] / measured - 1.0
        rows.append(row)
    return pd.DataFrame(rows, columns=[*COLUMNS, "measured_se", *[f"{n}_{c}" for n in extras
                                                                   for c in ("predicted", "rel_err")]])


def _stats(err: pd.Series) -> dict:
    a = err.abs()
    return {"rows": int(a.size), "median_abs_rel_err": float(a.median()), "max_abs_rel_err": float(a.max())}


def oos_summary(df: pd.DataFrame) -> dict:
    """|rel_err| over the out-of-sample rows (split ``heldout``: prompts and workloads the
    calibration never saw), overall and per (drafter, policy family), and per (workload, split)
    for every predicted split (``fit``: the calibration's own prompts under other policies, not
    out of sample); whether the targets are met (on the held-out rows)."""
    predicted = df[df["split"] != "in_sample"]
    oos = df[df["split"] == "heldout"]
    family = oos["policy"].str.extract(r"^(best_first|cost_aware|batch_alloc|[a-z]+)", expand=False)
    out = {"out_of_sample": _stats(oos["rel_err"]), "targets": TARGETS,
           "by_drafter_shape": {f"{d} {f}": _stats(g["rel_err"]) for (d, f), g in oos.groupby([oos["drafter"], family])},
           "by_workload_split": {f"{w} {s}": _stats(g["rel_err"])
                                 for (w, s), g in predicted.groupby(["workload", "split"])},
           "same_prompts": _stats(df.loc[df["split"] == "fit", "rel_err"]) if (df["split"] == "fit").any() else None,
           "in_sample": _stats(df.loc[df["split"] == "in_sample", "rel_err"]) if (df["split"] == "in_sample").any()
           else None}
    rel_se = df["measured_se"] / df["measured_accepted"] if "measured_se" in df else None
    if rel_se is not None:
        out["measured_se_rel"] = {f"{w} {s}": float(g.median()) for (w, s), g in
                                  rel_se.groupby([df["workload"], df["split"].replace("in_sample", "fit")])}
    share = df[df["workload"] == df["workload"].iloc[0]] if len(df) else df
    halves = share.assign(half=share["split"].replace("in_sample", "fit")).pivot_table(
        index="policy", columns="half", values="measured_accepted")
    if {"fit", "heldout"} <= set(halves.columns):
        gap = (halves["heldout"] / halves["fit"] - 1.0).abs()
        out["prompt_halves_gap"] = {"workload": str(df["workload"].iloc[0]), "median": float(gap.median()),
                                    "max": float(gap.max())}
    out["extras"] = {c[:-len("_rel_err")]: {"out_of_sample": _stats(oos[c]),
                                            "by_workload_split": {f"{w} {s}": _stats(g[c])
                                                                  for (w, s), g in predicted.groupby(["workload", "split"])}}
                     for c in df.columns if c.endswith("_rel_err")}
    o = out["out_of_sample"]
    out["meets_targets"] = bool(o["median_abs_rel_err"] <= TARGETS["median_abs_rel_err"]
                                and o["max_abs_rel_err"] <= TARGETS["max_abs_rel_err"])
    return out


def summary_markdown(df: pd.DataFrame, summary: dict, header: list[str]) -> str:
    """A short generated summary: the header lines, the overall and grouped errors, the worst rows."""
    def pct(x):
        return f"{100 * x:.2f}%"
    o, t = summary["out_of_sample"], summary["targets"]
    lines = [*header, "",
             f"Out of sample ({o['rows']} rows): median |error| {pct(o['median_abs_rel_err'])}, worst "
             f"{pct(o['max_abs_rel_err'])} (targets {pct(t['median_abs_rel_err'])} / {pct(t['max_abs_rel_err'])}: "
             f"{'met' if summary['meets_targets'] else 'not met'})."]
    if summary.get("same_prompts"):
        f = summary["same_prompts"]
        lines += [f"The calibration's own prompts under other policies ({f['rows']} rows; not out of sample): median "
                  f"|error| {pct(f['median_abs_rel_err'])}, worst {pct(f['max_abs_rel_err'])}."]
    lines += [""]
    if summary["in_sample"]:
        lines += [f"In sample (the fitted run itself): |error| {pct(summary['in_sample']['max_abs_rel_err'])}.", ""]
    if summary.get("measured_se_rel"):
        lines += ["Sampling error of the measured means (one standard error, whole sequences resampled), median: "
                  + ", ".join(f"{k} {pct(v)}" for k, v in summary["measured_se_rel"].items()) + "."]
    if summary.get("prompt_halves_gap"):
        g = summary["prompt_halves_gap"]
        lines += [f"The same policy measured on the two {g['workload']} prompt halves differs by a median "
                  f"{pct(g['median'])} (at most {pct(g['max'])}): no fit on one half predicts the other closer "
                  "than the halves agree."]
    lines.append("")
    extras = summary.get("extras") or {}
    for key, title in (("by_drafter_shape", "drafter x shape"), ("by_workload_split", "workload x split")):
        more = [n for n, e in extras.items() if key in e]
        lines += [f"| {title} | rows | median abs err | worst |" + "".join(f" {n} median | {n} worst |" for n in more),
                  "|---|---|---|---|" + "---|---|" * len(more)]
        lines += [f"| {k} | {v['rows']} | {pct(v['median_abs_rel_err'])} | {pct(v['max_abs_rel_err'])} |"
                  + "".join(f" {pct(extras[n][key][k]['median_abs_rel_err'])} | {pct(extras[n][key][k]['max_abs_rel_err'])} |"
                            for n in more) for k, v in summary[key].items()]
        if more:
            o = summary["out_of_sample"]
            lines += [f"| all out of sample | {o['rows']} | {pct(o['median_abs_rel_err'])} | {pct(o['max_abs_rel_err'])} |"
                      + "".join(f" {pct(extras[n]['out_of_sample']['median_abs_rel_err'])} | "
                                f"{pct(extras[n]['out_of_sample']['max_abs_rel_err'])} |" for n in more)]
        lines.append("")
    worst = df[df["split"] != "in_sample"].assign(a=lambda d: d["rel_err"].abs()).nlargest(5, "a")
    lines += ["Worst rows:", "", "| policy | workload | split | measured | predicted | error |"
              + "".join(f" {n} | {n} error |" for n in extras), "|---|---|---|---|---|---|" + "---|---|" * len(extras)]
    lines += [f"| {r['policy']} | {r['workload']} | {r['split']} | {r['measured_accepted']:.3f} | "
              f"{r['predicted_accepted']:.3f} | {100 * r['rel_err']:+.2f}% |"
              + "".join(f" {r[n + '_predicted']:.3f} | {100 * r[n + '_rel_err']:+.2f}% |" for n in extras)
              for _, r in worst.iterrows()]
    return "\n".join(lines) + "\n"
