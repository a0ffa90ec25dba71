"""Draft-tree builders: pure functions, numbers in, :class:`DraftTree` out.

Budget convention: ``budget`` D counts the nodes INCLUDING the root (SGLang's
``--speculative-num-draft-tokens``), so a tree of budget D verifies D tokens.

- :func:`linear_tree` - a chain (k = 1).
- :func:`eagle_tree` - SGLang EAGLE: ``num_steps`` rounds of top-k expansion of a frontier
  kept by cumulative draft log-prob, then the best D-1 generated nodes (``eagle_name`` =
  "s4_k2_d5").
- :func:`eagle_tree_positional` - the same tree when the drafter's probabilities depend only
  on depth and rank (numbers in: ``[depth, rank]`` draft probabilities).
- :func:`best_first_tree` - DDTree: from per-position top-K marginals of a block drafter,
  the D-1 nodes of highest prefix probability, grown with a heap.
- :func:`batched_best_first_tree` - the same heap popped ``width`` nodes per step.
- :func:`cost_aware_tree` - CaDDTree: the best-first prefix maximising (1 + Phi) / (C_d + C_v(|T|)).
- :func:`best_first_order` - the best-first order + prefix probabilities, computed once so
  that any budget's tree is a prefix of it (planner and simulator reuse it).
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import numpy as np

from simtree.errors import SimtreeError, check_whole
from simtree.probs import check_prob_rows
from simtree.trees.tree import DraftTree

__all__ = ["linear_tree", "eagle_tree", "eagle_tree_positional", "eagle_name", "parse_eagle_name", "eagle_max_nodes", "BestFirstOrder",
           "best_first_order", "best_first_tree", "batched_best_first_tree",
           "cost_aware_budget", "cost_aware_tree"]

# Below this budget the Python heap beats the per-level numpy beam (about 2 us per node
# against ~60 us + ~30 us per depth level on a CPU core).
_HEAP_MAX_BUDGET = 40


# ---- linear --------------------------------------------------------------------------------
def linear_tree(tokens: Sequence[int], log_probs: Sequence[float] | None = None) -> DraftTree:
    """A chain: ``tokens[0]`` is the root, ``tokens[i]`` the i-th draft token. Shapes [D]."""
    tokens = np.asarray(tokens).reshape(-1)
    return DraftTree.chain(tokens.shape[0], tokens, log_probs)


# ---- EAGLE ---------------------------------------------------------------------------------
_EAGLE_NAME = re.compile(r"^s(\d+)_k(\d+)_d(\d+)$")


def eagle_name(num_steps: int, topk: int, budget: int) -> str:
    """``eagle_name(4, 2, 5) == "s4_k2_d5"``."""
    return f"s{int(num_steps)}_k{int(topk)}_d{int(budget)}"


def parse_eagle_name(name: str) -> tuple[int, int, int]:
    """``"s4_k2_d5" -> (4, 2, 5)``; SimtreeError on anything else."""
    m = _EAGLE_NAME.match(str(name).strip())
    if not m:
        raise SimtreeError(f"bad EAGLE tree name {name!r}: expected 's<steps>_k<topk>_d<budget>', e.g. 's4_k2_d5'")
    s, k, d = (int(g) for g in m.groups())
    if s < 1 or k < 1 or d < 1:
        raise SimtreeError(f"bad EAGLE tree name {name!r}: steps, topk and budget must be >= 1")
    return s, k, d


def eagle_max_nodes(num_steps: int, topk: int) -> int:
    """Nodes an EAGLE draft generates, root included: 1 + k + (s-1) k^2."""
    return 1 + topk + (num_steps - 1) * topk * topk


Propose = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _call_propose(propose: Propose, parents, tokens, frontier, topk):
    out_tokens, out_logp = propose(parents.copy(), tokens.copy(), frontier.copy())
    out_tokens, out_logp = np.asarray(out_tokens), np.asarray(out_logp, np.float64)
    want = (frontier.shape[0], topk)
    if out_tokens.shape != want or out_logp.shape != want:
        raise SimtreeError(f"drafter returned tokens {out_tokens.shape} and log-probs {out_logp.shape}, "
                           f"expected {want} (frontier x topk)")
    if not np.all(np.isfinite(out_logp)) or np.any(out_logp > 1e-6):
        raise SimtreeError("drafter returned a log-prob that is NaN, infinite or > 0")
    return out_tokens.astype(np.int64), np.minimum(out_logp, 0.0)


def eagle_tree(propose: Propose, num_steps: int, topk: int, budget: int, root_token: int = 0) -> DraftTree:
    """SGLang-style EAGLE tree.

    Step 1 expands the root into its top-k children; every later step expands the frontier
    (the k best nodes of the previous step by cumulative log-prob) into k children each and
    keeps the best k of those k*k as the next frontier.  All 1 + k + (s-1)k^2 generated nodes
    compete; the D-1 best non-root nodes by cumulative log-prob are kept (ties: earlier
    generated first, so a parent - whose score is >= its child's - always outranks it) and
    renumbered in generation order, which is topological (depth by depth).

    ``propose(parents [m], tokens [m], frontier [f]) -> (tokens [f, k], log_probs [f, k])``
    gets the generated nodes so far (generation ids) and returns each frontier node's
    k candidate tokens with their log-probs given that node's path.
    """
    num_steps, topk, budget = (check_whole(v, name, 1) for v, name in
                               ((num_steps, "num_steps"), (topk, "topk"), (budget, "budget")))
    if budget > eagle_max_nodes(num_steps, topk):
        raise SimtreeError(f"budget {budget} exceeds the {eagle_max_nodes(num_steps, topk)} nodes that "
                           f"{num_steps} steps of top-{topk} generate (1 + k + (s-1)k^2)")
    parents = np.array([-1], np.int64)
    tokens = np.array([int(root_token)], np.int64)
    logp = np.zeros(1)
    score = np.zeros(1)  # cumulative log-prob = EAGLE draft score
    frontier = np.array([0], np.int64)
    for _ in range(num_steps):
        new_tok, new_logp = _call_propose(propose, parents, tokens, frontier, topk)
        start = parents.shape[0]
        cand_parent = np.repeat(frontier, topk)
        cand_score = (score[frontier][:, None] + new_logp).reshape(-1)
        parents = np.concatenate([parents, cand_parent])
        tokens = np.concatenate([tokens, new_tok.reshape(-1)])
        logp = np.concatenate([logp, new_logp.reshape(-1)])
        score = np.concatenate([score, cand_score])
        frontier = start + np.argsort(-cand_score, kind="stable")[:topk]
    keep = np.sort(np.argsort(-score[1:], kind="stable")[:budget - 1] + 1)
    return DraftTree(parents, tokens, logp).subtree(np.concatenate([[0], keep]))


def eagle_tree_positional(draft_probs, num_steps: int, topk: int, budget: int, root_token: int = 0) -> DraftTree:
    """:func:`eagle_tree` for a positional drafter: every node at depth d proposes the ranks
    0..topk-1 (their token ids) with draft probabilities ``draft_probs[d, :topk]`` (float
    [P, K], rows sum <= 1; depths beyond P repeat the last row, ranks beyond K have prob 0).

    Scores are the running minimum along the rank, so that sibling order by score is the rank
    order even where a row is not monotone in rank (a rank-r node is always the r-th sibling,
    as the positional acceptance tables count it).
    """
    probs = np.asarray(draft_probs, np.float64)
    if probs.ndim != 2 or probs.size == 0:
        raise SimtreeError(f"draft probs must be a non-empty [depth, rank] array, got shape {probs.shape}")
    check_prob_rows(probs, "draft probs", axis=1)
    topk = check_whole(topk, "topk", 1)
    probs = np.minimum.accumulate(probs, axis=1)
    probs = np.hstack([probs, np.zeros((probs.shape[0], max(topk - probs.shape[1], 0)))])[:, :topk]
    scores = np.log(np.maximum(probs, 1e-300))
    ranks = np.arange(topk, dtype=np.int64)

    def propose(parents, tokens, frontier):
        # step t's frontier lies at depth t (eagle_tree expands one level per step)
        depth, node = 0, int(frontier[0])
        while node > 0:
            node, depth = int(parents[node]), depth + 1
        row = scores[min(depth, scores.shape[0] - 1)]
        return np.tile(ranks, (frontier.shape[0], 1)), np.tile(row, (frontier.shape[0], 1))
    return eagle_tree(propose, num_steps, topk, budget, root_token)


# ---- best-first (DDTree) -------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class BestFirstOrder:
    """Nodes in best-first (pop) order; every prefix of length n is the budget-n tree.

    parents int64 [n]   parent in this order (-1 for the root, node 0)
    tokens  int64 [n]   drafted token (root_token for the root)
    probs   float64 [n] the chosen marginal prob of each node (1 for the root)
    prefix_probs float64 [n]  product of ``probs`` along the path; non-increasing after the root
    depth, rank int64 [n]     depth (root 0) and rank within its position's top-K list
    """

    parents: np.ndarray
    tokens: np.ndarray
    probs: np.ndarray
    prefix_probs: np.ndarray
    depth: np.ndarray
    rank: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    @cached_property
    def cum_phi(self) -> np.ndarray:
        """float64 [n]: Phi of the budget-(i+1) tree = sum of prefix probs of its non-root nodes."""
        return np.cumsum(self.prefix_probs) - 1.0

    def tree(self, budget: int | None = None) -> DraftTree:
        n = self.num_nodes if budget is None else min(check_whole(budget, "budget", 1), self.num_nodes)
        # log(0) is not a valid draft score: a zero-probability pick gets log(tiny), about -708
        logp = np.log(np.maximum(self.probs[:n], np.finfo(np.float64).tiny))
        return DraftTree(self.parents[:n], self.tokens[:n], logp)


def _check_marginals(marginal_tokens, marginal_probs) -> tuple[np.ndarray, np.ndarray]:
    """Validate [P, K] marginals; return them sorted by prob desc per position (stable)."""
    try:
        probs = np.asarray(marginal_probs, np.float64)
        toks = np.asarray(marginal_tokens)
    except (TypeError, ValueError) as exc:
        raise SimtreeError(f"marginals are not numeric arrays ({exc})") from None
    if probs.ndim != 2 or probs.shape != toks.shape or probs.size == 0:
        raise SimtreeError(f"marginal tokens {toks.shape} and probs {probs.shape} must be equal, "
                           "non-empty [positions, topK] arrays")
    check_prob_rows(probs, "marginal probs", axis=1)  # rows: disjoint tokens, sum <= 1
    if toks.dtype.kind not in "iu":
        raise SimtreeError(f"marginal tokens must be integers, got dtype {toks.dtype}")
    toks = toks.astype(np.int64)
    if np.any(probs[:, 1:] > probs[:, :-1]):
        order = np.argsort(-probs, axis=1, kind="stable")
        toks, probs = np.take_along_axis(toks, order, 1), np.take_along_axis(probs, order, 1)
    return toks, np.minimum(probs, 1.0)


def _grow(toks, probs, budget: int, width: int, root_token: int):
    """Heap growth (the batched builder); returns (BestFirstOrder, steps).

    Keys (-prefix_prob, depth, parent's pop index within its depth, rank) are a total order
    shared with :func:`_order_by_levels`.  Popping a node pushes its next sibling at once
    (same parent, rank + 1: already known from the same marginal) and its first child
    (depth + 1, rank 0) only after the step's ``width`` pops, so one step never stacks a node
    on another node of the same step.
    """
    P, K = probs.shape
    plist, tlist = probs.tolist(), toks.tolist()
    parents, tokens, chosen, prefix, depth, rank = [-1], [int(root_token)], [1.0], [1.0], [0], [0]
    level_index, popped_at = [0], [0] * (P + 1)
    heap = [(-plist[0][0], 1, 0, 0, 0)]  # (-prefix, depth, parent's level index, rank, parent)
    steps = 0
    while heap and len(parents) < budget:
        steps += 1
        deferred = []
        for _ in range(min(width, budget - len(parents))):
            if not heap:
                break
            neg, d, plevel, r, par = heapq.heappop(heap)
            node = len(parents)
            parents.append(par), tokens.append(tlist[d - 1][r]), chosen.append(plist[d - 1][r])
            prefix.append(-neg), depth.append(d), rank.append(r)
            level_index.append(popped_at[d])
            popped_at[d] += 1
            if r + 1 < K:
                heapq.heappush(heap, (-prefix[par] * plist[d - 1][r + 1], d, plevel, r + 1, par))
            if d < P:
                deferred.append((neg * plist[d][0], d + 1, level_index[node], 0, node))
        for entry in deferred:
            heapq.heappush(heap, entry)
    arr = lambda x, t=np.int64: np.asarray(x, t)  # noqa: E731
    order = BestFirstOrder(arr(parents), arr(tokens), arr(chosen, np.float64), arr(prefix, np.float64),
                           arr(depth), arr(rank))
    return order, steps


def _top_stable(values: np.ndarray, idx: np.ndarray, n: int) -> np.ndarray:
    """The n entries of ``idx`` with the largest ``values``, sorted desc; ties keep idx order.

    A partition first (O(m)) so that the stable sort only sees about n entries.
    """
    v = values[idx]
    if idx.size > n:
        cut = np.partition(v, v.size - n)[v.size - n]  # the n-th largest value
        above, tied = v > cut, np.flatnonzero(v == cut)
        chosen = above.copy()
        chosen[tied[: n - int(above.sum())]] = True  # lowest-index ties fill up to n
        idx, v = idx[chosen], v[chosen]
    return idx[np.argsort(-v, kind="stable")]


def _order_by_levels(toks, probs, budget: int, root_token: int) -> BestFirstOrder:
    """Vectorised best-first order: a beam of ``budget - 1`` per depth, merged by key.

    The best N = budget-1 nodes restricted to depth d are among the best N children of the
    best N nodes of depth d-1, so a per-level beam of N loses nothing; a candidate below the
    N-th best prefix prob seen so far (tau) can never enter, which cuts deep levels short.
    Key (-prefix_prob, depth, index within its level) as in :func:`_grow`.
    """
    P, K = probs.shape
    N = budget - 1
    lv_prob, lv_parent, lv_rank = [np.ones(1)], [np.full(1, -1)], [np.zeros(1, np.int64)]
    seen, tau = np.empty(0), 0.0
    for d in range(P):
        cand = (lv_prob[-1][:, None] * probs[d]).ravel()
        idx = np.flatnonzero(cand >= tau) if tau > 0 else np.arange(cand.size)
        if idx.size == 0 or N == 0:
            break
        keep = _top_stable(cand, idx, N)
        lv_prob.append(cand[keep]), lv_parent.append(keep // K), lv_rank.append(keep % K)
        seen = np.concatenate([seen, cand[keep]])
        if seen.size >= N:
            tau = np.partition(seen, seen.size - N)[seen.size - N]
    sizes = np.array([p.size for p in lv_prob])
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    prob = np.concatenate(lv_prob)
    depth = np.repeat(np.arange(sizes.size), sizes)
    within = np.arange(prob.size) - np.repeat(start, sizes)
    order = np.lexsort((within, depth, -prob))[:budget]
    position = np.full(prob.size, -1, np.int64)
    position[order] = np.arange(order.size)
    parent_flat = np.concatenate([[-1]] + [s + p for s, p in zip(start[:-1], lv_parent[1:])])
    parents = np.where(parent_flat[order] >= 0, position[np.maximum(parent_flat[order], 0)], -1)
    rank = np.concatenate(lv_rank)[order]
    d = depth[order]
    row = np.maximum(d - 1, 0)
    tokens = np.where(d > 0, toks[row, rank], int(root_token))
    chosen = np.where(d > 0, probs[row, rank], 1.0)
    return BestFirstOrder(parents, tokens, chosen, prob[order], d, rank)


def best_first_order(marginal_tokens, marginal_probs, budget: int, root_token: int = 0) -> BestFirstOrder:
    """Best-first order of up to ``budget`` nodes (root included) from [P, K] marginals.

    Node prefix probability = product of the chosen marginal probs along its path; the order
    pops the highest first, so every prefix of it is the best ancestor-closed tree of that
    size.  Fewer than ``budget`` nodes only when all P levels of top-K are exhausted.
    """
    toks, probs = _check_marginals(marginal_tokens, marginal_probs)
    budget = check_whole(budget, "budget", 1)
    if budget <= _HEAP_MAX_BUDGET:  # same order either way; the heap is cheaper when small
        return _grow(toks, probs, budget, 1, root_token)[0]
    return _order_by_levels(toks, probs, budget, root_token)


def best_first_tree(marginal_tokens, marginal_probs, budget: int, root_token: int = 0) -> DraftTree:
    """DDTree: the ``budget``-node tree of highest prefix probabilities (log_probs = log of the
    chosen marginal probs). Inputs [P, K]; sorted per position here if they are not."""
    return best_first_order(marginal_tokens, marginal_probs, budget, root_token).tree()


def batched_best_first_tree(marginal_tokens, marginal_probs, budget: int, width: int,
                            root_token: int = 0) -> tuple[DraftTree, int]:
    """Best-first with ``width`` heap pops per sequential step; returns (tree, steps).

    Steps = ceil((budget-1)/width) whenever every step finds ``width`` candidates (the root's
    first step only has the K children of the root). width = 1 gives :func:`best_first_tree`.
    """
    toks, probs = _check_marginals(marginal_tokens, marginal_probs)
    order, steps = _grow(toks, probs, check_whole(budget, "budget", 1), check_whole(width, "width", 1), root_token)
    return order.tree(), steps


# ---- cost-aware stop (CaDDTree) ------------------------------------------------------------
def _verify_costs(verify_cost: Callable, n: np.ndarray) -> np.ndarray:
    try:
        out = np.asarray(verify_cost(n), np.float64)
        if out.shape != n.shape:
            raise ValueError("not vectorised")
    except (TypeError, ValueError):
        out = np.array([float(verify_cost(int(v))) for v in n])
    return out


def cost_aware_budget(order: BestFirstOrder, verify_cost: Callable, draft_cost_us: float,
                      max_budget: int | None = None, convex: bool = False) -> int:
    """The budget n (root included) maximising (1 + Phi(n)) / (C_d + C_v(n)) over 1..max_budget.

    Phi(n) is concave in n (best-first adds non-increasing prefix probs); when C_v is convex and
    non-decreasing the objective is unimodal, so the first n where it stops rising is the argmax
    (``convex=True``, only for a caller that knows its C_v is convex).  A C_v that is not convex in
    n (MoE expert saturation: flat once all experts are read; a fitted bundle's measured-cell
    corrections, :mod:`simtree.costs.verify_cells`) can make it rise again after a dip, so the
    default, ``convex=False``, takes the global argmax (the smallest n on ties): the same n as the
    first stop where C_v is convex, at the same cost (one vectorised pass over n = 1..max_budget
    either way).
    """
    m = order.num_nodes if max_budget is None else min(check_whole(max_budget, "max_budget", 1), order.num_nodes)
    n = np.arange(1, m + 1)
    cost = float(draft_cost_us) + _verify_costs(verify_cost, n)
    if not (cost.min() > 0 and cost.max() < np.inf):  # NaN fails both comparisons
        raise SimtreeError("draft + verify cost must be finite and > 0 us for every budget (got NaN, inf or <= 0)")
    objective = (1.0 + order.cum_phi[:m]) / cost
    if not convex:
        return int(np.argmax(objective)) + 1
    if m == 1:
        return 1
    falls = objective[1:] <= objective[:-1]
    first = int(falls.argmax())
    return first + 1 if falls[first] else m


def cost_aware_tree(marginal_tokens, marginal_probs, verify_cost: Callable, draft_cost_us: float,
                    max_budget: int, root_token: int = 0, convex: bool = False) -> DraftTree:
    """CaDDTree: the best-first prefix T maximising (1 + Phi(T)) / (C_d + C_v(|T|)).

    ``verify_cost(n) -> us`` for n nodes including the root (an int array is tried first);
    The global argmax by default; ``convex=True`` the first stop (:func:`cost_aware_budget`).
    """
    order = best_first_order(marginal_tokens, marginal_probs, max_budget, root_token)
    return order.tree(cost_aware_budget(order, verify_cost, draft_cost_us, convex=convex))
