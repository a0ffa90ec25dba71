"""Workloads: an acceptance model plus the lengths a request brings - what the simulator and
planner consume - and the names callers import.

An acceptance model (:class:`AcceptanceModel`, :mod:`simtree.acceptance.mixture`) is a
mixture of per-round levels, each a positional table ``accept_table[d, r]`` = P(the rank-r
child at depth d+1 is accepted | its parent was accepted) with the drafter's probabilities
beside it.  Where one comes from:

- a preset name (gsm8k, mbpp, sharegpt): :mod:`simtree.acceptance.presets`, calibrated to the
  published DeepSeek-V4-Flash MTP table;
- a trace file: :func:`~simtree.acceptance.fit.fit_confidence` when its records log the
  drafter's top-K (version 2 linear runs), else :func:`~simtree.acceptance.fit.fit_positional`;
- ``DRAFTS.jsonl@TRACES.jsonl``: :func:`~simtree.acceptance.transfer.transfer_model`, the
  drafter's confidences on the workload through the calibration fitted on the traces;
- :func:`calibrate_linear` / :func:`from_marginals` for synthetic models.

"Accepted tokens" (published figures, ``mean_accepted_tokens``) count the bonus token: a chain
of budget D (D-1 drafts) gains between 1 and D tokens per round; simtree's Phi excludes it.
Traces, models and presets are described in docs/acceptance.md.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simtree.acceptance.fit import fit_confidence, fit_marginals, fit_positional, has_topk
from simtree.acceptance.mixture import ALPHA_MAX, AcceptanceModel, calibrate_linear, from_marginals
from simtree.acceptance.presets import PRESETS, PUBLISHED_V4_FLASH_MTP, preset_model
from simtree.acceptance.traces import MAX_CONTEXT_LEN, TraceRecord, read_traces
from simtree.acceptance.transfer import is_drafts_file, split_spec, transfer_from_spec
from simtree.errors import SimtreeError, check_real, check_whole

__all__ = ["AcceptanceModel", "Workload", "PRESETS", "PUBLISHED_V4_FLASH_MTP", "calibrate_linear",
           "from_marginals", "fit_positional", "fit_marginals", "fit_confidence", "read_traces", "get_workload",
           "fit_traces", "TraceRecord", "MIN_TRACE_RECORDS", "MAX_CONTEXT_LEN", "MAX_OUTPUT_LEN"]

MIN_TRACE_RECORDS = 100   # fewer records than this: the fit warns that it is unreliable
MAX_OUTPUT_LEN = 1 << 20  # an output of 1e8 tokens is a typing error and would only make the planner crawl


@dataclass(frozen=True, eq=False)
class Workload:
    """An acceptance model plus the lengths a request brings: prompt lengths [m] (samples of the
    distribution; the simulator draws from them) and output tokens per sequence."""

    name: str
    acceptance: AcceptanceModel
    prompt_lens: np.ndarray
    output_len: int
    note: str = ""

    @property
    def mean_prompt_len(self) -> float:
        return float(np.mean(self.prompt_lens))


def _depths(depths: list[int]) -> str:
    return ", ".join(str(d) for d in depths[:6]) + (", ..." if len(depths) > 6 else "")


def _lognormal_quantiles(mean: float, sigma: float, m: int = 64) -> np.ndarray:
    """m deterministic quantiles of a log-normal with the given mean (prompt-length samples)."""
    from scipy.stats import norm
    check_real(mean, "mean prompt length", 1, "number of tokens")
    z = norm.ppf((np.arange(m) + 0.5) / m)
    return np.maximum(np.round(np.exp(math.log(mean) - 0.5 * sigma ** 2 + sigma * z)), 1).astype(np.int64)


def fit_traces(records: list[TraceRecord], name: str, where: str = "traces") -> AcceptanceModel:
    """The acceptance model of one workload's trace records: the confidence model when they log
    the drafter's top-K, else the positional counts; warns when the records are few or (for
    the positional fit) accept nearly every draft."""
    if len(records) < MIN_TRACE_RECORDS:
        warnings.warn(f"{where}: only {len(records)} trace records for workload {name!r} (fewer than "
                      f"{MIN_TRACE_RECORDS}): its fitted acceptance is unreliable", RuntimeWarning, stacklevel=3)
    if has_topk(records):
        return fit_confidence(records, name)
    acc = fit_positional(records, name)
    if acc.meta["capped_depths"]:
        warnings.warn(f"{where}: workload {name!r} accepts nearly every draft at depths "
                      f"{_depths(acc.meta['capped_depths'])}; capped at {ALPHA_MAX} per depth (a finite trace "
                      "cannot show certain acceptance)", RuntimeWarning, stacklevel=3)
    return acc


# Prompt/output lengths are assumed defaults (GSM8K zero-shot chat prompts, MBPP with tests,
# ShareGPT conversations), not measured; override them in the CLI.
_PRESET_LENGTHS = {"gsm8k": (256, 0.4, 256), "mbpp": (384, 0.4, 256), "sharegpt": (640, 0.9, 384)}


def get_workload(spec: str, prompt_len: float | None = None, output_len: int | None = None) -> Workload:
    """A preset name (gsm8k, mbpp, sharegpt), a JSONL trace file, optionally
    ``file.jsonl#workload`` to pick one workload of a mixed file, an engine acceptance file
    (``acceptance.json`` of ``simtree import-metrics``), or ``DRAFTS.jsonl@TRACES.jsonl``: the
    drafter's confidences on a workload (no outcome) calibrated on another's linear traces
    (:mod:`simtree.acceptance.transfer`)."""
    spec = str(spec)
    if spec in PRESETS:
        mean, sigma, out = _PRESET_LENGTHS[spec]
        acc, note = preset_model(spec), "preset"
    elif spec.endswith(".json") and Path(spec).is_file():   # measured by a serving engine
        from simtree.acceptance.engine_file import engine_acceptance_model
        from simtree.fileio import read_json
        acc = engine_acceptance_model(read_json(spec, "engine acceptance"), spec)
        mean, sigma, out = 512.0, 0.5, 256
        note = f"measured by {acc.name.split('_')[0]} ({acc.meta.get('num_drafts') or 'an unknown number of'} drafts)"
    elif split_spec(spec) is not None:   # the drafter's confidences on it, calibrated on another's traces
        acc, drafts = transfer_from_spec(spec)
        first = drafts.context_len[(drafts.position == drafts.position.min()) & (drafts.context_len > 0)]
        mean, sigma, out = (float(np.mean(first)) if first.size else 512.0), 0.5, 256
        note = (f"drafter confidences at {drafts.size} positions, calibrated on "
                f"{acc.meta['calibrated_on']['records']} trace records of {acc.meta['calibrated_on']['workload']}")
    elif ".jsonl" in spec or Path(spec).is_file():
        path, _, only = spec.partition("#")  # "traces.jsonl#sharegpt" keeps one workload
        if is_drafts_file(path):
            raise SimtreeError(f"{path} holds drafter confidences without outcomes: give the traces that calibrate "
                               f"them as {path}@TRACES.jsonl")
        records = read_traces(path, only or None)
        names = sorted({r.workload for r in records})
        if len(names) > 1:
            raise SimtreeError(f"{path} holds workloads {', '.join(names)}: pick one as {path}#<workload>")
        acc = fit_traces(records, names[0], path)
        # the prompt is the context of a sequence's first round; later rounds' contexts already
        # include generated tokens, which the simulator adds itself
        first = [r.context_len for r in records if r.context_len is not None and r.round_index == 0]
        ctx = first or [r.context_len for r in records if r.context_len is not None]
        mean, sigma, out = (float(np.mean(ctx)) if ctx else 512.0), 0.5, 256
        note = f"fitted from {len(records)} trace records"
    else:
        raise SimtreeError(f"unknown workload {spec!r}: use one of {', '.join(PRESETS)} or a .jsonl trace file")
    if prompt_len is not None:
        if isinstance(prompt_len, bool) or not math.isfinite(prompt_len) or not 1 <= prompt_len <= MAX_CONTEXT_LEN:
            raise SimtreeError(f"prompt length must be in [1, {MAX_CONTEXT_LEN}] tokens, got {prompt_len}")
        mean = prompt_len
    if output_len is not None:
        out = check_whole(output_len, "output length", 1, MAX_OUTPUT_LEN)
    return Workload(acc.name, acc, _lognormal_quantiles(mean, sigma), int(out), note)
