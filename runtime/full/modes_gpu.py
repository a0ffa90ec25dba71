"""Every mode the runtime builds, at full scale on the GPU, and the plan's choice beside them
(``scripts/modes_gpu.sh`` runs it, one model a call):

    python -m simtree.runtime.full.modes_gpu --model qwen3.6-27b --out DIR [--max-seconds 480]
    python -m simtree.runtime.full.modes_gpu report DIR_OR_TGZ [...] --out reports/h100/modes   (modes_report.py)

1. ``costs``    the deployment's shipped bundle with the block drafters' C_d fitted from a
                drafter profile (``--drafter-profile``, default the committed H100 sweep
                reports/h100/drafters_profile.csv: ASSUMPTION where the session's GPU is another,
                said in every file) -> the plan over the batch sizes (every runnable family,
                the block drafters included) of what the runs measure: one rank with b
                sequences, no collectives (``simtree.deploy.costs.one_rank``; a deployment's
                plan of batch b would put ceil(b / dp) sequences on a rank and add the
                all-to-all the rank runs here do not) -> DIR/plan/policy.json, candidates.csv.
2. ``lossless`` live greedy, 2 prompts at batch 2, every mode's shape in :data:`MODE_SHAPES`
                against plain decoding (bf16: a difference is a near-tie where the plain top-2
                gap is within twice the verify-vs-decode deviation there) -> DIR/lossless.csv.
3. ``measure``  ``full_run`` (replay of ``--acceptance``): per batch size plain, linear D=4, the
                plan's choice and every shape of :data:`MODE_SHAPES` -> DIR/measure/summary.*,
                and DIR/modes.csv: per batch the plan's choice and every other mode measured, the
                best measured, and the choice's throughput over it (``plan_over_best``).

A phase that fails is logged (DIR/log.txt) and the next runs; no new run starts past
``--max-seconds`` (its row says skipped).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from pathlib import Path

import pandas as pd

from simtree.fileio import write_csv_atomic
from simtree.planning.modes import BLOCK_DRAFTER_MODES, PolicySpec

from .gpu_run import Session, default_costs, runtime_deployment
from .modes_report import MODE_SHAPES

__all__ = ["MODE_SHAPES", "drafter_bundle", "modes_table", "main"]

DRAFTER_PROFILE = "reports/h100/drafters_profile.csv"
BUNDLE_NOTE = "verify and MTP costs from "   # before the bundle's path in the notes (log.txt): modes_rerun reads it


def drafter_bundle(costs_path: str, profile: str, model: str, builder_steps: str = "remove"):
    """(the bundle with the drafters' C_d fitted from ``profile``'s rows of ``model``, notes);
    ``builder_steps``: :func:`simtree.costs.drafter_fit.fit_drafters`'.  The note that names the
    profile names the sweep too (its rows' variant, contexts and days: a path's table may be
    replaced after the run)."""
    from simtree.costs.drafter_fit import fit_drafters, fitted_rows, sweep_label
    from simtree.costs.model import load_costs
    from simtree.costs.profile_table import profile_hash

    bundle = load_costs(costs_path)
    df = pd.read_csv(profile)
    rows = df[df["model"] == model]
    if rows.empty:
        return bundle, [f"{profile} has no drafter rows of {model}: no block-drafter candidates"]
    first = rows.iloc[0]
    key = {"model": model, "device": str(first["device"]), "dtype": str(first["dtype"]),
           "deployment": str(first["deployment"])}
    digest = profile_hash(profile)    # the table at that path may be replaced
    fitted, notes = fit_drafters(rows, **key, source={"profile": profile, "sha256": digest},
                                 builder_steps=builder_steps)
    notes.append(f"drafters' C_d from {profile} ({first['device']}; {sweep_label(fitted_rows(rows, fitted, **key))}); "
                 f"{BUNDLE_NOTE}{costs_path}")
    return dataclasses.replace(bundle, drafters=fitted), notes


def _gpu_name(device: str) -> str:
    import torch
    return torch.cuda.get_device_name(device) if str(device).startswith("cuda") and torch.cuda.is_available() \
        else str(device)


def modes_table(rows: list[dict], model: str, note: str, gpu: str = "") -> list[dict]:
    """Per batch size, the plan's choice and every other mode measured (summary rows of
    ``full_run``): each row's measured rank and the choice's throughput over the best measured."""
    out = []
    for B in sorted({r["batch_size"] for r in rows}):
        runs = [r for r in rows if r["batch_size"] == B and r["measured_tok_s"] == r["measured_tok_s"]]
        if not runs:
            continue
        best = max(runs, key=lambda r: r["measured_tok_s"])
        plan = next((r for r in runs if r["policy"].startswith("plan:")), None)
        order = sorted(runs, key=lambda r: -r["measured_tok_s"])
        for r in runs:
            out.append({"model": model, "batch_size": B, "policy": r["policy"], "plan_choice": r is plan,
                        "measured_tok_s": r["measured_tok_s"], "predicted_tok_s": r["predicted_tok_s"],
                        "rel_err": r["rel_err"], "measured_rank": order.index(r) + 1,
                        "best_measured": best["policy"],
                        "plan_over_best": plan["measured_tok_s"] / best["measured_tok_s"] if plan else float("nan"),
                        "measured_accepted": r["measured_accepted"], "round_ms": r["measured_round_ms"],
                        "gpu": gpu, "note": note})
    return out


def _write_csv(path: Path, rows: list[dict]) -> None:
    if rows:
        write_csv_atomic(path, rows)


def _lossless(s: Session, model, specs, costs) -> None:
    from .build import dtype_name
    from .lossless import check_lossless, make_predictable
    make_predictable(model, 0.3)       # rounds accept and reject; shapes (and timings) unchanged
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [9, 8, 7, 6, 5, 4, 3]]
    rows = []
    for spec in specs:
        if s.left() < 60:
            s.log(f"lossless {spec.name}: skipped, time")
            continue
        try:
            r = check_lossless(model, prompts, [spec], 16, costs=costs)[0]
        except Exception as exc:   # noqa: BLE001 - one mode's failure is logged, the next runs
            s.log(f"lossless {spec.name} FAILED: {type(exc).__name__}: {exc}")
            continue
        r["dtype"] = dtype_name(model.dtype)
        r["near_tie"] = bool(not r["match"] and r["margin"] is not None and r["margin"] <= 2 * r["deviation"])
        s.log(f"lossless {r['policy']}: {'MATCH' if r['match'] else 'near-tie' if r['near_tie'] else 'DIFFERS'} "
              f"(accepted/round {r['accepted_tokens_per_round']:.2f})")
        rows.append(r)
    _write_csv(s.out / "lossless.csv", rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:       # home side: the report of run folders (modes_report.py)
        from .modes_report import main as report_main
        return report_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--costs", default=None, help="cost bundle (default: the deployment's shipped one)")
    ap.add_argument("--drafter-profile", default=DRAFTER_PROFILE)
    ap.add_argument("--acceptance", default="gsm8k")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--max-seconds", type=float, default=480.0)
    ap.add_argument("--phases", default="costs,lossless,measure")
    args = ap.parse_args(argv)
    phases = args.phases.split(",")
    s = Session(args.out, args.max_seconds)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    specs = [PolicySpec.from_dict(m, p) for m, p in MODE_SHAPES]
    deployment = runtime_deployment(args.model, None)
    costs, policy, notes = None, None, []
    try:
        from simtree.acceptance.model import get_workload
        from .rank_plan import plan_rank
        costs, notes = drafter_bundle(args.costs or default_costs(args.model, deployment),
                                      args.drafter_profile, args.model)
        for n in notes:
            s.log(n)
        if "costs" in phases:
            policy, res = plan_rank(costs, get_workload(args.acceptance), sizes, s.out / "plan")
            for row in res.chosen.itertuples():
                s.log(f"plan batch {row.batch_size}: {row.policy} ({row.tok_s:.0f} tok/s predicted)")
    except Exception as exc:   # noqa: BLE001 - the runs go on without a plan
        s.log(f"costs FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    priced = set(getattr(costs, "drafters", None) or {})
    unpriced = [sp.name for sp in specs if sp.mode in BLOCK_DRAFTER_MODES and sp.mode not in priced]
    if unpriced:
        s.log(f"no C_d for {', '.join(unpriced)}: not run")
        specs = [sp for sp in specs if sp.name not in unpriced]
    from .build import build_model
    t0 = time.time()
    model = build_model(args.model, args.device)
    s.log(f"built {args.model} ({deployment}) in {time.time() - t0:.0f} s")
    gpu = _gpu_name(args.device)
    s.log(f"gpu: {gpu}")
    if "lossless" in phases:
        try:
            _lossless(s, model, specs, costs)
        except Exception as exc:   # noqa: BLE001
            s.log(f"lossless FAILED: {type(exc).__name__}: {exc}")
    if "measure" in phases:
        from .measure import full_run
        try:
            res = full_run(model, device=args.device, costs=costs, policy=policy, batch_sizes=sizes,
                           acceptance=args.acceptance, out=s.out / "measure", rounds=args.rounds, warmup_rounds=2,
                           extra=[(sp.mode, sp) for sp in specs], deadline=s.t0 + args.max_seconds - 20,
                           progress=s.log)
            note = "; ".join(n for n in notes if "drafters' C_d" in n)
            _write_csv(s.out / "modes.csv", modes_table(res["rows"], args.model, note, gpu))
            s.log(f"modes.csv: {len(res['rows'])} runs")
        except Exception as exc:   # noqa: BLE001
            s.log(f"measure FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    s.log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
