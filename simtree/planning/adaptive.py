"""The adaptive modes in the simulator: cost_aware and batch_alloc decide each round's nodes.

Per acceptance level, the drafter's marginals (``AcceptanceModel.draft_marginals``: what a
runtime sees) give a best-first order (:func:`simtree.trees.builders.best_first_order`); its
survival probabilities are what the round decides with (:mod:`simtree.planning.allocation`),
and Phi of every prefix, scored with the level's acceptance table, is what the target then
accepts.  Data flows one way: the acceptance model hands numbers to the builder, the builder
returns an order, and this module scores it.

- A real round (Monte-Carlo, :meth:`AdaptiveRounds.round_nodes`): one candidate list per
  sequence of the batch, at its drawn level.  cost_aware prices nodes at the run's
  :class:`~simtree.planning.allocation.RunningPrice`, batch_alloc at the round's own rate.
- The analytic run (:meth:`AdaptiveRounds.decide`): level l stands for b * w_l requests
  (fluid).  batch_alloc keeps the prefix of the best believed rate; cost_aware is priced at
  the rate the policy itself runs at - the fixed point of price -> allocation -> rate, with
  the rate counted in the tokens the target accepts and the policy's rounds spread over the
  text states as :meth:`~simtree.acceptance.mixture.AcceptanceModel.round_weights` says.  For
  a calibrated drafter with one state the first step is the fixed point (the ratio-optimal
  prefix is the one priced at its own rate).
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from simtree.acceptance.mixture import AcceptanceModel
from simtree.acceptance.phi import below_off_chain, below_scale
from simtree.planning.allocation import (RunningPrice, allocate_round, batch_allocation, priced_allocation,
                                         ratio_allocation)
from simtree.planning.modes import BatchAllocParams, CostAwareParams
from simtree.trees.builders import BestFirstOrder, best_first_order
from simtree.trees.tree import DraftTree

__all__ = ["AdaptiveRounds", "scored_phi", "adaptive_bucket"]

FIXED_POINT_STEPS = 16   # price / round-weight iterations of one analytic decision (2-4 suffice when not exact)


def scored_phi(order: BestFirstOrder, table: np.ndarray, chain_marginals=False) -> np.ndarray:
    """float64 [n]: Phi of every prefix of ``order`` (the budget-(i+1) tree) under the positional
    acceptance ``table [P, K]``: a node of depth d whose token is rank id r is accepted with
    table[d-1, r] given its parent (0 beyond the table's ranks; below an off-chain node with
    ``chain_marginals``, 0 or a share per rank: :func:`simtree.acceptance.phi.node_accept_probs_ranked`)."""
    P, K = table.shape
    d, r = order.depth, order.tokens
    inside = (d > 0) & (r < K)
    p = np.ones(order.num_nodes)
    p[d > 0] = 0.0
    p[inside] = table[np.minimum(d[inside] - 1, P - 1), r[inside]]
    scale = below_scale(chain_marginals, K)
    if scale is not None:
        below = below_off_chain(order.parents, r) & inside
        p[below] *= scale[r[below]]
    reach = p.copy()
    for i in range(1, order.num_nodes):   # best-first pops a parent before its children
        reach[i] *= reach[order.parents[i]]
    return np.cumsum(reach) - 1.0


# per acceptance model: {(draft_depth, max_budget): per-level (order, table, phi, survival)};
# they depend on the model and the spec only, so every batch size and cost bundle shares them
_LEVELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _level_orders(acc: AcceptanceModel, draft_depth: int, max_budget: int) -> tuple:
    cached = _LEVELS.setdefault(acc, {})
    key = (draft_depth, max_budget)
    if key not in cached:
        orders, tables, phis = [], [], []
        for level in range(acc.num_levels):
            toks, probs = acc.draft_marginals(level, draft_depth)
            orders.append(best_first_order(toks, probs, max_budget))
            tables.append(acc.table(level, draft_depth))
            phis.append(scored_phi(orders[-1], tables[-1], acc.chain_scoring))
        survival = [o.prefix_probs[1:max_budget] for o in orders]
        cached[key] = (tuple(orders), tuple(tables), tuple(phis), tuple(survival))
    return cached[key]


class AdaptiveRounds:
    """Round decisions of a cost_aware or batch_alloc ``spec`` for one acceptance model, cost
    models and batch size (see the module docstring)."""

    def __init__(self, acc: AcceptanceModel, spec: CostAwareParams | BatchAllocParams, costs, batch_size: int,
                 max_nodes: int | None = None):
        """``max_nodes``: the most nodes a round's tree may have (a static bucket below the spec's
        max budget caps every round's budgets, as the runtime's candidate lists are cut to it)."""
        self.acc, self.spec, self.costs, self.b = acc, spec, costs, int(batch_size)
        self.priced = isinstance(spec, CostAwareParams)
        s, k = spec.draft_shape()
        self.draft_us = float(costs.draft.predict(s, k, self.b))
        self.orders, self.tables, self.phis, survival = _level_orders(acc, spec.draft_depth, spec.max_nodes)
        cap = spec.max_nodes if max_nodes is None else max(1, min(int(max_nodes), spec.max_nodes))
        self.max_nodes = cap
        self.survival = tuple(sv[:cap - 1] for sv in survival)   # best-first: a prefix of a longer order

    def verify_cost(self, ctx: float):
        return lambda n: self.costs.verify.predict(n, ctx, self.b)

    def phi(self, level: int, n: int) -> float:
        """Expected accepted drafts of level ``level``'s budget-``n`` tree."""
        return float(self.phis[level][n - 1])

    def tree(self, level: int, n: int) -> DraftTree:
        return self.orders[level].tree(n)

    def _phi(self, nodes: np.ndarray) -> np.ndarray:
        return np.array([self.phis[lv][n - 1] for lv, n in enumerate(nodes)])

    def decide(self, ctx: float) -> tuple[np.ndarray, np.ndarray]:
        """The analytic decision at context ``ctx``: (nodes per level int [L], the share of the
        policy's rounds at each level [L])."""
        acc, b, cv = self.acc, self.b, self.verify_cost(ctx)
        w, price = acc.weights, None
        for _ in range(FIXED_POINT_STEPS):
            if price is None:
                extra, believed, cost = ratio_allocation(self.survival, b * w, cv, self.draft_us, b)
            else:
                extra = priced_allocation(self.survival, b * w, cv, price, b)
            nodes = 1 + extra
            phi = self._phi(nodes)
            w_next = acc.round_weights(1.0 + phi)
            settled = bool(np.allclose(w_next, w, rtol=1e-9, atol=1e-12))
            if self.priced:
                if price is not None or not settled:   # else the allocation's own cost holds
                    cost = self.draft_us + float(np.asarray(cv(max(float(w_next @ nodes), 1.0)), np.float64))
                rate = b * float(w_next @ (1.0 + phi)) / cost
                settled = settled and math.isclose(rate, believed if price is None else price, rel_tol=1e-9)
                price = rate
            w = w_next
            if settled:
                break
        return nodes, w

    def round_nodes(self, levels: np.ndarray, ctx: float, price: RunningPrice | None) -> np.ndarray:
        """Nodes per sequence (int [b]) of one real round whose sequences drew ``levels``;
        cost_aware needs the run's ``price`` (updated by the caller after the round)."""
        survival = [self.survival[lv] for lv in levels]
        cv = self.verify_cost(ctx)
        if self.priced:
            return 1 + allocate_round(survival, cv, self.draft_us, self.b, price)
        return 1 + batch_allocation(survival, np.ones(len(survival)), cv, self.draft_us, self.b)


def adaptive_bucket(acc: AcceptanceModel, spec: CostAwareParams | BatchAllocParams, costs, batch_size: int,
                    context_len: float) -> int:
    """The static bucket of a cost_aware / batch_alloc run: the most nodes the analytic decision
    (:meth:`AdaptiveRounds.decide`) gives any acceptance level at ``context_len`` (at least 2, at
    most the spec's max budget).  The full runtime captures its CUDA graphs at this many nodes
    per sequence and verifies them every round (the nodes past a round's budget are padding),
    its budgets capped at it; the simulator prices the mode at this bucket.  A bucket of the max budget would pay C_v(max budget) each round for
    trees the rule mostly keeps smaller."""
    nodes, _ = AdaptiveRounds(acc, spec, costs, batch_size).decide(float(context_len))
    return max(2, min(spec.max_nodes, int(np.max(nodes))))
