"""Uncertainty bands on a plan's choices.

Each workload's acceptance model is uncertain: a preset is calibrated to published numbers
within targets (linear +-0.05 tokens, tree gains +-1.5 points), a trace fit rests on a finite
sample of sequences.  :func:`simtree.acceptance.bootstrap.bootstrap_models` draws K models
around it (within the calibration targets, or by resampling the trace's sequences and
refitting).  Per (workload, batch size) of a plan, the chosen policy and its runner-up (the
best candidate of another family: none, linear, EAGLE, best-first, adaptive) are predicted
again under each of the K models, at the same cost models (a runner-up predicting exactly the
chosen tok/s verifies the same tree, e.g. best_first_d2_w1_p1 and linear_d2, and is passed
over):

- the chosen policy's band: the ``BAND_QUANTILES`` (10th, 90th percentile) of its tok/s;
- the advantage over the runner-up per model (paired: both under the same model), and its
  band; a choice is *within the band* when the runner-up is at least as fast under at least
  10 % of the models (the advantage's 10th percentile is <= 0): the data cannot tell the two
  apart.

Models and the fixed policies' trees are cached (a preset's bootstrap once per process, a
fixed shape once per model), so the bands cost about as many analytic runs as K x cells x 2.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from functools import lru_cache
from typing import Sequence

import numpy as np
import pandas as pd

from simtree.acceptance.bootstrap import bootstrap_models
from simtree.acceptance.model import PRESETS, AcceptanceModel, Workload
from simtree.costs.model import Costs
from simtree.errors import ExtrapolationWarning, SimtreeError, check_whole
from simtree.planning.modes import ADAPTIVE_MODES, BLOCK_DRAFTER_MODES, PolicySpec
from simtree.planning.policy_file import Policy
from simtree.planning.simulate import analytic_run, analytic_static, static_round

__all__ = ["BAND_MODELS", "BAND_QUANTILES", "BAND_COLUMNS", "band_workloads", "plan_bands", "with_bands",
           "bands_from_policy"]

BAND_MODELS = 16              # K bootstrap models per workload (`simtree plan --band-models`)
BAND_QUANTILES = (0.1, 0.9)   # the band: 10th to 90th percentile over the K models
BAND_COLUMNS = ("workload", "batch_size", "tok_s_lo", "tok_s_hi", "runner_up", "advantage_lo", "advantage_hi",
                "within_band", "band_models")


def _family(mode: str) -> str:
    return "adaptive" if mode in ADAPTIVE_MODES else mode


@lru_cache(maxsize=16)
def _preset_models(name: str, k: int, seed: int) -> tuple[AcceptanceModel, ...]:
    return tuple(bootstrap_models(name, k, seed))


def band_workloads(spec: str, workload: Workload, k: int = BAND_MODELS, seed: int = 0) -> list[Workload]:
    """K workloads around ``workload`` (what :func:`simtree.acceptance.model.get_workload` made
    of ``spec``, a preset name or a trace file): the same lengths, acceptance from
    :func:`~simtree.acceptance.bootstrap.bootstrap_models` (a preset's once per process)."""
    k = check_whole(k, "band models", 1, 10_000)
    if spec in PRESETS:
        models = _preset_models(spec, k, seed)
    else:
        with warnings.catch_warnings():
            # the workload's own fit has warned about this trace (few records, ...): its
            # resamples would say it again, K times
            warnings.simplefilter("ignore", RuntimeWarning)
            models = bootstrap_models(spec, k, seed)
    return [Workload(workload.name, m, workload.prompt_lens, workload.output_len, f"{workload.note}; bootstrap {i}")
            for i, m in enumerate(models)]


class _Scores:
    """tok/s of one policy under each of K workloads at one batch size; a fixed shape's trees are
    built once per model (shared by every batch size)."""

    def __init__(self, costs: Costs, workloads: Sequence[Workload]):
        self.costs, self.workloads, self.shapes = costs, list(workloads), {}

    def __call__(self, spec: PolicySpec, b: int) -> np.ndarray:
        if spec.mode in BLOCK_DRAFTER_MODES:
            from simtree.planning.drafter_candidates import score_run
            return np.array([score_run(self.costs, w, spec, b)["tok_s"] for w in self.workloads])
        if spec.mode in ADAPTIVE_MODES:
            return np.array([analytic_run(w, spec, self.costs, b)["tok_s"] for w in self.workloads])
        if spec.name not in self.shapes:
            self.shapes[spec.name] = [static_round(w.acceptance, spec) for w in self.workloads]
        shapes = self.shapes[spec.name]
        s, k = spec.draft_shape()
        draft = 0.0 if s == 0 else float(self.costs.draft.predict(s, k, b))
        w0 = self.workloads[0]   # every bootstrap workload has the same lengths
        out = analytic_static([x.tokens_per_round for x in shapes], [x.nodes_per_seq for x in shapes], draft,
                              self.costs, b, w0.mean_prompt_len, w0.output_len)
        return out["throughput_tok_s"]


def plan_bands(chosen: pd.DataFrame, candidates: pd.DataFrame, costs: Costs, bands: dict[str, Sequence[Workload]],
               quantiles: tuple[float, float] = BAND_QUANTILES) -> pd.DataFrame:
    """One row (``BAND_COLUMNS``) per chosen (workload, batch size) whose workload has models in
    ``bands`` ({workload name: K workloads}): the chosen policy's tok/s band, the runner-up,
    the band of the chosen policy's advantage over it, and ``within_band``."""
    lo_q, hi_q = quantiles
    if not 0 <= lo_q < hi_q <= 1:
        raise SimtreeError(f"band quantiles must satisfy 0 <= lo < hi <= 1, got {quantiles}")
    scores = {name: _Scores(costs, models) for name, models in bands.items() if models}
    rows = []
    with warnings.catch_warnings():
        # the plan names every cost-model axis it extrapolates; the bands ask the same ones again
        warnings.simplefilter("ignore", ExtrapolationWarning)
        for c in chosen.itertuples():
            if c.workload not in scores:
                continue
            score, b = scores[c.workload], int(c.batch_size)
            mine = score(PolicySpec.from_dict(c.mode, json.loads(c.params)), b)
            cell = candidates[(candidates["workload"] == c.workload) & (candidates["batch_size"] == b)]
            # another family, and not the same prediction (e.g. best_first_d2_p1 is the chain linear_d2)
            other = cell[[_family(m) != _family(c.mode) for m in cell["mode"]]
                         & ~np.isclose(cell["tok_s"].to_numpy(), c.tok_s, rtol=1e-9, atol=0.0)]
            row = {"workload": c.workload, "batch_size": b, "tok_s_lo": float(np.quantile(mine, lo_q)),
                   "tok_s_hi": float(np.quantile(mine, hi_q)), "runner_up": None, "advantage_lo": float("nan"), "advantage_hi": float("nan"), "within_band": False,
                   "band_models": int(mine.size)}
            if not other.empty:
                r = other.loc[other["tok_s"].idxmax()]
                advantage = mine / score(PolicySpec.from_dict(r["mode"], json.loads(r["params"])), b) - 1.0
                lo, hi = float(np.quantile(advantage, lo_q)), float(np.quantile(advantage, hi_q))
                row.update(runner_up=str(r["policy"]), advantage_lo=lo, advantage_hi=hi, within_band=bool(lo <= 0.0))
            rows.append(row)
    return pd.DataFrame(rows, columns=list(BAND_COLUMNS))


def with_bands(policy: Policy, bands: pd.DataFrame) -> Policy:
    """``policy`` with each entry's band (the row of ``bands`` at its planned batch size)."""
    if bands is None or bands.empty:
        return policy
    index = bands.set_index(["workload", "batch_size"])
    entries = []
    for e in policy.entries:
        key = (e.workload, e.batch_max)
        if key not in index.index:
            entries.append(e)
            continue
        r = index.loc[key]
        advantage = None if r["runner_up"] is None or pd.isna(r["runner_up"]) else \
            (str(r["runner_up"]), (float(r["advantage_lo"]), float(r["advantage_hi"])))
        entries.append(replace(e, tok_s_band=(float(r["tok_s_lo"]), float(r["tok_s_hi"])), runner_up=advantage,
                               within_band=bool(r["within_band"]), band_models=int(r["band_models"])))
    return replace(policy, entries=entries)


def bands_from_policy(policy: Policy) -> pd.DataFrame | None:
    """The bands a policy file carries (None when its entries have none: an older plan)."""
    rows = []
    for e in policy.entries:
        if e.tok_s_band is None:
            continue
        name, adv = e.runner_up if e.runner_up else (None, (float("nan"), float("nan")))
        rows.append({"workload": e.workload, "batch_size": e.batch_max, "tok_s_lo": e.tok_s_band[0],
                     "tok_s_hi": e.tok_s_band[1], "runner_up": name, "advantage_lo": adv[0], "advantage_hi": adv[1], "within_band": e.within_band,
                     "band_models": e.band_models})
    return pd.DataFrame(rows, columns=list(BAND_COLUMNS)) if rows else None
