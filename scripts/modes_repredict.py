"""The committed modes runs predicted again by this checkout's prediction code, from the cost
bundle each run priced with (on CPU; the GPU's measurements stay as measured):

    python scripts/modes_repredict.py reports/h100/modes/runs.tgz --model qwen3.6-27b
    git show 49a6edf^:reports/h100/drafters_profile.csv > /tmp/drafters_v4_run.csv
    python scripts/modes_repredict.py reports/h100/modes/runs.tgz --run deepseek-v4-flash-b8-b32 \\
        --drafter-profile /tmp/drafters_v4_run.csv     # that V4 run planned before 49a6edf replaced the table

Per run folder (each folder's ``measure/summary.json`` in the archive; ``--model`` keeps one model's
folders, ``--run`` one folder by its name):
:func:`simtree.runtime.full.measure.repredict` on the bundle the run's log names (its file
in this checkout, ``simtree/data/costs/``) with the drafters' C_d fitted from
``--drafter-profile`` as ``modes_gpu`` fits them.  A recomputed prediction counts as the code's
only where the bundle is the run's: every run's predicted round time must come out as recorded
(within ``--tol``, the recorded files' 6 significant digits), else one line says which run and
nothing is printed.  Printed: every run whose predicted tok/s moved beyond ``--tol``, before ->
after, with its accepted tokens a round (measured; predicted before -> after); the others are
counted.  Recomputed predictions are not blind: the runs were measured before the code changed.
"""
from __future__ import annotations

import sys
from pathlib import Path

from simtree.errors import SimtreeError
from simtree.runtime.full.measure import repredict
from simtree.runtime.full.modes_gpu import drafter_bundle
from simtree.runtime.full.modes_rerun import parser, read_runs, run_bundles, run_summary


def compare(folder: Path, profile: str, tol: float, summary: dict | None = None) -> list[dict]:
    """Each run of ``folder``: its recorded and recomputed predictions (a one-line error where a
    recomputed round time is not the recorded one: not the run's bundle); ``summary``: the folder's
    :func:`run_summary` where the caller read it already."""
    summary = run_summary(folder) if summary is None else summary
    model = summary["runs"][0]["model"]
    failed = None
    for path in run_bundles(folder):     # the shipped bundle, else a frozen copy of the one of the run's time
        try:
            return _compare(summary, model, drafter_bundle(str(path), profile, model)[0], tol)
        except SimtreeError as exc:
            failed = failed or exc
    raise failed


def _compare(summary: dict, model: str, costs, tol: float) -> list[dict]:
    now = {(r["policy"], r["batch_size"]): r for r in repredict(summary, costs)["rows"]}
    out = []
    for was in summary["rows"]:
        key = (was["policy"], was["batch_size"])
        new = now[key]
        moved = new["predicted_round_ms"] / was["predicted_round_ms"] - 1
        if abs(moved) > tol:
            raise SimtreeError(f"{model} batch {key[1]} {key[0]}: predicted round {was['predicted_round_ms']:.4f} ms "
                               f"recorded, {new['predicted_round_ms']:.4f} now ({moved:+.2e}): not the bundle the run "
                               f"priced with (--drafter-profile?)")
        out.append({"model": model, "batch": key[1], "run": key[0], "measured_tok_s": was["measured_tok_s"],
                    "before": was["predicted_tok_s"], "after": new["predicted_tok_s"],
                    "err_before": was["rel_err"], "err_after": new["rel_err"], "accepted": was["measured_accepted"],
                    "acc_before": was["predicted_accepted"], "acc_after": new["predicted_accepted"],
                    "moved": abs(new["predicted_tok_s"] / was["predicted_tok_s"] - 1) > tol})
    return out


def render(rows: list[dict]) -> str:
    moved = [r for r in rows if r["moved"]]
    lines = [f"{len(rows) - len(moved)} of {len(rows)} runs predicted as recorded; {len(moved)} moved:", "",
             "| model | batch | run | measured tok/s | predicted before -> after | error before -> after "
             "| accepted / round measured | predicted before -> after |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['batch']} | {r['run']} | {r['measured_tok_s']:.1f} | {r['before']:.1f} -> "
              f"{r['after']:.1f} | {100 * r['err_before']:+.1f}% -> {100 * r['err_after']:+.1f}% | {r['accepted']:.2f} "
              f"| {r['acc_before']:.2f} -> {r['acc_after']:.2f} |" for r in moved]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default=None, help="only this model's run folder")
    ap.add_argument("--run", default=None, help="only the run folder of this name")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args(argv)

    def kept(folder: Path) -> list[dict]:
        summary = run_summary(folder)
        keep = args.model in (None, summary["runs"][0]["model"]) and args.run in (None, folder.name)
        return compare(folder, args.drafter_profile, args.tol, summary) if keep else []

    try:
        rows = read_runs(args.inputs, kept)
        if not rows:
            raise SimtreeError(f"no run of {args.run or args.model} in the inputs")
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
