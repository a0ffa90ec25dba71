"""Speculative decoding engine (greedy, lossless) over a batch of ragged prompts.

One round for the B live sequences (root = each sequence's last token, not yet in the cache):

    draft  -> one tree per sequence from the policy (a PolicySpec, contract 3); stored
              depth-first, larger subtree first, where the GDN tree kernel saves more than the
              host pays for it (one sequence, > 64 nodes: ``kernels.gdn.depth_first_pays``;
              attention and acceptance do not depend on the order)
    verify -> one target ``verify`` of the whole TreeBatch; target_next = argmax per node
    accept -> ``greedy_accept_batch``; each sequence gains num_accepted + 1 tokens (the bonus)
    commit -> target cache: accepted path only (KV rows, GDN state, conv state); the draft
              cache catches up on the same path (timed as drafting)

Policies (:mod:`simtree.planning.modes`): NoneParams (root only: plain decoding, one fused
decode step per round: ``HybridLM.step``, whose GDN layers read and write their state once),
LinearParams, EagleParams, BestFirstParams, CostAwareParams, BatchAllocParams; the marginal
modes draft a top-1 chain of ``draft_depth`` steps and keep the top-4 of each step's
distribution as that position's marginal (see drafter.py), as simtree.planning.simulate assumes.
cost_aware and batch_alloc need cost models (:class:`simtree.costs.model.Costs`:
``verify.predict(n, l, b)`` us for the whole batch's verify, ``draft.predict(s, k, b)``) and
decide each round's nodes across the batch with the simulator's own rules
(:mod:`simtree.planning.allocation`): batch_alloc at the round's own best rate, cost_aware at
the run's price of verify time (the tokens its recent rounds gained per us of their predicted
time), each node weighed against its marginal cost given the other sequences' trees.

``tokens_produced`` counts every token the decode rounds produce: all B sequences decode every
round until the slowest has ``max_new_tokens`` (a static batch), so sequences that are done
keep producing tokens that are then cut from the outputs.  What a user receives is ``outputs``
(max_new_tokens per prompt, the first from the prefill); each round records how many
sequences were still short of max_new_tokens when it began (``live``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from simtree.costs.model import Costs
from simtree.errors import SimtreeError, check_int
from simtree.planning.modes import (BatchAllocParams, BestFirstParams, CostAwareParams, EagleParams, LinearParams,
                                    NoneParams, PolicySpec)
from simtree.planning.allocation import RunningPrice, allocate_round, batch_allocation
from simtree.runtime.drafter import Drafter
from simtree.runtime.model import HybridLM
from simtree.trees.builders import batched_best_first_tree, best_first_order, eagle_max_nodes, linear_tree
from simtree.trees.greedy import greedy_accept_batch
from simtree.trees.tree import DraftTree, TreeBatch

__all__ = ["RoundStats", "GenerationResult", "SpecEngine", "greedy_decode", "check_spec", "draft_extent",
           "MAX_DRAFT_NODES"]

MARGINAL_TOPK = 4  # candidates per position kept from the drafter's distribution
TRACE_TOPK = 8     # linear runs: candidates per drafted position logged in traces (the chain is their top-1)
MAX_DRAFT_NODES = 8192  # drafted nodes per sequence per round: beyond, the draft verify's mask explodes


def draft_extent(spec: PolicySpec) -> tuple[int, int]:
    """(nodes the drafter scores per sequence per round, deepest drafted position) of a spec:
    the drafted positions are the cost model's draft steps (``PolicySpec.draft_shape``)."""
    if isinstance(spec, NoneParams):
        return 0, 0
    depth, topk = spec.draft_shape()
    return (eagle_max_nodes(depth, topk) if isinstance(spec, EagleParams) else depth + 1), depth


def check_spec(spec) -> PolicySpec:
    """``spec`` when it is a :class:`PolicySpec` (validated when it was built, so the engine
    runs exactly the policy the planner predicted); a one-line SimtreeError otherwise."""
    if not isinstance(spec, PolicySpec):
        raise SimtreeError(f"a decoding policy is a PolicySpec (NoneParams, LinearParams, EagleParams, ...), "
                           f"got {type(spec).__name__}")
    return spec


@dataclass
class RoundStats:
    draft_us: float
    verify_us: float
    commit_us: float
    nodes: list          # tree size per sequence (root included)
    accepted: list       # accepted draft tokens per sequence (bonus excluded)
    live: int = 0        # sequences still short of max_new_tokens when the round began

    @property
    def round_us(self) -> float:
        return self.draft_us + self.verify_us + self.commit_us


@dataclass
class GenerationResult:
    outputs: list        # per prompt: the first max_new_tokens generated token ids
    rounds: list         # RoundStats per decode round
    prefill_us: float
    tokens_produced: int  # all tokens the decode rounds produced (before cutting)


def greedy_decode(model: HybridLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with the sequential path (``step``): the lossless reference."""
    if not prompt:
        raise SimtreeError("prompt is empty: it needs at least one token")
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", 0)
    cache = model.new_cache(1, len(prompt) + max_new_tokens + 1)
    dev = cache.lengths.device
    for t in prompt:
        logits = model.step(torch.tensor([t], device=dev), cache)
    out = []
    for _ in range(max_new_tokens):
        out.append(int(logits[0].argmax()))
        logits = model.step(torch.tensor([out[-1]], device=dev), cache)
    return out


def _sync(model: HybridLM) -> None:
    """Wait for queued GPU work so perf_counter brackets it (no-op on CPU)."""
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.synchronize()


class SpecEngine:
    """``SpecEngine(target, draft, costs=None).generate(prompts, max_new_tokens, spec)``."""

    def __init__(self, target: HybridLM, draft: HybridLM | None = None, costs: Costs | None = None):
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise SimtreeError(f"draft vocab_size {draft.config.vocab_size} != target vocab_size "
                               f"{target.config.vocab_size}: speculative decoding needs one vocabulary")
        self.target, self.draft, self.costs = target, draft, costs
        self._topk = None  # the round's drafter top-k (tokens, probs) [B, P, K] along its chain, for traces
        self._price = RunningPrice()   # cost_aware's price of verify time, per generate()

    # ---- tree construction per mode ------------------------------------------------------
    def _trees(self, spec: PolicySpec, drafter: Drafter | None, roots, ctx_len: float) -> list[DraftTree]:
        B = len(roots)
        if isinstance(spec, EagleParams):
            return drafter.eagle_trees(roots, spec.num_steps, spec.topk, spec.budget)
        depth = spec.draft_shape()[0]   # the draft steps the planner costs
        if depth == 0:   # nothing drafted: the root alone
            return [DraftTree.chain(1, [r]) for r in roots]
        linear = isinstance(spec, LinearParams)
        k = min(TRACE_TOPK, self.draft.config.vocab_size) if linear else MARGINAL_TOPK
        toks, probs = drafter.greedy_marginals(roots, depth, k)
        self._topk = (toks, probs)
        if linear:
            return [linear_tree([r, *toks[b, :, 0]], [0.0, *np.log(probs[b, :, 0])]) for b, r in enumerate(roots)]
        if isinstance(spec, BestFirstParams):
            return [batched_best_first_tree(toks[b], probs[b], spec.budget, spec.width, r)[0]
                    for b, r in enumerate(roots)]
        costs = self._costs(spec)
        draft_us = float(costs.draft.predict(depth, 1, B))
        orders = [best_first_order(toks[b], probs[b], spec.max_nodes, r) for b, r in enumerate(roots)]
        survival = [o.prefix_probs[1:] for o in orders]
        verify = lambda n: costs.verify.predict(n, ctx_len, B)  # noqa: E731
        if isinstance(spec, CostAwareParams):
            extra = allocate_round(survival, verify, draft_us, B, self._price)
        else:
            assert isinstance(spec, BatchAllocParams)
            extra = batch_allocation(survival, np.ones(B), verify, draft_us, B)
        return [o.tree(1 + int(k)) for o, k in zip(orders, extra)]

    def _update_price(self, spec: PolicySpec, batch: TreeBatch, gained: int, ctx_len: float) -> None:
        """cost_aware: the round's gained tokens and predicted time (C_d + C_v of the trees it
        verified) move the run's price."""
        if isinstance(spec, CostAwareParams):
            costs, B = self.costs, batch.batch_size
            round_us = (float(costs.draft.predict(spec.draft_depth, 1, B))
                        + float(np.asarray(costs.verify.predict(batch.total_nodes / B, ctx_len, B), np.float64)))
            self._price.update(gained, round_us)

    def _costs(self, spec: PolicySpec) -> Costs:
        if self.costs is None:
            raise SimtreeError(f"mode {spec.mode} needs a cost model (--costs): "
                               "it weighs tree size against verify cost")
        return self.costs

    def check_fits(self, spec: PolicySpec) -> None:
        """One-line errors for policies these models cannot draft: top-k above the draft
        vocabulary, or more drafted nodes per round than MAX_DRAFT_NODES."""
        spec = check_spec(spec)
        if isinstance(spec, NoneParams) or self.draft is None:
            return
        vocab = self.draft.config.vocab_size
        if isinstance(spec, EagleParams) and spec.topk > vocab:
            raise SimtreeError(f"eagle topk {spec.topk} exceeds the draft model's vocabulary "
                               f"({vocab} tokens): use --topk <= {vocab}")
        nodes, _ = draft_extent(spec)
        if nodes > MAX_DRAFT_NODES:
            what = ("steps and top-k (1 + k + (s-1) k^2)" if isinstance(spec, EagleParams) else
                    "budget" if isinstance(spec, LinearParams) else "draft depth")
            raise SimtreeError(f"{spec.name} drafts {nodes} nodes per sequence per round, more than the "
                               f"{MAX_DRAFT_NODES} this runtime supports: lower its {what}")

    # ---- the decode loop -----------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, spec: PolicySpec, workload: str = "",
                 trace=None, progress=None, controller=None) -> GenerationResult:
        """Decode ``max_new_tokens`` greedy tokens for each prompt. ``trace``: an open
        :class:`simtree.runtime.trace.TraceWriter`; ``progress(done_tokens)``: a callback.
        ``controller`` (:class:`simtree.control.Controller`, or any object with its ``tiers``,
        ``choose`` and ``observe``): each round runs the tier it chooses instead of ``spec``
        (caches are sized for the widest of ``spec`` and its tiers)."""
        spec = check_spec(spec)
        if controller is not None:
            for tier in controller.tiers:
                self.check_fits(tier.spec)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise SimtreeError("every prompt needs at least one token")
        max_new_tokens = check_int(max_new_tokens, "max_new_tokens")
        specs = [spec] + ([] if controller is None else [t.spec for t in controller.tiers])
        speculates = any(not isinstance(sp, NoneParams) for sp in specs)
        if speculates and self.draft is None:
            raise SimtreeError(f"mode {spec.mode} needs a draft model")
        self.check_fits(spec)
        self._price = RunningPrice()
        B = len(prompts)
        widest = max(sp.max_nodes for sp in specs)
        # a sequence keeps decoding until the slowest reaches max_new_tokens, gaining at most
        # `widest` tokens per round: size the cache for max_new_tokens rounds of that
        max_len = max(map(len, prompts)) + widest * (max_new_tokens + 1) + 2
        cache = self.target.new_cache(B, max_len)
        # the drafter's cache also holds the deepest drafted position of a round on top
        draft_len = max_len + max(draft_extent(sp)[1] for sp in specs) + 1
        t0 = time.perf_counter()
        outs = [[int(t)] for t in self.target.prefill(cache, prompts).argmax(-1)]
        drafter = None
        if speculates:
            drafter = Drafter(self.draft, B, draft_len)
            drafter.prefill(prompts)
        prefill_us = (time.perf_counter() - t0) * 1e6
        rounds, produced = [], 0
        while min(map(len, outs)) < max_new_tokens:
            roots = [o[-1] for o in outs]
            ctx_lens = cache.lengths.tolist()
            ctx = float(np.mean(ctx_lens))
            t0 = time.perf_counter()
            self._topk = None
            tier = None if controller is None else controller.choose(len(roots), ctx_lens)
            spec_r = spec if tier is None else tier.spec
            batch = TreeBatch(self._trees(spec_r, drafter, roots, ctx))
            if self.target.prefers_depth_first(batch):   # the GDN kernel's fastest order
                batch = batch.depth_first()
            t1 = time.perf_counter()
            plain = batch.max_nodes == 1   # nothing drafted: one decode step, no tree
            if plain:   # the root is always accepted: the step advances the cache itself
                logits = self.target.step(torch.as_tensor(roots, device=cache.lengths.device), cache)
            else:
                logits, pend = self.target.verify(batch, cache, ctx_lens)   # lengths read once a round
            target_next = logits.argmax(-1).cpu().numpy()  # the host copy synchronises
            t2 = time.perf_counter()
            acc = greedy_accept_batch(batch, target_next)
            if tier is not None:
                controller.observe(tier, acc.num_accepted)
            if not plain:
                self.target.commit(cache, batch, pend, acc.last_node)
                _sync(self.target)
            t3 = time.perf_counter()
            paths = [[roots[b], *acc.result(b).accepted_tokens.tolist()] for b in range(B)]
            if drafter is not None:
                drafter.catch_up(paths)
                _sync(self.target)
            t4 = time.perf_counter()
            before = [len(o) for o in outs]
            for b in range(B):
                outs[b] += paths[b][1:] + [int(acc.bonus_tokens[b])]
            produced += int(acc.num_accepted.sum()) + B
            self._update_price(spec_r, batch, int(acc.num_accepted.sum()) + B, ctx)
            stats = RoundStats((t1 - t0 + t4 - t3) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6,
                               [t.num_nodes for t in batch.trees], acc.num_accepted.tolist(),
                               live=sum(n < max_new_tokens for n in before))
            rounds.append(stats)
            if trace is not None:
                trace.write_round(batch, acc, workload=workload, batch_size=B, round_index=len(rounds) - 1,
                                  mode=spec_r.mode, context_lens=ctx_lens, topk=self._topk)
            if progress is not None:
                progress(min(sum(min(len(o), max_new_tokens) for o in outs), B * max_new_tokens))
        return GenerationResult([o[:max_new_tokens] for o in outs], rounds, prefill_us, produced)
