"""DSpark's confidence head as an acceptance input, and its confidence-scheduled verify.

    cal = calibrate_confidence(records)            # from traces with ``confidence`` (docs/acceptance.md)
    cal.accept(conf)                               # calibrated conditional acceptance per position
    expected_prefix_accepted(cal.accept(conf), m)  # expected accepted drafts verifying m positions
    lens, thr = confidence_verify_lens(surv, step_us)   # the load-dependent verified prefixes

Calibration: at position j (1-based) of a record the head predicted conf_j, the probability that
position j is accepted given that positions before it were.  The event is observed where the
positions before it were accepted and j was verified: accepted when j <= num_accepted, rejected
when j = num_accepted + 1 <= verified_len.  Observations are binned by conf and the bins'
acceptance rates made non-decreasing in conf (pool-adjacent-violators), so a higher confidence
never means a lower acceptance; between bins the map is linear.  (DSpark itself calibrates by
per-position temperature scaling; a monotone map fitted from the runs is the same kind of
correction, order-preserving.)

Verify (sglang 0.5.23 ``dspark_planner.compute_verify_token_budget``, re-derived): the batch's
verified positions are the m most likely to survive, over all sequences (a prefix of each,
since survival falls along a block); m maximises (B + sum of the m survivals) / step_us(B + m),
the expected tokens per microsecond of the round.  The survival of the m-th position is the
threshold: where the batch is small the step time hardly grows with m and the threshold is low
(verify nearly everything); under load every verified token costs and the threshold rises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from simtree.acceptance.traces import TraceRecord
from simtree.errors import SimtreeError

__all__ = ["ConfidenceCalibration", "calibrate_confidence", "expected_prefix_accepted", "confidence_verify_lens",
           "check_threshold"]


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


def expected_prefix_accepted(accept: np.ndarray, verify: int | np.ndarray) -> np.ndarray:
    """Expected accepted drafts when the first ``verify`` positions of each row of conditional
    acceptances ``accept`` [..., P] are verified: sum_{j < m} prod_{i <= j} accept_i."""
    a = np.asarray(accept, np.float64)
    surv = np.cumprod(a, -1)
    m = np.broadcast_to(np.asarray(verify), a.shape[:-1])
    return (surv * (np.arange(a.shape[-1]) < m[..., None])).sum(-1)


def confidence_verify_lens(survival: np.ndarray, step_us: Callable[[int], float]) -> tuple[np.ndarray, float]:
    """(verified prefix length per sequence [B], the survival threshold) for survivals [B, P]
    (non-increasing along P) and the round's time ``step_us(tokens)`` for B + m verified tokens."""
    s = np.asarray(survival, np.float64)
    if s.ndim != 2 or np.any((s < 0) | (s > 1)) or np.any(np.diff(s, axis=1) > 1e-12):
        raise SimtreeError("survivals must be [B, P] in [0, 1], non-increasing along each row")
    B = s.shape[0]
    order = np.argsort(-s, axis=None, kind="stable")
    gain = B + np.r_[0.0, np.cumsum(s.reshape(-1)[order])]
    rate = gain / np.array([step_us(B + m) for m in range(gain.shape[0])])
    m = int(np.argmax(rate))
    chosen = np.zeros(s.size, bool)
    chosen[order[:m]] = True
    thr = float(s.reshape(-1)[order[m - 1]]) if m else 1.0
    return chosen.reshape(s.shape).sum(1), thr
