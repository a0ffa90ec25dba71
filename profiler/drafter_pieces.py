"""Profile stages of the block drafters' rounds (variant ``round``): one drafting round of a
batch as the runtime's block round runs it - the drafter's backbone forward, then
``simtree.kernels.layers.drafters.draft_round``, the function ``runtime/full/block_engine.py``
calls for its draft part - timed over each family's own axes and written as rows of the
profile table's schema.

    stage          what one round runs                          the row's axes
    draft_block    backbone + top-k marginals + the            num_steps = block length L,
                   best-first tree of n nodes, built           nodes_per_seq = tree nodes n,
                   sort-based and laid out                     topk = marginals kept per position
                                                               (the runtime keeps MARGINAL_TOPK)
    draft_tfm      backbone + top-cand_k candidates +          nodes_per_seq = tree nodes n,
                   adapter best-first, w expansions a step     topk = w (expansions per step),
                                                               num_steps = ceil((n-1)/w) sequential
                                                               adapter steps (set from n and w)
    draft_dspark   backbone + L sequential Markov-head steps   num_steps = block length L,
                   (top-k each) + confidence + the chain's     topk = k candidates per position,
                   verified prefix at a threshold, laid out    nodes_per_seq = 1

``context_len`` l is the drafter's cached context (its layers attend to it); ``batch_size`` b.
The drafter's state is the runtime's (``DrafterRound``'s): L + 1 context rows a round (the most
it accepts), all real, committed to its caches and then reset to context l (one small copy), so
every replay times the same round; a float32 RoPE table.  DSpark's prefix is cut at a threshold
(a policy with one); batch_alloc's per-round rule (no threshold) is not in the stage.  The
drafter's sizes are the public ones (``drafter_config``); its embedding and LM head are its own
random tensors of the target's shape (shared with the target in a server).  Rows carry variant
``round`` (``simtree.drafters.ROUND_VARIANT``): older tables' ``layers`` rows built the block tree
with n - 1 sequential steps, which the fit takes out (``simtree.costs.drafter_fit``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from simtree.costs.steps import Point, Unavailable, Workload
from simtree.drafters import DRAFTER_ROPE_THETA, ROUND_VARIANT
from simtree.kernels.layers.device_trees import TreeBuffers
from simtree.kernels.layers.drafters import (BackboneState, DraftedRound, DrafterConfig, DraftShape,
                                             backbone_forward, draft_round, drafter_config, drafter_specs, prepare,
                                             tfm_steps, threshold_keep, tree_from_marginals)
from simtree.kernels.layers.drafters.config import MAX_BLOCK_LEN
from simtree.kernels.layers.rope import RopeTable
from simtree.kernels.layers.weights import make_weights

from .pieces import Ctx, nbytes

__all__ = ["DRAFTER_STAGES", "drafter_workload", "check_drafter", "drafter_point_axes", "DraftInputs",
           "drafter_inputs", "run_round", "ROUND_VARIANT", "DSPARK_THRESHOLD"]

DRAFTER_STAGES = {"draft_block": "block", "draft_tfm": "tfm", "draft_dspark": "dspark"}
TFM_BLOCK_LEN = 7      # the TfM adapter drafts over the public block (its tree's depth bound)
DSPARK_THRESHOLD = 0.3  # the stage's verify threshold (the work does not depend on its value)
DSPARK_KEEP = threshold_keep(DSPARK_THRESHOLD)


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


@dataclass
class DraftInputs:
    """One round's inputs and buffers, as the runtime's block round holds them: the drafter
    (``cfg``, prepared weights ``w``), its state and RoPE table, the context rows ``feats`` [B, A,
    F*h] (``n_new`` [B] real), the anchors [B], the tree buffers [B, tree_nodes], ``lengths0``
    the committed context each replay starts from."""

    cfg: DrafterConfig
    w: dict
    state: BackboneState
    rope: RopeTable
    feats: torch.Tensor
    n_new: torch.Tensor
    anchor: torch.Tensor
    tree: TreeBuffers
    lengths0: torch.Tensor
    tree_nodes: int
    width: int
    topk: int


def drafter_inputs(ctx: Ctx, p: Point) -> DraftInputs:
    """The round of one grid point (module docstring); Unavailable for a model without dense
    layer code or a block length past the drafter's."""
    family = DRAFTER_STAGES[p.stage]
    if ctx.model.family not in ("gdn_hybrid", "v4"):
        raise Unavailable(f"model {ctx.model.name}: no drafter layer code for family {ctx.model.family!r}")
    L = TFM_BLOCK_LEN if family == "tfm" else p.num_steps
    if not 1 <= L <= MAX_BLOCK_LEN:
        raise Unavailable(f"{p.stage}: block length {L} outside 1..{MAX_BLOCK_LEN}")
    b, k, l = p.batch_size, max(p.topk, 1), p.context_len
    cfg, w = _weights(ctx, family)
    cfg = cfg.with_block_len(L)
    dev, dt = ctx.device, ctx.dtype
    A = L + 1                                  # the runtime's context rows a round
    st = BackboneState.new(cfg, b, l + A, A, dt, dev)
    st.lengths.fill_(l)
    rope = RopeTable(cfg.dims.rope, DRAFTER_ROPE_THETA, dev, st.max_len + A + L + 1, dtype=dt)
    feats = ctx.randn(b, A, cfg.target_layers * cfg.h, salt=41)
    n_new = torch.full((b,), A, dtype=torch.int64, device=dev)
    anchor = torch.randint(0, cfg.vocab, (b,), device=dev, generator=ctx.gen(43))
    for c in st.caches:
        c.normal_(generator=ctx.gen(47))
    nodes = L + 1 if family == "dspark" else p.nodes_per_seq
    return DraftInputs(cfg, w, st, rope, feats, n_new, anchor, TreeBuffers.empty(b, nodes, dev),
                       st.lengths.clone(), nodes, k if family == "tfm" else 1, k)


def run_round(x: DraftInputs) -> DraftedRound:
    """One round: the lengths reset, the backbone forward, the runtime's draft part into ``x.tree``."""
    x.state.lengths.copy_(x.lengths0)
    hid = backbone_forward(x.w, x.cfg, x.state, x.rope, x.feats, x.n_new, x.anchor)
    return draft_round(x.cfg.family, x.w, x.cfg, hid, x.anchor, x.tree, DraftShape(x.tree_nodes, x.width, x.topk),
                       keep=DSPARK_KEEP)


def drafter_workload(ctx: Ctx, p: Point) -> Workload:
    """The round of one grid point, timed (module docstring)."""
    if p.variant != ROUND_VARIANT:
        raise Unavailable(f"{p.stage} is timed by variant {ROUND_VARIANT!r} (the runtime's round) only, "
                          f"not {p.variant!r}")

    def make():
        x = drafter_inputs(ctx, p)
        return (lambda: run_round(x)), nbytes(x.feats, *x.state.caches)
    return Workload(make)


def check_drafter(ctx: Ctx, stage: str) -> str:
    """A round at a small point: its trees are topological with finite scores on their valid
    nodes; block's tree holds the same path scores as the best-first tree built step by step
    (``tree_from_marginals``, a reference off the timed path) from the round's marginals;
    DSpark's confidences lie in [0, 1] and its verified prefix within the chain.  The backbone
    is checked against a dense torch reference in tests/test_drafters.py."""
    s = 7 if stage != "draft_tfm" else 0
    x = drafter_inputs(ctx, Point(stage, ROUND_VARIANT, ctx.model.name, 2, 6, 64, "any", s, 3))
    out, t = run_round(x), x.tree
    par = t.parents[:, 1:]
    idx = torch.arange(1, par.shape[1] + 1, device=par.device)
    assert bool((par < idx).all()) and bool((par >= 0).all()), f"{stage}: parents not topological"
    assert bool(torch.isfinite(t.score[t.valid]).all()), f"{stage}: a valid node's score is not finite"
    if stage == "draft_dspark":
        conf = out.confidence
        assert bool(((conf >= 0) & (conf <= 1)).all()), f"{stage}: confidence outside [0, 1]"
        assert bool(((out.verified_len >= 0) & (out.verified_len <= x.tree_nodes - 1)).all()), f"{stage}: prefix"
        return "ok (topological chain, confidence in [0, 1]; backbone vs dense reference: tests/test_drafters.py)"
    if stage == "draft_block":
        ref = tree_from_marginals(out.lp, out.ids, x.anchor, x.tree_nodes)
        got = torch.where(t.valid, t.score, float("-inf")).sort(1).values
        want = torch.where(ref.valid, ref.score, float("-inf")).sort(1).values
        fin = torch.isfinite(want)
        assert bool((torch.isfinite(got) == fin).all()) and torch.allclose(got[fin], want[fin], atol=1e-3, rtol=1e-3), \
            f"{stage}: the sort-based tree's path scores differ from the step-by-step best-first tree's"
        return "ok (topological trees, path scores = step-by-step best-first's; backbone: tests/test_drafters.py)"
    return "ok (topological trees, finite scores; backbone vs dense reference: tests/test_drafters.py)"
