"""An online controller: which speculation tier the next decode step runs.

An engine's scheduler calls it once per step::

    ctl = Controller(costs, acceptance)            # a cost bundle and an acceptance model
    tier = ctl.choose(batch_size, context_lens)     # before the step: tier.spec is the policy
    ...draft and verify with tier.spec...           # (choose(..., rounds_done=...) where the engine
    ctl.observe(tier, accepted_drafts)              #  counts each sequence's rounds so far)

``choose`` predicts each tier's batch throughput at the live batch size and mean context,
``rate_t = b * (1 + r * phi_t) / (C_d(t, b) + C_v(n_t, l, b))`` (C_d of plain decoding: its share
of the drafter's catch-up, one ``LAG_ROWS``-row catch-up per ``LAG_ROWS`` plain steps,
:mod:`simtree.control.catchup`; with ``plain_draft="extend"``, an engine whose plain steps run
the drafter over each step's row, as SGLang's do, that forward, C_d(1, 1, b); phi_t the tier's expected accepted
drafts under the acceptance model, r the running ratio of observed to predicted accepted
drafts: both summed over the last ``memory`` sequence-rounds or so (exponential decay per
sequence-round), plus a prior of ``prior`` predicted drafts at ratio 1; as plain decoding,
which measures no acceptance, lets the evidence decay, the prior brings r back toward 1 and
speculation is tried again), and ranks the tiers by ``rate_t / penalty_t(h)``, the rate a reply
of ``h`` rounds sees: ``penalty_t(h) = E[tokens of a round] * E[(h / tokens of h rounds) ** p] **
(1 / p)`` (p = ``tail_power``, default 2: the root mean square, so the spread of the reply's time
per token counts beside its mean; >= 1 by Jensen, the more so the likelier a round accepts
nothing, falling as 1 / h), with ``h = tail_rounds`` (default 1) past the rounds the youngest live
sequence has run (``rounds_done``; 0 when not given).  ``tail_mix="mean"`` averages the penalty over
the live replies instead, each at ``tail_rounds`` past its own rounds: ``rate_t / mean_i
penalty_t(h_i)``, the batch's expected time per token with each reply's short-reply tail (one new
reply among 64 weighs 1/64, a batch of new replies fully).  While a new
reply is live, a tier that wins on the mean by drafting a chain whose rounds often accept
nothing ranks below a tree that rarely does, so a short reply's time per token, the one a TPOT
p99 is made of, stays low; once every live reply has run many rounds, one more round barely
moves any reply's time per token and the mean rate (throughput) decides.  ``tail_rounds=0``
ranks by the mean alone.

The first step runs the best tier for its batch under the prior (r = 1: the planner's choice).
Later it moves to the best tier only when it holds a switch's credit (one earned every
``min_dwell_steps`` steps, at most ``switch_burst`` held, so a load change is answered at the next
step and answered back) and the best's predicted gain clears ``margin`` (default 0) plus
``confidence_z`` standard errors of the gain as r is uncertain (tiers with equal expected drafts:
none) plus the switch's cost (``switch_cost_us``, default 0: an engine that captured every tier's
graph rebuilds nothing) spread over the ``min_dwell_steps`` steps a credit stands for.  Hence the
bound: switches <= steps // min_dwell_steps after any number of steps (the first choice is not a
switch), and at most ``switch_burst + W // min_dwell_steps`` in any W consecutive steps.  Tiers are
the fixed-shape policies an engine runs per step: plain decoding, chains (linear D) and EAGLE
trees (s, k, D).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from simtree.acceptance.mixture import AcceptanceModel
from simtree.control.catchup import LAG_ROWS, catch_up_us
from simtree.control.tiers import DEFAULT_TIERS, Tier, tier_shape
from simtree.errors import SimtreeError, check_int
from simtree.planning.modes import PolicySpec

__all__ = ["Tier", "Controller", "DEFAULT_TIERS", "tier_shape", "MARGIN", "MIN_DWELL_STEPS", "SWITCH_BURST",
           "TAIL_ROUNDS", "TAIL_POWER", "TAIL_MIX", "SWITCH_COST_US", "CONFIDENCE_Z"]

MARGIN = 0.0            # a relative gain every switch must clear besides its uncertainty and cost
SWITCH_COST_US = 0.0    # what one switch costs the engine (tiers' graphs captured: nothing to rebuild)
CONFIDENCE_Z = 2.0      # standard errors of the acceptance estimate a switch's predicted gain must clear
PENALTY_ROUNDS = 128    # reply lengths (rounds) whose short-reply penalty is tabulated exactly
MIN_DWELL_STEPS = 16    # one switch's credit is earned per this many steps ...
SWITCH_BURST = 4        # ... and at most this many held: two load changes, each a switch and the switch back
MEMORY = 2000           # sequence-rounds the running acceptance ratio remembers (decay 1 - 1/MEMORY each)
PRIOR = 50.0            # predicted drafts' worth of belief in the acceptance model (ratio 1)
TAIL_ROUNDS = 1         # rounds of the reply whose time per token ranks the tiers (1: each round's own)
TAIL_POWER = 2.0        # its time per token averaged in this power mean (1: the mean; 2: root mean square)
TAIL_MIX = "youngest"   # whose penalty ranks the step: the youngest live reply's, or the "mean" over the live replies
TAIL_MIXES = ("youngest", "mean")
PLAIN_DRAFTS = ("lag", "extend")   # what a plain step does with the drafter (Controller.plain_draft)
STEP_CACHE = 4096       # (batch, context) points whose step times are kept (an engine pricing one context hits always)


@dataclass
class Controller:
    """Picks the next step's tier with hysteresis (module docstring)."""

    costs: object
    acceptance: AcceptanceModel
    specs: Sequence[PolicySpec] = DEFAULT_TIERS
    margin: float = MARGIN
    min_dwell_steps: int = MIN_DWELL_STEPS
    switch_burst: int = SWITCH_BURST
    memory: float = MEMORY
    prior: float = PRIOR
    tail_rounds: int = TAIL_ROUNDS
    tail_power: float = TAIL_POWER
    tail_mix: str = TAIL_MIX
    plain_draft: str = "lag"
    switch_cost_us: float = SWITCH_COST_US
    confidence_z: float = CONFIDENCE_Z
    tiers: list[Tier] = field(init=False)
    current: Tier | None = field(init=False, default=None)
    _observed: float = field(init=False, default=0.0)
    _predicted: float = field(init=False, default=0.0)
    _variance: float = field(init=False, default=0.0)
    steps: int = field(init=False, default=0)
    switches: int = field(init=False, default=0)
    _credit: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.specs:
            raise SimtreeError("the controller needs at least one tier")
        check_int(self.min_dwell_steps, "min_dwell_steps", 1)
        check_int(self.switch_burst, "switch_burst", 1)
        check_int(self.tail_rounds, "tail_rounds", 0)
        if self.tail_mix not in TAIL_MIXES:
            raise SimtreeError(f"tail_mix {self.tail_mix!r} must be one of {', '.join(TAIL_MIXES)}")
        if self.plain_draft not in PLAIN_DRAFTS:
            raise SimtreeError(f"plain_draft {self.plain_draft!r} must be one of {', '.join(PLAIN_DRAFTS)}")
        if not (0 <= self.margin < 1 and self.memory >= 1 and self.prior > 0 and self.switch_cost_us >= 0
                and self.confidence_z >= 0 and self.tail_power >= 1):
            raise SimtreeError(f"margin {self.margin} must be in [0, 1), memory {self.memory} >= 1, prior "
                               f"{self.prior} > 0, switch_cost_us {self.switch_cost_us} and confidence_z "
                               f"{self.confidence_z} >= 0, tail_power {self.tail_power} >= 1")
        self.tiers = [tier_shape(self.acceptance, s, i) for i, s in enumerate(self.specs)]
        self._nodes = np.array([t.nodes_per_seq for t in self.tiers])
        self._accepted = np.array([t.expected_accepted for t in self.tiers])
        self._accepted_var = np.array([t.accepted_var for t in self.tiers])
        self._penalties = np.stack([t.short_reply_penalties(PENALTY_ROUNDS, self.tail_power)
                                    for t in self.tiers])   # [T, H]
        self._plain = np.array([t.spec.mode == "none" for t in self.tiers])
        # plain and drafted tiers: the drafter lags (simtree's runtime), or runs over every plain step's row
        self._lags = bool(self._plain.any() and not self._plain.all()) and self.plain_draft == "lag"
        self._extends = bool(self._plain.any()) and self.plain_draft == "extend"
        self._lag_us = {}   # batch -> a plain step's share of the catch-up (microseconds)
        self._step_us = {}  # (batch, context) -> every tier's step time (microseconds): the costs never change
        self._penalty = {}  # reply rounds -> every tier's penalty

    def penalty(self, rounds: int) -> np.ndarray:
        """[T] every tier's short-reply penalty for a reply of ``rounds`` rounds (1 for 0); past
        ``PENALTY_ROUNDS`` it falls as 1 / rounds, as Jensen's gap of a mean of i.i.d. rounds does."""
        rounds = int(rounds)
        if rounds not in self._penalty:
            self._penalty[rounds] = self.penalties([rounds])[:, 0]
            self._penalty[rounds].setflags(write=False)
        return self._penalty[rounds]

    def penalties(self, rounds) -> np.ndarray:
        """[T, N] :meth:`penalty` at each of ``rounds`` (N reply lengths), vectorised."""
        h = np.asarray(rounds, np.int64).reshape(-1)
        exact = self._penalties[:, np.clip(h, 1, PENALTY_ROUNDS) - 1]
        beyond = 1.0 + (self._penalties[:, -1:] - 1.0) * (PENALTY_ROUNDS / np.maximum(h, 1))
        return np.where(h <= 0, 1.0, np.where(h <= PENALTY_ROUNDS, exact, beyond))

    def predicted_tok_s(self, batch_size: int, context_len: float) -> np.ndarray:
        """[T] predicted batch tokens per second of every tier at this batch and mean context."""
        b = check_int(batch_size, "batch size", 1)
        key = (b, float(context_len))
        step = self._step_us.get(key)
        if step is None:
            verify = np.asarray(self.costs.verify.predict(self._nodes, key[1], b), np.float64)
            draft = np.array([t.draft_us(self.costs, b) for t in self.tiers])
            if self._lags:      # a plain step's share of the MTP layer's catch-up (simtree.control.catchup)
                if b not in self._lag_us:
                    self._lag_us[b] = catch_up_us(self.costs, LAG_ROWS, b) / LAG_ROWS
                draft[self._plain] += self._lag_us[b]
            elif self._extends:  # the drafter's forward over the step's one row per sequence
                draft[self._plain] += catch_up_us(self.costs, 1, b)
            if len(self._step_us) >= STEP_CACHE:
                self._step_us.clear()
            step = self._step_us[key] = draft + verify
            step.setflags(write=False)
        return b * (1.0 + self.ratio * self._accepted) / step * 1e6

    def horizon_rounds(self, rounds_done=None) -> int:
        """The reply length (rounds) whose time per token ranks the tiers: ``tail_rounds`` past the
        rounds the youngest live sequence has run (0: the mean alone)."""
        if self.tail_rounds == 0:
            return 0
        done = np.asarray([] if rounds_done is None else rounds_done).reshape(-1)
        return self.tail_rounds + (int(done.min()) if done.size else 0)

    def tail_penalty(self, rounds_done=None) -> np.ndarray:
        """[T] the penalty ``choose`` divides the rate by: the youngest live reply's at
        :meth:`horizon_rounds`, or (``tail_mix="mean"``) the mean over the live replies of each one's
        penalty at ``tail_rounds`` past its own rounds (every sequence new when ``rounds_done`` is not given)."""
        if self.tail_mix == "youngest" or self.tail_rounds == 0:
            return self.penalty(self.horizon_rounds(rounds_done))
        done = np.asarray([] if rounds_done is None else rounds_done).reshape(-1)
        if not done.size:
            return self.penalty(self.tail_rounds)
        return self.penalties(self.tail_rounds + done.astype(np.int64)).mean(axis=1)

    def objective(self, batch_size: int, context_len: float, rounds_done=None) -> np.ndarray:
        """[T] what ``choose`` ranks: the predicted rate over :meth:`tail_penalty` (the rate the
        youngest live reply sees if it ends after ``tail_rounds`` more rounds, by default)."""
        return self._rate_and_objective(batch_size, context_len, rounds_done)[1]

    def _rate_and_objective(self, batch_size: int, context_len: float, rounds_done) -> tuple[np.ndarray, np.ndarray]:
        rate = self.predicted_tok_s(batch_size, context_len)
        return rate, rate / self.tail_penalty(rounds_done)

    def switch_threshold(self, frm: Tier, to: Tier, batch_size: int, rate_to: float) -> float:
        """The relative gain of ``to`` over ``frm`` a switch needs: ``margin``, plus
        ``confidence_z`` standard errors of the gain as the running acceptance ratio is uncertain,
        plus the switch's cost spread over the ``min_dwell_steps`` steps one switch's credit stands for."""
        r = self.ratio
        slope = abs(self._accepted[to.index] / (1.0 + r * self._accepted[to.index])
                    - self._accepted[frm.index] / (1.0 + r * self._accepted[frm.index]))   # d log(rate) / d r
        step_us = batch_size * (1.0 + r * self._accepted[to.index]) / rate_to * 1e6
        return (self.margin + self.confidence_z * slope * self.ratio_stderr
                + self.switch_cost_us / (self.min_dwell_steps * step_us))

    def choose(self, batch_size: int, context_lens, rounds_done=None) -> Tier:
        """The tier the next step runs, for ``batch_size`` live sequences of ``context_lens``;
        ``rounds_done`` (optional): the rounds each live sequence has decoded so far."""
        ctx = np.asarray(context_lens, np.float64).reshape(-1)
        rate, score = self._rate_and_objective(batch_size, float(ctx.mean()) if ctx.size else 1.0, rounds_done)
        best = self.tiers[int(np.argmax(score))]
        self.steps += 1
        if self.steps % self.min_dwell_steps == 0:   # one credit per min_dwell_steps steps, switch_burst held
            self._credit = min(self._credit + 1, self.switch_burst)
        if self.current is None:   # the prior's best tier for this batch
            self.current = best
        elif best is not self.current and self._credit > 0:
            cur = self.current
            if score[best.index] > (1.0 + self.switch_threshold(cur, best, batch_size, rate[best.index])) * score[cur.index]:
                self.current = best
                self._credit -= 1
                self.switches += 1
        return self.current

    @property
    def ratio(self) -> float:
        """Observed over predicted accepted drafts, recent sequence-rounds weighted most."""
        return (self._observed + self.prior) / (self._predicted + self.prior)

    @property
    def ratio_stderr(self) -> float:
        """Standard error of :attr:`ratio`: the weighted rounds' variance under the acceptance
        model over the predicted drafts (0 before any evidence: the model is the prior)."""
        return float(np.sqrt(self._variance)) / (self._predicted + self.prior)

    def observe(self, tier: Tier, accepted_drafts) -> None:
        """Accepted draft tokens (bonus excluded) per sequence of the step that ran ``tier``."""
        a = np.asarray(accepted_drafts, np.float64).reshape(-1)
        decay = (1.0 - 1.0 / self.memory) ** a.size
        self._observed *= decay
        self._predicted *= decay
        self._variance *= decay * decay
        if tier.expected_accepted > 0:   # plain decoding measures no acceptance: the evidence only decays
            self._observed += float(a.sum())
            self._predicted += a.size * tier.expected_accepted
            self._variance += a.size * self._accepted_var[tier.index]

    @property
    def max_switches(self) -> int:
        """The bound on :attr:`switches` after :attr:`steps` steps (and in any window of W steps at
        most ``switch_burst + W // min_dwell_steps``)."""
        return self.steps // self.min_dwell_steps
