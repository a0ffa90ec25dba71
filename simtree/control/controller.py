"""An online controller: which speculation tier the next decode step runs.

An engine's scheduler calls it once per step::

    ctl = Controller(costs, acceptance)            # a cost bundle and an acceptance model
    tier = ctl.choose(batch_size, context_lens)     # before the step: tier.spec is the policy
    ...draft and verify with tier.spec...
    ctl.observe(tier, accepted_drafts)              # after verify: accepted drafts per sequence

``choose`` predicts each tier's batch throughput at the live batch size and mean context,
``rate_t = b * (1 + r * phi_t) / (C_d(t, b) + C_v(n_t, l, b))`` (phi_t the tier's expected accepted
drafts under the acceptance model, r the running ratio of observed to predicted accepted
drafts: both summed over the last ``memory`` sequence-rounds or so (exponential decay per
sequence-round), plus a prior of ``prior`` predicted drafts at ratio 1; as plain decoding,
which measures no acceptance, lets the evidence decay, the prior brings r back toward 1 and
speculation is tried again), and ranks the tiers by ``rate_t / penalty_t``, the rate a reply of
``tail_rounds`` rounds sees: ``penalty_t = E[tokens of a round] * E[h / tokens of h rounds]``
(h = ``tail_rounds``, default 1: each round's expected time per token; >= 1 by Jensen, the more
so the likelier a round accepts nothing), so a
tier that wins on the mean by drafting a chain whose rounds often accept nothing ranks below a
tree that rarely does: a short reply's time per token, the one a TPOT p99 is made of, stays
low.  ``tail_rounds=0`` ranks by the mean alone.  It moves to the best tier only when the best
beats the current one by ``margin`` and the current tier has run ``min_dwell_steps`` steps.
Hence the bound: at most one switch per ``min_dwell_steps`` steps, i.e. switches <= steps //
min_dwell_steps (the first choice is not a switch).  Tiers are the fixed-shape policies an
engine runs per step: plain decoding, chains (linear D) and EAGLE trees (s, k, D).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from simtree.acceptance.mixture import AcceptanceModel
from simtree.acceptance.phi import accepted_length_pmf, node_accept_probs_ranked
from simtree.errors import SimtreeError, check_int
from simtree.planning.modes import EagleParams, LinearParams, NoneParams, PolicySpec
from simtree.planning.simulate import static_round

__all__ = ["Tier", "Controller", "DEFAULT_TIERS", "tier_shape", "MARGIN", "MIN_DWELL_STEPS", "TAIL_ROUNDS"]

MARGIN = 0.02           # a tier must be predicted 2% faster than the current one to switch to it
MIN_DWELL_STEPS = 16    # and the current one must have run this many steps
MEMORY = 2000           # sequence-rounds the running acceptance ratio remembers (decay 1 - 1/MEMORY each)
PRIOR = 50.0            # predicted drafts' worth of belief in the acceptance model (ratio 1)
TAIL_ROUNDS = 1         # rounds of the reply whose time per token ranks the tiers (1: each round's own)
DEFAULT_TIERS: tuple[PolicySpec, ...] = (
    (NoneParams(),) + tuple(LinearParams(d) for d in range(2, 8))
    + tuple(EagleParams(s, k, d) for s, k, d in [(2, 2, 4), (2, 2, 5), (2, 2, 6), (2, 2, 7), (3, 2, 6), (3, 2, 8),
                                                  (4, 2, 8)]))


@dataclass(frozen=True, eq=False)
class Tier:
    """A fixed-shape policy with its numbers under one acceptance model: nodes verified per
    sequence [L], expected accepted drafts [L] and the CDF of accepted drafts [L, depth + 1],
    per acceptance level; ``weights`` [L] the share of rounds at each level."""

    spec: PolicySpec
    nodes: np.ndarray
    accepted: np.ndarray
    cdf: np.ndarray
    weights: np.ndarray
    index: int = 0
    same_nodes: bool = False   # every level verifies as many nodes (chains, full EAGLE trees)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def expected_accepted(self) -> float:
        return float(self.weights @ self.accepted)

    @property
    def nodes_per_seq(self) -> float:
        return float(self.weights @ self.nodes)

    def short_reply_penalty(self, rounds: int) -> float:
        """E[tokens of a round] * E[rounds / tokens of ``rounds`` rounds] (>= 1): how much slower
        per token a reply of ``rounds`` rounds runs than the mean says; 1 for ``rounds`` 0."""
        if rounds <= 0:
            return 1.0
        pmf = self.weights @ np.diff(self.cdf, axis=1, prepend=0.0)   # accepted drafts per round
        tokens = np.concatenate([[0.0], pmf])                            # P(tokens = j), j >= 1
        total = np.array([1.0])
        for _ in range(rounds):
            total = np.convolve(total, tokens)
        j = np.arange(1, total.size)
        return float((tokens @ np.arange(tokens.size)) * (total[1:] @ (rounds / j)))

    def draft_us(self, costs, batch_size: int) -> float:
        s, k = self.spec.draft_shape()
        return 0.0 if s == 0 else float(costs.draft.predict(s, k, batch_size))


def tier_shape(acc: AcceptanceModel, spec: PolicySpec, index: int = 0) -> Tier:
    shape = static_round(acc, spec)
    depth = max(t.max_depth for t in shape.trees)
    cdf = np.ones((acc.num_levels, depth + 1))
    for level, (tree, table) in enumerate(zip(shape.trees, shape.tables)):
        pmf = accepted_length_pmf(tree, node_accept_probs_ranked(tree, table))
        cdf[level, :pmf.size] = np.cumsum(pmf)
    cdf[:, -1] = 1.0
    return Tier(spec, shape.nodes, shape.accepted, cdf, np.asarray(acc.weights), index,
                bool(np.all(shape.nodes == shape.nodes[0])))


@dataclass
class Controller:
    """Picks the next step's tier with hysteresis (module docstring)."""

    costs: object
    acceptance: AcceptanceModel
    specs: Sequence[PolicySpec] = DEFAULT_TIERS
    margin: float = MARGIN
    min_dwell_steps: int = MIN_DWELL_STEPS
    memory: float = MEMORY
    prior: float = PRIOR
    tail_rounds: int = TAIL_ROUNDS
    tiers: list[Tier] = field(init=False)
    current: Tier | None = field(init=False, default=None)
    _observed: float = field(init=False, default=0.0)
    _predicted: float = field(init=False, default=0.0)
    steps: int = field(init=False, default=0)
    switches: int = field(init=False, default=0)
    _since_switch: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.specs:
            raise SimtreeError("the controller needs at least one tier")
        check_int(self.min_dwell_steps, "min_dwell_steps", 1)
        check_int(self.tail_rounds, "tail_rounds", 0)
        if not (0 <= self.margin < 1 and self.memory >= 1 and self.prior > 0):
            raise SimtreeError(f"margin {self.margin} must be in [0, 1), memory {self.memory} >= 1 and prior "
                               f"{self.prior} > 0")
        self.tiers = [tier_shape(self.acceptance, s, i) for i, s in enumerate(self.specs)]
        self._nodes = np.array([t.nodes_per_seq for t in self.tiers])
        self._accepted = np.array([t.expected_accepted for t in self.tiers])
        self._penalty = np.array([t.short_reply_penalty(self.tail_rounds) for t in self.tiers])

    def predicted_tok_s(self, batch_size: int, context_len: float) -> np.ndarray:
        """[T] predicted batch tokens per second of every tier at this batch and mean context."""
        b = check_int(batch_size, "batch size", 1)
        verify = np.asarray(self.costs.verify.predict(self._nodes, float(context_len), b), np.float64)
        draft = np.array([t.draft_us(self.costs, b) for t in self.tiers])
        return b * (1.0 + self.ratio * self._accepted) / (draft + verify) * 1e6

    def objective(self, batch_size: int, context_len: float) -> np.ndarray:
        """[T] what ``choose`` ranks: the predicted rate a reply of ``tail_rounds`` rounds sees."""
        return self.predicted_tok_s(batch_size, context_len) / self._penalty

    def choose(self, batch_size: int, context_lens) -> Tier:
        """The tier the next step runs, for ``batch_size`` live sequences of ``context_lens``."""
        ctx = np.asarray(context_lens, np.float64).reshape(-1)
        rate = self.objective(batch_size, float(ctx.mean()) if ctx.size else 1.0)
        best = self.tiers[int(np.argmax(rate))]
        self.steps += 1
        self._since_switch += 1
        if self.current is None:
            self.current, self._since_switch = best, 0
        elif (best is not self.current and self._since_switch >= self.min_dwell_steps
              and rate[best.index] > (1.0 + self.margin) * rate[self.current.index]):
            self.current, self._since_switch = best, 0
            self.switches += 1
        return self.current

    @property
    def ratio(self) -> float:
        """Observed over predicted accepted drafts, recent sequence-rounds weighted most."""
        return (self._observed + self.prior) / (self._predicted + self.prior)

    def observe(self, tier: Tier, accepted_drafts) -> None:
        """Accepted draft tokens (bonus excluded) per sequence of the step that ran ``tier``."""
        a = np.asarray(accepted_drafts, np.float64).reshape(-1)
        decay = (1.0 - 1.0 / self.memory) ** a.size
        self._observed *= decay
        self._predicted *= decay
        if tier.expected_accepted > 0:   # plain decoding measures no acceptance: the evidence only decays
            self._observed += float(a.sum())
            self._predicted += a.size * tier.expected_accepted

    @property
    def max_switches(self) -> int:
        """The bound on :attr:`switches` after :attr:`steps` steps."""
        return self.steps // self.min_dwell_steps
