"""The committed modes runs' rounds split into what was measured and what the cost model
predicts, term by term, before and after this checkout's cost code (on CPU; the GPU times stay
as measured):

    python scripts/block_round_costs.py reports/h100/modes/runs.tgz [--out FILE.md]

Per run (each model's ``measure/summary.json`` in the archive): the measured stages (CUDA events
around the stages, means over the timed rounds: draft, verify, commit) and the spread of the
verify over the rounds; the predicted C_d and C_v(nodes, l, b) of this checkout (the measure
module's prediction, :func:`simtree.runtime.full.measure.repredict`, on the bundle the run used
with the drafters' C_d fitted from ``--drafter-profile`` as ``modes_gpu`` fits them) beside the
round time the run itself predicted (``before``: the recorded ``predicted_round_ms``; C_v is the
same shipped bundle, so the recorded C_d is that less C_v).  ``MTP-drafted verify, same nodes``:
for a block drafter's run, the verify of the run in the same session whose tree has as many
nodes but was drafted by the MTP layer (4: linear_d4, a chain as DSpark's; 8:
best_first_d8_w1_p3), where there is one.

Then each batch's plan choice: the plan as the run made it (``plan/candidates.csv``: the
deployment's batch, for V4-Flash ep=8 rank_batch(b) = ceil(b / 8) sequences a rank) against this
checkout's plan of the same; and the plan of the rank as the runs measured it (the rank's bundle
taken as one GPU: b sequences on the rank, no all-to-all), the measured best beside it.

Last, per run folder, the bundle that priced it: the shipped bundle its log names, in this
checkout (its path and sha256), so that a table made before a later refit of that bundle says
so when made again.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from simtree.acceptance.model import get_workload
from simtree.deploy.costs import one_rank
from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic
from simtree.planning.modes import BLOCK_DRAFTER_MODES
from simtree.planning.planner import plan
from simtree.runtime.full.allocation import draft_cost_us
from simtree.runtime.full.measure import repredict, run_shape
from simtree.runtime.full.modes_rerun import parser, read_runs, run_bundle, run_costs, run_summary
from simtree.fileio import file_sha256

SAME_NODES = {4: "linear_d4:linear_d4", 8: "best_first:best_first_d8_w1_p3"}
CHECKOUT = Path(__file__).resolve().parents[1]


def _terms(costs, run: dict) -> tuple[float, float]:
    """(C_d, C_v) in ms of one run as the measure module prices it: C_d the bundle's own
    (:func:`simtree.runtime.full.allocation.draft_cost_us`: the MTP layer's C_d(s, k, b), or the
    block drafter's at the run's mean context), C_v averaged over the rounds' contexts."""
    stats, B, rs = run["stats"], run["batch_size"], run_shape(run)
    cv = float(np.mean([costs.verify.predict(rs.nodes, float(c), B) for c in stats["context_lens"]])) / 1e3
    if rs.plain:
        return 0.0, cv
    return draft_cost_us(costs, rs, B, float(np.mean(stats["context_lens"]))) / 1e3, cv


def run_table(folder: Path, profile: str):
    """(one row per run, this checkout's bundle, the bundle as the runs had it)."""
    summary = run_summary(folder)
    model = summary["runs"][0]["model"]
    costs = run_costs(folder, model, profile)
    recorded = {(r["policy"], r["batch_size"]): r for r in summary["rows"]}
    now = {(r["policy"], r["batch_size"]): r for r in repredict(summary, costs)["rows"]}
    verify_of = {}
    out = []
    for run in summary["runs"]:
        rs, st, B = run_shape(run), run["stats"], run["batch_size"]
        key = (f"{run['label']}:{rs.name}", B)
        verify_of[key] = float(np.mean(st["verify_ms"]))
        cd, cv = _terms(costs, run)
        before, after = recorded[key], now[key]
        meas = float(before["measured_round_ms"])
        out.append({"model": model, "batch": B, "run": key[0], "mode": run["mode"], "nodes": rs.nodes,
                    "draft_ms": float(np.mean(st["draft_ms"])), "verify_ms": verify_of[key],
                    "commit_ms": float(np.mean(st["commit_ms"])), "verify_sd_ms": float(np.std(st["verify_ms"])),
                    "round_ms": meas, "C_v_ms": cv, "C_d_before_ms": float(before["predicted_round_ms"]) - cv,
                    "C_d_after_ms": cd, "pred_before_ms": float(before["predicted_round_ms"]),
                    "pred_after_ms": float(after["predicted_round_ms"]),
                    "cost_err_before": float(before["predicted_round_ms"]) / meas - 1,
                    "cost_err_after": float(after["predicted_round_ms"]) / meas - 1,
                    "tok_s_measured": float(before["measured_tok_s"]), "block_drafter": rs.block_drafter})
    df = pd.DataFrame(out)
    df["mtp_verify_same_nodes_ms"] = [verify_of.get((SAME_NODES.get(n), b), np.nan) if blk else np.nan
                                      for n, b, blk in zip(df["nodes"], df["batch"], df["block_drafter"])]
    # the bundle as the runs had it: the block drafter's C_d with the profile stage's tree-builder steps kept in
    return df, costs, run_costs(folder, model, profile, builder_steps="keep")


def plan_table(folder: Path, costs, old_costs, sizes: list[int], runs: pd.DataFrame) -> list[dict]:
    was = pd.read_csv(folder / "plan" / "candidates.csv")
    wl = get_workload(str(was["workload"].iloc[0]))
    now = plan(costs, [wl], sizes).candidates
    rank = plan(one_rank(costs), [wl], sizes).candidates
    rank_was = plan(one_rank(old_costs), [wl], sizes).candidates
    out = []
    for B in sizes:
        pick = lambda df: df[df["batch_size"] == B].sort_values("tok_s", ascending=False).iloc[0]  # noqa: E731
        meas = runs[runs["batch"] == B].sort_values("tok_s_measured", ascending=False).iloc[0]
        r = rank[rank["batch_size"] == B]
        mtp = r[~r["mode"].isin(BLOCK_DRAFTER_MODES)].sort_values("tok_s", ascending=False).iloc[0]
        out.append({"model": runs["model"].iloc[0], "batch": B, "plan_before": pick(was)["policy"],
                    "plan_after": pick(now)["policy"], "rank_plan_before": pick(rank_was)["policy"],
                    "rank_plan_after": pick(rank)["policy"], "rank_tok_s": float(pick(rank)["tok_s"]),
                    "rank_mtp": mtp["policy"], "rank_mtp_tok_s": float(mtp["tok_s"]),
                    "best_measured": meas["run"], "best_measured_tok_s": float(meas["tok_s_measured"])})
    return out


def priced_with(run: str, bundle: Path) -> str:
    """One line: the bundle that priced the runs of folder ``run``, its path (in the checkout
    where it lies there) and the sha256 of the file."""
    bundle = Path(bundle).resolve()
    shown = bundle.relative_to(CHECKOUT) if bundle.is_relative_to(CHECKOUT) else bundle
    return f"{run}: priced with {shown} (sha256 {file_sha256(bundle)})"


def render(tables: list[pd.DataFrame], plans: list[dict], priced: list[str] = ()) -> str:
    lines = ["| model | batch | run | nodes | draft ms | verify ms (sd) | MTP-drafted verify, same nodes | commit ms "
             "| round ms | C_d before -> after | C_v | predicted round before -> after | cost error before -> after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for df in tables:
        for r in df.itertuples():
            same = r.mtp_verify_same_nodes_ms
            same = "-" if same != same else f"{same:.2f}"
            lines.append(f"| {r.model} | {r.batch} | {r.run} | {r.nodes} | {r.draft_ms:.2f} | {r.verify_ms:.2f} "
                         f"({r.verify_sd_ms:.2f}) | {same} | {r.commit_ms:.2f} | {r.round_ms:.2f} | "
                         f"{r.C_d_before_ms:.2f} -> {r.C_d_after_ms:.2f} | {r.C_v_ms:.2f} | {r.pred_before_ms:.2f} -> "
                         f"{r.pred_after_ms:.2f} | {100 * r.cost_err_before:+.1f}% -> {100 * r.cost_err_after:+.1f}% |")
    lines += ["", "| model | batch | plan as run (deployment batch) | same plan now | the rank's plan before (b on the "
              "rank) | the rank's plan now, predicted tok/s | its best MTP-drafted candidate | best measured (tok/s) |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {p['model']} | {p['batch']} | {p['plan_before']} | {p['plan_after']} | {p['rank_plan_before']} | "
              f"{p['rank_plan_after']} "
              f"{p['rank_tok_s']:.0f} | {p['rank_mtp']} {p['rank_mtp_tok_s']:.0f} | {p['best_measured']} "
              f"({p['best_measured_tok_s']:.1f}) |" for p in plans]
    if priced:
        lines += ["", *priced]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--out", default=None, help="write the tables here (markdown) as well")
    args = ap.parse_args(argv)

    def tables(folder: Path) -> list[tuple[pd.DataFrame, list[dict], str]]:
        df, costs, old_costs = run_table(folder, args.drafter_profile)
        return [(df, plan_table(folder, costs, old_costs, sorted(df["batch"].unique().tolist()), df),
                 priced_with(folder.name, run_bundle(folder)))]

    try:
        per_run = read_runs(args.inputs, tables)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = render([df for df, _, _ in per_run], [p for _, plans, _ in per_run for p in plans],
                  [line for _, _, line in per_run])
    if args.out:
        write_text_atomic(args.out, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
