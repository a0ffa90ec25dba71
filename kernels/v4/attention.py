"""Sparse gather attention over per-query index lists, with a per-head sink (Triton + torch).

    q      [N, H, D]   queries (one shared latent head: K == V)
    idx    [N, K]      virtual row indices into concat(sources) (-1 = skip), the same form
                       FlashMLA's sparse decode takes
    sources            up to 4 tensors [P_i, D] (e.g. persistent window pool | tree nodes'
                       latents | compressed pool | scratch entries), never copied together
    sink   [H]         o_h = sum_j softmax([s_hj ..., sink_h])_j k_j,  s_hj = q_h . k_j * scale

The kernel runs one program per (query, block of 16 heads), streams BLOCK_K gathered rows at
a time and keeps an online softmax that starts from the sink (m = sink, l = 1).
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["sparse_attention", "sparse_attention_torch", "gather_rows"]


def gather_rows(idx: torch.Tensor, sources: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """idx [...] virtual rows -> (rows [..., D] with zeros at -1, valid mask [...])."""
    valid = idx >= 0
    out = None
    start = 0
    for src in sources:
        inside = valid & (idx >= start) & (idx < start + src.shape[0])
        rows = src[(idx - start).clamp(0, max(src.shape[0] - 1, 0))] if src.shape[0] else None
        if rows is not None:
            rows = torch.where(inside.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
            out = rows if out is None else out + rows
        start += src.shape[0]
    return out, valid


def sparse_attention_torch(q, idx, sources, sink, scale) -> torch.Tensor:
    """Reference of :func:`sparse_attention` (computes in q's dtype)."""
    keys, valid = gather_rows(idx, sources)
    keys = keys.to(q.dtype)
    logits = torch.einsum("nhd,nkd->nhk", q, keys) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    logits = torch.cat([logits, sink.to(q.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)], dim=2)
    probs = torch.softmax(logits, dim=2)[..., :-1]
    return torch.einsum("nhk,nkd->nhd", probs, keys)


@triton.jit
def _sparse_attn_kernel(Q, IDX, S0, S1, S2, S3, SINK, OUT, B1, B2, B3, K, H, scale,
                        stride_qn, stride_qh, stride_in, stride_on, stride_oh,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_T: tl.constexpr,
                        IEEE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mh = offs_h < H
    md = offs_d < D
    q = tl.load(Q + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mh[:, None] & md[None, :], other=0.0)
    m_i = tl.load(SINK + offs_h, mask=mh, other=0.0).to(tl.float32)
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(IDX + n * stride_in + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
        valid = idx >= 0
        in0 = valid & (idx < B1)
        in1 = (idx >= B1) & (idx < B2)
        in2 = (idx >= B2) & (idx < B3)
        in3 = idx >= B3
        col = offs_d[None, :]
        # exactly one of the four masked loads is live per row; sum in fp32, dot in the source dtype
        kk = tl.load(S0 + idx[:, None] * D + col, mask=in0[:, None] & md[None, :], other=0.0).to(tl.float32)
        kk += tl.load(S1 + (idx - B1)[:, None] * D + col, mask=in1[:, None] & md[None, :], other=0.0).to(tl.float32)
        kk += tl.load(S2 + (idx - B2)[:, None] * D + col, mask=in2[:, None] & md[None, :], other=0.0).to(tl.float32)
        kk += tl.load(S3 + (idx - B3)[:, None] * D + col, mask=in3[:, None] & md[None, :], other=0.0).to(tl.float32)
        kk = kk.to(DOT_T)
        if IEEE:  # fp32 sources: exact fp32 products, not tf32
            s = tl.dot(q.to(kk.dtype), tl.trans(kk), input_precision="ieee") * scale
        else:
            s = tl.dot(q.to(kk.dtype), tl.trans(kk)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(kk.dtype), kk, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(kk.dtype), kk)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(OUT + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=mh[:, None] & md[None, :])


def sparse_attention(q: torch.Tensor, idx: torch.Tensor, sources: Sequence[torch.Tensor],
                     sink: torch.Tensor, scale: float, block_k: int = 32, num_warps: int = 8) -> torch.Tensor:
    """Triton sparse attention; shapes in the module docstring. Returns [N, H, D] in q's dtype."""
    N, H, D = q.shape
    if len(sources) > 4 or not sources:
        raise ValueError(f"sparse_attention takes 1 to 4 sources, got {len(sources)}")
    dtype = sources[0].dtype
    srcs = [s.contiguous() for s in sources]
    for s in srcs:
        if s.dtype != dtype or s.shape[-1] != D:
            raise ValueError(f"every source must be [P, {D}] {dtype}, got {tuple(s.shape)} {s.dtype}")
    bounds = [0]
    for s in srcs:
        bounds.append(bounds[-1] + s.shape[0])
    while len(srcs) < 4:  # unused sources: empty range past the end
        srcs.append(srcs[0])
        bounds.append(bounds[-1])
    q = q.contiguous()
    idx = idx.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    block_h = 16
    # bf16/fp16 dots on the GPU; fp32 under TRITON_INTERPRET (its bf16 tl.dot is wrong)
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    dot_t = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32)
    dot_t = tl.float32 if interp else dot_t
    block_d = triton.next_power_of_2(max(D, 16))
    grid = (N, triton.cdiv(H, block_h))
    if N and idx.shape[1] >= 0:
        _sparse_attn_kernel[grid](q, idx, srcs[0], srcs[1], srcs[2], srcs[3], sink.float().contiguous(), out,
                                  bounds[1], bounds[2], bounds[3], idx.shape[1], H, scale,
                                  q.stride(0), q.stride(1), idx.stride(0), out.stride(0), out.stride(1),
                                  D=D, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_K=block_k,
                                  DOT_T=dot_t, IEEE=dot_t == tl.float32,
                                  num_warps=num_warps)
    return out
