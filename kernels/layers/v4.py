"""Layers of DeepSeek-V4 (one expert-parallel rank), built from the kernels: what the full
runtime's rank composes and what the profiler times, layer kind by layer kind.

The residual stream is ``hc`` hyper-connection streams x [T, hc, h] (:mod:`.mhc`; the experts FP8
where the shape's expert format says so, the attention's linears where its ``attn_proj_dtype``
does, :mod:`.fp8`); a layer:

    a = hc_pre(x);  x = hc_post(x, W_ob groups(W_oa o), a),  o = tree verify of the SWA / CSA /
                                                         HCA attention of RMSNorm(a's input)
    m = hc_pre(x);  x = hc_post(x, MoE(RMSNorm(m's input)), m)

with, from h = RMSNorm(input) and one fused GEMM h -> [q latent | kv latent (| indexer weights;
FP8 layers run those bf16 weights as a GEMM of their own, ``wi_head``)]:
q = RoPE(RMSNorm_per_head(W_qb RMSNorm(q latent))) (the per-head norm unweighted), kv =
RoPE(RMSNorm(kv latent)) (RoPE on the last ``rope_dim`` channels; removed from o again since
K == V), the compressors reading h, the CSA indexer's queries RoPE(W_iq q latent) and head
weights (the fused GEMM's last Hi columns) / sqrt(Hi).  RoPE: base ``rope_theta`` on SWA
layers, ``compress_rope_theta`` (YaRN where configured) on CSA / HCA layers, their
compressors and the indexer.  V4 rotates interleaved channel pairs (2i, 2i + 1); simtree keeps
each rope slice de-interleaved (evens, then odds: the kernels' half-split rotation), and the
checkpoint loader permutes the rope rows of every projection that writes them
(:mod:`simtree.checkpoints.deepseek_v4`), so the rotation is V4's exactly.

MoE: ``sqrtsoftplus`` scores; the top-k of scores + ``e_score_correction_bias`` (selection
only), or on a hash layer (``mlp_layer_types`` "hash_moe") the table ``tid2eid[token id]``;
weights the chosen scores renormalised times ``routed_scaling_factor``; expert gate / up clamped
by ``swiglu_limit``; plus the shared expert (clamped alike).  The model ends in ``hc_head``,
the final RMSNorm and the LM head.

The round's index lists are the kernels' device plans (``plan_verify_device`` /
``plan_commit_device``: static shapes, no host sync), one per layer kind per round, shared by
that kind's layers (their caches have the same pages); :func:`round_meta` builds them with the
round's positions and RoPE rows, :func:`commit_plans` the commit's.

The rank's experts are the shape's: a rank's shape (``ModelShape.shard("ep=8")``: 32 of
DeepSeek-V4-Flash's 256, 6 of them per token) carries its own expert count; a whole-model shape
(deployment "tp=1") is split over :func:`default_ep_ranks` ranks, to the same 32.  A rank routes
over its own experts (router rows and hash table of the rank): the all-to-all is not run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from simtree.parallel import DEFAULT_DEPLOYMENT, parse_deployment
from simtree.errors import SimtreeError
from simtree.kernels.v4._launched import tree_verify_fused
from simtree.kernels.v4 import (CompressorParams, V4AttnConfig, V4Cache, V4Inputs, V4LayerWeights, apply_commit,
                                plan_commit_device, plan_verify_device, tree_verify)
from simtree.models import ModelShape, hash_layers
from simtree.quant import expert_dtype, runtime_attn_proj

from . import fp8, ops
from .attention import tree_attention
from .forms import v4_form, v4_fusions
from .head import embed
from .mhc import expand, hc_head, hc_post, hc_pre
from .moe import route_v4, routed_experts, swiglu
from .opcount import kernel_core
from .rope import RopeTable, inv_freq
from .weights import Spec, expert_linear, linear, residual_gain

__all__ = ["V4Dims", "EP_RANKS", "ROPE_THETA", "default_ep_ranks", "rank_experts", "layer_specs", "model_specs",
           "attn_config", "layer_weights", "rope_tables", "V4Round", "round_meta", "commit_plans", "advance",
           "attn_pre", "attn_core", "attn_post", "attn_commit", "moe", "attn_block_pre", "attn_block_post",
           "moe_block", "layer", "embed_streams", "hc_collapse", "final_hidden", "mtp_forward", "EPS"]

EP_RANKS = 8
ROPE_THETA = 10000.0      # rope_theta of V4-Flash (the SWA layers)
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
    hc: int = 4                      # hyper-connection streams (hc_mult)
    hc_iters: int = 20               # Sinkhorn iterations
    hc_eps: float = 1e-6
    eps: float = EPS                 # rms_norm_eps
    limit: float = 10.0              # swiglu_limit (0: none)
    route_scale: float = 1.5         # routed_scaling_factor
    theta: float = 10000.0           # rope_theta (SWA layers)
    ctheta: float = 160000.0         # compress_rope_theta (CSA / HCA layers, compressors, indexer)
    yarn: tuple = ()                 # the compressed layers' YaRN parameters, (key, value) pairs
    hash_layers: tuple = ()          # indices of the hash-routed MoE layers
    experts: str = "bf16"            # the routed and shared experts' weights: bf16 or fp8 (block-scaled)
    proj: str = "bf16"               # the attention's linears: bf16 or fp8 (block-scaled, as the checkpoint ships)

    @classmethod
    def of(cls, shape: ModelShape, ep_ranks: int | None = None) -> "V4Dims":
        v, m = shape.v4, shape.mlp
        E, _ = rank_experts(shape, ep_ranks)
        hashed = hash_layers(shape)
        yarn = v.get("rope_scaling") or {}
        return cls(shape.hidden, shape.vocab, int(v["q_heads"]), int(v["head_dim"]), int(v["rope_dim"]),
                   int(v["q_lora_rank"]), int(v["o_groups"]), int(v["o_lora_rank"]), int(v["window"]),
                   int(v["csa_ratio"]), int(v["hca_ratio"]), int(v["index_topk"]), int(v["index_heads"]),
                   int(v["index_head_dim"]), E, int(m["experts_per_token"]), int(m["expert_intermediate"]),
                   int(m.get("n_shared", 0)) * int(m.get("shared_intermediate", 0)),
                   int(v.get("hc_mult", 4)), int(v.get("hc_sinkhorn_iters", 20)), float(v.get("hc_eps", 1e-6)),
                   float(v.get("rms_norm_eps", EPS)), float(m.get("swiglu_limit", 10.0) or 0.0),
                   float(m.get("routed_scaling_factor", 1.5)), float(v.get("rope_theta", 10000.0)),
                   float(v.get("compress_rope_theta", 160000.0)),
                   tuple(sorted(yarn.items())) if yarn.get("rope_type", yarn.get("type")) == "yarn" else (),
                   hashed, experts=expert_dtype(m), proj=runtime_attn_proj(v))

    def ratio(self, kind: str) -> int:
        return {"swa": 0, "csa": self.csa, "hca": self.hca}[kind]

    def a_out(self, kind: str) -> int:
        """Columns of the fused first projection: q latent | kv latent (| the indexer's head
        weights, bf16 layers only: FP8 layers keep that bf16 projection apart, ``wi_head``)."""
        return self.qr + self.D + (self.Hi if kind == "csa" and self.proj == "bf16" else 0)

    def freqs(self, kind: str):
        """Inverse RoPE frequencies of a layer kind (SWA: rope_theta; CSA / HCA: the compressed ones)."""
        if kind == "swa":
            return inv_freq(self.rope, self.theta)
        return inv_freq(self.rope, self.ctheta, dict(self.yarn) or None)


# ---- weights ----------------------------------------------------------------------------------
def comp_proj_dtype(dt):
    """The compressors' projections' dtype under the form ``v4_comp``: None (the model's dtype,
    as the checkpoint ships them) for "model", else ``dt`` (fp32, float64 in a float64 model)."""
    return None if v4_form("v4_comp") == "model" else dt


def _compressor_specs(p: str, dim: int, ratio: int, h: int, dt) -> list[Spec]:
    """A compressor: its two projections at ``comp_proj_dtype(dt)`` (the kernels multiply them
    into fp32 either way, compressor.matmul_t), its position bias and norm in ``dt`` (fp32,
    float64 in a float64 model)."""
    c = (2 if ratio == 4 else 1) * dim
    pdt = comp_proj_dtype(dt)
    return [linear(p + "wkv", c, h, dtype=pdt), linear(p + "wgate", c, h, dtype=pdt),
            Spec(p + "ape", (ratio, c), "normal", 0.5, dt), Spec(p + "norm", (dim,), "const", 1.0, dt)]


def _hc_specs(p: str, d: V4Dims, dt) -> list[Spec]:
    n = (2 + d.hc) * d.hc
    return [linear(p + "_fn", n, d.hc * d.h, dtype=dt), Spec(p + "_base", (n,), "const", 0.0, dt),
            Spec(p + "_scale", (3,), "const", 1.0, dt)]


def layer_specs(p: str, kind: str, d: V4Dims, out_gain: float, comp_dt, hashed: bool = False) -> list[Spec]:
    """One block: attention of ``kind`` (swa / csa / hca), the rank's MoE (``hashed``: routed by
    the token-id table) and the two hyper-connections."""
    if kind not in ("swa", "csa", "hca"):
        raise SimtreeError(f"a V4 layer is swa, csa or hca, not {kind!r}")
    h, H, D, pj = d.h, d.H, d.D, d.proj
    specs = [Spec(p + "ln1", (h,), "const", 1.0), *expert_linear(p + "wqkv_a", d.a_out(kind), h, pj),
             Spec(p + "q_norm", (d.qr,), "const", 1.0), *expert_linear(p + "wq_b", H * D, d.qr, pj),
             Spec(p + "kv_norm", (D,), "const", 1.0),
             *expert_linear(p + "wo_a", d.orank, H // d.G * D, pj, groups=d.G),
             *expert_linear(p + "wo_b", h, d.G * d.orank, pj, out_gain),
             Spec(p + "sink", (H,), "normal", 1.0, torch.float32)]
    if kind != "swa":
        specs += _compressor_specs(p + "comp.", D, d.ratio(kind), h, comp_dt)
    if kind == "csa":
        specs += _compressor_specs(p + "idx.", d.Di, d.csa, h, comp_dt) + \
            expert_linear(p + "wq_idx", d.Hi * d.Di, d.qr, pj) + ([linear(p + "wi_head", d.Hi, h)] if pj == "fp8" else [])
    specs += [Spec(p + "ln2", (h,), "const", 1.0), linear(p + "router", d.E, h),
              *expert_linear(p + "experts_gu", 2 * d.I, h, d.experts, groups=d.E),
              *expert_linear(p + "experts_down", h, d.I, d.experts, out_gain, groups=d.E)]
    specs.append(Spec(p + "tid2eid", (d.vocab, d.topk_e), "randint", d.E, torch.int64) if hashed
                 else Spec(p + "router_bias", (d.E,), "const", 0.0, comp_dt))
    if d.Is:
        specs += [*expert_linear(p + "shared_gu", 2 * d.Is, h, d.experts),
                  *expert_linear(p + "shared_down", h, d.Is, d.experts, out_gain)]
    return specs + _hc_specs(p + "hc_attn", d, comp_dt) + _hc_specs(p + "hc_ffn", d, comp_dt)


def _head_specs(p: str, d: V4Dims, dt) -> list[Spec]:
    """A final hyper-connection collapse (hc_head): fn [hc, hc h], base [hc], scale [1]."""
    return [linear(p + "hc_head_fn", d.hc, d.hc * d.h, dtype=dt), Spec(p + "hc_head_base", (d.hc,), "const", 0.0, dt),
            Spec(p + "hc_head_scale", (1,), "const", 1.0, dt)]


def ends_specs(d: V4Dims, comp_dt=torch.float32) -> list[Spec]:
    """Token embedding, LM head, final norm and the final hyper-connection collapse."""
    return [Spec("embed", (d.vocab, d.h)), linear("lm_head", d.vocab, d.h), Spec("norm", (d.h,), "const", 1.0),
            *_head_specs("", d, comp_dt)]


def mtp_specs(d: V4Dims, gain: float, comp_dt) -> list[Spec]:
    """The MTP layer: token / hidden norms and projections (e_proj, h_proj: [h, h] each, the
    hidden one applied to every stream), an SWA block with routed MoE, its own hc_head and norm."""
    h = d.h
    return [Spec("mtp.enorm", (h,), "const", 1.0), Spec("mtp.hnorm", (h,), "const", 1.0),
            linear("mtp.e_proj", h, h), linear("mtp.h_proj", h, h), *layer_specs("mtp.", "swa", d, gain, comp_dt),
            Spec("mtp.norm", (h,), "const", 1.0), *_head_specs("mtp.", d, comp_dt)]


def model_specs(shape: ModelShape, ep_ranks: int | None = None, dtype=torch.bfloat16) -> list[Spec]:
    """Every weight of one rank and its MTP layer; the compressors' projections as the form
    ``v4_comp`` says (fp32 or the model's dtype), their position bias and norm, the
    hyper-connections, sinks and router bias in fp32 (float64 in a float64 model)."""
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
    specs = ends_specs(d, comp_dt)
    for i, kind in enumerate(shape.layer_kinds):
        specs += layer_specs(f"layers.{i}.", kind, d, gain, comp_dt, i in d.hash_layers)
    return specs + mtp_specs(d, gain, comp_dt)


def attn_config(d: V4Dims) -> V4AttnConfig:
    return V4AttnConfig(num_heads=d.H, head_dim=d.D, rope_dim=d.rope, window=d.window, csa_ratio=d.csa,
                        hca_ratio=d.hca, topk=d.topk, indexer_heads=d.Hi, indexer_dim=d.Di, hidden=d.h,
                        norm_eps=d.eps, rope_theta=d.ctheta, page_size=256 if d.h >= 1024 else 16)


def layer_weights(w: dict, kind: str, d: V4Dims) -> V4LayerWeights:
    """The kernels' view of a layer's attention weights (compressors, sink)."""
    freqs = tuple(float(f) for f in d.freqs("csa"))

    def comp(p, dim, ratio):
        return CompressorParams(w[p + "wkv"], w[p + "wgate"], w[p + "ape"], w[p + "norm"], ratio, dim, d.rope,
                                ratio == 4, d.eps, d.ctheta, freqs)
    return V4LayerWeights(kind, comp("comp.", d.D, d.ratio(kind)) if kind != "swa" else None,
                          comp("idx.", d.Di, d.csa) if kind == "csa" else None, w["sink"])


def rope_tables(d: V4Dims, device, dtype) -> dict:
    """{"main": SWA layers' table, "compress": CSA / HCA layers'}."""
    return {"main": RopeTable(d.rope, d.theta, device, dtype=dtype, freqs=d.freqs("swa")),
            "compress": RopeTable(d.rope, d.ctheta, device, dtype=dtype, freqs=d.freqs("csa"))}


# ---- per-round metadata ---------------------------------------------------------------------
@dataclass
class V4Round:
    """One round's shared metadata: B sequences x n nodes; pos [N]; cs [N, R] RoPE rows of the
    SWA layers, cs_c of the compressed ones; depth [B, n]; plans {kind: VerifyPlan} (device
    plans, one per layer kind)."""

    B: int
    n: int
    lengths: torch.Tensor
    pos: torch.Tensor
    cs: torch.Tensor
    depth: torch.Tensor
    plans: dict
    cs_c: torch.Tensor | None = None

    def rows(self, kind: str) -> torch.Tensor:
        return self.cs if kind == "swa" or self.cs_c is None else self.cs_c


@functools.lru_cache(maxsize=32)
def _cu(B: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, B * n + 1, n, dtype=torch.int64, device=device)


def round_meta(ropes: dict, kinds: dict, lengths: torch.Tensor, parents: torch.Tensor,
               max_context: int) -> V4Round:
    """The round's device plans for trees ``parents`` [B, n] (local, -1 at the root; n = 1:
    plain decoding), one per layer kind (``kinds``: {kind: (cache, V4LayerWeights)} of a layer
    of that kind), with its positions and RoPE rows (``ropes``: :func:`rope_tables`).  ``max_context``: the plans' bound on a
    sequence's cached tokens (their static sizes follow it)."""
    B, n = parents.shape
    flat, cu = parents.reshape(-1), _cu(B, n, parents.device)
    plans = {kind: plan_verify_device(cache, lw, flat, cu, lengths, n, max_context)
             for kind, (cache, lw) in kinds.items()}
    first = next(iter(plans.values()))
    pos = lengths[first.node_seq] + first.depth
    return V4Round(B, n, lengths, pos, ropes["main"].rows(pos), first.depth.view(B, n), plans,
                   ropes["compress"].rows(pos))


def commit_plans(kinds: dict, rm: V4Round, accepted: torch.Tensor) -> dict:
    """{kind: CommitPlan} for the accepted nodes (LOCAL index, int64 [B]) of the round."""
    return {kind: plan_commit_device(cache, lw, rm.plans[kind], accepted) for kind, (cache, lw) in kinds.items()}


def advance(lengths: torch.Tensor, rm: V4Round, accepted: torch.Tensor) -> None:
    """The sequences' lengths past the accepted nodes' root paths."""
    lengths += rm.depth.gather(1, accepted[:, None])[:, 0] + 1


# ---- attention block ------------------------------------------------------------------------------
def attn_pre(w: dict, d: V4Dims, kind: str, x: torch.Tensor, cs: torch.Tensor) -> V4Inputs:
    """x [N, h] (the block's input) -> the kernels' V4Inputs (q [N, H, D], kv [N, D],
    x = RMSNorm(x), iq, iw); ``cs``: the kind's RoPE rows."""
    N = x.shape[0]
    h = ops.rms_norm(x, w["ln1"], d.eps)
    a = fp8.linear(h, fp8.weight(w, "wqkv_a"))
    qr = ops.rms_norm(a[:, :d.qr], w["q_norm"], d.eps)
    q = ops.norm_rope(fp8.linear(qr, fp8.weight(w, "wq_b")).view(N, d.H, d.D), None, cs, d.D - d.rope, False, d.eps,
                      True)
    kv = ops.norm_rope(a[:, d.qr:d.qr + d.D].view(N, 1, d.D), w["kv_norm"], cs, d.D - d.rope, False, d.eps, True)
    iq = iw = None
    if kind == "csa":
        iq = ops.norm_rope(fp8.linear(qr, fp8.weight(w, "wq_idx")).view(N, d.Hi, d.Di), None, cs, d.Di - d.rope,
                           False, d.eps, False)
        iw_dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        iw = a[:, d.qr + d.D:] if "wi_head" not in w else F.linear(h, w["wi_head"])
        iw = iw.to(iw_dt) * d.Hi ** -0.5
    return V4Inputs(q, kv.view(N, d.D), h, iq, iw)


def attn_core(kind: str, cache: V4Cache, lw: V4LayerWeights, inp: V4Inputs, plan, impl: str):
    """The kernels' tree verify of one layer -> (o [N, H, D], scratch for the commit)."""
    with kernel_core(f"v4_{kind}_verify"):
        fusions = v4_fusions() if impl != "torch" else ()
        if fusions:
            return tree_verify_fused(cache, lw, inp, plan, fusions, attention=impl)
        return tree_verify(cache, lw, inp, plan, attention=impl)


def attn_post(w: dict, d: V4Dims, o: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """o [N, H, D] -> W_ob groups(W_oa o) [N, h], the RoPE taken out of o first (K == V)."""
    N = o.shape[0]
    o = ops.norm_rope(o, None, cs, d.D - d.rope, True, d.eps, False)
    wo_a = fp8.weight(w, "wo_a")
    if isinstance(wo_a, fp8.Fp8Weight) and fp8.gpu_fp8(o):    # the groups: one grouped FP8 GEMM, group-major rows
        xg = o.view(N, d.G, -1).transpose(0, 1).reshape(d.G * N, -1)
        offs = torch.arange(1, d.G + 1, device=o.device, dtype=torch.int32) * N
        og = fp8.grouped_linear(xg, wo_a, offs).view(d.G, N, -1)
    else:                                                     # (elsewhere FP8 weights run dequantised)
        if isinstance(wo_a, fp8.Fp8Weight):
            wo_a = fp8.dequantize_weight(wo_a, o.dtype)
        og = torch.bmm(o.view(N, d.G, -1).transpose(0, 1), wo_a.transpose(1, 2))        # [G, N, o_rank]
    return fp8.linear(og.transpose(0, 1).reshape(N, -1), fp8.weight(w, "wo_b"))


def attn_commit(kind: str, cache: V4Cache, scratch, cplan, impl: str) -> None:
    with kernel_core(f"v4_{kind}_commit"):
        apply_commit(cache, scratch, cplan, impl=impl)


def _hc(w: dict, d: V4Dims, x: torch.Tensor, which: str):
    return hc_pre(x, w[which + "_fn"], w[which + "_base"], w[which + "_scale"], d.hc_iters, d.hc_eps, d.eps)


def attn_block_pre(w: dict, d: V4Dims, kind: str, x: torch.Tensor, cs: torch.Tensor):
    """Streams x [N, hc, h] -> (V4Inputs, the hyper-connection's (post, comb))."""
    a, post, comb = _hc(w, d, x, "hc_attn")
    return attn_pre(w, d, kind, a, cs), (post, comb)


def attn_block_post(w: dict, d: V4Dims, x: torch.Tensor, o: torch.Tensor, cs: torch.Tensor, hc) -> torch.Tensor:
    """The attention output o [N, H, D] written back into the streams x [N, hc, h]."""
    return hc_post(x, attn_post(w, d, o, cs), *hc)


def moe(w: dict, d: V4Dims, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts (top-k of the rank's E, or the hash table's) + the shared expert, of
    RMSNorm(x) [N, h] -> [N, h]; ``token_ids`` [N]: the tokens, for a hash layer."""
    h = ops.rms_norm(x, w["ln2"], d.eps)
    tid2eid = w.get("tid2eid")
    if tid2eid is not None and token_ids is None:
        raise SimtreeError("a hash-routed V4 MoE layer needs the token ids")
    ids, wts = route_v4(h, w["router"], d.topk_e, d.route_scale, w.get("router_bias"), tid2eid, token_ids)
    y = routed_experts(h, ids, wts, fp8.weight(w, "experts_gu"), fp8.weight(w, "experts_down"), d.limit)
    if d.Is:
        y = y + fp8.linear(swiglu(fp8.linear(h, fp8.weight(w, "shared_gu")), d.limit), fp8.weight(w, "shared_down"))
    return y


def moe_block(w: dict, d: V4Dims, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Streams x [N, hc, h] -> x after the MoE and its hyper-connection."""
    m, post, comb = _hc(w, d, x, "hc_ffn")
    return hc_post(x, moe(w, d, m, token_ids), post, comb)


def layer(w: dict, d: V4Dims, kind: str, x, cache: V4Cache, lw: V4LayerWeights, rm: V4Round, impl: str,
          token_ids: torch.Tensor | None = None):
    """One block over the streams x [N, hc, h] -> (x, scratch for attn_commit)."""
    cs = rm.rows(kind)
    inp, hc = attn_block_pre(w, d, kind, x, cs)
    o, scratch = attn_core(kind, cache, lw, inp, rm.plans[kind], impl)
    return moe_block(w, d, attn_block_post(w, d, x, o, cs, hc), token_ids), scratch


def embed_streams(d: V4Dims, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Tokens -> the streams [N, hc, h] (the embedding in every stream)."""
    return expand(embed(table, tokens.reshape(-1)), d.hc)


def hc_collapse(w: dict, d: V4Dims, x: torch.Tensor, prefix: str = "") -> torch.Tensor:
    """Streams [..., hc * h] -> hc_head(streams) [N, h] (``prefix`` "mtp.": the MTP's own)."""
    x = x.reshape(-1, d.hc, d.h)
    return hc_head(x, w[prefix + "hc_head_fn"], w[prefix + "hc_head_base"], w[prefix + "hc_head_scale"], d.hc_eps,
                   d.eps)


def final_hidden(w: dict, d: V4Dims, x: torch.Tensor, prefix: str = "") -> torch.Tensor:
    """Streams [..., hc * h] -> RMSNorm(hc_head(streams)) [N, h], what the LM head reads."""
    return ops.rms_norm(hc_collapse(w, d, x, prefix), w[prefix + "norm"], d.eps)


def mtp_forward(w: dict, d: V4Dims, embed_table, sink, tokens, prev_hidden, cs, pos, rows, bits, cache, scratch,
                lengths) -> torch.Tensor:
    """The MTP layer (an SWA block, its own latent cache [B, S + 1, 1, 1, D] plus scratch rows
    [B, R, 1, 1, D]; window and sink) over rows tokens [B, Q] and the previous streams
    prev_hidden [B, Q, hc * h] -> its streams [B, Q, hc * h] (before its hc_head)."""
    B, Q = tokens.shape
    e = F.linear(ops.rms_norm(embed(embed_table, tokens.reshape(-1)), w["enorm"], d.eps), w["e_proj"])
    hs = ops.rms_norm(prev_hidden.reshape(B * Q * d.hc, d.h), w["hnorm"], d.eps)
    x = F.linear(hs, w["h_proj"]).view(B * Q, d.hc, d.h) + e[:, None]
    inp, hc = attn_block_pre(w, d, "swa", x, cs)
    R, S = scratch.shape[1], cache.shape[1] - 1
    dest = (rows + (torch.arange(B, device=rows.device) * R)[:, None]).reshape(-1)
    scratch.view(B * R, d.D).index_copy_(0, dest, inp.kv)
    lat = cache[:, :S, 0]
    with kernel_core("tree_attention"):
        o = tree_attention(inp.q.view(B, Q, d.H, d.D), lat, lat, lengths, pos, scratch[:, :, 0], scratch[:, :, 0],
                           bits, window=d.window, sink=sink)
    x = attn_block_post(w, d, x, o.view(B * Q, d.H, d.D), cs, hc)
    return moe_block(w, d, x).view(B, Q, -1)
