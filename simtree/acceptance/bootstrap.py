"""K acceptance models around one, for a band on every prediction made with it.

:func:`bootstrap_models` resamples a trace's sequences (whole sequences: a sequence's rounds
are correlated, so resampling single rounds would make the band too narrow) and refits; for a
preset it draws models whose published quantities stay within the calibration targets
(linear +-0.05 tokens, tree gains +-1.5 points), by moving the preset's parameters along the
fitted sensitivities.  A planner runs its prediction once per model and reports the spread.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from scipy.optimize import brentq

from simtree.acceptance.calibrate import TARGETS, TREE_STEPS, published_quantities
from simtree.acceptance.mixture import ALPHA_MAX, AcceptanceModel
from simtree.acceptance.model import fit_traces
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.presets import PRESETS, PUBLISHED_BUDGETS, preset_model
from simtree.acceptance.traces import TraceRecord, read_traces, sequence_ids
from simtree.acceptance.transfer import split_spec, transfer_bootstrap
from simtree.errors import SEED_MAX, SimtreeError, check_whole

__all__ = ["bootstrap_models", "sequence_ids"]


def _trace_models(records: list[TraceRecord], n: int, rng: np.random.Generator) -> list[AcceptanceModel]:
    ids = sequence_ids(records)
    groups = [np.flatnonzero(ids == s) for s in np.unique(ids)]
    name = records[0].workload
    out = []
    for k in range(n):
        pick = rng.integers(0, len(groups), len(groups))
        sample = [records[i] for g in pick for i in groups[g]]
        acc = fit_traces(sample, name, "bootstrap sample")
        out.append(AcceptanceModel(f"{name}#b{k}", acc.tables, acc.weights, acc.source + " (bootstrap)",
                                   {**acc.meta, "bootstrap": k}, acc.draft_probs, acc.state, acc.state_share))
    return out


def _scaled(acc: AcceptanceModel, top: float, siblings: float) -> np.ndarray:
    """The preset's tables with rank 0 scaled by ``top`` and ranks >= 1 by ``siblings``; ranks
    >= 1 give way where a row would pass ALPHA_MAX (rank 0 keeps its value)."""
    t = acc.tables.copy()
    t[:, :, 0] = np.minimum(t[:, :, 0] * top, ALPHA_MAX)
    sib = t[:, :, 1:] * siblings
    room = np.maximum(ALPHA_MAX - t[:, :, :1], 0.0)
    t[:, :, 1:] = sib * np.minimum(1.0, room / np.maximum(sib.sum(2, keepdims=True), 1e-300))
    return t


def _gain_pct(acc: AcceptanceModel, budget: int) -> float:
    """The published gain's quantity alone: the s3_k2 tree over the chain at ``budget`` (%)."""
    tree = accepted_per_round(acc, "eagle", {"num_steps": TREE_STEPS, "topk": 2, "budget": budget})
    return 100.0 * (tree / (1.0 + acc.linear_accepted(budget)) - 1.0)


def _solve(f, target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] with f(x) = target for an increasing f (Brent's method to 1e-7 of the
    range; the nearer end if out of reach)."""
    f_lo, f_hi = f(lo) - target, f(hi) - target
    if f_lo >= 0:
        return lo
    if f_hi <= 0:
        return hi
    return float(brentq(lambda x: f(x) - target, lo, hi, xtol=1e-7 * (hi - lo)))


def _preset_models(name: str, n: int, rng: np.random.Generator) -> list[AcceptanceModel]:
    """Models whose linear number moves by up to the 0.05-token target and whose top-2 gain (at
    the widest published budget) by up to the 1.5-point target, uniformly: rank 0 scaled to
    move the chain, ranks >= 1 to move the gain."""
    base = preset_model(name)
    d = max(PUBLISHED_BUDGETS)

    def model(top, siblings, k):
        t = _scaled(base, top, siblings)
        return AcceptanceModel(f"{name}#b{k}", t, base.weights, f"preset {name} within its calibration targets",
                               {**base.meta, "bootstrap": k}, t)

    q0 = published_quantities(base, d)
    out = []
    for k in range(n):
        shift_tokens, shift_points = rng.uniform(-1, 1) * TARGETS["linear_tokens"], rng.uniform(-1, 1) * TARGETS["gain_points"]
        top = _solve(lambda x: 1.0 + model(x, 1.0, k).linear_accepted(d), q0["linear"] + shift_tokens, 0.5, 1.5)
        siblings = _solve(lambda x: _gain_pct(model(top, x, k), d), q0["gain_pct"] + shift_points, 0.0, 3.0)
        acc = model(top, siblings, k)
        acc.meta.update({"linear_shift_tokens": round(float(shift_tokens), 4),
                         "gain_shift_points": round(float(shift_points), 3)})
        out.append(acc)
    return out


def bootstrap_models(source, n: int, seed: int = 0) -> list[AcceptanceModel]:
    """``n`` acceptance models around ``source``: a preset name, a trace file (``path`` or
    ``path#workload``), a ``DRAFTS.jsonl@TRACES.jsonl`` spec (:mod:`simtree.acceptance.transfer`)
    or a list of trace records of one workload.  Deterministic for a seed."""
    n = check_whole(n, "bootstrap models", 1, 10_000)
    rng = np.random.default_rng(check_whole(seed, "seed", 0, SEED_MAX))
    if isinstance(source, str) and source in PRESETS:
        return _preset_models(source, n, rng)
    if isinstance(source, (str, Path)) and split_spec(str(source)) is not None:   # DRAFTS.jsonl@TRACES.jsonl
        return transfer_bootstrap(str(source), n, rng)
    if isinstance(source, (str, Path)):
        path, _, only = str(source).partition("#")
        source = read_traces(path, only or None)
    records = list(source)
    if not records or not all(isinstance(r, TraceRecord) for r in records):
        raise SimtreeError("bootstrap source must be a preset name, a trace file or a list of trace records")
    names = sorted({r.workload for r in records})
    if len(names) > 1:
        raise SimtreeError(f"bootstrap traces hold workloads {', '.join(names)}: pick one (file.jsonl#workload)")
    return _trace_models(records, n, rng)
