"""The acceptance a serving engine measured (``simtree import-metrics``; schema
``simtree.engine_acceptance/1``) as an :class:`AcceptanceModel`.

With per-position rates (vLLM), depth d accepts the drafter's top-1 with the measured
conditional rate P(position d accepted | d-1 was); beyond the measured positions the deepest
rate repeats.  With only a mean accepted length (SGLang), the geometric model of
:func:`~simtree.acceptance.mixture.calibrate_linear` reproduces it at the engine's draft
length.  Engines verify chains, so the rates of lower-ranked siblings are not measured: each
takes ``SIBLING_SHARE`` of the mass the ranks above it leave (the assumption of
``calibrate_linear``), and the file's note says so.
"""
from __future__ import annotations

import math

import numpy as np

from simtree.acceptance.mixture import ALPHA_MAX, DEFAULT_DEPTH, DEFAULT_TOPK, AcceptanceModel, calibrate_linear
from simtree.errors import SimtreeError

__all__ = ["ENGINE_ACCEPTANCE_SCHEMA", "SIBLING_SHARE", "META_FIELDS", "conditional_from_per_position",
           "engine_acceptance_model"]

ENGINE_ACCEPTANCE_SCHEMA = "simtree.engine_acceptance/1"
SIBLING_SHARE = 0.35
ASSUMED = "sibling ranks assumed (engines verify chains): each takes 0.35 of the mass left above it"


def conditional_from_per_position(per_position) -> np.ndarray:
    """P(position k accepted | k - 1 accepted) from the engines' per-position acceptance rates
    (P(position k accepted)); 0 after a position no draft reached."""
    p = np.asarray(per_position, dtype=float)
    prev = np.concatenate([[1.0], p[:-1]])
    return np.where(prev > 0, p / np.maximum(prev, 1e-300), 0.0)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(low: int):
    return lambda v: _finite(v) and v == int(v) and v >= low


def _strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# the metadata every file of the schema holds (simtree.engines.metrics.EngineAcceptance.to_dict writes
# these, in this order, from its own fields):
# field -> (what it must be, whether it may be null, the check); the rates are read by _conditional_rates
META_FIELDS = {
    "engine": ("the engine's name (a non-empty string)", False, lambda v: isinstance(v, str) and v.strip() != ""),
    "sources": ("a list of strings (what was read)", False, _strings),
    "mean_accepted_tokens": ("a finite number >= 1 (the bonus token included)", False, lambda v: _finite(v) and v >= 1),
    "mean_accepted_tokens_se": ("a finite number >= 0, or null", True, lambda v: _finite(v) and v >= 0),
    "draft_len": ("a whole number >= 1, or null", True, _whole(1)),
    "num_drafts": ("a whole number >= 0, or null", True, _whole(0)),
    "num_draft_tokens": ("a whole number >= 0, or null", True, _whole(0)),
    "num_accepted_tokens": ("a whole number >= 0, or null", True, _whole(0)),
    "notes": ("a list of strings", False, _strings),
}
_WHOLE = ("draft_len", "num_drafts", "num_draft_tokens", "num_accepted_tokens")   # read as int (JSON may say 3.0)


def _checked_meta(data: dict, where: str) -> dict:
    """The fields of :data:`META_FIELDS`, each present and of its kind (whole numbers as int);
    else one line naming the file and the field."""
    out = {}
    for key, (what, nullable, ok) in META_FIELDS.items():
        if key not in data:
            raise SimtreeError(f"{where}: the engine acceptance file has no {key!r} field ({what})")
        value = data[key]
        if not ((value is None and nullable) or (value is not None and ok(value))):
            raise SimtreeError(f"{where}: {key} must be {what}, got {value!r}")
        out[key] = int(value) if key in _WHOLE and value is not None else value
    return out


def _conditional_rates(data: dict, where: str):
    """The file's conditional_accept_rate, checked against its per_position_accept_rate where it
    has both (the model reads the conditional ones: an edit of the other alone was ignored)."""
    cond, per = data.get("conditional_accept_rate"), data.get("per_position_accept_rate")
    if not per:
        return cond
    try:
        p = np.asarray(per, np.float64)
    except (TypeError, ValueError):
        p = np.full(1, np.nan)
    if p.ndim != 1 or not np.all(np.isfinite(p)) or np.any((p < 0) | (p > 1)) or np.any(np.diff(p) > 0):
        raise SimtreeError(f"{where}: per_position_accept_rate must be probabilities that do not rise with the "
                           f"position (accepting one implies every earlier one), got {per}")
    derived = conditional_from_per_position(p)
    try:
        agree = cond is None or (np.shape(cond) == derived.shape and np.allclose(cond, derived, rtol=1e-9, atol=1e-12))
    except (TypeError, ValueError):
        agree = False
    if not agree:
        raise SimtreeError(f"{where}: conditional_accept_rate {cond} is not what per_position_accept_rate {per} "
                           f"gives ({[round(float(x), 6) for x in derived]}): give one of them, or both agreeing")
    return [float(x) for x in derived]


def engine_acceptance_model(data: dict, where: str) -> AcceptanceModel:
    if not isinstance(data, dict) or data.get("schema") != ENGINE_ACCEPTANCE_SCHEMA:
        raise SimtreeError(f"{where}: not an engine acceptance file (schema {ENGINE_ACCEPTANCE_SCHEMA!r})")
    fields = _checked_meta(data, where)
    name = f"{fields['engine']}_measured"
    meta = {**{k: fields[k] for k in ("num_drafts", "mean_accepted_tokens", "mean_accepted_tokens_se")},
            "assumed": ASSUMED}
    cond = _conditional_rates(data, where)
    if cond:
        alpha = np.asarray(cond, np.float64)
        if alpha.ndim != 1 or not np.all(np.isfinite(alpha)) or np.any((alpha < 0) | (alpha > 1)):
            raise SimtreeError(f"{where}: conditional_accept_rate must be probabilities, got {cond}")
        alpha = np.minimum(alpha, ALPHA_MAX)
        depth = max(DEFAULT_DEPTH, alpha.size)
        alpha = np.concatenate([alpha, np.repeat(alpha[-1:], depth - alpha.size)])
        cols, left = [alpha], 1.0 - alpha
        for _ in range(1, DEFAULT_TOPK):
            cols.append(np.minimum(left * SIBLING_SHARE, cols[-1]))
            left = left - cols[-1]
        return AcceptanceModel(name, np.stack(cols, 1)[None], np.ones(1), f"{where} (per-position rates)", meta)
    mean, draft_len = fields["mean_accepted_tokens"], fields["draft_len"]
    if draft_len is None:
        raise SimtreeError(f"{where}: the draft length is unknown (draft_len {draft_len!r}): a mean accepted "
                           "length alone cannot be turned into per-depth acceptance")
    if mean <= 1.0:
        raise SimtreeError(f"{where}: mean accepted tokens {mean:g} <= 1: the engine accepted no drafts")
    mean = min(mean, 1.0 + 0.97 * draft_len)
    for spread in (0.25, 0.0):   # three difficulty levels where the mean allows, else one
        try:
            acc = calibrate_linear(mean, draft_len + 1, name=name, source=f"{where} (mean accepted length)",
                                   sibling_share=SIBLING_SHARE, spread=spread)
        except SimtreeError:
            continue
        return AcceptanceModel(acc.name, acc.tables, acc.weights, acc.source, {**acc.meta, **meta})
    raise SimtreeError(f"{where}: mean accepted tokens {mean:g} is out of reach for draft length {draft_len}")
