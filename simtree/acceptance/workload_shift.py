"""A drafter calibration carried to another workload with a few of that workload's rounds.

A calibration (:class:`~simtree.acceptance.fit.ChainCalibration`) fitted on one workload's
linear runs reads the drafter's probability of a candidate, its depth, rank and what the
context lookup proposes.  On another workload the same drafter may be less (or more) sure than
it is right: the model drafts code rank-0 tokens the target takes far more often than chat
tokens of the same draft probability (docs/acceptance.md, section 5, decision 9).  Nothing the
drafter computes says so; a few of the new workload's rounds do.

:func:`fit_workload_shift` measures it: on linear traces of the new workload (a few prompts'
rounds, with the drafter's top-K and the lookup's ranks), one logit shift per cell (rank group,
or rank group x lookup state) such that the calibration, shifted, expects as many hits as those
trials hold; a cell with few trials is shrunk towards no shift (``prior_trials`` pseudo-trials).
:func:`shifted_calibration` applies it: every curve of the cell moved by its shift, the depth
effects kept.  The result is a calibration of the *new* workload that read its acceptance
outcomes - on those few rounds only - and is labelled so wherever it is reported.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable

import numpy as np
from scipy.special import expit, logit

from simtree.acceptance.fit import _CLIP, ChainCalibration, _offset, trial_logits, trial_states
from simtree.acceptance.traces import TraceRecord, chain_trials
from simtree.errors import SimtreeError, check_whole

__all__ = ["WorkloadShift", "fit_workload_shift", "shifted_calibration", "sample_rounds", "CELLS"]

CELLS = ("global", "rank", "rank_lookup")


@dataclass(frozen=True)
class WorkloadShift:
    """Logit shifts ``delta [rank groups, lookup states]`` (one column where the calibration has
    no lookup curves) and the trials and hits each rests on; ``cells``: how they were pooled
    (:data:`CELLS`)."""

    delta: np.ndarray
    trials: np.ndarray
    hits: np.ndarray
    cells: str

    def as_dict(self) -> dict:
        return {"cells": self.cells, "logit_shift": np.round(self.delta, 4).tolist(),
                "trials": self.trials.astype(int).tolist(), "hits": self.hits.astype(int).tolist()}


def _base_logits(calibration: ChainCalibration, records: list[TraceRecord]):
    """(trials, their rank groups, lookup states, the calibration's logits) of ``records``."""
    trials = chain_trials(records, calibration.curves.shape[0])
    states = np.zeros(trials.size, np.int64)
    if calibration.matched:
        if any(r.context_match is None for r in records):
            raise SimtreeError("the calibration reads the context lookup: every calibration round needs context_match")
        states = trial_states(records, trials)
    groups, base = trial_logits(calibration, trials, states)
    return trials, groups, states, base


def fit_workload_shift(calibration: ChainCalibration, records: Iterable[TraceRecord], *, cells: str = "rank",
                       prior_trials: float = 20.0) -> WorkloadShift:
    """The logit shifts that make ``calibration`` expect the hits of ``records`` (linear traces of
    the new workload with the drafter's top-K and the target's tokens), per ``cells``: ``global``
    (one shift), ``rank`` (one per rank group) or ``rank_lookup`` (one per rank group and lookup
    state).  Each is solved on its cell's trials (half a trial short of all or none) and shrunk
    towards 0 with ``prior_trials`` pseudo-trials; no trials, no shift."""
    if cells not in CELLS:
        raise SimtreeError(f"unknown shift cells {cells!r}: expected one of {', '.join(CELLS)}")
    records = [r for r in records if r.topk_tokens is not None and r.target_tokens is not None]
    shape = calibration.curves.shape[:2]
    delta, n_cell, h_cell = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    if not records:       # no evidence: no shift (the pseudo-trials alone)
        return WorkloadShift(delta, n_cell, h_cell, cells)
    trials, groups, states, base = _base_logits(calibration, records)
    cell = {"global": np.zeros(trials.size, np.int64), "rank": groups,
            "rank_lookup": groups * shape[1] + states}[cells]
    for c in np.unique(cell):
        at = cell == c
        n, hits = int(at.sum()), float(trials.hit[at].sum())
        fitted = _offset(base[at], min(max(hits, 0.5), n - 0.5)) if n > 1 else 0.0
        value = n * fitted / (n + prior_trials)
        if cells == "global":
            delta[:], n_cell[:], h_cell[:] = value, n, hits
        elif cells == "rank":
            delta[c], n_cell[c], h_cell[c] = value, n, hits
        else:
            delta.flat[c], n_cell.flat[c], h_cell.flat[c] = value, n, hits
    return WorkloadShift(delta, n_cell, h_cell, cells)


def shifted_calibration(calibration: ChainCalibration, shift: WorkloadShift) -> ChainCalibration:
    """A copy of ``calibration`` whose curves are moved by ``shift`` (logit), the depth effects kept."""
    if shift.delta.shape != calibration.curves.shape[:2]:
        raise SimtreeError(f"a shift of shape {shift.delta.shape} does not fit a calibration of "
                           f"{calibration.curves.shape[:2]} rank groups x lookup states")
    out = copy.copy(calibration)
    out.curves = np.clip(expit(logit(calibration.curves) + shift.delta[:, :, None]), _CLIP, 1 - _CLIP)
    return out


def sample_rounds(records: list, share: int, seed: int = 0) -> list:
    """A seeded random 1/``share`` of ``records`` (each kept with that probability, in their
    order): a few rounds spread over every prompt of a run, as an engine's metrics over a short
    while of traffic - not the first prompts alone (their text is not the workload's average)."""
    keep = np.random.default_rng(seed).random(len(records)) < 1.0 / check_whole(share, "share", 1)
    return [r for r, k in zip(records, keep) if k]
