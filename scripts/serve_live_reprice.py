"""The committed live run's phases priced again on a cost bundle refitted from the run's own
profile, on CPU: the measured columns stay as the GPU measured them.

The archive (``reports/bench_serve/live_run.tgz``, written by ``scripts/serve_live_gpu.sh``)
holds the run's profile (``profile.csv``), the bundle the run used (``costs.json``) and its CSV
(``serve_live.csv``).  This script fits ``profile.csv`` again with ``simtree fit``'s automatic
form choice of this checkout (``fit_profile``), replays every phase on CPU with the tier the run
recorded for it (the tiny model is fp32 and greedy: the same tokens, rounds and accepted drafts
as on the GPU, checked against the run's ``rounds`` and ``tokens_per_round``), and prices the
replayed rounds as ``scripts/serve_live.py`` does (:func:`simtree.serving.policies.step_us` at each
round's batch, mean verified nodes and mean context, plus the drafter's catch-up,
:class:`simtree.control.catchup.CatchUpClock`).  Priced on the run's own bundle, the replay must
give the run's recorded predictions (else it stops: the replay is not the run); priced on the
refit, it gives the new ``predicted_tpot_ms``, ``predicted_model_tpot_ms`` and
``predicted_catchup_ms``.  The run's own prediction stays as ``run_predicted_tpot_ms`` and its
bundle as ``run_costs``; ``costs`` names the refit.  Both bundles are in sample: fitted on the
profile this session timed.

    python scripts/serve_live_reprice.py --archive reports/bench_serve/live_run.tgz \\
        --out reports/bench_serve/serve_live.csv
    python -m simtree.serving.live_report reports/bench_serve/serve_live.csv --readme reports/bench_serve/README.md
"""
from __future__ import annotations

import argparse
import sys
import tarfile
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_live import Recording, _prompts, live_controller, live_lag_rows, price  # noqa: E402

from simtree.control import Controller  # noqa: E402
from simtree.costs.model import load_costs  # noqa: E402
from simtree.costs.profile_fit import fit_profile  # noqa: E402
from simtree.errors import SimtreeError  # noqa: E402
from simtree.fileio import write_atomic  # noqa: E402
from simtree.planning.modes import NoneParams  # noqa: E402
from simtree.runtime.full.build import build_model  # noqa: E402
from simtree.runtime.full.generate import generate  # noqa: E402
from simtree.serving.live_report import CATCH_UP_COLUMNS, COLUMNS, REPRICE_COLUMNS  # noqa: E402

ARCHIVE_FILES = ("profile.csv", "costs.json", "serve_live.csv")
MATCH_REL = 1e-4   # the CSV keeps 6 significant digits


class Forced(Recording):
    """The run's tier for every round of a phase; the controller only follows acceptance (its
    running ratio prices ``predicted_model_tpot_ms`` as it did live)."""

    def __init__(self, ctl: Controller, tier):
        super().__init__(ctl)
        self.tier = tier

    def choose(self, batch_size, context_lens, rounds_done=None):
        self.log.append((self.tier, int(batch_size), float(np.mean(context_lens)), self.ctl.ratio))
        return self.tier


def _unpack(archive: Path, into: Path) -> dict:
    try:
        with tarfile.open(archive) as tar:
            names = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
            missing = [f for f in ARCHIVE_FILES if f not in names]
            if missing:
                raise SimtreeError(f"{archive}: no {', '.join(missing)} in the live run's archive")
            for f in ARCHIVE_FILES:
                (into / f).write_bytes(tar.extractfile(names[f]).read())
    except (OSError, tarfile.TarError) as exc:
        raise SimtreeError(f"{archive}: cannot read the live run's archive ({type(exc).__name__})") from None
    return {f: into / f for f in ARCHIVE_FILES}


def _phase_tier(ctl: Controller, tiers: str, phase: int):
    names = [t.split(":")[0] for t in str(tiers).split(";")]
    if len(names) != 1:
        raise SimtreeError(f"phase {phase} ran several tiers ({tiers}): their order is not recorded, it cannot be replayed")
    by_name = {t.name: t for t in ctl.tiers}
    if names[0] not in by_name:
        raise SimtreeError(f"phase {phase}: tier {names[0]} is not one of the controller's ({', '.join(by_name)})")
    return by_name[names[0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archive", default="reports/bench_serve/live_run.tgz")
    ap.add_argument("--out", default="reports/bench_serve/serve_live.csv")
    ap.add_argument("--model", default="simtree/data/models/qwen3.5-tiny-sharegpt")
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--lag-rows", type=int, default=None,
                    help="the run's catch-up buffer rows (default: the runtime's rule for the controller's tiers, as serve_live.py)")
    ap.add_argument("--refit-out", default=None, help="also save the refitted bundle here")
    args = ap.parse_args()
    archive = Path(args.archive)
    with tempfile.TemporaryDirectory() as tmp:
        files = _unpack(archive, Path(tmp))
        run = pd.read_csv(files["serve_live.csv"])
        run_costs = load_costs(files["costs.json"])
        refit = fit_profile(files["profile.csv"]).bundle
        if args.refit_out:
            refit.save(args.refit_out)
    model = build_model(args.model, device="cpu", dtype=torch.float32)
    ctl = live_controller(run_costs, args.workload)
    if args.lag_rows is None:     # the lag buffer serve_live.py priced with
        args.lag_rows = live_lag_rows(model, ctl)
    ids, _ = _prompts(int(run.batch_size.sum()), args.workload, args.model, None)
    out, start = run.copy(), 0
    out["run_predicted_tpot_ms"], out["run_costs"] = run.predicted_tpot_ms, run.costs
    out["costs"] = f"{archive.name}:profile.csv refitted"
    for i, r in run.iterrows():
        b = int(r.batch_size)
        rec = Forced(ctl, _phase_tier(ctl, r.tiers, int(r.phase)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = generate(model, ids[start:start + b], int(r.new_tokens), NoneParams(), costs=run_costs, controller=rec)
            start += b
            gained = sum(float(np.mean(x.accepted)) + 1.0 for x in res.rounds)
            if len(res.rounds) != int(r.rounds) or abs(gained / len(res.rounds) / r.tokens_per_round - 1) > MATCH_REL:
                raise SimtreeError(f"phase {i}: the CPU replay ran {len(res.rounds)} rounds at {gained / len(res.rounds):.4g} "
                                   f"tokens a round, the run {int(r.rounds)} at {r.tokens_per_round:.4g}: not the run")
            old = price(run_costs, rec.log, res.rounds, args.lag_rows)
            for col, v in old.items():
                if abs(v - r[col]) > MATCH_REL * max(abs(r[col]), 1e-3):
                    raise SimtreeError(f"phase {i}: the run's own bundle prices the replay at {col} {v:.6g}, the run "
                                       f"recorded {r[col]:.6g}: the replay is not the run")
            for col, v in price(refit, rec.log, res.rounds, args.lag_rows).items():
                out.loc[i, col] = v
        names = Counter(t.name for t, *_ in rec.log)
        print(f"phase {i} b={b} {';'.join(f'{n}:{c}' for n, c in names.items())}: measured {r.measured_tpot_ms:.3f} "
              f"ms/token, run's bundle {r.predicted_tpot_ms:.3f} ({r.predicted_tpot_ms / r.measured_tpot_ms - 1:+.1%}), "
              f"refit {out.loc[i, 'predicted_tpot_ms']:.3f} "
              f"({out.loc[i, 'predicted_tpot_ms'] / r.measured_tpot_ms - 1:+.1%})", flush=True)
    cols = COLUMNS + CATCH_UP_COLUMNS + REPRICE_COLUMNS
    write_atomic(args.out, lambda p: out[cols].to_csv(p, index=False, float_format="%.6g"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main()
    except SimtreeError as exc:
        raise SystemExit(f"error: {exc}") from None
