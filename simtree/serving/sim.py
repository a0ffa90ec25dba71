"""Continuous batching of an arrival trace, step by step, on measured costs.

Each step admits the requests that have arrived (up to ``max_batch`` live), lets the policy
driver run one speculative round for every live sequence, and advances the clock by the
round's predicted time.  A request's first token comes with its admission (prefill is not
modelled: the benchmark compares decode policies); TPOT is (finish - first token) /
(output tokens - 1).  Throughput is all output tokens over the time from the first arrival
to the last completion.  Randomness is per request and round (common random numbers): the
n-th round of a request draws the same acceptance level and uniform under every policy.
A switch is a step whose policy label differs from the step before.  A driver whose engine
lags (``driver.lags``: it runs plain and drafted steps) pays the MTP layer's catch-up in the
drafted step after plain ones, and every ``LAG_ROWS`` plain steps
(:class:`simtree.control.catchup.CatchUpClock`).  :func:`serve_replicas`
serves one trace under several acceptance seeds (the same seeds for every policy).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simtree.control.catchup import CatchUpClock
from simtree.serving.traces import Trace

__all__ = ["ServeResult", "serve", "serve_replicas", "MAX_BATCH", "p99_band", "PLAIN"]

MAX_BATCH = 64
PLAIN = "none"      # the label of a plain step
BOOTSTRAP = 1000


@dataclass(frozen=True)
class ServeResult:
    tok_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    switches: int
    steps: int
    makespan_s: float
    mean_batch: float
    tpot_p99_band_ms: tuple = (float("nan"), float("nan"))   # 95% bootstrap band of the p99 over requests
    tpot_ms: np.ndarray | None = field(default=None, repr=False, compare=False)   # per request (output > 1)
    tok_s_runs: tuple = ()   # each replica's tok/s (serve_replicas)
    catch_ups: int = 0       # the drafter's catch-ups after plain steps (engines that lag)
    catch_up_s: float = 0.0  # their time
    switches_runs: tuple = ()   # each replica's switches and steps (serve_replicas)
    steps_runs: tuple = ()

    @property
    def switches_per_min(self) -> float:
        return self.switches / (self.makespan_s / 60.0) if self.makespan_s > 0 else 0.0


def serve(trace: Trace, driver, weights: np.ndarray, *, max_batch: int = MAX_BATCH, seed: int = 0) -> ServeResult:
    cum = np.cumsum(weights)
    cum[-1] = 1.0
    R = trace.arrival_s.shape[0]
    rounds_max = int(trace.output_len.max())
    streams = np.random.default_rng(seed).random((2, R, rounds_max))   # [level | accept, request, round]
    level_of = np.searchsorted(cum, streams[0], side="right")
    rounds_done = np.zeros(R, np.int64)
    first = np.full(R, np.nan)
    finish = np.full(R, np.nan)
    ids = np.zeros(0, np.int64)
    ctx = np.zeros(0, np.float64)
    left = np.zeros(0, np.int64)
    t, nxt, done, steps, switches, label, batch_sum = float(trace.arrival_s[0]), 0, 0, 0, 0, None, 0
    lag = CatchUpClock(driver.costs) if getattr(driver, "lags", False) else None
    while done < R:
        while nxt < R and trace.arrival_s[nxt] <= t and ids.size < max_batch:
            first[nxt] = t
            if trace.output_len[nxt] <= 1:
                finish[nxt], done = t, done + 1
            else:
                ids = np.append(ids, nxt)
                ctx = np.append(ctx, float(trace.prompt_len[nxt] + 1))
                left = np.append(left, int(trace.output_len[nxt]) - 1)
            nxt += 1
        if ids.size == 0:
            t = max(t, float(trace.arrival_s[nxt]))
            continue
        b = ids.size
        n = rounds_done[ids]
        levels = level_of[ids, n]
        step_us, accepted, what = driver.step(b, ctx, levels, streams[1, ids, n], n)
        if lag is not None:
            step_us += lag.step_us(what == PLAIN, b)
        rounds_done[ids] = n + 1
        steps, batch_sum = steps + 1, batch_sum + b
        switches += label is not None and what != label
        label = what
        t += step_us * 1e-6
        gained = np.minimum(accepted + 1, left)
        left = left - gained
        ctx = ctx + gained
        end = left <= 0
        if end.any():
            finish[ids[end]] = t
            done += int(end.sum())
            ids, ctx, left = ids[~end], ctx[~end], left[~end]
    out = trace.output_len
    multi = out > 1
    tpot_ms = (finish[multi] - first[multi]) / (out[multi] - 1) * 1e3
    makespan = float(np.max(finish) - trace.arrival_s[0])
    return ServeResult(float(out.sum() / makespan), float(np.percentile(tpot_ms, 50)),
                       float(np.percentile(tpot_ms, 99)), int(switches), steps, makespan,
                       batch_sum / max(steps, 1), p99_band(tpot_ms), tpot_ms, (float(out.sum() / makespan),),
                       0 if lag is None else lag.count, 0.0 if lag is None else lag.total_us * 1e-6)


def serve_replicas(trace: Trace, make_driver, weights: np.ndarray, seeds, *,
                   max_batch: int = MAX_BATCH) -> ServeResult:
    """The same arrival trace served once per acceptance seed in ``seeds`` (a fresh driver each):
    tok/s is the replicas' mean (each in ``tok_s_runs``), the TPOT percentiles and their band are
    over every replica's requests pooled, switches and steps are summed (each replica's in
    ``switches_runs`` and ``steps_runs``)."""
    runs = [serve(trace, make_driver(), weights, max_batch=max_batch, seed=int(s)) for s in seeds]
    tpot = np.concatenate([r.tpot_ms for r in runs])
    steps = sum(r.steps for r in runs)
    return ServeResult(float(np.mean([r.tok_s for r in runs])), float(np.percentile(tpot, 50)),
                       float(np.percentile(tpot, 99)), sum(r.switches for r in runs), steps,
                       sum(r.makespan_s for r in runs), sum(r.mean_batch * r.steps for r in runs) / max(steps, 1),
                       p99_band(tpot), tpot, tuple(r.tok_s for r in runs), sum(r.catch_ups for r in runs),
                       sum(r.catch_up_s for r in runs), tuple(r.switches for r in runs), tuple(r.steps for r in runs))


def p99_band(tpot_ms: np.ndarray, resamples: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """The 2.5 and 97.5 percentiles of the p99 over ``resamples`` bootstrap resamples of the
    requests: how far the p99 of a trace this long moves by which requests it drew."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, tpot_ms.size, (resamples, tpot_ms.size))
    p99 = np.percentile(tpot_ms[idx], 99, axis=1)
    return float(np.percentile(p99, 2.5)), float(np.percentile(p99, 97.5))
