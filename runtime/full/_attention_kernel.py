"""Triton kernel of :func:`simtree.runtime.full.attention.tree_attention` (launch details).

One program per (query, KV head, block of that head's query heads): an online softmax over
the sequence's cache rows [lo, cache_lens[b]) in blocks of BLOCK_N, then over the tree rows
whose bit is set, then the sink.  Lengths, positions and bits are read on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from simtree.errors import SimtreeError

__all__ = ["tree_attention_triton"]


@triton.jit
def _block(q, acc, m_i, l_i, K, V, rows, valid, s_kr, s_vr, d, scale):
    """One block of keys (row offsets ``rows`` [BLOCK_N] int64, ``valid``) folded into the
    online softmax of q [BLOCK_G, D]."""
    k = tl.load(K + rows[:, None] * s_kr + d[None, :], mask=valid[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + rows[:, None] * s_vr + d[None, :], mask=valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_kernel(Q, KC, VC, KT, VT, LENS, QPOS, BITS, SINK, OUT,
                           s_qb, s_qq, s_qh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                           s_ktb, s_ktt, s_kth, s_vtb, s_vtt, s_vth, s_ob, s_oq, s_oh,
                           NQ, T, scale,
                           G: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                           WINDOW: tl.constexpr, HAS_SINK: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.program_id(2) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = g < G
    heads = kvh * G + g
    b = (pid // NQ).to(tl.int64)
    qi = (pid % NQ).to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + qi * s_qq + heads[:, None] * s_qh + d[None, :], mask=gmask[:, None], other=0.0)
    L = tl.load(LENS + b)
    lo = L * 0
    if WINDOW > 0:
        lo = tl.maximum(tl.load(QPOS + pid) - WINDOW + 1, 0)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    kc = KC + b * s_kcb + kvh * s_kch
    vc = VC + b * s_vcb + kvh * s_vch
    for start in range((lo // BLOCK_N) * BLOCK_N, L, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N).to(tl.int64)
        acc, m_i, l_i = _block(q, acc, m_i, l_i, kc, vc, n, (n >= lo) & (n < L), s_kcs, s_vcs, d, scale)
    kt = KT + b * s_ktb + kvh * s_kth
    vt = VT + b * s_vtb + kvh * s_vth
    for start in range(0, T, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N).to(tl.int64)
        inside = t < T
        word = tl.load(BITS + pid.to(tl.int64) * W + t // 64, mask=inside, other=0)
        seen = inside & (((word >> (t % 64)) & 1) != 0)
        acc, m_i, l_i = _block(q, acc, m_i, l_i, kt, vt, t, seen, s_ktt, s_vtt, d, scale)
    if HAS_SINK:
        sk = tl.load(SINK + heads, mask=gmask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, sk)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sk - m_new)
        acc = acc * alpha[:, None]
    out = acc / l_i[:, None]
    tl.store(OUT + b * s_ob + qi * s_oq + heads[:, None] * s_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=gmask[:, None])


def tree_attention_triton(q, k_cache, v_cache, cache_lens, q_pos, k_tree, v_tree, tree_bits, *,
                          scale: float, window: int = 0, sink=None) -> torch.Tensor:
    B, Q, Hq, D = q.shape
    Hkv, T = k_cache.shape[2], k_tree.shape[1]
    G = Hq // Hkv
    if D < 16 or D & (D - 1):
        raise SimtreeError(f"tree attention kernel needs a power-of-two head dim >= 16, got {D}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_tree", k_tree), ("v_tree", v_tree)):
        if t.stride(-1) != 1:
            raise SimtreeError(f"tree attention kernel needs {name} contiguous in its last dim")
    out = torch.empty_like(q)
    block_g = 16                  # tl.dot's smallest M; query heads of one KV head share a tile
    block_n = 64 if D <= 256 else 32
    lens = cache_lens.to(torch.int64).contiguous()
    pos = q_pos.to(torch.int64).contiguous()
    bits = tree_bits.to(torch.int64).contiguous()
    sink_t = sink.float().contiguous() if sink is not None else lens
    grid = (B * Q, Hkv, triton.cdiv(G, block_g))
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, k_tree, v_tree, lens, pos, bits, sink_t, out,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_tree.stride(0), k_tree.stride(1),
        k_tree.stride(2), v_tree.stride(0), v_tree.stride(1), v_tree.stride(2),
        out.stride(0), out.stride(1), out.stride(2), Q, T, float(scale),
        G=G, D=D, W=bits.shape[-1], BLOCK_G=block_g, BLOCK_N=block_n, WINDOW=int(window),
        HAS_SINK=sink is not None, num_warps=4 if D <= 128 else 8)
    return out
