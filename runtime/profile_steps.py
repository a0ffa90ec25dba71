"""Profiled steps of the runtime's own models (variant ``runtime_tiny``): what ``simtree run``
pays per round, timed the way its engine runs it, so a cost bundle fitted from these rows
predicts ``simtree run`` on the same machine (apples to apples).  The runtime owns them; the
profiler times them when `simtree profile` hands :func:`step_builders` to the sweep (a
:class:`~simtree.costs.steps.StepBuilder` per variant).

* ``model_verify_step``: the shipped target's verify of a :class:`TreeBatch` of b EAGLE-like
  trees of n nodes over a cache holding l random prompt tokens per sequence, plus what the
  engine books right after it: the host copy of the argmax, greedy acceptance and the
  accepted-path commit (a real round pays the commit; the engine times it as "commit").
  At n = 1 the engine drafts nothing and runs one fused decode step instead
  (``HybridLM.step``: no tree, no verify, no commit), so that point times that step, the
  argmax copy and the acceptance book-keeping.  The
  committed path is the first-child chain down to depth min(2, tree depth); the trees are
  rebuilt (fresh DraftTree objects, whose derived views are computed lazily) and the cache
  length reset before each repetition, so every repetition pays what a round pays at fixed l.
* ``draft_step`` (n = topk): one round of drafting as :class:`simtree.runtime.drafter.Drafter`
  does it on the shipped draft over context l: top-1 greedy chain of ``num_steps`` steps
  (topk 1: linear and the marginal modes) or ``num_steps`` batched EAGLE steps of top-k
  (``Drafter.eagle_trees``, budget min(1 + k + (s-1) k^2, 16)), each step one draft forward
  over all b partial trees; plus the draft cache's catch-up on an accepted path of
  1 + ceil(s / 2) tokens (the engine books catch-up as drafting).

Caches are prefilled once per (model, b, l) with random tokens and shared by the points of
that (b, l).  Weights: ``simtree/data/models/{target,draft}``, or the ``models_dir`` given to
:class:`RuntimeSteps` (kept in ``ctx.notes["runtime_models_dir"]``).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from simtree.costs.steps import Point, StepBuilder, StepContext, Unavailable, Workload, random_tree
from simtree.errors import SimtreeError

__all__ = ["RUNTIME_VARIANT", "RuntimeSteps", "step_builders", "runtime_workload", "check_runtime_variant"]

RUNTIME_VARIANT = "runtime_tiny"
_PROMPT_SEED = 12345


class RuntimeSteps:
    """The :class:`~simtree.costs.steps.StepBuilder` of variant ``runtime_tiny``: the shipped
    models (or those in ``models_dir``: target/ and draft/)."""

    def __init__(self, models_dir: str | Path | None = None):
        self.models_dir = models_dir

    def workload(self, ctx: StepContext, point: Point) -> Workload:
        if self.models_dir is not None:
            ctx.notes.setdefault("runtime_models_dir", self.models_dir)
        return runtime_workload(ctx, point)

    def check(self, ctx: StepContext, stage: str) -> str:
        if self.models_dir is not None:
            ctx.notes.setdefault("runtime_models_dir", self.models_dir)
        return check_runtime_variant(ctx, stage)


def step_builders(models_dir: str | Path | None = None) -> dict[str, StepBuilder]:
    """{variant: StepBuilder} of the runtime's steps, for ``run_sweep(..., builders=...)``."""
    return {RUNTIME_VARIANT: RuntimeSteps(models_dir)}


def _models(ctx: StepContext):
    """(target, draft) HybridLMs on ctx.device, loaded once per context."""
    if "runtime_models" not in ctx.notes:
        from simtree.runtime.loading import DEFAULT_MODELS_DIR, load_model

        root = Path(ctx.notes.get("runtime_models_dir") or DEFAULT_MODELS_DIR)
        ctx.notes["runtime_models"] = (load_model(root / "target").to(ctx.device).eval(),
                                       load_model(root / "draft").to(ctx.device).eval())
    return ctx.notes["runtime_models"]


def _prompts(model, b: int, l: int) -> list[list[int]]:
    rng = np.random.default_rng(_PROMPT_SEED + 7 * b + l)
    return rng.integers(0, min(model.config.vocab_size, 256), size=(b, l)).tolist()


def _target_cache(ctx, b: int, l: int):
    """A target cache of b sequences at context l (random tokens), shared per (b, l)."""
    key = ("target_cache", b, l)
    if key not in ctx.notes:
        target, _ = _models(ctx)
        cache = target.new_cache(b, l + 64)   # room for the largest tree + its commit
        target.prefill(cache, _prompts(target, b, l))
        ctx.notes[key] = cache
    return ctx.notes[key]


def _drafter(ctx, b: int, l: int):
    from simtree.runtime.drafter import Drafter

    key = ("drafter", b, l)
    if key not in ctx.notes:
        _, draft = _models(ctx)
        d = Drafter(draft, b, l + 64)
        d.prefill(_prompts(draft, b, l))
        ctx.notes[key] = d
    return ctx.notes[key]


def _random_trees(b: int, n: int, shape: str, vocab: int, seed: int):
    from simtree.trees.tree import DraftTree, TreeBatch

    rng = np.random.default_rng(seed)
    trees = []
    for _ in range(b):
        t = random_tree(n, "eagle" if shape in ("any", "eagle") else shape, rng)
        trees.append(DraftTree(t.parents, rng.integers(0, vocab, size=n)))
    return TreeBatch(trees)


def _verify_trees(ctx, b: int, n: int, shape: str, vocab: int):
    """The drafted trees a model_verify_step point verifies (seeded by the point), so a probe
    that times the same round another way (``scripts/check_verify_step_gpu.py``) gets them."""
    return _random_trees(b, n, shape, vocab, ctx.seed + 31 * b + n).trees


def _first_child_path_end(tree, max_depth: int = 2) -> int:
    node = 0
    for _ in range(max_depth):
        kids = np.flatnonzero(tree.parents == node)
        if kids.size == 0:
            break
        node = int(kids[0])
    return node


def _verify_step(ctx, p):
    from simtree.trees.greedy import greedy_accept_batch
    from simtree.trees.tree import DraftTree, TreeBatch

    target, _ = _models(ctx)
    b, n, l = p.batch_size, p.nodes_per_seq, p.context_len
    cache = _target_cache(ctx, b, l)
    base = cache.lengths.clone()
    proto = _verify_trees(ctx, b, n, p.tree_shape, target.config.vocab_size)
    if n == 1:   # the engine's plain round (``SpecEngine``: max_nodes == 1)
        roots = [int(t.tokens[0]) for t in proto]

        def plain():
            cache.lengths.copy_(base)
            batch = TreeBatch([DraftTree(t.parents, t.tokens) for t in proto])
            target_next = target.step(torch.as_tensor(roots, device=cache.lengths.device),
                                      cache).argmax(-1).cpu().numpy()
            greedy_accept_batch(batch, target_next)
        return plain, 0
    accepted = [_first_child_path_end(t) for t in proto]

    def step():
        cache.lengths.copy_(base)
        # fresh trees every repetition: DraftTree caches its derived views (masks, depths), and
        # the engine pays for them on every round's new trees inside verify and commit
        batch = TreeBatch([DraftTree(t.parents, t.tokens) for t in proto])
        logits, pend = target.verify(batch, cache)
        target_next = logits.argmax(-1).cpu().numpy()
        greedy_accept_batch(batch, target_next)          # booked with the commit by the engine
        target.commit(cache, batch, pend, accepted)
    return step, 0


def _draft_step(ctx, p):
    from simtree.trees.builders import eagle_max_nodes, linear_tree

    b, s, k, l = p.batch_size, max(p.num_steps, 1), max(p.topk, 1), p.context_len
    drafter = _drafter(ctx, b, l)
    base = drafter.cache.lengths.clone()
    rng = np.random.default_rng(ctx.seed + 17 * b + s)
    roots = rng.integers(0, 256, size=b).tolist()
    path_len = 1 + math.ceil(s / 2)
    paths = [[r, *rng.integers(0, 256, size=path_len - 1).tolist()] for r in roots]
    budget = min(eagle_max_nodes(s, k), 16)

    def step():
        drafter.cache.lengths.copy_(base)
        if k == 1:
            toks, probs = drafter.greedy_marginals(roots, s, 1)
            for i, r in enumerate(roots):
                linear_tree([r, *toks[i, :, 0]], [0.0, *np.log(probs[i, :, 0])])
        else:
            drafter.eagle_trees(roots, s, k, budget)
        drafter.catch_up(paths)
    return step, 0


def runtime_workload(ctx: StepContext, p: Point) -> Workload:
    """The :class:`Workload` of a ``runtime_tiny`` point (see the module docstring)."""
    if p.stage not in ("model_verify_step", "draft_step"):
        raise Unavailable(f"{RUNTIME_VARIANT} times model_verify_step and draft_step only, not {p.stage}")
    if p.context_len < 1:
        raise SimtreeError(f"{RUNTIME_VARIANT} needs context_len >= 1 (a prompt), got {p.context_len}")
    if p.stage == "model_verify_step":
        return Workload(lambda: _verify_step(ctx, p), eager=True)
    return Workload(lambda: _draft_step(ctx, p), eager=True)


def check_runtime_variant(ctx: StepContext, stage: str) -> str:
    """Tree verify of a chain == the sequential greedy path's logits (the lossless reference)."""
    target, draft = _models(ctx)
    model = target if stage == "model_verify_step" else draft
    from simtree.trees.tree import DraftTree, TreeBatch

    prompt = _prompts(model, 1, 12)[0]
    chain = prompt[8:]
    cache = model.new_cache(1, 32)
    model.prefill(cache, [prompt[:8]])
    logits, _ = model.verify(TreeBatch([DraftTree.chain(len(chain), chain)]), cache)
    ref = model.new_cache(1, 32)
    model.prefill(ref, [prompt[:8]])
    steps = torch.stack([model.step(torch.tensor([t], device=ctx.device), ref)[0] for t in chain])
    err = float((logits - steps).abs().max() / steps.abs().max())
    assert err < 1e-3, f"{RUNTIME_VARIANT} verify differs from sequential decoding: rel err {err:.2e}"
    return f"ok (tree verify == sequential step logits, rel err {err:.1e})"
