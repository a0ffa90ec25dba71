"""DSpark's confidence head as an acceptance input.

    cal = calibrate_confidence(records)            # from traces with ``confidence`` (docs/acceptance.md)
    cal.accept(conf)                               # calibrated conditional acceptance per position

Calibration: at position j (1-based) of a record the head predicted conf_j, the probability that
position j is accepted given that positions before it were.  The event is observed where the
positions before it were accepted and j was verified: accepted when j <= num_accepted, rejected
when j = num_accepted + 1 <= verified_len.  Observations are binned by conf and the bins'
acceptance rates made non-decreasing in conf (pool-adjacent-violators), so a higher confidence
never means a lower acceptance; between bins the map is linear.  (DSpark itself calibrates by
per-position temperature scaling; a monotone map fitted from the runs is the same kind of
correction, order-preserving.)

The confidence-scheduled verify (which positions of the batch are verified) is batch_alloc's
rule, :func:`simtree.planning.allocation.batch_allocation`, with the draft cost in the round's
time: the planner (``simtree.planning.drafter_candidates``) and the full runtime
(``runtime/full/allocation.py``) run it; ``threshold`` fixes the cut instead (:func:`check_threshold`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from simtree.acceptance.traces import TraceRecord
from simtree.errors import SimtreeError

__all__ = ["ConfidenceCalibration", "calibrate_confidence", "check_threshold"]


def check_threshold(threshold: float) -> float:
    """``threshold`` as a float in [0, 1], else a one-line error."""
    t = float(threshold)
    if not 0.0 <= t <= 1.0:
        raise SimtreeError(f"confidence threshold {threshold!r} is outside [0, 1]")
    return t


@dataclass(frozen=True)
class ConfidenceCalibration:
    """Bins of the head's confidence: mean confidence, calibrated acceptance (non-decreasing),
    trials per bin."""

    conf: np.ndarray
    rate: np.ndarray
    trials: np.ndarray

    def accept(self, conf) -> np.ndarray:
        """Calibrated conditional acceptance of confidences ``conf`` (any shape)."""
        return np.interp(np.asarray(conf, np.float64), self.conf, self.rate)


def _pav(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) regression of y."""
    vals, wts, sizes = [], [], []
    for yi, wi in zip(y, w):
        vals.append(yi), wts.append(wi), sizes.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            w2 = wts[-2] + wts[-1]
            v = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / w2
            s = sizes[-2] + sizes[-1]
            del vals[-1], wts[-1], sizes[-1]
            vals[-1], wts[-1], sizes[-1] = v, w2, s
    return np.repeat(vals, sizes)


def calibrate_confidence(records: Iterable[TraceRecord], bins: int = 10, prior: float = 1.0) -> ConfidenceCalibration:
    """The calibration map from records with ``confidence`` (module docstring); ``prior``
    pseudo-trials per bin at the bin's own confidence keep empty bins and certainties finite."""
    conf, hit = [], []
    for rec in records:
        if rec.confidence is None:
            continue
        acc = rec.num_accepted
        verified = rec.verified_len if rec.verified_len is not None else rec.confidence.shape[0]
        upto = min(acc + 1, verified, rec.confidence.shape[0])
        conf.append(rec.confidence[:upto])
        hit.append(np.arange(upto) < acc)
    if not conf:
        raise SimtreeError("no trace record carries confidence scores: DSpark runs write them (docs/acceptance.md)")
    c, h = np.concatenate(conf), np.concatenate(hit).astype(np.float64)
    edges = np.quantile(c, np.linspace(0, 1, bins + 1))
    idx = np.clip(np.searchsorted(edges, c, side="right") - 1, 0, bins - 1)
    n = np.bincount(idx, minlength=bins).astype(np.float64)
    keep = n > 0
    mean_c = np.bincount(idx, c, bins)[keep] / n[keep]
    rate = (np.bincount(idx, h, bins)[keep] + prior * mean_c) / (n[keep] + prior)
    return ConfidenceCalibration(mean_c, _pav(rate, n[keep] + prior), n[keep])
