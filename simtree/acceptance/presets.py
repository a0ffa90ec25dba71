"""Shipped acceptance presets: gsm8k, mbpp, sharegpt, calibrated to the published
DeepSeek-V4-Flash MTP tree table (docs/acceptance.md gives the numbers, their source and what
is assumed).

The model behind a preset is the one :func:`simtree.acceptance.fit.fit_confidence` fits from
traces, written with a few parameters instead of measured rows:

- confidence: at every depth the drafter is *sure* (top-1 draft prob ``sure_top1``) with
  probability ``sure_share`` and *unsure* (``unsure_top1``) otherwise, independently per
  depth; rank r >= 1 takes the share ``sibling_share`` of the mass the ranks above it leave
  (rank decay);
- horizon: beyond about ``horizon`` drafted tokens the drafter loses the thread (an MTP layer
  trained for one step, reused): every probability of depth d is multiplied by
  1 / (1 + exp((d - horizon) / horizon_width));
- the drafter is calibrated: its draft probabilities are the acceptance probabilities.

The parameters of each workload are fitted by ``python -m simtree.acceptance.calibrate``
(:mod:`simtree.acceptance.calibrate`), which writes them to ``presets.json`` beside this file
and the comparison with every published number to reports/acceptance/preset_calibration.csv.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from simtree.acceptance.mixture import ALPHA_MAX, DEFAULT_DEPTH, DEFAULT_TOPK, AcceptanceModel
from simtree.errors import SimtreeError

__all__ = ["PresetParams", "preset_model", "preset_params", "PRESETS", "PRESETS_FILE", "PUBLISHED_V4_FLASH_MTP",
           "PUBLISHED_TREE_GAIN_PCT", "PUBLISHED_BUDGETS", "PUBLISHED_SHAPE_SPREAD_PCT",
           "PUBLISHED_BATCH_SPREAD_TOKENS", "PUBLISHED_SOURCE", "ENUMERATED_DEPTHS", "preset_levels", "reload_presets"]

# DeepSeek-V4-Flash, MTP drafter, batch 1-64 averaged (docs/acceptance.md): accepted tokens
# per round including the bonus token, linear drafting, flat for D = 5, 6, 7, 8 ...
PUBLISHED_V4_FLASH_MTP = {"gsm8k": 2.84, "mbpp": 2.67, "sharegpt": 2.39}
PUBLISHED_BUDGETS = (5, 6, 7, 8)
# ... a top-2 tree accepts this much more than linear at the same D (percent; one figure per D,
# the three workloads within 1-2 points of it) ...
PUBLISHED_TREE_GAIN_PCT = {5: 11.0, 6: 14.4, 7: 17.0, 8: 18.6}
# ... shallow-wide and deep-narrow shapes at one D differ by at most about this (percent) ...
PUBLISHED_SHAPE_SPREAD_PCT = 2.0
# ... and accepted length varies over batch sizes 1-64 by less than this (tokens).
PUBLISHED_BATCH_SPREAD_TOKENS = 0.04
PUBLISHED_SOURCE = ("DeepSeek-V4-Flash MTP tree-speculation table (GSM8K / MBPP / ShareGPT, D = 5-8, "
                    "batch 1-64), as quoted in docs/acceptance.md")
PRESETS = tuple(PUBLISHED_V4_FLASH_MTP)
PRESETS_FILE = Path(__file__).with_name("presets.json")
ENUMERATED_DEPTHS = 3   # levels: both confidence states at each of the first 3 depths (8 levels)


@dataclass(frozen=True)
class PresetParams:
    """The parameters of one preset (see the module docstring)."""

    sure_share: float
    sure_top1: float
    unsure_top1: float
    sibling_share: float
    horizon: float
    horizon_width: float

    def check(self, name: str) -> "PresetParams":
        for key, value in asdict(self).items():
            if not np.isfinite(value):
                raise SimtreeError(f"preset {name!r}: {key} = {value} is not a finite number")
        if not (0 <= self.sure_share <= 1 and 0 < self.unsure_top1 <= self.sure_top1 <= 1
                and 0 <= self.sibling_share <= 1 and self.horizon_width > 0):
            raise SimtreeError(f"preset {name!r}: parameters out of range: {asdict(self)}")
        return self


def _row(top1: float, sibling_share: float, topk: int) -> np.ndarray:
    """[K]: top-1, then each rank takes ``sibling_share`` of the mass left above it."""
    cols, left = [top1], 1.0 - top1
    for _ in range(1, topk):
        cols.append(left * sibling_share)
        left -= cols[-1]
    return np.array(cols)


def preset_levels(params: PresetParams, name: str = "preset", *, depth: int = DEFAULT_DEPTH,
                  topk: int = DEFAULT_TOPK, enumerated_depths: int = ENUMERATED_DEPTHS,
                  source: str = "", meta: dict | None = None) -> AcceptanceModel:
    """The levels of a preset: each combination of sure / unsure over the first
    ``enumerated_depths`` depths (weight = product of the states' shares), deeper depths at
    their mean row; acceptance = draft probabilities (a calibrated drafter)."""
    p = params.check(name)
    d = np.arange(1, depth + 1)
    horizon = 1.0 / (1.0 + np.exp(np.clip((d - p.horizon) / p.horizon_width, -50, 50)))
    sure, unsure = _row(p.sure_top1, p.sibling_share, topk), _row(p.unsure_top1, p.sibling_share, topk)
    mean = p.sure_share * sure + (1 - p.sure_share) * unsure
    tables, weights = [], []
    for combo in itertools.product((True, False), repeat=enumerated_depths):
        rows = np.repeat(mean[None], depth, axis=0)
        w = 1.0
        for i, is_sure in enumerate(combo[:depth]):
            rows[i] = sure if is_sure else unsure
            w *= p.sure_share if is_sure else 1 - p.sure_share
        tables.append(rows * horizon[:, None])
        weights.append(w)
    tables = np.array(tables)
    tables /= np.maximum(tables.sum(2, keepdims=True) / ALPHA_MAX, 1.0)
    keep = np.array(weights) > 0   # a share of exactly 0 or 1 leaves fewer levels
    return AcceptanceModel(name, tables[keep], np.array(weights)[keep] / np.sum(weights), source,
                           {"preset": asdict(p), **(meta or {})})


@lru_cache(maxsize=1)
def _presets_file() -> dict:
    try:
        data = json.loads(PRESETS_FILE.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SimtreeError(f"cannot read the preset calibration {PRESETS_FILE}: {exc}; "
                           "regenerate it with python -m simtree.acceptance.calibrate") from None
    if not isinstance(data, dict) or not isinstance(data.get("presets"), dict):
        raise SimtreeError(f"{PRESETS_FILE}: not a preset calibration (no 'presets' object)")
    return data


def reload_presets() -> None:
    """Forget the cached ``presets.json`` (after the calibration rewrote it)."""
    _presets_file.cache_clear()


def preset_params(name: str) -> PresetParams:
    """The fitted parameters of preset ``name`` (from ``presets.json``)."""
    entry = _presets_file()["presets"].get(name)
    if not isinstance(entry, dict):
        raise SimtreeError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    try:
        return PresetParams(**{k: float(entry[k]) for k in PresetParams.__dataclass_fields__}).check(name)
    except (KeyError, TypeError, ValueError) as exc:
        raise SimtreeError(f"{PRESETS_FILE}: preset {name!r} lacks or mistypes a parameter ({exc})") from None


def preset_model(name: str) -> AcceptanceModel:
    """The shipped acceptance model of preset ``name`` (gsm8k, mbpp, sharegpt)."""
    data = _presets_file()
    meta = {"calibrated_to": PUBLISHED_SOURCE, "fitted_by": data.get("fitted_by", ""),
            "models": data.get("models", {})}
    return preset_levels(preset_params(name), name, source=f"preset {name}: {PUBLISHED_SOURCE}", meta=meta)
