"""Profiled steps of the runtime's tiny default (variant ``runtime_tiny``): what ``simtree run``
pays per round, timed as its engine runs it, so a cost bundle fitted from these rows predicts
``simtree run`` on the same machine (apples to apples).  The runtime owns them; the profiler
times them when `simtree profile` hands :func:`step_builders` to the sweep (a
:class:`~simtree.costs.steps.StepBuilder` per variant).

The steps are the engine's own (:mod:`simtree.runtime.full.steps`, the stages ``simtree run``
books): ``model_verify_step`` (b, n, l) its verify + commit stages over b trees of n nodes (an
EAGLE top-2 tree, or a chain for tree shape ``linear``; n = 1 the plain decode step);
``draft_step`` (b, s, k, l) its draft + catch-up stages.  Caches hold l tokens of random
content.  Weights: the shipped ``runtime-tiny`` checkpoint, or the folder given to
:class:`RuntimeSteps` (kept in ``ctx.notes["runtime_models_dir"]``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from simtree.costs.steps import Point, StepBuilder, StepContext, Unavailable, Workload
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

def _model(ctx: StepContext):
    """The tiny default (or the checkpoint in ``models_dir``) on ctx.device, loaded once per
    context, float32 as ``simtree run`` decodes it."""
    if "runtime_model" not in ctx.notes:
        from simtree.runtime.full.build import build_model

        ctx.notes["runtime_model"] = build_model(str(ctx.notes.get("runtime_models_dir") or "runtime-tiny"),
                                                 device=ctx.device, dtype=torch.float32)
    return ctx.notes["runtime_model"]

def _timed(step):
    """(the step's run, 0 instance bytes), the step kept alive by the closure."""
    return step.run, 0

def _verify_step(ctx, p):
    from simtree.runtime.full.steps import verify_step

    tree = "linear" if p.tree_shape == "linear" else "eagle"
    return _timed(verify_step(_model(ctx), p.batch_size, p.nodes_per_seq, p.context_len, tree=tree, seed=ctx.seed))

def _draft_step(ctx, p):
    from simtree.runtime.full.steps import draft_step

    return _timed(draft_step(_model(ctx), p.batch_size, max(p.num_steps, 1), max(p.topk, 1), p.context_len,
                             seed=ctx.seed))

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
    """The verify of a chain == the plain decode steps' logits (the lossless reference)."""
    model = _model(ctx)
    rng = np.random.default_rng(_PROMPT_SEED)
    chain = torch.as_tensor(rng.integers(0, min(model.vocab, 256), size=(1, 6)), device=model.device)
    parents = torch.arange(-1, 5, device=model.device)[None]
    st = model.new_state(1, 32)
    logits = model.logits(model.verify(st, chain, parents)[0])
    steps = torch.cat([model.logits(model.decode(st, chain[:, t])) for t in range(chain.shape[1])])
    err = float((logits - steps).abs().max() / steps.abs().max())
    assert err < 1e-3, f"{RUNTIME_VARIANT} verify differs from plain decoding: rel err {err:.2e}"
    return f"ok (chain verify == plain decode step logits, rel err {err:.1e})"
