"""The home side of :mod:`.oos`: the out-of-sample table of ``oos run`` folders.

    python -m simtree.runtime.full.oos report DIR [DIR ...] --bundle FROZEN.json [--profile P.csv] --out OUT

writes ``throughput_out_of_sample.csv`` (one row per measured run: model, deployment, policy,
batch_size, context_len, measured_tok_s, predicted_tok_s, rel_err, bundle_sha256, then the
cost and acceptance parts of the error and whether the point lies on the bundle's profile
grid), ``summary.md`` and ``predicted_vs_measured.png``.  The plan's choice at a point is the
policy the frozen bundle predicts fastest among all those measured there; the summary says how
often it was the measured best or within 2% of it, and, where the runs measured modes besides
plain, linear and EAGLE, the error per mode.

``on_profile_grid``: the run's batch, context and verified nodes on the grid of the profile the
bundle's C_v was fitted on, and its draft on the draft grid: the MTP layer's (num_steps, topk)
for the modes it drafts, a block drafter's own axes (``simtree.costs.model.DRAFTER_COLUMNS``:
tree nodes or top-K, block length or adapter steps, batch, context) in the drafter profile its
C_d was fitted on (``oos freeze``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from simtree.costs.model import DRAFTER_COLUMNS
from simtree.errors import SimtreeError
from simtree.fileio import archived_by_sha, file_sha256, write_atomic, write_text_atomic
from simtree.planning.modes import BLOCK_DRAFTER_MODES, PolicySpec
from simtree.planning.policy_file import RANK_SUFFIX, deployment_label, rank_collectives
from simtree.reporting.summary import MIN_POLICIES, PLAN_TOLERANCE, plan_points

from .modes_report import mode_of

__all__ = ["COLUMNS", "report", "summarize"]

COLUMNS = ("model", "deployment", "policy", "batch_size", "context_len", "measured_tok_s", "predicted_tok_s",
           "rel_err", "bundle_sha256", "cost_rel_err", "accept_rel_err", "nodes", "on_profile_grid", "gpu",
           "point_complete")
WITHIN = PLAN_TOLERANCE   # the plan's choice counts as best within 2% of the measured best
# the modes of the first out-of-sample runs (oos.POLICIES with plain and linear D=4): their
# summary has no table per mode
SHAPE_MODES = ("none", "linear", "eagle")


def _grid(costs_path, profiles=()) -> dict:
    """The values of each axis in the profile the bundle was fitted on (its verify and draft
    sources, and each block drafter's, checked against the sha256 the bundle records);
    ``profiles``: more tables to look in."""
    import pandas as pd
    bundle = json.loads(Path(costs_path).read_text())
    parts = [("verify", bundle["verify"], ("batch_size", "context_len", "nodes_per_seq")),
             ("draft", bundle["draft"], ("batch_size", "num_steps", "topk"))]
    parts += [(fam, fit, (*DRAFTER_COLUMNS[fam], "context_len")) for fam, fit in (bundle.get("drafters") or {}).items()]
    grid: dict = {"drafters": {}}
    for part, fit, axes in parts:
        src = (fit.get("info") or {}).get("source") or {}
        path = _fitted_profile(costs_path, src, profiles)
        if path is None:
            raise SimtreeError(f"{costs_path}: its {part} profile {src.get('profile')} is not the one it was fitted on, "
                               "and no profile given (--profile), beside the bundle or shipped in "
                               "simtree/data/profiles has its sha256 (commit the fitted one beside the bundle)")
        table = pd.read_csv(path)
        if src.get("stage"):
            table = table[table["stage"] == src["stage"]]
        if part in BLOCK_DRAFTER_MODES:   # a drafter profile holds both targets, its fit one variant
            table = table[(table["model"] == bundle["meta"].get("model")) & (table["variant"] == src.get("variant"))]
        axes_grid = {a: sorted(float(x) for x in table[a].unique()) for a in axes}
        if part in BLOCK_DRAFTER_MODES:
            grid["drafters"][part] = axes_grid
        else:
            grid[part] = axes_grid
    return grid


FROZEN_PROFILES = "frozen_profiles.tgz"   # the refitted shipped profiles' committed copies, beside the bundles


def _fitted_profile(costs_path, src: dict, profiles=()) -> Path | None:
    """The profile a bundle was fitted on: the path it records, else a table of the same sha256
    among ``profiles``, beside the bundle (in :data:`FROZEN_PROFILES` there, where a shipped
    profile has changed since, or a ``.csv`` of its own) or among the shipped profiles (the
    session's working copy is gone)."""
    from simtree.data import data_path
    want = src.get("sha256")
    recorded = Path(src.get("profile", ""))
    candidates = [recorded, *map(Path, profiles), *sorted(Path(costs_path).parent.glob("*.csv")),
                  *sorted(data_path("profiles").glob(f"*/{recorded.name or '*.csv'}"))]
    found = next((c for c in candidates if c.is_file() and "sha256:" + file_sha256(c) == want), None)
    return found or (archived_by_sha(Path(costs_path).parent / FROZEN_PROFILES, want) if want else None)


def _on_grid(row: dict, grid: dict) -> bool:
    v, d = grid.get("verify") or {}, grid.get("draft") or {}
    checks = [(row["batch_size"], v.get("batch_size")), (row["context_len"], v.get("context_len")),
              (row["nodes"], v.get("nodes_per_seq"))]
    if row.get("drafter"):   # a block drafter's round: its own axes in its profile (none there: off the grid)
        own = grid.get("drafters", {}).get(row["drafter"])
        if own is None:
            return False
        x, y, _ = DRAFTER_COLUMNS[row["drafter"]]
        checks += [(row["batch_size"], own["batch_size"]), (row["context_len"], own["context_len"]),
                   (row["drafter_x"], own[x]), (row["drafter_y"], own[y])]
    elif row.get("num_steps"):   # an MTP-drafted round: its draft step too
        checks += [(row["batch_size"], d.get("batch_size")), (row["num_steps"], d.get("num_steps")),
                   (row["topk"], d.get("topk"))]
    return all(vals is None or float(x) in {float(y) for y in vals} for x, vals in checks)


def _draft_axes(mode, params: dict) -> dict:
    """The axes a run's draft is priced at: num_steps and topk of the MTP layer's draft (0 steps
    for plain decoding), or a block drafter's family and its C_d's x and y
    (:func:`simtree.planning.drafter_candidates.score_spec`)."""
    if mode in BLOCK_DRAFTER_MODES:
        from simtree.drafters import MARGINAL_TOPK
        spec = PolicySpec.from_dict(mode, params)
        if mode == "dspark":
            x, y = MARGINAL_TOPK, spec.block_len
        elif mode == "tfm":
            x, y = spec.budget, max(1, math.ceil((spec.budget - 1) / spec.width))
        else:
            x, y = spec.budget, spec.block_len
        return {"num_steps": 0, "topk": 0, "drafter": mode, "drafter_x": x, "drafter_y": y}
    if mode is None:
        return {"num_steps": 0, "topk": 0}
    steps, topk = PolicySpec.from_dict(mode, params).draft_shape()
    return {"num_steps": int(steps), "topk": int(topk)}


def _load_dir(d: Path, missed: list | None = None) -> list[dict]:
    """The measured runs of one ``oos run`` folder; ``missed`` collects the runs that failed or
    were skipped (model, batch, context, policy, why)."""
    meta_path = d / "meta.json"
    if not meta_path.exists():
        raise SimtreeError(f"{d}: no meta.json (not a folder written by `oos run`)")
    meta = json.loads(meta_path.read_text())
    rows = []
    for summ in sorted(d.glob("ctx_*/summary.json")):
        data = json.loads(summ.read_text())
        for r, run in zip(data["rows"], data["runs"]):
            if run.get("error") or not math.isfinite(float(r.get("measured_tok_s", float("nan")))):
                if missed is not None:
                    why = str(run.get("error") or "not measured").split(". ")[0][:90]
                    missed.append({"model": r["model"], "batch_size": int(r["batch_size"]),
                                   "context_len": int(r["context_len"]), "policy": r["policy"], "why": why})
                continue
            params = run.get("params") or {}
            rows.append({"model": r["model"], "deployment": _deployment_label(meta["deployment"]),
                         "policy": r["policy"],
                         "batch_size": int(r["batch_size"]), "context_len": int(r["context_len"]),
                         "measured_tok_s": float(r["measured_tok_s"]), "predicted_tok_s": float(r["predicted_tok_s"]),
                         "rel_err": float(r["rel_err"]), "bundle_sha256": meta["bundle_sha256"],
                         "cost_rel_err": float(r["cost_rel_err"]), "accept_rel_err": float(r["accept_rel_err"]),
                         "nodes": int(r["nodes"]), **_draft_axes(run.get("mode"), params),
                         "gpu": meta["gpu"], "_costs": meta["costs"]})
    if not rows:
        raise SimtreeError(f"{d}: no measured runs")
    return rows


def _deployment_label(deployment: str) -> str:
    """What a row measured: the deployment where the run was all of it (one GPU), else the rank run
    alone, "<deployment> rank" as policy files name it (:func:`deployment_label`; runs kept before
    wrote "ep=8 rank (all-to-all not run)" in their own rows)."""
    from simtree.parallel import parse_deployment
    dep = parse_deployment(deployment)
    return dep.name if dep.gpus == 1 else deployment_label(dep.name + RANK_SUFFIX)


def _run_key(r: dict) -> tuple:
    return r["model"], int(r["batch_size"]), int(r["context_len"]), r["policy"]


def _latest(rows: list[dict], missed: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """A later folder (later in ``dirs``) measuring a run again or one an earlier folder missed:
    its measurement stands (one row per run), the miss it fills is no longer listed, and each
    earlier measurement it replaces is returned (listed in the summary, old and new side by side).
    A run is the same run only under the same deployment and frozen bundle."""
    key = lambda r: (*_run_key(r), r.get("deployment"), r.get("bundle_sha256"))   # noqa: E731
    last = {key(r): r for r in rows}
    kept = [r for r in rows if last[key(r)] is r]
    replaced = [{**r, "later_tok_s": last[key(r)]["measured_tok_s"]} for r in rows if last[key(r)] is not r]
    measured = {_run_key(r) for r in kept}
    return kept, [m for m in missed if _run_key(m) not in measured], replaced


def _not_run(dirs: list[Path]) -> list[str]:
    """The lines of the folders' ``meta.json`` naming modes a run left out (a frozen bundle without
    the block drafters' C_d)."""
    out = []
    for d in dirs:
        meta = json.loads((Path(d) / "meta.json").read_text())
        if meta.get("not_run"):
            out.append(f"{meta['model']}: {', '.join(meta['not_run'])} ({meta.get('not_run_why', 'not run')})")
    return out


def report(dirs: list[Path], out: Path, bundles: dict | None = None, profiles=()) -> dict:
    """Rows of every folder -> out/throughput_out_of_sample.csv, summary.md, predicted_vs_measured.png.
    ``bundles``: {sha256: path of the frozen bundle beside the table}; ``profiles``: tables to find a
    bundle's fitted profile among (by the sha256 it records), besides those beside it (the grid check)."""
    import pandas as pd

    missed: list = []
    rows = [r for d in dirs for r in _load_dir(Path(d), missed)]
    rows, missed, replaced = _latest(rows, missed)
    short = {(m["model"], int(m["batch_size"]), int(m["context_len"])) for m in missed}
    for r in rows:   # every run asked for at its point measured: else the choice may be one that did not run
        r["point_complete"] = (r["model"], int(r["batch_size"]), int(r["context_len"])) not in short
    grids = {}
    for r in rows:
        key = r["bundle_sha256"]
        if key not in grids:
            path = (bundles or {}).get(key) or r["_costs"]
            if not Path(path).exists() or file_sha256(path) != key:
                raise SimtreeError(f"frozen bundle {key[:12]} not found (give --bundle PATH of the bundle the run used)")
            grids[key] = _grid(path, profiles)
        r["on_profile_grid"] = _on_grid(r, grids[key])
    table = pd.DataFrame(rows)[list(COLUMNS)]
    checks = plan_points(rows)
    stats = summarize(table, checks)
    # all three built before any is written: a failure leaves the previous report as it was
    csv_text, md_text, png = (table.to_csv(index=False, float_format="%.6g"),
                              _markdown(stats, checks, missed, replaced, _not_run(dirs)), _plot_png(table))
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "throughput_out_of_sample.csv", csv_text)
    write_text_atomic(out / "summary.md", md_text)
    write_atomic(out / "predicted_vs_measured.png", lambda tmp: Path(tmp).write_bytes(png))
    return stats


def _errors(g) -> dict:
    return {"runs": int(len(g)), "median": float(g["rel_err"].abs().median()), "worst": float(g["rel_err"].abs().max())}


def summarize(table, checks: list[dict]) -> dict:
    err = table["rel_err"].abs()
    off = table[~table["on_profile_grid"].astype(bool)]["rel_err"].abs()
    per_model = {m: _errors(g) for m, g in table.groupby("model")}
    modes = table["policy"].map(mode_of)
    per_mode = {m: {**_errors(g), "cost_median": float(g["cost_rel_err"].abs().median()),
                    "accept_median": float(g["accept_rel_err"].abs().median()),
                    "off_grid_runs": int((~g["on_profile_grid"].astype(bool)).sum())}
                for m, g in table.groupby(modes, sort=False)}
    return {"runs": int(len(table)), "median": float(err.median()), "worst": float(err.max()),
            "off_grid_runs": int(len(off)), "off_grid_median": float(off.median()) if len(off) else float("nan"),
            "off_grid_worst": float(off.max()) if len(off) else float("nan"),
            "cost_median": float(table["cost_rel_err"].abs().median()),
            "accept_median": float(table["accept_rel_err"].abs().median()),
            "points": sum(c["counted"] for c in checks), "plan_ok": sum(c["ok"] and c["counted"] for c in checks),
            "thin_points": sum(not c["counted"] for c in checks),
            "min_policies": min((c["policies"] for c in checks if c["counted"]), default=0), "per_model": per_model,
            "per_mode": per_mode,
            "ranks": {d: sorted(g["model"].unique()) for d, g in table.groupby("deployment") if " rank" in str(d)},
            "gpus": sorted(table["gpu"].unique()), "batch_sizes": sorted(int(b) for b in table["batch_size"].unique()),
            "contexts": sorted(int(c) for c in table["context_len"].unique())}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _mode_lines(per_mode: dict) -> list[str]:
    """The error per mode, the drafter that drafts it named (none where the runs measured only
    the modes of the first runs, :data:`SHAPE_MODES`: their summary stays as it was)."""
    if set(per_mode) <= set(SHAPE_MODES):
        return []
    lines = ["", "Per mode (the plain, MTP-drafted and block-drafted families; C_d of the block drafters from the "
             "frozen bundle's drafter fits):", "",
             "| mode | drafter | runs | median abs error | worst | cost part (median) | acceptance part (median) | "
             "off the grid |", "|---|---|---|---|---|---|---|---|"]
    for m, p in per_mode.items():
        drafter = "none" if m == "none" else "block drafter" if m in BLOCK_DRAFTER_MODES else "MTP layer"
        lines.append(f"| {m} | {drafter} | {p['runs']} | {_pct(p['median'])} | {_pct(p['worst'])} | "
                     f"{_pct(p['cost_median'])} | {_pct(p['accept_median'])} | {p['off_grid_runs']} |")
    return lines


def _markdown(s: dict, checks: list[dict], missed: list | None = None, replaced: list | None = None,
              not_run: list | None = None) -> str:
    pct = _pct
    lines = ["# Throughput predicted out of sample", "",
             "Generated by `python -m simtree.runtime.full.oos report` from the GPU runs of `scripts/oos_gpu.sh`; "
             "the frozen bundles beside this file were fitted on an earlier GPU session's profile (their sha256 is "
             "in every row of `throughput_out_of_sample.csv`). Acceptance is replayed from the preset the "
             "prediction uses (in sample by construction): the errors below are the cost models', out of sample.", "",
             f"GPU: {', '.join(s['gpus'])}; batch sizes {s['batch_sizes']}; contexts {s['contexts']}.", "",
             *[f"{', '.join(models)}: {dep}, one rank run alone on one GPU (the {rank_collectives(dep)} not run) - "
               "the batch is the b sequences on that rank, as the bundle prices it, not the deployment's batch (of "
               "which a rank holds ceil(b / dp)).\n"
               for dep, models in s.get("ranks", {}).items()],
             "| | runs | median abs error | worst |", "|---|---|---|---|",
             f"| all runs (out of sample) | {s['runs']} | {pct(s['median'])} | {pct(s['worst'])} |",
             f"| points off the profile grid | {s['off_grid_runs']} | {pct(s['off_grid_median'])} | "
             f"{pct(s['off_grid_worst'])} |"]
    for m, p in s["per_model"].items():
        lines.append(f"| {m} | {p['runs']} | {pct(p['median'])} | {pct(p['worst'])} |")
    lines += _mode_lines(s.get("per_mode", {}))
    lines += ["", f"Cost part of the error: median {pct(s['cost_median'])}; acceptance part: median "
              f"{pct(s['accept_median'])} (replayed).", "",
              f"Plan's choice (the frozen bundle's fastest predicted policy among those measured) best or within "
              f"{pct(WITHIN)} of the measured best at {s['plan_ok']} of {s['points']} points with at least "
              f"{MIN_POLICIES} policies measured (at least {s['min_policies']} at each of them)"
              + (f"; {s['thin_points']} point(s) with fewer, or where a run asked for was not measured (its "
                 "prediction may have been the choice; the runs not measured are listed below), are listed but "
                 "not counted" if s['thin_points'] else "") + ".", "",
              "| model | batch | context | policies | chosen | measured best | gap |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        counted = "" if c["counted"] else " (not counted)"
        lines.append(f"| {c['model']} | {c['batch_size']} | {c['context_len']} | {c['policies']}{counted} | "
                     f"{c['chosen']} | {c['best']} | {pct(c['gap'])} |")
    if missed:   # runs asked for and not measured: per point, how many and why
        groups: dict = {}
        for m in missed:
            groups.setdefault((m["model"], m["batch_size"], m["context_len"], m["why"]), []).append(m["policy"])
        lines += ["", f"Runs not measured ({len(missed)}; not in the table):", "",
                  "| model | batch | context | runs | why |", "|---|---|---|---|---|"]
        for (model, b, ctx, why), pols in sorted(groups.items()):
            lines.append(f"| {model} | {b} | {ctx} | {len(pols)} | {why} |")
    if not_run:   # modes a run left out at every point
        lines += ["", "Modes not run at any point:", "", *[f"- {line}" for line in not_run]]
    if replaced:   # runs a later folder measured again: the later measurement is the table's
        lines += ["", f"Runs measured again by a later folder ({len(replaced)}; the table keeps the later):", "",
                  "| model | batch | context | policy | earlier tok/s | later tok/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch_size']} | {r['context_len']} | {r['policy']} | "
                  f"{r['measured_tok_s']:.2f} | {r['later_tok_s']:.2f} |" for r in replaced]
    return "\n".join(lines) + "\n"


def _plot_png(table) -> bytes:
    """The predicted-against-measured scatter as PNG bytes (nothing written)."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for (model, on), g in table.groupby(["model", "on_profile_grid"]):
        ax.scatter(g["measured_tok_s"], g["predicted_tok_s"], s=14, label=f"{model} ({'on' if on else 'off'} grid)",
                   marker="o" if on else "x")
    lo = float(min(table["measured_tok_s"].min(), table["predicted_tok_s"].min())) * 0.8
    hi = float(max(table["measured_tok_s"].max(), table["predicted_tok_s"].max())) * 1.2
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured tok/s")
    ax.set_ylabel("predicted tok/s (frozen bundle)")
    ax.set_title("Throughput, out of sample")
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
