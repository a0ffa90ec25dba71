"""Throughput predicted out of sample: a frozen bundle, a later GPU run, points off the profile.

GPU side (``scripts/oos_gpu.sh``), one model per call:

    python -m simtree.runtime.full.oos run --model qwen3.6-27b --costs FROZEN.json --out DIR

builds the model once and, for every context length and batch size, measures plain decoding,
linear D=4 and the ``POLICIES`` below (replayed acceptance, ``full_run``) with the prediction
from ``FROZEN.json`` - a bundle fitted before this run, on another GPU session's profile.

Home side:

    python -m simtree.runtime.full.oos report DIR [DIR ...] --bundle FROZEN.json [--profile P.csv] --out OUT

writes ``throughput_out_of_sample.csv`` (one row per measured run: model, deployment, policy,
batch_size, context_len, measured_tok_s, predicted_tok_s, rel_err, bundle_sha256, then the
cost and acceptance parts of the error and whether the point lies on the bundle's profile
grid), ``summary.md`` and ``predicted_vs_measured.png``.  The plan's choice at a point is the
policy the frozen bundle predicts fastest among those measured there; the summary says how
often it was the measured best or within 2% of it.

What is out of sample: the cost bundle (fitted on an earlier session's profile; its sha256 is
in every row) and the points (contexts, batch sizes and budgets the profile did not time are
marked ``on_profile_grid`` False).  What is not: the acceptance is replayed from the same preset
the prediction uses (``accept_rel_err`` is small by construction), so the error is the cost
model's.  The rank runs the batch the bundle prices (a V4 ``ep=8`` rank at batch b is priced at
rank batch b, without the all-to-all it does not run): a row of a rank run alone says so in its
deployment ("ep=8 rank", the label policy files use; the summary says the all-to-all was not run):
batch_size is the rank's b sequences, not the ep=8 deployment's batch, of which a rank would hold
ceil(b / 8)).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

from simtree.errors import SimtreeError
from simtree.fileio import write_atomic, write_text_atomic
from simtree.planning.policy_file import RANK_SUFFIX, deployment_label, rank_collectives
from simtree.planning.simulate import PolicySpec
from simtree.reporting.summary import MIN_POLICIES, PLAN_TOLERANCE, plan_points

__all__ = ["POLICIES", "CONTEXTS", "BATCH_SIZES", "run", "report", "main"]

CONTEXTS = (4096, 16384, 1024)
BATCH_SIZES = (2, 8, 32)
# besides plain and linear D=4 (full_run measures those): budgets on and off the draft grid
# (the shipped profiles time draft steps s <= 7 and nodes 1-4, 6, 8, 12, 16)
POLICIES = (("linear_d10", "linear", {"budget": 10}),
            ("eagle", "eagle", {"num_steps": 2, "topk": 2, "budget": 4}),
            ("eagle", "eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
            ("eagle", "eagle", {"num_steps": 5, "topk": 3, "budget": 12}),
            ("eagle", "eagle", {"num_steps": 6, "topk": 4, "budget": 16}),
            ("eagle", "eagle", {"num_steps": 8, "topk": 2, "budget": 10}))
COLUMNS = ("model", "deployment", "policy", "batch_size", "context_len", "measured_tok_s", "predicted_tok_s",
           "rel_err", "bundle_sha256", "cost_rel_err", "accept_rel_err", "nodes", "on_profile_grid", "gpu")
WITHIN = PLAN_TOLERANCE   # the plan's choice counts as best within 2% of the measured best


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _extra() -> list[tuple[str, PolicySpec]]:
    return [(label, PolicySpec.from_dict(mode, params)) for label, mode, params in POLICIES]


def run(model: str, costs: str, out: Path, *, contexts=CONTEXTS, batch_sizes=BATCH_SIZES, device: str = "cuda",
        deployment: str | None = None, max_seconds: float = 330.0, acceptance: str = "gsm8k",
        rounds: int = 24, min_draws: int = 96) -> int:
    """Measure every (context, batch, policy) of one model; ``out/ctx_<l>/summary.json`` per context."""
    import torch

    from .build import build_model
    from .gpu_run import runtime_deployment
    from .measure import full_run
    from simtree.models import get_model

    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a", buffering=1)

    def say(line: str) -> None:
        msg = f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:6.1f}s] {line}"
        print(msg, flush=True)
        log.write(msg + "\n")

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    dep = runtime_deployment(model, deployment)
    meta = {"model": model, "deployment": dep, "gpu": gpu, "torch": torch.__version__, "costs": str(costs),
            "bundle_sha256": sha256(costs), "contexts": list(contexts), "batch_sizes": list(batch_sizes),
            "policies": [[label, mode, params] for label, mode, params in POLICIES], "acceptance": acceptance,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    write_text_atomic(out / "meta.json", json.dumps(meta, indent=1))
    say(f"oos {model} ({dep}) on {gpu}; frozen bundle {costs} sha256 {meta['bundle_sha256'][:12]}")
    built = build_model(get_model(model), device, seed=0)   # V4: one ep=8 rank, as gpu_run builds it
    say(f"built {built.shape.name} ({built.deployment})")
    failed = 0
    for i, ctx in enumerate(contexts):
        left = max_seconds - (time.time() - t0)
        share = left / (len(contexts) - i)
        say(f"=== context {ctx}: {share:.0f} s")
        try:
            full_run(built, device=device, costs=costs, batch_sizes=list(batch_sizes), acceptance=acceptance,
                     context_len=ctx, out=out / f"ctx_{ctx}", rounds=rounds, warmup_rounds=3, min_draws=min_draws,
                     progress=say, deadline=time.time() + share - 5, extra=_extra())
        except Exception as exc:   # noqa: BLE001 - one context failing leaves the others
            failed += 1
            say(f"context {ctx} FAILED: {type(exc).__name__}: {exc}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    say(f"done; {failed} context(s) failed")
    return 1 if failed else 0


def _grid(costs_path, profiles=()) -> dict:
    """The values of each axis in the profile the bundle was fitted on (its verify and draft
    sources, checked against the sha256 the bundle records); ``profiles``: more tables to look in."""
    import pandas as pd
    bundle = json.loads(Path(costs_path).read_text())
    grid = {}
    for part, axes in (("verify", ("batch_size", "context_len", "nodes_per_seq")), ("draft", ("batch_size", "num_steps", "topk"))):
        src = (bundle[part].get("info") or {}).get("source") or {}
        path = _fitted_profile(costs_path, src, profiles)
        if path is None:
            raise SimtreeError(f"{costs_path}: its {part} profile {src.get('profile')} is not the one it was fitted on, "
                               "and no profile given (--profile), beside the bundle or shipped in "
                               "simtree/data/profiles has its sha256 (commit the fitted one beside the bundle)")
        table = pd.read_csv(path)
        if src.get("stage"):
            table = table[table["stage"] == src["stage"]]
        grid[part] = {a: sorted(float(x) for x in table[a].unique()) for a in axes}
    return grid


def _fitted_profile(costs_path, src: dict, profiles=()) -> Path | None:
    """The profile a bundle was fitted on: the path it records, else a table of the same sha256
    among ``profiles``, beside the bundle (``frozen_X.profile.csv`` where a shipped profile has
    changed since) or among the shipped profiles (the session's working copy is gone)."""
    from simtree.data import data_path
    want = src.get("sha256")
    recorded = Path(src.get("profile", ""))
    candidates = [recorded, *map(Path, profiles), *sorted(Path(costs_path).parent.glob("*.csv")),
                  *sorted(data_path("profiles").glob(f"*/{recorded.name or '*.csv'}"))]
    return next((c for c in candidates if c.is_file() and "sha256:" + sha256(c) == want), None)


def _on_grid(row: dict, grid: dict) -> bool:
    v, d = grid.get("verify") or {}, grid.get("draft") or {}
    checks = [("batch_size", row["batch_size"], v.get("batch_size")), ("context_len", row["context_len"],
              v.get("context_len")), ("nodes", row["nodes"], v.get("nodes_per_seq"))]
    if row.get("num_steps"):   # a drafted round: its draft step too
        checks += [("batch_size", row["batch_size"], d.get("batch_size")),
                   ("num_steps", row["num_steps"], d.get("num_steps")), ("topk", row["topk"], d.get("topk"))]
    return all(vals is None or float(x) in {float(y) for y in vals} for _, x, vals in checks)


def _draft_axes(mode, params: dict) -> dict:
    """num_steps and topk of a run's draft (0 steps for plain decoding)."""
    if mode == "eagle":
        return {"num_steps": int(params["num_steps"]), "topk": int(params["topk"])}
    if mode == "linear":
        return {"num_steps": int(params["budget"]) - 1, "topk": 1}
    return {"num_steps": 0, "topk": 0}


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


def report(dirs: list[Path], out: Path, bundles: dict | None = None, profiles=()) -> dict:
    """Rows of every folder -> out/throughput_out_of_sample.csv, summary.md, predicted_vs_measured.png.
    ``bundles``: {sha256: path of the frozen bundle beside the table}; ``profiles``: tables to find a
    bundle's fitted profile among (by the sha256 it records), besides those beside it (the grid check)."""
    import pandas as pd

    missed: list = []
    rows = [r for d in dirs for r in _load_dir(Path(d), missed)]
    rows, missed, replaced = _latest(rows, missed)
    grids = {}
    for r in rows:
        key = r["bundle_sha256"]
        if key not in grids:
            path = (bundles or {}).get(key) or r["_costs"]
            if not Path(path).exists() or sha256(path) != key:
                raise SimtreeError(f"frozen bundle {key[:12]} not found (give --bundle PATH of the bundle the run used)")
            grids[key] = _grid(path, profiles)
        r["on_profile_grid"] = _on_grid(r, grids[key])
    table = pd.DataFrame(rows)[list(COLUMNS)]
    checks = plan_points(rows)
    stats = summarize(table, checks)
    # all three built before any is written: a failure leaves the previous report as it was
    csv_text, md_text, png = (table.to_csv(index=False, float_format="%.6g"),
                              _markdown(stats, checks, missed, replaced), _plot_png(table))
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "throughput_out_of_sample.csv", csv_text)
    write_text_atomic(out / "summary.md", md_text)
    write_atomic(out / "predicted_vs_measured.png", lambda tmp: Path(tmp).write_bytes(png))
    return stats


def summarize(table, checks: list[dict]) -> dict:
    err = table["rel_err"].abs()
    off = table[~table["on_profile_grid"].astype(bool)]["rel_err"].abs()
    per_model = {m: {"runs": int(len(g)), "median": float(g["rel_err"].abs().median()),
                     "worst": float(g["rel_err"].abs().max())} for m, g in table.groupby("model")}
    return {"runs": int(len(table)), "median": float(err.median()), "worst": float(err.max()),
            "off_grid_runs": int(len(off)), "off_grid_median": float(off.median()) if len(off) else float("nan"),
            "off_grid_worst": float(off.max()) if len(off) else float("nan"),
            "cost_median": float(table["cost_rel_err"].abs().median()),
            "accept_median": float(table["accept_rel_err"].abs().median()),
            "points": sum(c["counted"] for c in checks), "plan_ok": sum(c["ok"] and c["counted"] for c in checks),
            "thin_points": sum(not c["counted"] for c in checks),
            "min_policies": min((c["policies"] for c in checks if c["counted"]), default=0), "per_model": per_model,
            "ranks": {d: sorted(g["model"].unique()) for d, g in table.groupby("deployment") if " rank" in str(d)},
            "gpus": sorted(table["gpu"].unique()), "batch_sizes": sorted(int(b) for b in table["batch_size"].unique()),
            "contexts": sorted(int(c) for c in table["context_len"].unique())}


def _markdown(s: dict, checks: list[dict], missed: list | None = None, replaced: list | None = None) -> str:
    pct = lambda x: f"{100 * x:.1f}%"   # noqa: E731
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
    lines += ["", f"Cost part of the error: median {pct(s['cost_median'])}; acceptance part: median "
              f"{pct(s['accept_median'])} (replayed).", "",
              f"Plan's choice (the frozen bundle's fastest predicted policy among those measured) best or within "
              f"{pct(WITHIN)} of the measured best at {s['plan_ok']} of {s['points']} points with at least "
              f"{MIN_POLICIES} policies measured (at least {s['min_policies']} at each of them)"
              + (f"; {s['thin_points']} point(s) with fewer (the runs not measured are listed below) are listed "
                 "but not counted" if s['thin_points'] else "") + ".", "",
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="GPU: measure one model against a frozen bundle")
    r.add_argument("--model", required=True)
    r.add_argument("--costs", required=True, help="the frozen cost bundle")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--deployment", default=None)
    r.add_argument("--device", default="cuda")
    r.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    r.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    r.add_argument("--max-seconds", type=float, default=330.0)
    r.add_argument("--min-draws", type=int, default=96)
    p = sub.add_parser("report", help="home: the out-of-sample table from run folders")
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("reports/validation"))
    p.add_argument("--bundle", action="append", default=[], help="a frozen bundle the runs used (repeatable)")
    p.add_argument("--profile", action="append", default=[], type=Path,
                   help="a profile a bundle was fitted on, found by the sha256 the bundle records (repeatable; "
                        "a profile beside the bundle or shipped is found without it)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "run":
            ints = lambda s: tuple(int(x) for x in s.split(",") if x)   # noqa: E731
            return run(args.model, args.costs, args.out, contexts=ints(args.contexts),
                       batch_sizes=ints(args.batch_sizes), device=args.device, deployment=args.deployment,
                       max_seconds=args.max_seconds, min_draws=args.min_draws)
        for path in (*args.bundle, *args.profile):
            if not Path(path).is_file():
                raise SimtreeError(f"{path}: no such file")
        stats = report(args.dirs, args.out, {sha256(b): b for b in args.bundle}, args.profile)
        print(f"{stats['runs']} runs: median {100 * stats['median']:.1f}%, worst {100 * stats['worst']:.1f}%; "
              f"plan's choice best or within 2% at {stats['plan_ok']} of {stats['points']} points -> {args.out}")
        return 0
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
