"""Variant ``layers``: the full runtime's own layer calls (``simtree.kernels.layers``), timed per
layer kind at a grid point, so a composed step is the sum of exactly what the runtime runs.

    stage                  times (the runtime's calls, in its order)
    round_meta_step        the round's shared metadata: positions, RoPE rows, tree bits, the GDN
                           kernels' tree metadata, conv taps (Qwen) / the device plans of every
                           layer kind (V4), the commit's rows or plans, the lengths' advance
    <kind>_proj_step       the layer's mixer minus its core: norm, fused projections, conv and
                           gates (GDN) or norm + RoPE (attention), output norm / gate, the output
                           projection with the residual add
    gdn_tree_verify, attn_tree_verify, v4_<kind>_verify      the core, as the layer calls it
    gdn_decode_step        the GDN core of a plain decoding step (state and conv state updated)
    gdn_tree_commit, attn_kv_commit, v4_<kind>_commit        one layer's share of the commit
    mlp_step               the MLP (Qwen) or the rank's MoE (V4), with its norm and residual
    lm_head_step           the model's two ends: token embedding, final norm + float32 logits
                           + argmax

Weights are one layer of each kind, made by the runtime's own specs (``weights.make_weights``),
shared by the points of a sweep (``ctx.notes["layers"]``).  Every step is free of host syncs
and is timed from a CUDA graph, as the runtime replays its stages.
"""
from __future__ import annotations

import math

import torch

from simtree.costs.steps import Point, Unavailable, Workload
from simtree.kernels.layers import head, qwen as Q, v4 as V
from simtree.kernels.layers.weights import make_weights
from simtree.kernels.v4 import V4Cache
from simtree.models import HASH_MLP_STAGE, MODEL_ROUND_STAGE, hash_layers

from .pieces import Ctx, nbytes, tree_batch

__all__ = ["LAYERS_VARIANT", "layers_workload", "layer_stages", "check_layers"]

LAYERS_VARIANT = "layers"
ROUND_STAGE = MODEL_ROUND_STAGE
_V4_MOE = ("ln2", "router", "router_bias", "experts_gu", "experts_down", "shared_gu", "shared_down", "hc_ffn_fn",
           "hc_ffn_base", "hc_ffn_scale")
_V4_MOE += tuple(n + "_scale_inv" for n in ("experts_gu", "experts_down", "shared_gu", "shared_down"))  # FP8 block scales


def layer_stages(model) -> list[str]:
    """Every stage variant ``layers`` times for a model shape."""
    kinds = model.kinds()
    out = [ROUND_STAGE, "lm_head_step", "mlp_step"] + [f"{k}_proj_step" for k in kinds]
    if hash_layers(model):
        out.append(HASH_MLP_STAGE)
    if model.family == "gdn_hybrid":
        out += [s for k, s in (("gdn", "gdn_tree_verify"), ("gdn", "gdn_decode_step"), ("gdn", "gdn_tree_commit"),
                               ("attn", "attn_tree_verify"), ("attn", "attn_kv_commit")) if k in kinds]
    else:
        out += [f"v4_{k}_{s}" for k in kinds for s in ("verify", "commit")]
    return out


class _Parts:
    """One layer of each kind and the model's ends, for one model shape on ctx.device."""

    def __init__(self, ctx: Ctx):
        m, dev, dt = ctx.model, ctx.device, ctx.dtype
        self.v4 = m.family == "v4"
        gain = 1.0 / math.sqrt(2 * m.num_layers)
        ends = [s for s in (Q.model_specs(m) if not self.v4 else V.model_specs(m, dtype=dt)) if "." not in s.name]
        self.ends = make_weights(ends, dev, dt, ctx.seed)
        self.w = {}
        if self.v4:
            self.d = V.V4Dims.of(m)
            comp_dt = torch.float64 if dt == torch.float64 else torch.float32
            for k in m.kinds():
                specs = V.layer_specs("", k, self.d, gain, comp_dt)
                self.w[k] = make_weights([s for s in specs if s.name not in _V4_MOE], dev, dt, ctx.seed)
            self.moe = make_weights([s for s in specs if s.name in _V4_MOE], dev, dt, ctx.seed)
            hashed = V.layer_specs("", "swa", self.d, gain, comp_dt, hashed=True)
            self.hash_moe = make_weights([s for s in hashed if s.name in _V4_MOE + ("tid2eid",)
                                          and s.name != "router_bias"], dev, dt, ctx.seed)
            self.lw = {k: V.layer_weights(self.w[k], k, self.d) for k in self.w}
            self.ropes = V.rope_tables(self.d, dev, dt)
            self.cfg = V.attn_config(self.d)
            self.impl = "triton" if dev.type == "cuda" and dt != torch.float64 else "torch"
        else:
            self.d = Q.QwenDims.of(m)
            self.tables = Q.RoundTables(self.d, dev, dtype=dt)
            self.has_gdn = "gdn" in m.kinds()
            for k in m.kinds():
                self.w[k] = Q.prepare(make_weights(Q.layer_specs("", k, self.d, gain), dev, dt, ctx.seed), dt)


def _parts(ctx: Ctx) -> _Parts:
    if ctx.notes.get("layers_model") != ctx.model.name:
        ctx.notes.pop("layers", None)
        ctx.notes["layers"], ctx.notes["layers_model"] = _Parts(ctx), ctx.model.name
    return ctx.notes["layers"]


def _trees(ctx: Ctx, b: int, n: int, shape: str) -> torch.Tensor:
    """[b, n] local parents of the point's trees."""
    tb = tree_batch(b, n, shape, ctx.seed)
    return torch.as_tensor(tb.parents, device=ctx.device).view(b, n)


def _deepest(ctx: Ctx, b: int, n: int, shape: str) -> torch.Tensor:
    """Each tree's deepest node: the longest path a commit folds (its dearest case)."""
    return torch.as_tensor(tree_batch(b, n, shape, ctx.seed).deepest_nodes, device=ctx.device)


def _lengths(ctx: Ctx, b: int, l: int) -> torch.Tensor:
    return torch.full((b,), l, dtype=torch.int64, device=ctx.device)


# ---- Qwen --------------------------------------------------------------------------------------
def _ends_step(ctx: Ctx, P: _Parts, x: torch.Tensor, eps: float, collapse=None):
    """lm_head_step of either family: the token embedding of T tokens, then final norm + logits
    (V4: the embedding into its streams, and ``collapse``, the streams' final hc_head, first)."""
    T, vocab = x.shape[0], P.ends["embed"].shape[0]
    tokens = torch.randint(0, vocab, (T,), device=ctx.device, generator=ctx.gen(T))

    def step():
        if collapse is None:
            head.embed(P.ends["embed"], tokens)
            return head.greedy(x, P.ends["norm"], P.ends["lm_head"], eps)
        V.embed_streams(P.d, P.ends["embed"], tokens)
        return head.greedy(collapse(x), P.ends["norm"], P.ends["lm_head"], eps)
    return step, nbytes(x, tokens)


def _qwen(ctx: Ctx, P: _Parts, p: Point, kind: str | None):
    b, n, l, d = p.batch_size, p.nodes_per_seq, p.context_len, P.d
    T, S1 = b * n, l + n + 2
    P.tables.rope.ensure(S1 + 1)
    lengths = _lengths(ctx, b, l)
    parents = None if n == 1 else _trees(ctx, b, n, p.tree_shape)
    rm = Q.round_meta(d, P.tables, lengths, parents, S1, P.has_gdn)
    acc = None if n == 1 else _deepest(ctx, b, n, p.tree_shape)
    x = ctx.randn(T, d.h, salt=T)
    stage = p.stage
    if stage == ROUND_STAGE:
        adv = lengths.clone()

        def step():
            r = Q.round_meta(d, P.tables, lengths, parents, S1, P.has_gdn)
            Q.advance(adv, r.commit if n == 1 else Q.commit_meta(d, P.tables, r, acc, S1, P.has_gdn))
        return step, nbytes(lengths)
    if stage == "lm_head_step":
        return _ends_step(ctx, P, x, Q.EPS)
    if stage == "mlp_step":
        w = P.w[next(iter(P.w))]
        return (lambda: Q.mlp(w, d, x)), nbytes(x)
    w = P.w[kind]
    if kind == "gdn":
        conv = ctx.randn(b, d.W - 1, d.conv, salt=b)
        pre = Q.gdn_pre(w, d, x, conv, rm)
        ssm = ctx.randn(b, d.gHV, d.gK, d.gV, dtype=torch.float32, scale=0.1, salt=b + 1)
        if stage == "gdn_proj_step":
            o = ctx.randn(T, d.gHV, d.gV, salt=T + 1)

            def step():
                q = Q.gdn_pre(w, d, x, conv, rm)
                return Q.gdn_post(w, d, x, o, q.z)
            return step, nbytes(x, o, conv)
        if stage == "gdn_decode_step":
            return (lambda: Q.gdn_core_decode(d, pre, ssm, conv, rm)), nbytes(ssm, pre.q, pre.k, pre.v)
        if stage == "gdn_tree_verify":
            return (lambda: Q.gdn_core_verify(d, pre, ssm, rm)), nbytes(ssm, pre.q, pre.k, pre.v)
        _, cache = Q.gdn_core_verify(d, pre, ssm, rm)
        cm = Q.commit_meta(d, P.tables, rm, acc, S1, P.has_gdn)
        return (lambda: Q.gdn_commit(d, ssm, conv, (pre.x_conv, pre.k, cache), rm, cm)), nbytes(ssm, cache.u)
    q, kv, gate = Q.attn_pre(w, d, x, rm.cs)
    if stage == "attn_proj_step":
        o = ctx.randn(T, d.Hq, d.D, salt=T + 2)

        def step():
            _, _, g = Q.attn_pre(w, d, x, rm.cs)
            return Q.attn_post(w, d, x, o, g)
        return step, nbytes(x, o)
    cache = ctx.randn(b, S1, 2, d.Hkv, d.D, salt=S1)
    if stage == "attn_tree_verify":
        return (lambda: Q.attn_core(d, q, kv, cache, lengths, rm.pos, rm.bits)), nbytes(cache, q, kv)
    rows = rm.commit.kv_rows if n == 1 else Q.commit_meta(d, P.tables, rm, acc, S1, P.has_gdn).kv_rows
    return (lambda: Q.attn_commit(cache, kv, rows)), nbytes(kv)


# ---- V4 ----------------------------------------------------------------------------------------
def _v4(ctx: Ctx, P: _Parts, p: Point, kind: str | None):
    b, n, l, d = p.batch_size, p.nodes_per_seq, p.context_len, P.d
    T = b * n
    max_len = l + 4 * n + 8                          # as the runtime's step engines size a state
    for table in P.ropes.values():
        table.ensure(max_len + 2)
    lengths = _lengths(ctx, b, l)
    parents = (torch.full((b, 1), -1, dtype=torch.int64, device=ctx.device) if n == 1
               else _trees(ctx, b, n, p.tree_shape))
    acc = torch.zeros(b, dtype=torch.int64, device=ctx.device) if n == 1 else _deepest(ctx, b, n, p.tree_shape)
    x = ctx.randn(T, d.hc, d.h, salt=T)              # the hyper-connection streams
    stage = p.stage
    if stage == "lm_head_step":                      # + the final collapse of the streams
        return _ends_step(ctx, P, x, d.eps, lambda y: V.hc_collapse(P.ends, d, y))
    if stage == "mlp_step":                          # routed (not hash) MoE with its hyper-connection
        return (lambda: V.moe_block(P.moe, d, x)), nbytes(x)
    if stage == HASH_MLP_STAGE:                      # a hash-routed layer's: the tokens pick the experts
        ids = torch.randint(0, d.vocab, (T,), device=ctx.device, generator=ctx.gen(T + 5))
        return (lambda: V.moe_block(P.hash_moe, d, x, ids)), nbytes(x, ids)
    if stage == f"{kind}_proj_step":                 # RoPE rows of the nodes' positions only
        depth = torch.as_tensor(tree_batch(b, n, p.tree_shape, ctx.seed).depth, device=ctx.device)
        cs = P.ropes["main" if kind == "swa" else "compress"].rows(l + depth)
        w, o = P.w[kind], ctx.randn(T, d.H, d.D, salt=T + 3)

        def step():
            _, hc = V.attn_block_pre(w, d, kind, x, cs)
            return V.attn_block_post(w, d, x, o, cs, hc)
        return step, nbytes(x, o)
    sdt = torch.float64 if ctx.dtype == torch.float64 else torch.float32
    kinds = [kind] if kind else list(P.w)
    caches = {k: V4Cache.random(P.cfg, P.lw[k], b, l, max_len, dtype=ctx.dtype, state_dtype=sdt, device=ctx.device,
                                seed=ctx.seed) for k in kinds}
    held = nbytes(*(t for c in caches.values() for t in c.persistent_tensors().values()))
    both = {k: (caches[k], P.lw[k]) for k in kinds}
    rm = V.round_meta(P.ropes, both, lengths, parents, max_len - 1)
    if stage == ROUND_STAGE:
        adv = lengths.clone()

        def step():
            r = V.round_meta(P.ropes, both, lengths, parents, max_len - 1)
            V.commit_plans(both, r, acc)
            V.advance(adv, r, acc)
        return step, held
    w, cache, lw = P.w[kind], caches[kind], P.lw[kind]
    inp, _ = V.attn_block_pre(w, d, kind, x, rm.rows(kind))
    if stage == f"v4_{kind}_verify":
        return (lambda: V.attn_core(kind, cache, lw, inp, rm.plans[kind], P.impl)), held
    _, scratch = V.attn_core(kind, cache, lw, inp, rm.plans[kind], P.impl)
    cplan = V.commit_plans({kind: both[kind]}, rm, acc)[kind]
    return (lambda: V.attn_commit(kind, cache, scratch, cplan, P.impl)), held


def _kind_of(stage: str, kinds) -> str | None:
    if stage == HASH_MLP_STAGE:
        return None
    for k in kinds:
        if stage in (f"{k}_proj_step", f"v4_{k}_verify", f"v4_{k}_commit"):
            return k
    return {"gdn_tree_verify": "gdn", "gdn_decode_step": "gdn", "gdn_tree_commit": "gdn", "attn_tree_verify": "attn",
            "attn_kv_commit": "attn"}.get(stage)


def layers_workload(ctx: Ctx, p: Point) -> Workload:
    """The point's step of variant ``layers`` (module docstring); Unavailable where the model
    has no such layer or the stage is not one of its layer calls."""
    model = ctx.model
    if model.family not in ("gdn_hybrid", "v4"):
        raise Unavailable(f"model {model.name}: no full-scale layer code for family {model.family!r}")
    if p.stage not in layer_stages(model):
        raise Unavailable(f"{p.stage} is not a layer call of {model.name} (variant {LAYERS_VARIANT})")
    kind = _kind_of(p.stage, model.kinds())
    if p.stage == "gdn_decode_step" and p.nodes_per_seq != 1:
        raise Unavailable(f"gdn_decode_step is one token per sequence, not {p.nodes_per_seq}")
    if p.stage in ("gdn_tree_verify", "gdn_tree_commit") and p.nodes_per_seq == 1:
        raise Unavailable(f"{p.stage} at n = 1: plain decoding runs gdn_decode_step")

    def make():
        P = _parts(ctx)
        return (_v4 if P.v4 else _qwen)(ctx, P, p, kind)
    return Workload(make)


def check_layers(ctx: Ctx, stage: str) -> str:
    """The fused Triton ops of a layer call against their torch forms (``forms(fused="torch")``) at a
    small point, where the step has fused ops and the device runs Triton."""
    if ctx.device.type != "cuda" or not stage.endswith(("_proj_step", "mlp_step", "lm_head_step")):
        return "no reference (timing only)"
    from simtree.kernels.layers.forms import forms
    n = 8 if stage == "lm_head_step" else 4
    kind = _kind_of(stage, ctx.model.kinds())
    make = layers_workload(ctx, Point(stage, LAYERS_VARIANT, ctx.model.name, 2, n, 64, "eagle")).make
    step, _ = make()
    got = step()
    with forms(fused="torch"):
        want = step()
    if stage == "lm_head_step":
        agree = float((got == want).float().mean())
        assert agree >= 0.9, f"{stage}: greedy picks agree on {agree:.1%} of rows only"   # near-ties may flip
        return f"ok (greedy picks agree on {agree:.0%} of rows with the torch forms)"
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert err < 3e-2, f"{stage} ({kind}): fused ops differ from their torch forms by {err:.2e}"
    return f"ok (rel err {err:.1e} vs the torch forms of the fused ops)"
