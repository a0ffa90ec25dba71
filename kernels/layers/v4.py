"""Layers of DeepSeek-V4 (one expert-parallel rank), built from the kernels: what the full
runtime's rank composes and what the profiler times, layer kind by layer kind.

A layer (hyper-connections ignored, as the model YAML says; the experts FP8 where the shape's
``mlp.expert_dtype`` says so, :mod:`.fp8`):

    x += W_ob groups(W_oa o),  o = tree verify of the SWA / CSA / HCA attention (``kernels.v4``)
    x += MoE(RMSNorm x)        routed experts (the rank's own) + the shared expert

with, from h = RMSNorm(x) and one fused GEMM h -> [q latent | kv latent (| indexer weights)]:
q = RoPE(W_qb RMSNorm(q latent)), kv = RoPE(RMSNorm(kv latent)) (RoPE on the last ``rope_dim``
channels; removed from o again since K == V), the compressors reading h, the CSA indexer's
queries RoPE(W_iq q latent) and head weights (the fused GEMM's last Hi columns) / sqrt(Hi).

The round's index lists are the kernels' device plans (``plan_verify_device`` /
``plan_commit_device``: static shapes, no host sync), one per layer kind per round, shared by
that kind's layers (their caches have the same pages); :func:`round_meta` builds them with the
round's positions and RoPE rows, :func:`commit_plans` the commit's.

The rank's experts are the shape's: a rank's shape (``ModelShape.shard("ep=8")``: 32 of
DeepSeek-V4-Flash's 256, 6 of them per token) carries its own expert count; a whole-model shape
(deployment "tp=1") is split over :func:`default_ep_ranks` ranks, to the same 32.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from simtree.deploy.deployment import DEFAULT_DEPLOYMENT, parse_deployment
from simtree.errors import SimtreeError
from simtree.kernels.v4 import (CompressorParams, V4AttnConfig, V4Cache, V4Inputs, V4LayerWeights, apply_commit,
                                plan_commit_device, plan_verify_device, tree_verify)
from simtree.models import ModelShape
from simtree.quant import expert_dtype

from . import fp8, ops
from .attention import tree_attention
from .head import embed
from .moe import route_topk, routed_experts
from .opcount import kernel_core
from .rope import RopeTable
from .weights import Spec, ends_specs, expert_linear, linear, mtp_specs, residual_gain

__all__ = ["V4Dims", "EP_RANKS", "ROPE_THETA", "default_ep_ranks", "rank_experts", "layer_specs", "model_specs",
           "attn_config", "layer_weights", "V4Round", "round_meta", "commit_plans", "advance", "attn_pre", "attn_core",
           "attn_post", "attn_commit", "moe", "layer", "mtp_forward", "EPS"]

EP_RANKS = 8
ROPE_THETA = 10000.0      # the kernels' compressor RoPE (V4AttnConfig.rope_theta)
EPS = 1e-6


def default_ep_ranks(shape: ModelShape) -> int:
    """8 (the deployment), or fewer where 8 would leave a rank fewer experts than a token picks
    (the tiny test model: 8 experts, 2 per token -> 2 ranks of 4)."""
    m = shape.mlp
    if m["n_experts"] // EP_RANKS >= m["experts_per_token"]:
        return EP_RANKS
    return max(1, m["n_experts"] // (2 * m["experts_per_token"]))


def _rank_ep(shape: ModelShape) -> int | None:
    """The expert-parallel ranks of a shape already cut to one rank (``ModelShape.shard``: its
    deployment spans several GPUs; 1 where it splits only attention, so every expert stays),
    or of one that says so by ``mlp.ep_ranks``; None for a whole-model shape.  The default
    deployment "tp=1" is the whole model: its experts are still to be split."""
    if "ep_ranks" in shape.mlp:
        return int(shape.mlp["ep_ranks"])
    dep = parse_deployment(getattr(shape, "deployment", None) or DEFAULT_DEPLOYMENT)
    return dep.ep if dep.gpus > 1 else None


def rank_experts(shape: ModelShape, ep_ranks: int | None = None) -> tuple[int, int]:
    """(local experts, EP ranks): ``ep_ranks`` splits the shape's experts; a rank's shape keeps
    its own count (``shard`` divided it once already); a whole-model shape is split over
    default_ep_ranks."""
    n, k = int(shape.mlp["n_experts"]), int(shape.mlp["experts_per_token"])
    rank_ep = _rank_ep(shape)
    if rank_ep is not None and ep_ranks in (None, rank_ep):
        ranks, local = rank_ep, n
    else:
        if rank_ep is not None:
            raise SimtreeError(f"model {shape.name!r} is already one rank of {shape.deployment}: "
                               f"its {n} experts are the rank's, not to be split over {ep_ranks} ranks again")
        ranks = ep_ranks or default_ep_ranks(shape)
        if n % ranks:
            raise SimtreeError(f"model {shape.name!r}: {n} experts do not split over {ranks} ranks")
        local = n // ranks
    if local < k:
        raise SimtreeError(f"model {shape.name!r}: {local} experts per rank are fewer than the {k} a token picks")
    return local, ranks


@dataclass(frozen=True)
class V4Dims:
    h: int
    vocab: int
    H: int
    D: int
    rope: int
    qr: int
    G: int
    orank: int
    window: int
    csa: int
    hca: int
    topk: int
    Hi: int
    Di: int
    E: int
    topk_e: int
    I: int
    Is: int
    experts: str = "bf16"     # the routed and shared experts' weights: bf16 or fp8 (block-scaled)

    @classmethod
    def of(cls, shape: ModelShape, ep_ranks: int | None = None) -> "V4Dims":
        v, m = shape.v4, shape.mlp
        E, _ = rank_experts(shape, ep_ranks)
        return cls(shape.hidden, shape.vocab, int(v["q_heads"]), int(v["head_dim"]), int(v["rope_dim"]),
                   int(v["q_lora_rank"]), int(v["o_groups"]), int(v["o_lora_rank"]), int(v["window"]),
                   int(v["csa_ratio"]), int(v["hca_ratio"]), int(v["index_topk"]), int(v["index_heads"]),
                   int(v["index_head_dim"]), E, int(m["experts_per_token"]), int(m["expert_intermediate"]),
                   int(m.get("n_shared", 0)) * int(m.get("shared_intermediate", 0)), experts=expert_dtype(m))

    def ratio(self, kind: str) -> int:
        return {"swa": 0, "csa": self.csa, "hca": self.hca}[kind]

    def a_out(self, kind: str) -> int:
        """Columns of the fused first projection: q latent | kv latent (| indexer weights)."""
        return self.qr + self.D + (self.Hi if kind == "csa" else 0)


# ---- weights ----------------------------------------------------------------------------------
def _compressor_specs(p: str, dim: int, ratio: int, h: int, dt) -> list[Spec]:
    c = (2 if ratio == 4 else 1) * dim
    return [linear(p + "wkv", c, h, dtype=dt), linear(p + "wgate", c, h, dtype=dt),
            Spec(p + "ape", (ratio, c), "normal", 0.5, dt), Spec(p + "norm", (dim,), "const", 1.0, dt)]


def layer_specs(p: str, kind: str, d: V4Dims, out_gain: float, comp_dt) -> list[Spec]:
    """One block: attention of ``kind`` (swa / csa / hca) and the rank's MoE."""
    if kind not in ("swa", "csa", "hca"):
        raise SimtreeError(f"a V4 layer is swa, csa or hca, not {kind!r}")
    h, H, D = d.h, d.H, d.D
    specs = [Spec(p + "ln1", (h,), "const", 1.0), linear(p + "wqkv_a", d.a_out(kind), h),
             Spec(p + "q_norm", (d.qr,), "const", 1.0), linear(p + "wq_b", H * D, d.qr),
             Spec(p + "kv_norm", (D,), "const", 1.0),
             linear(p + "wo_a", d.orank, H // d.G * D, groups=d.G), linear(p + "wo_b", h, d.G * d.orank, out_gain),
             Spec(p + "sink", (H,), "normal", 1.0, torch.float32)]
    if kind != "swa":
        specs += _compressor_specs(p + "comp.", D, d.ratio(kind), h, comp_dt)
    if kind == "csa":
        specs += _compressor_specs(p + "idx.", d.Di, d.csa, h, comp_dt) + [linear(p + "wq_idx", d.Hi * d.Di, d.qr)]
    specs += [Spec(p + "ln2", (h,), "const", 1.0), linear(p + "router", d.E, h),
              *expert_linear(p + "experts_gu", 2 * d.I, h, d.experts, groups=d.E),
              *expert_linear(p + "experts_down", h, d.I, d.experts, out_gain, groups=d.E)]
    if d.Is:
        specs += [*expert_linear(p + "shared_gu", 2 * d.Is, h, d.experts),
                  *expert_linear(p + "shared_down", h, d.Is, d.experts, out_gain)]
    return specs


def model_specs(shape: ModelShape, ep_ranks: int | None = None, dtype=torch.bfloat16) -> list[Spec]:
    """Every weight of one rank and its MTP layer; the compressors in fp32 (float64 in a float64
    model), as the kernels keep them."""
    bad = sorted(set(shape.layer_kinds) - {"swa", "csa", "hca"})
    if bad or shape.mlp.get("kind") != "moe":
        raise SimtreeError(f"model {shape.name!r} is not a V4 model (layer kinds {bad}, mlp "
                           f"{shape.mlp.get('kind')!r}): the V4 layers are swa / csa / hca with MoE")
    if shape.draft.get("attention", "swa") != "swa":
        raise SimtreeError(f"model {shape.name!r}: the V4 MTP layer is an SWA block, draft.attention is "
                           f"{shape.draft.get('attention')!r}")
    d = V4Dims.of(shape, ep_ranks)
    comp_dt = torch.float64 if dtype == torch.float64 else torch.float32
    gain = residual_gain(shape.num_layers)
    specs = ends_specs(d.vocab, d.h)
    for i, kind in enumerate(shape.layer_kinds):
        specs += layer_specs(f"layers.{i}.", kind, d, gain, comp_dt)
    return specs + mtp_specs(d.h, layer_specs("mtp.", "swa", d, gain, comp_dt))


def attn_config(d: V4Dims) -> V4AttnConfig:
    return V4AttnConfig(num_heads=d.H, head_dim=d.D, rope_dim=d.rope, window=d.window, csa_ratio=d.csa,
                        hca_ratio=d.hca, topk=d.topk, indexer_heads=d.Hi, indexer_dim=d.Di, hidden=d.h,
                        rope_theta=ROPE_THETA, page_size=256 if d.h >= 1024 else 16)


def layer_weights(w: dict, kind: str, d: V4Dims) -> V4LayerWeights:
    """The kernels' view of a layer's attention weights (compressors, sink)."""
    def comp(p, dim, ratio):
        return CompressorParams(w[p + "wkv"], w[p + "wgate"], w[p + "ape"], w[p + "norm"], ratio, dim, d.rope,
                                ratio == 4, theta=ROPE_THETA)
    return V4LayerWeights(kind, comp("comp.", d.D, d.ratio(kind)) if kind != "swa" else None,
                          comp("idx.", d.Di, d.csa) if kind == "csa" else None, w["sink"])


# ---- per-round metadata ---------------------------------------------------------------------
@dataclass
class V4Round:
    """One round's shared metadata: B sequences x n nodes; pos [N]; cs [N, R] RoPE rows; depth
    [B, n]; plans {kind: VerifyPlan} (device plans, one per layer kind)."""

    B: int
    n: int
    lengths: torch.Tensor
    pos: torch.Tensor
    cs: torch.Tensor
    depth: torch.Tensor
    plans: dict


@functools.lru_cache(maxsize=32)
def _cu(B: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, B * n + 1, n, dtype=torch.int64, device=device)


def round_meta(rope: RopeTable, kinds: dict, lengths: torch.Tensor, parents: torch.Tensor,
               max_context: int) -> V4Round:
    """The round's device plans for trees ``parents`` [B, n] (local, -1 at the root; n = 1:
    plain decoding), one per layer kind (``kinds``: {kind: (cache, V4LayerWeights)} of a layer
    of that kind), with its positions and RoPE rows.  ``max_context``: the plans' bound on a
    sequence's cached tokens (their static sizes follow it)."""
    B, n = parents.shape
    flat, cu = parents.reshape(-1), _cu(B, n, parents.device)
    plans = {kind: plan_verify_device(cache, lw, flat, cu, lengths, n, max_context)
             for kind, (cache, lw) in kinds.items()}
    first = next(iter(plans.values()))
    pos = lengths[first.node_seq] + first.depth
    return V4Round(B, n, lengths, pos, rope.rows(pos), first.depth.view(B, n), plans)


def commit_plans(kinds: dict, rm: V4Round, accepted: torch.Tensor) -> dict:
    """{kind: CommitPlan} for the accepted nodes (LOCAL index, int64 [B]) of the round."""
    return {kind: plan_commit_device(cache, lw, rm.plans[kind], accepted) for kind, (cache, lw) in kinds.items()}


def advance(lengths: torch.Tensor, rm: V4Round, accepted: torch.Tensor) -> None:
    """The sequences' lengths past the accepted nodes' root paths."""
    lengths += rm.depth.gather(1, accepted[:, None])[:, 0] + 1


# ---- attention block ------------------------------------------------------------------------------
def attn_pre(w: dict, d: V4Dims, kind: str, x: torch.Tensor, cs: torch.Tensor) -> V4Inputs:
    """x [N, h] -> the kernels' V4Inputs (q [N, H, D], kv [N, D], x = RMSNorm(x), iq, iw)."""
    N = x.shape[0]
    h = ops.rms_norm(x, w["ln1"], EPS)
    a = F.linear(h, w["wqkv_a"])
    qr = ops.rms_norm(a[:, :d.qr], w["q_norm"], EPS)
    q = ops.norm_rope(F.linear(qr, w["wq_b"]).view(N, d.H, d.D), None, cs, d.D - d.rope, False, EPS, False)
    kv = ops.norm_rope(a[:, d.qr:d.qr + d.D].view(N, 1, d.D), w["kv_norm"], cs, d.D - d.rope, False, EPS, True)
    iq = iw = None
    if kind == "csa":
        iq = ops.norm_rope(F.linear(qr, w["wq_idx"]).view(N, d.Hi, d.Di), None, cs, d.Di - d.rope, False, EPS, False)
        iw_dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        iw = a[:, d.qr + d.D:].to(iw_dt) * d.Hi ** -0.5
    return V4Inputs(q, kv.view(N, d.D), h, iq, iw)


def attn_core(kind: str, cache: V4Cache, lw: V4LayerWeights, inp: V4Inputs, plan, impl: str):
    """The kernels' tree verify of one layer -> (o [N, H, D], scratch for the commit)."""
    with kernel_core(f"v4_{kind}_verify"):
        return tree_verify(cache, lw, inp, plan, attention=impl)


def attn_post(w: dict, d: V4Dims, x: torch.Tensor, o: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """o [N, H, D] -> x + W_ob groups(W_oa o), the RoPE taken out of o first (K == V)."""
    N = o.shape[0]
    o = ops.norm_rope(o, None, cs, d.D - d.rope, True, EPS, False)
    og = torch.bmm(o.view(N, d.G, -1).transpose(0, 1), w["wo_a"].transpose(1, 2))        # [G, N, o_rank]
    return torch.addmm(x, og.transpose(0, 1).reshape(N, -1), w["wo_b"].t())


def attn_commit(kind: str, cache: V4Cache, scratch, cplan, impl: str) -> None:
    with kernel_core(f"v4_{kind}_commit"):
        apply_commit(cache, scratch, cplan, impl=impl)


def moe(w: dict, d: V4Dims, x: torch.Tensor) -> torch.Tensor:
    """x + routed experts (top-k of the rank's E) + the shared expert, of RMSNorm(x)."""
    h = ops.rms_norm(x, w["ln2"], EPS)
    ids, wts = route_topk(h, w["router"], d.topk_e)
    y = routed_experts(h, ids, wts, fp8.weight(w, "experts_gu"), fp8.weight(w, "experts_down"))
    if d.Is:
        act = ops.silu_mul(fp8.linear(h, fp8.weight(w, "shared_gu")))
        down = fp8.weight(w, "shared_down")
        y = fp8.linear(act, down) + y if isinstance(down, fp8.Fp8Weight) else torch.addmm(y, act, down.t())
    return x + y


def layer(w: dict, d: V4Dims, kind: str, x, cache: V4Cache, lw: V4LayerWeights, rm: V4Round, impl: str):
    """One block -> (x, scratch for attn_commit)."""
    inp = attn_pre(w, d, kind, x, rm.cs)
    o, scratch = attn_core(kind, cache, lw, inp, rm.plans[kind], impl)
    return moe(w, d, attn_post(w, d, x, o, rm.cs)), scratch


def mtp_forward(w: dict, d: V4Dims, embed_table, sink, tokens, prev_hidden, cs, pos, rows, bits, cache, scratch,
                lengths) -> torch.Tensor:
    """The MTP layer (an SWA block, its own latent cache [B, S + 1, 1, 1, D] plus scratch rows
    [B, R, 1, 1, D]; window and sink) over rows tokens [B, Q] -> hidden [B, Q, h]."""
    B, Q = tokens.shape
    e = ops.rms_norm(embed(embed_table, tokens), w["enorm"], EPS)
    hn = ops.rms_norm(prev_hidden.reshape(B * Q, -1), w["hnorm"], EPS)
    x = F.linear(torch.cat([e, hn], -1), w["fc"])
    inp = attn_pre(w, d, "swa", x, cs)
    R, S = scratch.shape[1], cache.shape[1] - 1
    dest = (rows + (torch.arange(B, device=rows.device) * R)[:, None]).reshape(-1)
    scratch.view(B * R, d.D).index_copy_(0, dest, inp.kv)
    lat = cache[:, :S, 0]
    with kernel_core("tree_attention"):
        o = tree_attention(inp.q.view(B, Q, d.H, d.D), lat, lat, lengths, pos, scratch[:, :, 0], scratch[:, :, 0],
                           bits, scale=d.D ** -0.5, window=d.window, sink=sink)
    x = attn_post(w, d, x, o.view(B * Q, d.H, d.D), cs)
    return moe(w, d, x).view(B, Q, -1)
