"""Per-round node allocation across a batch: how many of its best-first nodes each sequence
verifies in one round.

Each sequence brings a candidate list: the survival probabilities (prefix probabilities) of
its best-first nodes after the root, non-increasing, so any prefix is a tree.  The lists of
the batch are merged by survival probability (each list keeps its own order on ties) and a
prefix of K nodes is verified; the rule believes the round's verify costs C_v(1 + K/b) (mean
nodes per sequence; what the full runtime, verifying a static bucket, actually pays is priced
by the simulator, :mod:`simtree.planning.simulate`).  Two rules choose K:

- :func:`batch_allocation` (mode ``batch_alloc``, DSpark-style): the prefix maximising the
  round's own rate (b + sum of survival) / (C_d + C_v(1 + K/b));
- :func:`priced_allocation` (mode ``cost_aware``): the prefix maximising
  sum of survival - price * C_v(1 + K/b): a node is verified when its survival probability
  pays for its marginal verify cost given every other node of the same verify, at the price
  of time ``price`` (tokens per microsecond of the whole batch).  At the rate the policy
  itself runs at (:class:`RunningPrice` in a run; the fixed point in the analytic simulator)
  this is the allocation of the highest long-run rate (docs/acceptance.md, section 6).

Both take the global maximum over K in one vectorised pass, so a C_v that is not convex in n
(MoE expert saturation) is handled.  Pure numbers: the simulator, the planner and the runtime
engine all call these.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from simtree.errors import SimtreeError

__all__ = ["batch_allocation", "ratio_allocation", "priced_allocation", "RunningPrice", "allocate_round",
           "PRICE_MEMORY_ROUNDS"]

PRICE_MEMORY_ROUNDS = 16.0   # a run's price forgets a round's weight by 1/e after this many rounds


def _merged(survival: Sequence[np.ndarray], mass, verify_cost: Callable, batch_size: int):
    """(owner of each merged candidate [m], cumulative gain [m+1], verify cost [m+1]) of the
    merged, sorted candidate lists (prefix K = 0..m)."""
    probs = np.concatenate(survival) if len(survival) else np.zeros(0)
    owner = (np.concatenate([np.full(s.shape[0], i) for i, s in enumerate(survival)]) if len(survival)
             else np.zeros(0, int))
    order = np.argsort(-probs, kind="stable")  # stable keeps each list's own order on ties
    m = np.asarray(mass, np.float64)[owner[order]]
    added = np.concatenate([[0.0], np.cumsum(m)])
    gain = np.concatenate([[0.0], np.cumsum(probs[order] * m)])
    cost = np.asarray(verify_cost(1.0 + added / batch_size), np.float64)
    cost = np.broadcast_to(cost, added.shape)
    if not (cost.min() > 0 and cost.max() < np.inf):  # NaN fails both comparisons
        raise SimtreeError("cost model returned a NaN, infinite or non-positive verify cost")
    return owner[order], gain, cost


def ratio_allocation(survival: Sequence[np.ndarray], mass, verify_cost: Callable, draft_us: float,
                     batch_size: int) -> tuple[np.ndarray, float, float]:
    """(extra nodes per list [len(survival)], the round's rate (b + gain) / (C_d + C_v) at the
    kept prefix, that round's C_d + C_v in us) of :func:`batch_allocation`."""
    owner, gain, cost = _merged(survival, mass, verify_cost, batch_size)
    rate = (batch_size + gain) / (draft_us + cost)
    best = int(np.argmax(rate))
    return np.bincount(owner[:best], minlength=len(survival)), float(rate[best]), float(draft_us + cost[best])


def batch_allocation(survival: Sequence[np.ndarray], mass, verify_cost: Callable, draft_us: float,
                     batch_size: int) -> np.ndarray:
    """DSpark-style allocation: extra nodes per candidate list (int [len(survival)]).

    ``survival[i]`` [m_i]: prefix probabilities of list i's non-root best-first nodes
    (non-increasing); ``mass[i]``: how many requests carry list i (1 in a real round, b * w_level
    in the analytic fluid version).  The prefix maximising (b + sum of survival) /
    (C_d + C_v(1 + K/b)) is kept, K = nodes added.
    """
    return ratio_allocation(survival, mass, verify_cost, draft_us, batch_size)[0]


def priced_allocation(survival: Sequence[np.ndarray], mass, verify_cost: Callable, price: float,
                      batch_size: int) -> np.ndarray:
    """Extra nodes per candidate list (int [len(survival)]) maximising
    sum of survival - ``price`` * C_v(1 + K/b): each node priced at its marginal verify cost
    given the rest of the batch's verify.  ``price`` > 0: tokens per us of the whole batch."""
    if not (math.isfinite(price) and price > 0):
        raise SimtreeError(f"the price of verify time must be a finite number > 0 (tokens per us), got {price}")
    owner, gain, cost = _merged(survival, mass, verify_cost, batch_size)
    best = int(np.argmax(gain - price * cost))
    return np.bincount(owner[:best], minlength=len(survival))


@dataclass
class RunningPrice:
    """The price of verify time in a run: tokens the batch gained per us of its rounds' predicted
    time (C_d + C_v of the trees it verified), over recent rounds (exponential memory of
    ``memory_rounds``: contexts grow and C_v with them).  ``value`` is None before a round."""

    memory_rounds: float = PRICE_MEMORY_ROUNDS
    tokens: float = 0.0
    time_us: float = 0.0

    @property
    def value(self) -> float | None:
        return self.tokens / self.time_us if self.time_us > 0 else None

    def update(self, tokens: float, time_us: float) -> None:
        keep = 1.0 - 1.0 / self.memory_rounds
        self.tokens, self.time_us = keep * self.tokens + float(tokens), keep * self.time_us + float(time_us)


def allocate_round(survival: Sequence[np.ndarray], verify_cost: Callable, draft_us: float, batch_size: int,
                   price: RunningPrice) -> np.ndarray:
    """cost_aware's rule for one round of ``batch_size`` real sequences (one list each): priced
    at the run's price, or - in the first round, with no price yet - at the round's own best
    rate (:func:`batch_allocation`).  The caller updates ``price`` with the round's gained
    tokens and predicted time."""
    ones = np.ones(len(survival))
    if price.value is None:
        return batch_allocation(survival, ones, verify_cost, draft_us, batch_size)
    return priced_allocation(survival, ones, verify_cost, price.value, batch_size)
