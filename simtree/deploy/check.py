"""One rank's composed step against the same rank's measured step, communication left out.

    python -m simtree.deploy.check --profile RANK_PROFILE.csv --live STEPS.csv --out check.csv

``--profile``: a profile table of one deployment's rank with composed verify steps
(``model_verify_step`` / ``composed``: per-layer pieces timed at the rank's shard shape, summed);
``--live``: a table of the whole steps the runtime executes for that rank (``model_verify_step``
rows of variant ``full_runtime`` by default, e.g. the full-scale session's steps_profile.csv).
Points are matched on (batch, nodes per sequence, tree shape) with the composed latency
interpolated linearly in the context length between composed contexts (a live context outside
them is left out).  Writes the table (model, deployment, batch_size, nodes_per_seq,
context_len, tree_shape, composed_us, live_us, rel_err) and prints one line: the median and
worst |relative error| against the target (3%); exit code 1 when the median misses it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from simtree.parallel import parse_deployment
from simtree.errors import SimtreeError

__all__ = ["CheckResult", "compare_steps", "main", "TARGET_MEDIAN_ERROR"]

TARGET_MEDIAN_ERROR = 0.03
STAGE = "model_verify_step"


@dataclass
class CheckResult:
    table: pd.DataFrame
    notes: list = field(default_factory=list)

    @property
    def median_abs_err(self) -> float:
        return float(np.median(np.abs(self.table["rel_err"]))) if len(self.table) else float("nan")

    @property
    def max_abs_err(self) -> float:
        return float(np.max(np.abs(self.table["rel_err"]))) if len(self.table) else float("nan")

    def passed(self, target: float = TARGET_MEDIAN_ERROR) -> bool:
        return bool(len(self.table)) and self.median_abs_err <= target

    def summary(self, target: float = TARGET_MEDIAN_ERROR) -> str:
        if not len(self.table):
            return "no matching points between the composed and the live steps"
        t = self.table
        return (f"{t['model'].iloc[0]} at {t['deployment'].iloc[0]}: composed vs live rank step over {len(t)} points: "
                f"median |err| {100 * self.median_abs_err:.1f}%, worst {100 * self.max_abs_err:.1f}% "
                f"(target median <= {100 * target:.0f}%: {'met' if self.passed(target) else 'MISSED'})")


def _one(df: pd.DataFrame, column: str, value, what: str) -> pd.DataFrame:
    if value is not None:
        out = df[df[column] == value]
        if out.empty:
            have = ", ".join(map(str, sorted(df[column].unique())))
            raise SimtreeError(f"{what}: no rows with {column} {value!r} (have: {have})")
        return out
    values = sorted(df[column].unique())
    if len(values) != 1:
        raise SimtreeError(f"{what}: several {column}s ({', '.join(map(str, values))}): choose one with --{column}")
    return df


def compare_steps(profile, live, model: str | None = None, deployment: str | None = None,
                  live_variant: str = "full_runtime") -> CheckResult:
    """The matched points of the composed (``profile``) and measured (``live``) rank steps."""
    from simtree.costs.profile_table import load_profile

    notes = []
    comp = load_profile(profile)
    comp = comp[(comp["stage"] == STAGE) & (comp["variant"] == "composed")]
    if comp.empty:
        raise SimtreeError(f"{Path(profile).name}: no composed {STAGE} rows (the sweep's composition writes them)")
    comp = _one(comp, "model", model, Path(profile).name)
    dep = parse_deployment(deployment).name if deployment else None
    comp = _one(comp, "deployment", dep, Path(profile).name)
    name, dep = comp["model"].iloc[0], comp["deployment"].iloc[0]
    meas = load_profile(live)
    meas = meas[(meas["stage"] == STAGE) & (meas["variant"] == live_variant) & (meas["model"] == name)]
    if meas.empty:
        raise SimtreeError(f"{Path(live).name}: no {STAGE} rows of variant {live_variant} for {name}")
    if (meas["deployment"] == dep).any():
        meas = meas[meas["deployment"] == dep]
    else:
        have = sorted(meas["deployment"].unique())
        if len(have) > 1:
            raise SimtreeError(f"{Path(live).name}: {name} rows at {', '.join(have)}, none at {dep}")
        notes.append(f"the live rows name deployment {have[0]}: taken as the {dep} rank the runtime ran "
                     "(its rows do not say which rank)")
    rows = []
    for r in meas.itertuples(index=False):
        same = comp[(comp["batch_size"] == r.batch_size) & (comp["nodes_per_seq"] == r.nodes_per_seq)]
        if same.empty:
            continue
        shaped = same[same["tree_shape"] == r.tree_shape]   # else the composition's one shape stands in
        same = shaped if not shaped.empty else same[same["tree_shape"] == same["tree_shape"].iloc[0]]
        same = same.drop_duplicates("context_len").sort_values("context_len")
        ls = same["context_len"].to_numpy(float)
        if not ls[0] <= r.context_len <= ls[-1]:
            continue
        composed = float(np.interp(r.context_len, ls, same["latency_us_median"].to_numpy(float)))
        rows.append({"model": name, "deployment": dep, "batch_size": int(r.batch_size),
                     "nodes_per_seq": int(r.nodes_per_seq), "context_len": int(r.context_len),
                     "tree_shape": str(same["tree_shape"].iloc[0]), "composed_us": round(composed, 2),
                     "live_us": round(float(r.latency_us_median), 2),
                     "rel_err": round(composed / float(r.latency_us_median) - 1, 4)})
    left = len(meas) - len(rows)
    if left:
        notes.append(f"{left} live points have no composed point at their batch and nodes, or lie outside the "
                     "composed contexts: left out")
    return CheckResult(pd.DataFrame(rows, columns=["model", "deployment", "batch_size", "nodes_per_seq", "context_len",
                                                   "tree_shape", "composed_us", "live_us", "rel_err"]), notes)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m simtree.deploy.check", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, type=Path, help="the rank's profile table (composed steps)")
    ap.add_argument("--live", required=True, type=Path, help="the runtime's measured steps of that rank")
    ap.add_argument("--model", default=None)
    ap.add_argument("--deployment", default=None)
    ap.add_argument("--live-variant", default="full_runtime")
    ap.add_argument("--out", type=Path, default=None, help="CSV of the matched points")
    ap.add_argument("--target", type=float, default=TARGET_MEDIAN_ERROR)
    args = ap.parse_args(argv)
    try:
        res = compare_steps(args.profile, args.live, args.model, args.deployment, args.live_variant)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.out is not None:
        from simtree.fileio import write_atomic
        write_atomic(args.out, lambda tmp: res.table.to_csv(tmp, index=False))
    print(res.summary(args.target))
    return 0 if res.passed(args.target) else 1


if __name__ == "__main__":
    sys.exit(main())
