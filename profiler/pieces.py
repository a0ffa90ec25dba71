"""Torch building blocks timed by the stages: GEMM parts of a layer, MoE, attention cores.

Every ``*_piece`` builder allocates its own random inputs (never zeros) and returns
``(step, instance_bytes)``: ``step()`` runs the part once without host syncs (so it can be
captured in a CUDA graph); ``instance_bytes`` counts the inputs private to this copy (weights
are shared through ``ctx.weights`` and not counted). Shapes: T = tokens in the step
(batch * nodes per sequence), h = hidden size.
"""
from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from simtree.costs.forms import touched_experts
from simtree.costs.steps import random_tree
from simtree.models import ModelShape
from simtree.trees.tree import TreeBatch

__all__ = ["v4_window_index", "Ctx", "tree_batch", "proj_piece", "mlp_piece", "lm_head_piece", "attn_core_piece",
           "v4_core_piece", "sdpa_with_lse", "tree_attention", "v4_gather_attention", "nbytes"]


@dataclass
class Ctx:
    """Where and how to build pieces: model shape, device, dtype, shared weight cache."""

    model: ModelShape
    device: torch.device
    dtype: torch.dtype
    seed: int = 0
    weights: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    def gen(self, salt: int = 0) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1_000_003 + salt)
        return g

    def randn(self, *shape, scale: float = 1.0, dtype=None, salt: int = 0) -> torch.Tensor:
        dtype = dtype or self.dtype
        t = torch.randn(*shape, device=self.device, dtype=torch.float32 if dtype in (torch.float64,) else dtype,
                        generator=self.gen(salt + len(shape) * 7919 + sum(shape)))
        return (t * scale).to(dtype)

    def weight(self, name: str, *shape) -> torch.Tensor:
        """Shared random weight, scaled ~ 1/sqrt(fan_in) so activations stay O(1)."""
        key = (self.model.name, name, shape)
        if key not in self.weights:
            self.weights[key] = self.randn(*shape, scale=shape[-2] ** -0.5 if len(shape) >= 2 else 1.0,
                                           salt=zlib.crc32(name.encode()) % 10_000)
        return self.weights[key]


def nbytes(*tensors: torch.Tensor) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


# ---- trees --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=128)
def tree_batch(b: int, n: int, shape: str, seed: int = 0) -> TreeBatch:
    """b trees of n nodes each (a few distinct trees, cycled, to keep building cheap)."""
    rng = np.random.default_rng(seed)
    distinct = [random_tree(n, shape, rng) for _ in range(min(b, 4))]
    return TreeBatch(tuple(distinct[i % len(distinct)] for i in range(b)))


def _rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],))


# ---- GEMM parts ---------------------------------------------------------------------------
def proj_piece(ctx: Ctx, kind: str, T: int):
    """Projections + norms of one layer's attention block of ``kind`` at T tokens
    (everything in the layer except the attention core and the MLP)."""
    m, h = ctx.model, ctx.model.hidden
    x = ctx.randn(T, h, salt=T)
    if kind == "gdn":
        g = m.gdn
        dqk, dv = g["key_heads"] * g["key_dim"], g["value_heads"] * g["value_dim"]
        w_in = ctx.weight("gdn_qkvz", h, 2 * dqk + 2 * dv)
        w_ba = ctx.weight("gdn_ba", h, 2 * g["value_heads"])
        w_out = ctx.weight("gdn_o", dv, h)
        conv_w = ctx.weight("gdn_conv", g.get("conv_kernel", 4), 2 * dqk + dv)
        o = ctx.randn(T, g["value_heads"], g["value_dim"], salt=T + 1)

        def step():
            xn = _rms(x)
            qkvz = xn @ w_in
            qkv = qkvz[:, : 2 * dqk + dv]
            y = qkv * conv_w[0]                       # short causal conv: one FMA per tap
            for t in range(1, conv_w.shape[0]):
                y = y + qkv * conv_w[t]
            F.silu(y)
            xn @ w_ba
            z = qkvz[:, 2 * dqk + dv:].view(T, g["value_heads"], g["value_dim"])
            gated = _rms(o) * F.silu(z)               # RMSNorm(o) * SiLU(x W_z)
            return gated.reshape(T, dv) @ w_out
        return step, nbytes(x, o)
    if kind == "attn":
        a = m.attn
        dq = a["q_heads"] * a["head_dim"] * (2 if a.get("output_gate") else 1)
        dkv = 2 * a["kv_heads"] * a["head_dim"]
        w_q, w_kv = ctx.weight("attn_q", h, dq), ctx.weight("attn_kv", h, dkv)
        w_o = ctx.weight("attn_o", a["q_heads"] * a["head_dim"], h)
        o = ctx.randn(T, a["q_heads"] * a["head_dim"], salt=T + 2)

        def step():
            xn = _rms(x)
            q = (xn @ w_q).view(T, -1, a["head_dim"])
            kv = (xn @ w_kv).view(T, -1, a["head_dim"])
            _rms(q), _rms(kv)                          # q/k norms (RoPE is of the same order)
            gate = q[:, a["q_heads"]:] if a.get("output_gate") else None
            out = o if gate is None else o * torch.sigmoid(gate.reshape(T, -1))
            return out @ w_o
        return step, nbytes(x, o)
    # V4 (swa / csa / hca): low-rank q, one latent kv, grouped low-rank output projection.
    v = m.v4
    H, D, G = v["q_heads"], v["head_dim"], v["o_groups"]
    w_qa, w_qb = ctx.weight("v4_qa", h, v["q_lora_rank"]), ctx.weight("v4_qb", v["q_lora_rank"], H * D)
    w_kv = ctx.weight("v4_kv", h, D)
    w_oa = ctx.weight("v4_oa", G, H // G * D, v["o_lora_rank"])
    w_ob = ctx.weight("v4_ob", G * v["o_lora_rank"], h)
    extra = []
    if kind == "csa":   # C4 compressor (overlapping: 2x channels for kv and gate) + indexer
        extra = [ctx.weight("csa_comp", h, 4 * D), ctx.weight("idx_comp", h, 4 * v["index_head_dim"]),
                 ctx.weight("idx_w", h, v["index_heads"])]
        w_iq = ctx.weight("idx_q", v["q_lora_rank"], v["index_heads"] * v["index_head_dim"])
    elif kind == "hca":
        extra = [ctx.weight("hca_comp", h, 2 * D)]
    o = ctx.randn(T, H * D, salt=T + 3)
    hc_in, hc_out = _v4_hyper(ctx, T)

    def step():
        xn = _rms(hc_in())
        qa = _rms(xn @ w_qa)
        qa @ w_qb
        _rms(xn @ w_kv)
        for w in extra:
            xn @ w
        if kind == "csa":
            qa @ w_iq
        og = torch.bmm(o.view(T, G, H // G * D).transpose(0, 1), w_oa)  # [G, T, o_rank]
        return hc_out(og.transpose(0, 1).reshape(T, -1) @ w_ob)
    return step, nbytes(x, o)


def _v4_hyper(ctx: Ctx, T: int):
    """A V4 block's hyper-connection around it (kernels/layers/mhc.py): (collapse() -> the block's
    input [T, h], expand(out) -> the new streams), over hc_mult random streams [T, hc, h]."""
    from simtree.kernels.layers.mhc import hc_post, hc_pre
    v, h = ctx.model.v4, ctx.model.hidden
    hc, iters = int(v.get("hc_mult", 4)), int(v.get("hc_sinkhorn_iters", 20))
    xs = ctx.randn(T, hc, h, salt=T + 6)
    fn = ctx.weight("v4_hc_fn", (2 + hc) * hc, hc * h).to(torch.float64 if ctx.dtype == torch.float64 else torch.float32)
    base = torch.zeros((2 + hc) * hc, device=ctx.device, dtype=torch.float32)
    scale = torch.ones(3, device=ctx.device, dtype=torch.float32)
    held = {}

    def collapse():
        held["x"], held["post"], held["comb"] = hc_pre(xs, fn, base, scale, iters, 1e-6, 1e-6)
        return held["x"]

    def expand(out):
        return hc_post(xs, out, held["post"], held["comb"])
    return collapse, expand


def mlp_piece(ctx: Ctx, T: int):
    """The MLP of one layer at T tokens: dense SwiGLU, or MoE = router + the touched experts.

    MoE method: T tokens x top-k picks touch e experts, the expected count under uniform
    routing (``simtree.costs.forms.touched_experts``, rounded: what the runtime's softmax gate
    over random weights touches, and what the fitted cost model assumes); their weights are
    read once. We time a batched GEMM over e experts with ceil(T*topk/e) tokens each, plus the
    router GEMM, top-k, the token gather and the weighted scatter back, plus the shared experts
    as a dense SwiGLU.
    """
    m, h = ctx.model.mlp, ctx.model.hidden
    x = ctx.randn(T, h, salt=T + 4)
    if m["kind"] == "dense":
        w_gu, w_d = ctx.weight("mlp_gu", h, 2 * m["intermediate"]), ctx.weight("mlp_d", m["intermediate"], h)

        def step():
            gu = _rms(x) @ w_gu
            a, b = gu.chunk(2, dim=-1)
            return (F.silu(a) * b) @ w_d
        return step, nbytes(x)
    E, k, I = m["n_experts"], m["experts_per_token"], m["expert_intermediate"]
    e = min(max(int(round(float(touched_experts(T, E, k)))), k), T * k, E)
    per = math.ceil(T * k / e)
    w_r = ctx.weight("moe_router", h, E)
    w_gu = ctx.weight("moe_gu", E, h, 2 * I)[:e]
    w_d = ctx.weight("moe_d", E, I, h)[:e]
    shared = m.get("n_shared", 0) * m.get("shared_intermediate", 0)
    w_sgu = ctx.weight("moe_sgu", h, 2 * shared) if shared else None
    w_sd = ctx.weight("moe_sd", shared, h) if shared else None
    rows = torch.arange(e * per, device=ctx.device) % T   # which token fills each expert slot
    hc_in, hc_out = _v4_hyper(ctx, T) if ctx.model.family == "v4" else (lambda: x, lambda y: y)

    def step():
        xn = _rms(hc_in())
        scores = (xn @ w_r).float()
        weights, _ = torch.topk(scores, k, dim=-1)
        xe = xn.index_select(0, rows).view(e, per, h)
        gu = torch.bmm(xe, w_gu)
        a, b = gu.chunk(2, dim=-1)
        ye = torch.bmm(F.silu(a) * b, w_d).view(e * per, h)
        out = torch.zeros_like(xn).index_add_(0, rows, ye * weights.to(ye.dtype).mean())
        if w_sgu is not None:
            sa, sb = (xn @ w_sgu).chunk(2, dim=-1)
            out = out + (F.silu(sa) * sb) @ w_sd
        return hc_out(out)
    return step, nbytes(x)


def lm_head_piece(ctx: Ctx, T: int, topk: int = 1):
    """Final norm + LM head GEMM over the vocab at T tokens + greedy pick (top-k if drafting)."""
    h, V = ctx.model.hidden, ctx.model.vocab
    x = ctx.randn(T, h, salt=T + 5)
    w = ctx.weight("lm_head", h, V)
    head = lambda: x                                   # noqa: E731
    if ctx.model.family == "v4":                       # the streams' final collapse first (hc_head)
        from simtree.kernels.layers.mhc import hc_head
        hc = int(ctx.model.v4.get("hc_mult", 4))
        xs = ctx.randn(T, hc, h, salt=T + 7)
        fn = ctx.weight("v4_hc_head", hc, hc * h).float()
        base, scale = torch.zeros(hc, device=ctx.device), torch.ones(1, device=ctx.device)
        head = lambda: hc_head(xs, fn, base, scale, 1e-6, 1e-6)   # noqa: E731

    def step():
        logits = _rms(head()) @ w
        if topk <= 1:
            return logits.argmax(dim=-1)
        return torch.topk(logits, topk, dim=-1)
    return step, nbytes(x)


# ---- full attention (GQA) over [context | tree] ----------------------------------------------
def sdpa_with_lse(q, k, v, scale: float):
    """softmax(q k^T * scale) v and its log-sum-exp. q [B, H, L, D], k, v [B, H, S, D].

    Uses the fused flash kernel where torch exposes its LSE; falls back to explicit math
    (small shapes / CPU tests).  An empty context (S = 0, a sweep's context_len 0) attends to
    nothing: output 0, LSE -inf (torch's CPU flash kernel dies of SIGFPE on it)."""
    if k.shape[2] == 0:
        return q.new_zeros(q.shape), torch.full(q.shape[:3], float("-inf"), device=q.device)
    if q.is_cuda:
        try:
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
            return res[0], res[1]
        except (RuntimeError, TypeError):
            res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)
            return res[0], res[1][..., : q.shape[2]]
    if q.dtype in (torch.float32, torch.bfloat16) and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        return out, lse
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype), lse


def tree_attention(q, k_ctx, v_ctx, k_tree, v_tree, tree_bias, scale: float):
    """Tree verify attention for GQA, as a cascade: every node sees the whole context (one
    dense flash call, q heads folded into the query axis) plus its tree ancestors (a small
    masked n x n part); the two softmaxes are merged through their log-sum-exps.

    q [B, Hq, n, D]; k_ctx, v_ctx [B, Hkv, l, D]; k_tree, v_tree [B, Hkv, n, D];
    tree_bias [B, 1, n, n] (0 on ancestor-or-self, -inf elsewhere). Returns [B, Hq, n, D].
    """
    B, Hq, n, D = q.shape
    Hkv = k_ctx.shape[1]
    G = Hq // Hkv
    qf = q.reshape(B, Hkv, G * n, D)                  # head h uses kv head h // G
    out_c, lse_c = sdpa_with_lse(qf, k_ctx, v_ctx, scale)
    s = (qf @ k_tree.transpose(-1, -2)).float() * scale
    s = s.view(B, Hkv, G, n, n) + tree_bias.view(B, 1, 1, n, n)
    s = s.reshape(B, Hkv, G * n, n)
    lse_t = torch.logsumexp(s, dim=-1)
    out_t = torch.softmax(s, dim=-1).to(v_tree.dtype) @ v_tree
    lse = torch.logaddexp(lse_c.float(), lse_t)
    w_c = torch.exp(lse_c.float() - lse).unsqueeze(-1)
    w_t = torch.exp(lse_t - lse).unsqueeze(-1)
    out = (w_c * out_c.float() + w_t * out_t.float()).to(q.dtype)
    return out.reshape(B, Hq, n, D)


def attn_core_piece(ctx: Ctx, b: int, n: int, l: int, shape: str):
    """Full-attention tree verify of one layer: b sequences, n nodes each, context l."""
    a = ctx.model.attn
    Hq, Hkv, D = a["q_heads"], a["kv_heads"], a["head_dim"]
    tb = tree_batch(b, n, shape, ctx.seed)
    mask = np.stack([t.ancestor_mask for t in tb.trees])
    bias = torch.zeros(b, 1, n, n, device=ctx.device)
    bias.masked_fill_(~torch.as_tensor(mask, device=ctx.device).unsqueeze(1), float("-inf"))
    q = ctx.randn(b, Hq, n, D, salt=1)
    kc, vc = ctx.randn(b, Hkv, l, D, salt=2), ctx.randn(b, Hkv, l, D, salt=3)
    kt, vt = ctx.randn(b, Hkv, n, D, salt=4), ctx.randn(b, Hkv, n, D, salt=5)
    scale = D ** -0.5

    def step():
        return tree_attention(q, kc, vc, kt, vt, bias, scale)
    return step, nbytes(q, kc, vc, kt, vt, bias)


# ---- DeepSeek-V4 attention core (torch gather fallback) -------------------------------------
def v4_gather_attention(q, kv_all, idx, sink, scale: float):
    """Sparse MQA over per-query index lists. q [N, H, D]; kv_all [M, D] (K == V);
    idx [N, S] rows of kv_all (-1 = skip); sink [H] per-head attention sink. -> [N, H, D]."""
    valid = idx >= 0
    kv = kv_all.index_select(0, idx.clamp_min(0).reshape(-1)).view(*idx.shape, -1)   # [N, S, D]
    s = torch.einsum("nhd,nsd->nhs", q, kv).float() * scale
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    s = torch.cat([s, sink.float().view(1, -1, 1).expand(s.shape[0], -1, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]            # the sink takes mass, contributes nothing
    return torch.einsum("nhs,nsd->nhd", p.to(kv.dtype), kv)


def v4_window_index(tb: TreeBatch, l: int, W: int) -> np.ndarray:
    """int64 [N, W]: rows of [persistent windows (b*W) | tree nodes (N)] that each node's
    sliding window covers: its ancestors-or-self (the last W of them) and, before them, the
    newest persistent tokens of its own sequence (at most min(l, W)); -1 pads."""
    b, N = tb.batch_size, tb.total_nodes
    out = np.full((N, W), -1, np.int64)
    persistent = min(l, W)
    for t, start in zip(tb.trees, tb.cu_nodes[:-1]):
        seq = int(tb.seq_ids[start])
        for i in range(t.num_nodes):
            path = np.flatnonzero(t.ancestor_mask[i]) + start
            keep_p = max(0, min(persistent, W - len(path)))
            tail = seq * W + np.arange(W - keep_p, W)          # newest persistent slots
            row = np.concatenate([tail, b * W + path[-W:]])
            out[start + i, : row.size] = row
    return out


def v4_core_piece(ctx: Ctx, kind: str, b: int, n: int, l: int, shape: str, chunk_bytes: int = 2**30):
    """One V4 layer's tree verify attention core (torch): per node, the window (persistent
    tail + own ancestors, ``window`` entries) and the compressed entries it may see (HCA: all
    completed; CSA: the indexer's top-k, scored over all C4 keys). Scratch compression of
    windows completing inside the tree is not included (a few tokens' worth of GEMV)."""
    v = ctx.model.v4
    H, D, W = v["q_heads"], v["head_dim"], v["window"]
    N = b * n
    tb = tree_batch(b, n, shape, ctx.seed)
    win_idx = v4_window_index(tb, l, W)
    win_idx_t = torch.as_tensor(win_idx, device=ctx.device)
    ratio = v["csa_ratio"] if kind == "csa" else v["hca_ratio"]
    C = l // ratio if kind != "swa" else 0
    q = ctx.randn(N, H, D, salt=11, scale=1.0)
    # One latent buffer: [persistent windows (b*W) | tree nodes (N) | compressed (b*C)]
    kv_all = ctx.randn(b * W + N + b * C, D, salt=12)
    off = b * W + N
    sink = ctx.randn(H, salt=13, dtype=torch.float32)
    scale = D ** -0.5
    tensors = [q, kv_all, win_idx_t]
    if C > 0:
        seq_t = torch.as_tensor(tb.seq_ids, device=ctx.device)
        if kind == "hca":
            comp_idx = off + seq_t.view(-1, 1) * C + torch.arange(C, device=ctx.device).view(1, -1)
            comp_idx = torch.cat([win_idx_t, comp_idx], dim=1)
            tensors.append(comp_idx)
        else:
            topk = min(v["index_topk"], C)
            Hi, Di = v["index_heads"], v["index_head_dim"]
            iq = ctx.randn(b, n, Hi, Di, salt=15)
            iw = ctx.randn(b, n, Hi, salt=16)
            ik = ctx.randn(b, C, Di, salt=17)
            tensors += [iq, iw, ik]
            per_seq = n * Hi * C * 2
            seqs_per_chunk = max(1, chunk_bytes // max(per_seq, 1))
            base = (off + torch.arange(b, device=ctx.device) * C).view(b, 1, 1)

    def step():
        if C == 0:
            return v4_gather_attention(q, kv_all, win_idx_t, sink, scale)
        if kind == "hca":
            return v4_gather_attention(q, kv_all, comp_idx, sink, scale)
        else:   # lightning indexer: sum_h w_h * ReLU(q_h . k), then top-k per node
            picks = []
            for s0 in range(0, b, seqs_per_chunk):
                s1 = min(b, s0 + seqs_per_chunk)
                sc = torch.relu(torch.einsum("bnhd,bcd->bnhc", iq[s0:s1], ik[s0:s1]))
                sc = torch.einsum("bnhc,bnh->bnc", sc, iw[s0:s1])
                picks.append(torch.topk(sc, topk, dim=-1).indices + base[s0:s1])
            idx = torch.cat(picks).view(N, topk)
        return v4_gather_attention(q, kv_all, torch.cat([win_idx_t, idx], dim=1), sink, scale)
    return step, nbytes(*tensors)
