"""Profile stages of the block drafters' rounds (``simtree.kernels.layers.drafters``, variant
``layers``): one drafting round of a batch, as the runtime would run it, timed over each
family's own axes and written as rows of the profile table's schema.

    stage          what one round runs                          the row's axes
    draft_block    backbone + marginals + best-first tree     num_steps = block length L,
                   of n nodes                                  nodes_per_seq = tree nodes n,
                                                               topk = marginals kept per position
    draft_tfm      backbone + top-cand_k candidates +          nodes_per_seq = tree nodes n,
                   adapter best-first, w expansions a step     topk = w (expansions per step),
                                                               num_steps = ceil((n-1)/w) sequential
                                                               adapter steps (set from n and w)
    draft_dspark   backbone + L sequential Markov-head steps   num_steps = block length L,
                   (top-k each) + confidence                   topk = k candidates per position,
                                                               nodes_per_seq = 1

``context_len`` l is the drafter's cached context (its layers attend to it); ``batch_size`` b.
Each round feeds the drafter ``L`` new context rows (the most a round accepts), commits them to
its caches and is then reset to context l (one small copy), so every replay times the same
round.  The drafter's sizes are the public ones (``drafter_config``); its embedding and LM
head are its own random tensors of the target's shape (shared with the target in a server).
"""
from __future__ import annotations

import torch

from simtree.costs.steps import Point, Unavailable, Workload
from simtree.kernels.layers.drafters import (BackboneState, backbone_forward, block_marginals, drafter_config,
                                             drafter_specs, dspark_draft, prepare, tfm_steps, tfm_tree,
                                             tree_from_marginals)
from simtree.kernels.layers.drafters.config import MAX_BLOCK_LEN
from simtree.kernels.layers.rope import RopeTable
from simtree.kernels.layers.weights import make_weights

from .pieces import Ctx, nbytes

__all__ = ["DRAFTER_STAGES", "drafter_workload", "check_drafter", "drafter_point_axes"]

DRAFTER_STAGES = {"draft_block": "block", "draft_tfm": "tfm", "draft_dspark": "dspark"}
TFM_BLOCK_LEN = 7      # the TfM adapter drafts over the public block (its tree's depth bound)


def drafter_point_axes(stage: str, b: int, n: int, l: int, s: int, k: int) -> tuple[int, int, int]:
    """(nodes_per_seq, num_steps, topk) of a grid point of a drafter stage, rewritten to the
    stage's meaning (module docstring): tfm's num_steps follows from n and w; dspark's n is 1."""
    if stage == "draft_tfm":
        w = max(k, 1)
        return n, tfm_steps(n, w), w
    if stage == "draft_dspark":
        return 1, s, max(k, 1)
    return n, s, max(k, 1)


def _weights(ctx: Ctx, family: str):
    key = ("drafter", ctx.model.name, family)
    if ctx.notes.get("drafter_key") != key:
        ctx.notes.pop("drafter", None)
        cfg = drafter_config(ctx.model, family)
        ctx.notes["drafter"] = (cfg, prepare(make_weights(drafter_specs(cfg), ctx.device, ctx.dtype, ctx.seed), cfg))
        ctx.notes["drafter_key"] = key
    return ctx.notes["drafter"]


def drafter_workload(ctx: Ctx, p: Point) -> Workload:
    """The round of one grid point (module docstring); Unavailable for a model without dense
    layer code or a block length past the drafter's."""
    family = DRAFTER_STAGES[p.stage]
    if ctx.model.family not in ("gdn_hybrid", "v4"):
        raise Unavailable(f"model {ctx.model.name}: no drafter layer code for family {ctx.model.family!r}")
    L = TFM_BLOCK_LEN if family == "tfm" else p.num_steps
    if not 1 <= L <= MAX_BLOCK_LEN:
        raise Unavailable(f"{p.stage}: block length {L} outside 1..{MAX_BLOCK_LEN}")
    b, n, k, l = p.batch_size, p.nodes_per_seq, max(p.topk, 1), p.context_len

    def make():
        cfg, w = _weights(ctx, family)
        cfg = cfg.with_block_len(L)
        dev, dt = ctx.device, ctx.dtype
        st = BackboneState.new(cfg, b, l + L + 1, L, dt, dev)
        st.lengths.fill_(l)
        l0 = st.lengths.clone()
        rope = RopeTable(cfg.dims.rope, 1e6, dev, l + 2 * L + 2, dtype=dt)
        feats = ctx.randn(b, L, cfg.target_layers * cfg.h, salt=41)
        n_new = torch.full((b,), L, dtype=torch.int64, device=dev)
        anchor = torch.randint(0, cfg.vocab, (b,), device=dev, generator=ctx.gen(43))
        for c in st.caches:
            c.normal_(generator=ctx.gen(47))

        def step():
            st.lengths.copy_(l0)
            hid = backbone_forward(w, cfg, st, rope, feats, n_new, anchor)
            if family == "block":
                return tree_from_marginals(*block_marginals(w, hid, k), anchor, n)
            if family == "tfm":
                return tfm_tree(w, hid, anchor, cfg.cand_k, n, k)
            return dspark_draft(w, hid, anchor, k)
        return step, nbytes(feats, *st.caches)
    return Workload(make)


def check_drafter(ctx: Ctx, stage: str) -> str:
    """A round at a small point: its trees are topological with finite root-path scores, or
    DSpark's confidences lie in [0, 1]; the backbone is checked against a dense torch reference
    in tests/test_drafters.py."""
    s = 7 if stage != "draft_tfm" else 0
    step, _ = drafter_workload(ctx, Point(stage, "layers", ctx.model.name, 2, 6, 64, "any", s, 3)).make()
    out = step()
    if stage == "draft_dspark":
        conf = out[2]
        assert bool(((conf >= 0) & (conf <= 1)).all()), f"{stage}: confidence outside [0, 1]"
        return "ok (confidence in [0, 1]; backbone vs dense reference: tests/test_drafters.py)"
    par = out.parents[:, 1:]
    idx = torch.arange(1, par.shape[1] + 1, device=par.device)
    assert bool((par < idx).all()) and bool(torch.isfinite(out.score[out.valid]).all()), f"{stage}: bad tree"
    return "ok (topological trees, finite scores; backbone vs dense reference: tests/test_drafters.py)"
