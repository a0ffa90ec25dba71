"""The home side of a GPU session (scripts/full_gpu.sh): fit, plan and predictions from the
session's own profile of the runtime's layers, on the CPU, after the call.

    python -m simtree.runtime.full.session_report SESSION_DIR [SESSION_DIR ...] --out reports/h200/live

A session folder (one model; ``full_<model>.tgz`` unpacked) holds ``profile/profile.csv`` (the
sweep of the runtime's layer calls, composed into ``model_verify_step`` rows),
``steps_profile.csv`` (the runtime's whole verify and draft steps), ``summary.json`` (every
measured run's rounds), ``lossless.csv`` and ``log.txt``; lossless checks run apart
(``--lossless MODEL=CSV``, e.g. in fp32) join the sessions' in lossless.csv.  Per model:

1. fit: C_v from the composed rows of the layer profile, C_d from the whole draft steps ->
   ``costs_<model>.json``; both tables in one, tagged with the session's deployment (the
   rank it measured: the sweep's and gpu_run's rows must agree) ->
   ``profile_<model>_<tag>.csv``, what scripts/ship_defaults.sh fits a shipped bundle from
   once copied into simtree/data/profiles/h200/ (docs/full_runtime.md);
2. predict every measured run again from that bundle (``measure.repredict``);
3. plan: per batch size the measured policy the bundle predicts fastest (the planner's choice
   restricted to the shapes the session measured), reported as ``plan:<shape>``;
4. composed against measured: the composed step of the layer profile (interpolated in the
   context) against the runtime's measured whole step at each (b, n, l) of steps_profile.csv.

Writes under ``--out``: summary.csv / summary.md / predicted_vs_measured.png (plain, linear
D=4 and the plan's choice per batch size, both models), alternatives.csv (the other measured
shapes), composed_vs_measured.csv / .md, costs_<model>.json, profile_<model>_<tag>.csv,
lossless.csv.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from simtree.costs import profile_table as pt
from simtree.parallel import parse_deployment
from simtree.errors import SimtreeError
from simtree.models import get_model
from simtree.fileio import write_text_atomic

from .measure import repredict
from .report import EXTRA_COLUMNS, SUMMARY_COLUMNS, error_stats, write_summary

__all__ = ["session_report", "rank_profile", "session_deployment", "composed_vs_measured", "choose_plan", "read_lossless_check", "main"]

COMPOSED = ("model_verify_step", "composed")
WHOLE = "full_runtime"


def _load(path: Path, what: str) -> pd.DataFrame:
    if not path.exists():
        raise SimtreeError(f"{path}: no {what} (did that phase of the GPU session run?)")
    return pt.load_profile(path)


def composed_vs_measured(profile: pd.DataFrame, steps: pd.DataFrame) -> list[dict]:
    """One row per measured whole verify step (b, n, l): the composed step at the same (b, n),
    linearly interpolated in the context between the composed rows (clamped), and the error."""
    comp = profile[(profile.stage == COMPOSED[0]) & (profile.variant == COMPOSED[1])]
    meas = steps[(steps.stage == "model_verify_step") & (steps.variant == WHOLE)]
    out = []
    for r in meas.itertuples(index=False):
        rows = comp[(comp.model == r.model) & (comp.batch_size == r.batch_size)
                    & (comp.nodes_per_seq == r.nodes_per_seq)]
        if rows.empty:
            continue
        by_l = rows.groupby("context_len").latency_us_median.median().sort_index()
        composed = float(np.interp(r.context_len, by_l.index.to_numpy(float), by_l.to_numpy(float)))
        measured = float(r.latency_us_median)
        out.append({"model": r.model, "batch_size": int(r.batch_size), "nodes_per_seq": int(r.nodes_per_seq),
                    "context_len": int(r.context_len), "measured_us": measured, "composed_us": composed,
                    "rel_err": composed / measured - 1})
    return out


def session_deployment(profile: pd.DataFrame, steps: pd.DataFrame, where) -> str:
    """The one deployment a session measured: its layer sweep's rows and its whole steps must
    name the same rank (a table written before the column existed reads as tp=1)."""
    found = sorted(set(profile["deployment"]) | set(steps["deployment"]))
    if len(found) != 1:
        raise SimtreeError(f"{where}: the layer profile ({', '.join(sorted(set(profile['deployment'])))}) and the "
                           f"whole steps ({', '.join(sorted(set(steps['deployment'])))}) name different deployments: "
                           "one session measures one rank")
    return found[0]


def _composed(profile: pd.DataFrame) -> pd.DataFrame:
    verify = profile[(profile.stage == COMPOSED[0]) & (profile.variant == COMPOSED[1])]
    if verify.empty:
        raise SimtreeError("the layer profile has no composed model_verify_step rows (the sweep's composition "
                           "needs every piece at a (b, n): see profile.compose.json)")
    return verify


def _merged_table(profile: pd.DataFrame, steps: pd.DataFrame, path: Path) -> Path:
    """The composed verify rows and the whole draft steps in one table (what ``fit`` reads)."""
    verify = _composed(profile)
    draft = steps[(steps.stage == "draft_step") & (steps.variant == WHOLE)]
    if draft.empty:
        raise SimtreeError("steps_profile.csv has no draft_step rows (the session's steps phase)")
    pt.write_table(path, pt.validate_profile(pd.concat([verify, draft], ignore_index=True), path))
    return path


def rank_profile(folder: Path, out: Path) -> Path:
    """A sweep-only session (a rank the runtime does not build, e.g. Qwen3.6-27B at tp=2): its
    composed verify rows -> ``profile_<model>_<tag>.csv`` in ``out``, for the shipped profiles.
    Without whole draft steps its bundle's draft cost is the fit's assumption (simtree fit
    --draft-from-verify), which the bundle records."""
    profile = _load(folder / "profile" / "profile.csv", "layer profile")
    models, deps = sorted(set(profile.model)), sorted(set(profile.deployment))
    if len(models) != 1 or len(deps) != 1:
        raise SimtreeError(f"{folder}: a session profiles one model at one deployment, its profile holds "
                           f"{models} at {deps}")
    verify = _composed(profile)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"profile_{models[0]}_{parse_deployment(deps[0]).tag}.csv"
    pt.write_table(path, pt.validate_profile(verify.reset_index(drop=True), path))
    return path


def choose_plan(rows: list[dict]) -> list[dict]:
    """Per (model, batch size): the run the bundle predicts fastest, as a ``plan:`` row."""
    out = []
    for key in dict.fromkeys((r["model"], r["batch_size"]) for r in rows):
        ran = [r for r in rows if (r["model"], r["batch_size"]) == key and math.isfinite(r["predicted_tok_s"])]
        if ran:
            best = max(ran, key=lambda r: r["predicted_tok_s"])
            out.append({**best, "policy": "plan:" + best["policy"].split(":", 1)[1]})
    return out


def _csv(rows: list[dict], cols) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(cols), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: (f"{v:.6g}" if isinstance(v, float) else v) for c, v in r.items()})
    return buf.getvalue()


def _cvm_markdown(rows: list[dict]) -> str:
    lines = ["# Composed step of the runtime's layers vs the runtime's measured step", "",
             "composed: the layer profile's model_verify_step (round metadata + the model's ends + per layer kind "
             "its mixer, core, MLP / MoE, commit), interpolated in l; measured: the runtime's verify + commit "
             "(plain decoding at n = 1), CUDA-graph replays.  rel_err = composed / measured - 1.", "",
             "| model | b | n | l | measured_us | composed_us | rel_err |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['batch_size']} | {r['nodes_per_seq']} | {r['context_len']} | "
              f"{r['measured_us']:.0f} | {r['composed_us']:.0f} | {r['rel_err']:+.1%} |" for r in rows]
    lines.append("")
    for model in dict.fromkeys(r["model"] for r in rows):
        st = error_stats([r for r in rows if r["model"] == model], "rel_err")
        lines.append(f"- {model}: |rel_err| median {st['median']:.1%}, worst {st['worst']:.1%} over {st['n']} steps")
    return "\n".join(lines) + "\n"


def _untagged(path: Path) -> bool:
    with open(path) as fh:
        return "deployment" not in fh.readline().strip().split(",")


def session_report(sessions: list[Path], out: Path, untagged: dict | None = None,
                   lossless_checks: list[dict] = ()) -> dict:
    """Everything of the module docstring for the session folders; returns the summary rows,
    the composed-vs-measured rows and the files written.  ``untagged`` {model: deployment}:
    the rank a session measured whose tables have no deployment column (written before
    profile rows carried it); a table that has the column keeps what it says.
    ``lossless_checks``: rows of lossless checks run apart from the sessions
    (:func:`read_lossless_check`), appended to lossless.csv."""
    from simtree.costs.profile_fit import fit_profile

    out.mkdir(parents=True, exist_ok=True)
    rows, alternatives, cvm, notes, lossless = [], [], [], [], []
    for folder in sessions:
        profile = _load(folder / "profile" / "profile.csv", "layer profile")
        steps = _load(folder / "steps_profile.csv", "whole-step profile")
        models = sorted(set(profile.model))
        if len(models) != 1:
            raise SimtreeError(f"{folder}: a session profiles one model, its profile holds {models}")
        model = models[0]
        if model in (untagged or {}):
            tag = parse_deployment(untagged[model]).name
            for path, table in ((folder / "profile" / "profile.csv", profile), (folder / "steps_profile.csv", steps)):
                if not _untagged(path):
                    raise SimtreeError(f"{path}: its rows name their deployment; --untagged is for tables without one")
                table["deployment"] = tag
        dep = parse_deployment(session_deployment(profile, steps, folder))
        table = _merged_table(profile, steps, out / f"profile_{model}_{dep.tag}.csv")
        fit = fit_profile(table, stage=COMPOSED[0], variant=COMPOSED[1], draft_variant=WHOLE, deployment=dep.name)
        costs_path = out / f"costs_{model}.json"
        fit.bundle.save(costs_path)
        notes += [f"{model} fit: {n}" for n in fit.notes]
        cvm += composed_vs_measured(profile, steps)
        if not (folder / "summary.json").exists():   # a session run without its measure phase
            notes.append(f"{model}: no measured runs in {folder.name} (its profile and steps only)")
            continue
        res = repredict(folder / "summary.json", fit.bundle)
        notes += [f"{model}: {n}" for n in res["notes"] + res["prediction_notes"]]
        ran = [r for r in res["rows"] if math.isfinite(r.get("measured_tok_s", float("nan")))]
        plans = choose_plan(ran)
        keep = [r for r in res["rows"] if r["policy"].split(":")[0] in ("plain", "linear_d4")]
        rows += keep + plans
        alternatives += [r for r in res["rows"] if r not in keep]
        if (folder / "lossless.csv").exists():
            # the session's own check runs on the model it profiles: the profile's dtype, every layer
            n = get_model(model).num_layers
            whole = {"dtype": str(profile.dtype.iloc[0]), "layers": f"{n}/{n}"}
            lossless += [{"model": model, **whole, **{k: v for k, v in r.items() if k != "model"}}
                         for r in csv.DictReader(open(folder / "lossless.csv"))]
    lossless += list(lossless_checks)
    rows.sort(key=lambda r: (r["model"], r["batch_size"]))
    files = write_summary(rows, list(dict.fromkeys(notes)), out, alternatives)
    write_text_atomic(out / "alternatives.csv", _csv(alternatives, SUMMARY_COLUMNS + EXTRA_COLUMNS))
    cvm_cols = ("model", "batch_size", "nodes_per_seq", "context_len", "measured_us", "composed_us", "rel_err")
    write_text_atomic(out / "composed_vs_measured.csv", _csv(cvm, cvm_cols))
    write_text_atomic(out / "composed_vs_measured.md", _cvm_markdown(cvm))
    if lossless:
        # sessions before the verify-path probe have fewer columns: the union, blanks where absent
        write_text_atomic(out / "lossless.csv", _csv(lossless, list(dict.fromkeys(k for r in lossless for k in r))))
        md = out / "summary.md"
        write_text_atomic(md, md.read_text() + _lossless_markdown(lossless))
    return {"rows": rows, "composed_vs_measured": cvm, "files": files}


def read_lossless_check(model: str, path) -> list[dict]:
    """A lossless check run apart (gpu_run --dtype/--layers ... --phases build,lossless): its
    rows, named ``model``; a one-line error for a missing file, a table without the dtype and
    layers it ran at, or one that names another model."""
    path = Path(path)
    if not path.is_file():
        raise SimtreeError(f"{path}: no lossless check of {model} there")
    rows = list(csv.DictReader(open(path)))
    missing = [c for c in ("dtype", "layers", "policy", "match") if not rows or c not in rows[0]]
    if missing:
        raise SimtreeError(f"{path}: a lossless check needs the columns {', '.join(missing)} "
                           "(gpu_run's lossless.csv), with a row per policy")
    other = sorted({r["model"] for r in rows if r.get("model") and r["model"] != model})
    if other:
        raise SimtreeError(f"{path}: its rows are of {', '.join(other)}, not {model}")
    return [{"model": model, **{k: v for k, v in r.items() if k != "model"}} for r in rows]


def _lossless_markdown(rows: list[dict]) -> str:
    """summary.md's lossless section: one line per check (lossless.csv has every column)."""
    lines = ["", "## Lossless (live, batch 2, 2 prompts, against plain greedy; lossless.csv)", ""]
    for r in rows:
        what = f"{r['model']} {r.get('dtype') or '?'} {r.get('layers') or ''} layers {r['policy']}"
        if str(r["match"]) == "True":
            lines.append(f"- {what}: match")
        else:
            probe = (f", verify-vs-decode logit deviation {float(r['deviation']):.3g}, verify picks "
                     f"{r['verify_token']}" if r.get("deviation") not in (None, "") else "")
            lines.append(f"- {what}: differs at {r['first_diff']} (plain {r.get('plain_token')}, speculative "
                         f"{r.get('spec_token')}; plain top-2 gap {float(r['margin']):.3g}{probe})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sessions", nargs="*", type=Path, help="unpacked session folders, one per model")
    ap.add_argument("--out", type=Path, default=Path("reports/h200/live"))
    ap.add_argument("--sweep-only", action="append", default=[], type=Path, metavar="FOLDER",
                    help="a session that ran the layer sweep alone: only its rank profile is written")
    ap.add_argument("--untagged", action="append", default=[], metavar="MODEL=DEPLOYMENT",
                    help="the rank a session measured whose tables carry no deployment column, e.g. "
                         "deepseek-v4-flash=ep=8 (repeatable)")
    ap.add_argument("--lossless", action="append", default=[], metavar="MODEL=CSV",
                    help="a lossless check run apart from the sessions (gpu_run --dtype fp32 --phases "
                         "build,lossless), appended to lossless.csv (repeatable)")
    args = ap.parse_args(argv)
    try:
        checks = []
        for item in args.lossless:
            model, sep, path = item.partition("=")
            if not sep or not path:
                raise SimtreeError(f"--lossless {item!r}: expected MODEL=CSV, e.g. qwen3.6-27b=lossless.csv")
            get_model(model)
            checks += read_lossless_check(model, path)          # before any session is fitted
        untagged = {}
        for item in args.untagged:
            model, sep, dep = item.partition("=")
            if not sep or not dep:
                raise SimtreeError(f"--untagged {item!r}: expected MODEL=DEPLOYMENT, e.g. deepseek-v4-flash=ep=8")
            untagged[model] = dep
        for folder in args.sweep_only:
            print(f"rank profile (sweep only): {rank_profile(folder, args.out)}")
        if not args.sessions:
            return 0
        res = session_report(args.sessions, args.out, untagged, checks)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for key in ("rel_err", "cost_rel_err"):
        st = error_stats(res["rows"], key)
        print(f"|{key}|: median {st['median']:.1%}, worst {st['worst']:.1%} over {st['n']} runs")
    st = error_stats(res["composed_vs_measured"], "rel_err")
    print(f"composed vs measured step: median {st['median']:.1%}, worst {st['worst']:.1%} over {st['n']} points")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
