"""cost_aware's and batch_alloc's per-round budgets on the device: the planner's rule
(:mod:`simtree.planning.allocation`, which the simulator and the tiny runtime call) in torch,
with no host sync, so a round stays one CUDA-graph replay.

    alloc = DeviceAllocation(costs, rs, batch_size, max_len, device)
    extra = alloc.allocate(survival, context_len)   # survival [B, m] float64, context [] -> int64 [B]
    alloc.update(gained_tokens)                      # cost_aware: the run's price moves

Each sequence brings its best-first nodes' survival (prefix) probabilities, non-increasing;
the batch's lists merge by survival (a stable sort: each list keeps its order on ties, as
``np.argsort(kind="stable")`` of their concatenation does) and a prefix of K nodes is
verified, at C_v(1 + K/b, l, b).  batch_alloc keeps the prefix of the best round rate
(b + gain) / (C_d + C_v); cost_aware the prefix maximising gain - price x C_v at the run's
price (``RunningPrice``: tokens gained per us of predicted round time, exponential memory of
``PRICE_MEMORY_ROUNDS``), its first round batch_alloc's.  C_v is tabulated from the cost
bundle once, at every K of the bucket and a grid of contexts, and interpolated linearly in
the context on the device; so is a block drafter's C_d, which reads the round's context as the
planner prices it (the drafter attends to its cached context); the MTP layer's C_d(s, k, b)
has no context axis.
"""
from __future__ import annotations

import numpy as np
import torch

from simtree.drafters import MARGINAL_TOPK
from simtree.errors import SimtreeError
from simtree.planning.allocation import PRICE_MEMORY_ROUNDS

from .drafting import RoundShape

__all__ = ["DeviceAllocation", "CONTEXT_GRID", "draft_cost_us", "drafter_cost"]

CONTEXT_GRID = 65   # contexts at which C_v is tabulated, 0 .. max_len evenly


def drafter_cost(costs, family: str):
    """The bundle's C_d of a block-drafter ``family`` (:class:`simtree.costs.model.DrafterCostModel`),
    or a one-line error where it has none."""
    getter = getattr(costs, "drafter", None)
    if getter is None:
        raise SimtreeError(f"the cost bundle has no cost for drafter {family!r} (drafters with costs: none)")
    return getter(family)


def draft_cost_us(costs, rs: RoundShape, batch_size: int, context_len):
    """C_d of one round of shape ``rs`` for the batch at ``context_len`` (a number: a float; an
    array: one C_d each): the MTP layer's C_d(s, k, b), the same at every context, or the block
    drafter's over its own axes and the context (block: tree nodes, block length; tfm: tree
    nodes, adapter steps; dspark: candidates kept, block length), as the planner prices it."""
    scalar = np.ndim(context_len) == 0
    if not rs.block_drafter:
        s, k = rs.spec.draft_shape()
        cost = float(costs.draft.predict(s, k, batch_size))
        return cost if scalar else np.full(np.shape(context_len), cost)
    model = drafter_cost(costs, rs.drafter)
    L = model.check_block_len(rs.num_steps)
    ctx = float(context_len) if scalar else np.asarray(context_len, np.float64)
    if rs.drafter == "block":
        cost = model.predict(rs.budget, L, batch_size, ctx)
    elif rs.drafter == "tfm":
        cost = model.predict(rs.budget, max(1, -(-(rs.budget - 1) // rs.width)), batch_size, ctx)
    else:
        cost = model.predict(MARGINAL_TOPK, L, batch_size, ctx)    # DSpark drafts its top-K per position
    return float(cost) if scalar else np.broadcast_to(np.asarray(cost, np.float64), np.shape(ctx)).copy()


class DeviceAllocation:
    def __init__(self, costs, rs: RoundShape, batch_size: int, max_len: int, device):
        if costs is None:
            raise SimtreeError(f"mode {rs.spec.mode} needs a cost model (--costs): it weighs tree size against verify "
                               "cost")
        if rs.alloc not in ("cost_aware", "batch_alloc"):
            raise SimtreeError(f"round shape {rs.name} has no per-round allocation")
        B, m = int(batch_size), max(min(rs.tree_nodes - 1, rs.candidates), 0)
        self.B, self.m, self.priced = B, m, rs.alloc == "cost_aware"
        nodes = 1.0 + np.arange(B * m + 1, dtype=np.float64) / B
        self.ctx_step = max(float(max_len), 1.0) / (CONTEXT_GRID - 1)
        ctx = np.arange(CONTEXT_GRID, dtype=np.float64) * self.ctx_step
        table = np.asarray(costs.verify.predict(nodes[None, :], ctx[:, None], B), np.float64)
        table = np.broadcast_to(table, (CONTEXT_GRID, nodes.size))
        draft = draft_cost_us(costs, rs, B, ctx)
        if not (table.min() > 0 and table.max() < np.inf):     # NaN fails both comparisons
            raise SimtreeError("cost model returned a NaN, infinite or non-positive verify cost")
        if not (draft.min() >= 0 and draft.max() < np.inf):
            raise SimtreeError("cost model returned a NaN, infinite or negative draft cost")
        self.verify_us = torch.tensor(np.array(table), dtype=torch.float64, device=device)
        self.draft_us = torch.tensor(draft[:, None], dtype=torch.float64, device=device)   # [grid, 1]
        self.price = torch.zeros(2, dtype=torch.float64, device=device)   # tokens, time_us (RunningPrice)
        self.round_us = torch.zeros((), dtype=torch.float64, device=device)
        self._steps = torch.arange(B * m, device=device)

    def reset(self) -> None:
        self.price.zero_()

    def verify_cost(self, context_len: torch.Tensor) -> torch.Tensor:
        """float64 [B m + 1]: C_v(1 + K/b, l, b) for K = 0..B m at the context ``l`` (a 0-d tensor)."""
        return self._at_context(self.verify_us, context_len)

    def draft_cost(self, context_len: torch.Tensor) -> torch.Tensor:
        """float64 []: the round's C_d at the context ``l`` (a 0-d tensor)."""
        return self._at_context(self.draft_us, context_len)[0]

    def _at_context(self, table: torch.Tensor, context_len: torch.Tensor) -> torch.Tensor:
        """``table``'s rows (one per context of the grid) interpolated linearly at ``context_len``."""
        x = (context_len.double() / self.ctx_step).clamp(0, CONTEXT_GRID - 1)
        lo = x.floor().clamp(max=CONTEXT_GRID - 2).long().reshape(1)
        frac = x - lo[0]
        # index_select, not table[lo]: a 0-d index tensor is read on the host (a sync that
        # CUDA-graph capture refuses)
        rows = torch.index_select(table, 0, torch.cat([lo, lo + 1]))
        return rows[0] * (1 - frac) + rows[1] * frac

    def allocate(self, survival: torch.Tensor, context_len: torch.Tensor) -> torch.Tensor:
        """int64 [B]: extra nodes (after the root) each sequence verifies this round."""
        probs = survival.double().reshape(-1)
        order = torch.sort(probs, descending=True, stable=True).indices
        owner = order // max(self.m, 1)
        gain = torch.cat([probs.new_zeros(1), torch.cumsum(probs[order], 0)])
        cost, draft = self.verify_cost(context_len), self.draft_cost(context_len)
        best = torch.argmax((self.B + gain) / (draft + cost))        # batch_alloc's rule
        if self.priced:   # at the run's price, once it has one
            tokens, time_us = self.price[0], self.price[1]
            priced = torch.argmax(gain - tokens / time_us.clamp(min=1e-300) * cost)
            best = torch.where(time_us > 0, priced, best)
        self.round_us.copy_(draft + cost.gather(0, best.reshape(1))[0])   # no host read of best
        extra = torch.zeros(self.B, dtype=torch.int64, device=probs.device)
        return extra.index_add_(0, owner, (self._steps < best).long())

    def update(self, gained_tokens: torch.Tensor) -> None:
        """cost_aware: the round's gained tokens (the batch's) and predicted time move the price."""
        if self.priced:
            keep = 1.0 - 1.0 / PRICE_MEMORY_ROUNDS
            self.price.mul_(keep)
            self.price[0] += gained_tokens.double()
            self.price[1] += self.round_us
