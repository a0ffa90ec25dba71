"""Per-step speculation policies for the serving simulator.

Each driver's ``step(b, ctx, levels, u, rounds)`` decides the step for the ``b`` live sequences
(contexts ``ctx``; ``levels`` the acceptance level each sequence drew this round, ``u`` one
uniform number per sequence, ``rounds`` the rounds each has decoded so far), draws the accepted drafts per sequence from the acceptance model
by inverting their CDF at ``u``, and returns (step microseconds, accepted drafts [b], the label
of what it ran).  The simulator hands every policy the same numbers for a request's n-th round
(common random numbers), so two policies differ only by what they chose.  Step time = C_d + C_v at the batch's mean
context and mean verified nodes, as the planner prices a round.

SGLang's own classes run inside the loop: ``AdaptiveSpeculativeParams`` (its per-batch
``AdaptiveStepSlot``: EMA of accepted drafts, warm-up, update interval, hysteresis) and
DSpark's ``compute_verify_token_budget`` over an SPS table.  DSpark's survival probabilities
are each sequence's chain acceptance at the level it drew (the drafter's confidence, exact).

A driver that runs plain and drafted steps (``lags``: threshold tiers, the controller) is an
engine whose MTP layer falls behind during plain steps and catches up when drafting resumes: the
simulator adds that catch-up's price to the step that pays it
(:class:`simtree.control.catchup.CatchUpClock`); a plain step itself is C_v(1) alone.  SGLang's
adaptive steps keep the drafter level instead: each step-0 round adds the drafter's forward over
its rows (:class:`SGLangAdaptiveDriver`).
"""
from __future__ import annotations

import numpy as np

from simtree.acceptance.mixture import AcceptanceModel
from simtree.control.catchup import catch_up_us
from simtree.control.controller import Controller
from simtree.control.tiers import Tier, chain_spec, tier_shape

__all__ = ["FixedDriver", "ControllerDriver", "ThresholdDriver", "SGLangAdaptiveDriver", "DSparkDriver",
           "sample_tier", "linear_tier", "step_us"]


def sample_tier(tier: Tier, levels: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Accepted drafts per sequence of one round of ``tier`` at each sequence's level: the
    smallest count whose CDF reaches ``u``."""
    return (tier.cdf[levels] < u[:, None]).sum(1).astype(np.int64)


def step_us(costs, tier: Tier, nodes_per_seq: float, context_len: float, batch_size: int) -> float:
    """The benchmark's price of one round: C_d of ``tier`` + C_v at the batch's mean verified
    nodes and mean context (as the planner prices a round); the live run's prediction too."""
    return float(tier.draft_us(costs, batch_size) + costs.verify.predict(float(nodes_per_seq), float(context_len),
                                                                        batch_size))


def _step_us(costs, tier: Tier, levels: np.ndarray, ctx: np.ndarray) -> float:
    b = levels.shape[0]
    nodes = tier.nodes[0] if tier.same_nodes else tier.nodes[levels].sum() / b
    return step_us(costs, tier, nodes, float(ctx.sum()) / b, b)


def linear_tier(acc: AcceptanceModel, drafts: int, cache: dict) -> Tier:
    """The tier of a chain of ``drafts`` draft tokens (0: plain decoding), cached."""
    if drafts not in cache:
        cache[drafts] = tier_shape(acc, chain_spec(drafts))
    return cache[drafts]


class FixedDriver:
    lags = False    # one shape: a plain engine keeps no drafter, a drafting one never falls behind

    def __init__(self, costs, tier: Tier):
        self.costs, self.tier = costs, tier

    def step(self, b, ctx, levels, u, rounds=None):
        return _step_us(self.costs, self.tier, levels, ctx), sample_tier(self.tier, levels, u), self.tier.name


class ControllerDriver:
    lags = True

    def __init__(self, controller: Controller):
        self.ctl = controller
        self.costs = controller.costs

    def step(self, b, ctx, levels, u, rounds=None):
        tier = self.ctl.choose(b, ctx, rounds)
        accepted = sample_tier(tier, levels, u)
        self.ctl.observe(tier, accepted)
        return _step_us(self.ctl.costs, tier, levels, ctx), accepted, tier.name


class ThresholdDriver:
    """vLLM's Dynamic SD: inclusive batch ranges -> draft tokens; a batch between ranges keeps
    the previous range's length, one above the last keeps the last's."""

    lags = True

    def __init__(self, costs, acc: AcceptanceModel, tiers: list[tuple[int, int, int]]):
        self.costs, self.acc, self.tiers, self._cache = costs, acc, sorted(tiers), {}

    def drafts_for(self, b: int) -> int:
        k = self.tiers[0][2]
        for lo, _, kk in self.tiers:
            if b >= lo:
                k = kk
        return k

    def step(self, b, ctx, levels, u, rounds=None):
        tier = linear_tier(self.acc, self.drafts_for(b), self._cache)
        return _step_us(self.costs, tier, levels, ctx), sample_tier(tier, levels, u), tier.name


class SGLangAdaptiveDriver:
    """SGLang's ``AdaptiveSpeculativeParams`` picks the steps (top-k 1 chains) per batch.  Its
    drafter never falls behind: a step-0 round runs the draft model's extend over each request's
    new row (``eagle_worker_v2``: unless ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND``), priced
    ``C_d(1, 1, b)``, the drafter's forward over one row per sequence."""

    lags = False

    def __init__(self, costs, acc: AcceptanceModel, params):
        self.costs, self.acc, self.params, self._cache = costs, acc, params, {}

    def step(self, b, ctx, levels, u, rounds=None):
        steps = int(self.params.get_steps_for_batch(b))
        tier = linear_tier(self.acc, steps, self._cache)
        accepted = sample_tier(tier, levels, u)
        self.params.on_verify_complete([int(a) for a in accepted], b)
        extend = catch_up_us(self.costs, 1, b) if steps == 0 else 0.0
        return _step_us(self.costs, tier, levels, ctx) + extend, accepted, tier.name


class DSparkDriver:
    """DSpark: a block of ``gamma`` drafts per sequence, then SGLang's
    ``compute_verify_token_budget`` picks how many of the batch's drafted tokens to verify."""

    lags = False    # drafts every step

    def __init__(self, costs, acc: AcceptanceModel, sps_table, cfg, budget_fn):
        import torch   # SGLang's planner takes tensors
        self.torch, self.costs, self.table, self.cfg, self.budget_fn = torch, costs, sps_table, cfg, budget_fn
        self.gamma = int(cfg.gamma)
        alpha = np.stack([acc.table(level, self.gamma)[:, 0] for level in range(acc.num_levels)])
        self.survival = np.cumprod(alpha, axis=1)   # [L, gamma]: P(the first j drafts accepted)

    def step(self, b, ctx, levels, u, rounds=None):
        surv = self.survival[levels]
        decision = self.budget_fn(history_survival_probs=self.torch.from_numpy(surv), sps_table=self.table,
                                  cfg=self.cfg)
        budget = int(decision.budget)
        order = np.argsort(-surv, axis=None, kind="stable")[:budget]
        lengths = np.bincount(order // self.gamma, minlength=b)   # drafts verified per sequence
        run = (self.survival[levels] > 1.0 - u[:, None]).sum(1)  # the chain's accepted drafts at u
        accepted = np.minimum(run, lengths)
        step_us = float(self.costs.draft.predict(self.gamma, 1, b)
                        + self.costs.verify.predict(1.0 + budget / b, float(ctx.mean()), b))
        return step_us, accepted.astype(np.int64), "dspark"
