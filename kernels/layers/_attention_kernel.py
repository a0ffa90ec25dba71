"""Triton kernel of :func:`simtree.kernels.layers.attention.tree_attention` (launch details).

One program per (sequence, KV head, block of BLOCK_R rows), a row being one (query, query head
of that KV head) pair: the sequence's queries share every K/V tile they load, as the query heads
folded into the query axis of a flash-decoding kernel do.  An online softmax runs over the
sequence's cache rows [lo, cache_lens[b]) in blocks of BLOCK_N (each row masks its own window
start), then over the tree rows whose bit is set in that row's query, then the sink.  Lengths,
positions and bits are read on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from simtree.errors import SimtreeError

__all__ = ["tree_attention_triton"]


@triton.jit
def _block(q, acc, m_i, l_i, K, V, rows, load_ok, seen, s_kr, s_vr, d, scale, PREC: tl.constexpr):
    """One block of keys (row offsets ``rows`` [BLOCK_N] int64, loaded where ``load_ok``;
    ``seen`` [BLOCK_R, BLOCK_N] which query row sees which key) folded into the online softmax."""
    k = tl.load(K + rows[:, None] * s_kr + d[None, :], mask=load_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + rows[:, None] * s_vr + d[None, :], mask=load_ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_kernel(Q, KC, VC, KT, VT, LENS, QPOS, BITS, SINK, OUT,
                           s_qb, s_qq, s_qh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                           s_ktb, s_ktt, s_kth, s_vtb, s_vtt, s_vth, s_ob, s_oq, s_oh,
                           NQ, T, scale,
                           G: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                           WINDOW: tl.constexpr, HAS_SINK: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < NQ * G
    qi = (r // G).to(tl.int64)
    heads = kvh * G + r % G
    d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + qi[:, None] * s_qq + heads[:, None] * s_qh + d[None, :], mask=r_ok[:, None],
                other=0.0)
    L = tl.load(LENS + b)
    lo = tl.zeros([BLOCK_R], tl.int64)
    if WINDOW > 0:
        pos = tl.load(QPOS + b * NQ + qi, mask=r_ok, other=0)
        lo = tl.maximum(pos - WINDOW + 1, 0)
    lo_min = tl.min(tl.where(r_ok, lo, L), 0)
    m_i = tl.full([BLOCK_R], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    kc = KC + b * s_kcb + kvh * s_kch
    vc = VC + b * s_vcb + kvh * s_vch
    for start in range((lo_min // BLOCK_N) * BLOCK_N, L, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N).to(tl.int64)
        seen = (n[None, :] >= lo[:, None]) & (n[None, :] < L) & r_ok[:, None]
        acc, m_i, l_i = _block(q, acc, m_i, l_i, kc, vc, n, n < L, seen, s_kcs, s_vcs, d, scale, PREC)
    kt = KT + b * s_ktb + kvh * s_kth
    vt = VT + b * s_vtb + kvh * s_vth
    for start in range(0, T, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N).to(tl.int64)
        inside = t < T
        word = tl.load(BITS + (b * NQ + qi)[:, None] * W + (t // 64)[None, :],
                       mask=r_ok[:, None] & inside[None, :], other=0)
        seen = ((word >> (t % 64)[None, :]) & 1) != 0
        acc, m_i, l_i = _block(q, acc, m_i, l_i, kt, vt, t, inside, seen, s_ktt, s_vtt, d, scale, PREC)
    if HAS_SINK:
        sk = tl.load(SINK + heads, mask=r_ok, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, sk)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sk - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(r_ok, l_i, 1.0)[:, None]
    tl.store(OUT + b * s_ob + qi[:, None] * s_oq + heads[:, None] * s_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=r_ok[:, None])


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
    # rows of one program share its K/V tiles; the fp32 accumulator [BLOCK_R, D] bounds them
    block_r = 16 if D >= 512 else 32 if D >= 256 else 64
    block_r = min(block_r, max(16, triton.next_power_of_2(Q * G)))
    block_n = 64 if D <= 256 else 32
    if q.element_size() > 2:   # fp32 K/V tiles: half as many keys per tile fit the shared memory
        block_n //= 2
    lens = cache_lens.to(torch.int64).contiguous()
    pos = q_pos.to(torch.int64).contiguous()
    bits = tree_bits.to(torch.int64).contiguous()
    sink_t = sink.float().contiguous() if sink is not None else lens
    grid = (B, Hkv, triton.cdiv(Q * G, block_r))
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, k_tree, v_tree, lens, pos, bits, sink_t, out,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_tree.stride(0), k_tree.stride(1),
        k_tree.stride(2), v_tree.stride(0), v_tree.stride(1), v_tree.stride(2),
        out.stride(0), out.stride(1), out.stride(2), Q, T, float(scale),
        G=G, D=D, W=bits.shape[-1], BLOCK_R=block_r, BLOCK_N=block_n, WINDOW=int(window),
        HAS_SINK=sink is not None, PREC="tf32" if q.element_size() <= 2 else "ieee", num_warps=4 if D <= 128 else 8)
    return out
