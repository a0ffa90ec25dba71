"""Ready-made verify / commit steps at a given size, for benchmarks and the profiler.

    step = make_verify_step(cfg, "csa", batch_size=16, nodes_per_seq=8, context_len=65536,
                            tree_shape="random", device="cuda")
    step.verify()   # one layer's tree verify (device work only; index lists prebuilt)
    step.commit()   # accepted-path refresh of the longest root path (device work only)

Caches are random numbers (timing only).  ``tree_shape``: "linear" (a chain of n tokens, as
SGLang's MTP verify runs V4 today), "random" (random trees, at most 3 children per node) or
"eagle" (top-2 per step, the n best by depth-first order — a fixed, bushy shape).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from simtree.errors import SimtreeError
from simtree.trees.tree import DraftTree, TreeBatch

from .cache import V4Cache
from .commit import CommitPlan, apply_commit, plan_commit
from .config import V4AttnConfig
from .reference import V4Inputs, V4LayerWeights, random_inputs, random_layer_weights
from .verify import VerifyPlan, plan_verify, random_tree, tree_verify

__all__ = ["V4Step", "deepest_paths", "make_tree", "make_verify_step", "verify_bytes"]


def make_tree(n: int, shape: str, rng: np.random.Generator) -> DraftTree:
    """A draft tree of n nodes: "linear" | "random" | "eagle" (binary, breadth-first)."""
    if shape == "linear":
        return DraftTree.chain(n)
    if shape == "random":
        return random_tree(n, rng)
    if shape == "eagle":
        return DraftTree(np.array([-1] + [(i - 1) // 2 for i in range(1, n)]))
    raise SimtreeError(f"unknown tree shape {shape!r}; expected linear, random or eagle")


def deepest_paths(plan: VerifyPlan) -> list[list[int]]:
    """Root path (local ids) to each tree's deepest node, the lowest-numbered one among equals
    (= its deepest leaf of lowest index), from the plan's ancestor table: a few numpy passes
    for the whole batch instead of a per-tree ancestor table."""
    anc, depth, cu = plan.ancestors_host, plan.depth_host, plan.batch.cu_nodes
    deepest = np.maximum.reduceat(depth, cu[:-1])
    seq = np.repeat(np.arange(len(deepest)), np.diff(cu))
    hits = np.flatnonzero(depth == deepest[seq])
    node = hits[np.unique(seq[hits], return_index=True)[1]]   # first hit of every tree
    rows = (anc[node, ::-1] - cu[:-1, None]).tolist()          # root-most column first
    D = anc.shape[1]
    return [row[D - 1 - d:] for row, d in zip(rows, deepest.tolist())]


@dataclass
class V4Step:
    cfg: V4AttnConfig
    kind: str
    weights: V4LayerWeights
    cache: V4Cache
    inputs: V4Inputs
    plan: VerifyPlan
    commit_plan: CommitPlan
    verify: Callable[[], torch.Tensor]
    commit: Callable[[], None]
    accepted: list
    plan_ms: float = 0.0      # host time of plan_verify + plan_commit (index lists)


def make_verify_step(cfg: V4AttnConfig, kind: str, batch_size: int, nodes_per_seq: int,
                     context_len: int, tree_shape: str = "random", device="cuda",
                     dtype=torch.bfloat16, seed: int = 0, cache: V4Cache | None = None,
                     weights: V4LayerWeights | None = None, attention: str = "triton") -> V4Step:
    """Build a random cache (or reuse ``cache``), trees, inputs and both index plans."""
    rng = np.random.default_rng(seed)
    w = weights or random_layer_weights(cfg, kind, seed, torch.float32, device)
    if cache is None:
        cache = V4Cache.random(cfg, w, batch_size, context_len, context_len + 2 * nodes_per_seq + 8,
                               dtype=dtype, device=device, seed=seed)
    cache.lens[:] = context_len
    trees = TreeBatch(tuple(make_tree(nodes_per_seq, tree_shape, rng) for _ in range(batch_size)))
    gen = torch.Generator(device=device).manual_seed(seed)
    inp = random_inputs(cfg, trees.total_nodes, gen, dtype=torch.float32, device=device)
    inp = V4Inputs(inp.q.to(dtype), inp.kv.to(dtype), inp.x.to(dtype), inp.iq.to(dtype), inp.iw)
    t0 = time.perf_counter()
    plan = plan_verify(cache, trees, w, device=device)
    accepted = deepest_paths(plan)
    cplan = plan_commit(cache, w, plan, accepted, device=device)
    plan_ms = (time.perf_counter() - t0) * 1e3
    # commit replays read the scratch of one eager verify (not one made inside a CUDA graph)
    _, scratch = tree_verify(cache, w, inp, plan, attention=attention)

    def verify():
        return tree_verify(cache, w, inp, plan, attention=attention)[0]

    def commit():
        apply_commit(cache, scratch, cplan, sync_mirror=attention == "flashmla")

    return V4Step(cfg, kind, w, cache, inp, plan, cplan, verify, commit, accepted, plan_ms)


def verify_bytes(step: V4Step) -> int:
    """Bytes a verify must move at least: unique KV rows read, indexer keys scanned (CSA),
    compressor weights, q in / o out (the memory floor's numerator)."""
    cfg, cache, plan = step.cfg, step.cache, step.plan
    el = cache.window.pool.element_size()
    n = plan.batch.total_nodes
    total = 2 * n * cfg.num_heads * cfg.head_dim * step.inputs.q.element_size()
    win_rows = int(torch.unique(plan.win_idx[plan.win_idx >= 0]).numel())
    total += win_rows * cfg.head_dim * el
    if cache.ratio:
        lens = cache.lens
        if step.weights.indexer is None:
            total += int((lens // cache.ratio).sum()) * cfg.head_dim * el
        else:
            total += int((lens // cache.ratio).sum()) * cfg.indexer_dim * el  # indexer scan
            total += int(np.minimum(cfg.topk, lens // cache.ratio).sum()) * cfg.head_dim * el
        for p in (step.weights.comp, step.weights.indexer):
            if p is not None:
                total += 2 * p.wkv.numel() * p.wkv.element_size()
    return total
