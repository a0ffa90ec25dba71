"""Sparse gather attention over per-query index lists, with a per-head sink (Triton + torch).

    q      [N, H, D]   queries (one shared latent head: K == V, MQA)
    idx    [N, K]      virtual row indices into concat(sources) (-1 = skip), the same form
                       FlashMLA's sparse decode takes
    sources            up to 4 tensors [P_i, D] (e.g. persistent window pool | tree nodes'
                       latents | compressed pool | scratch entries), never copied together
    sink   [H]         o_h = sum_j softmax([s_hj ..., sink_h])_j k_j,  s_hj = q_h . k_j * scale

Kernel layout (MQA: every head reads the same gathered rows): one program per (query,
split of the index list, block of BLOCK_H heads) streams BLOCK_K gathered rows [BLOCK_K, D]
once and does [BLOCK_H, D] x [D, BLOCK_K] and [BLOCK_H, BLOCK_K] x [BLOCK_K, D] with tl.dot
(bf16 in, fp32 accumulate), online softmax; a block of BLOCK_K entries that are all -1 (the
padding of a list sized by its bound, e.g. HCA's persistent entries past a short context)
runs no product.  With few queries (small batch) the index list
is split over programs (flash-decoding) so that the grid fills the GPU; a second kernel
merges the splits by their log-sum-exp and folds the sink in:  o = sum_s e^{lse_s - M} o_s /
(sum_s e^{lse_s - M} + e^{sink - M}).  Unsplit, the online softmax starts from the sink
(m = sink, l = 1).  Bytes per query: K rows x D x 2 B (640 x 512 x 2 = 655 KB at V4-Flash).

:func:`sparse_attention` runs the swapped form (:func:`_sparse_attn_t_kernel`: the gathered
rows as both products' M side, 128 of them a step) with the "wave1" split rule: on an H100
1.25-2.63x faster than the form above at 16 of the floor bench's 18 points
(``docs/math/v4_compression.md``); the form above stays for the benchmark's launches.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from simtree.kernels._triton import interpreting

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
def _block_idx(IDX, n, stride_in, k0, k_hi, BLOCK_K: tl.constexpr):
    """Entries k0 .. k0 + BLOCK_K of query n's list (-1 past k_hi)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(IDX + n * stride_in + offs_k, mask=offs_k < k_hi, other=-1).to(tl.int64)


@triton.jit
def _rows(idx, S0, S1, S2, S3, B1, B2, B3, col, md, D: tl.constexpr, DOT_T: tl.constexpr):
    """A block of list entries -> (rows [BLOCK_K, D], valid [BLOCK_K])."""
    valid = idx >= 0
    # one row pointer per index (select among the four sources), then a single gather:
    # each row is read once for all BLOCK_H heads
    row = tl.where(idx < B1, S0 + idx * D,
                   tl.where(idx < B2, S1 + (idx - B1) * D,
                            tl.where(idx < B3, S2 + (idx - B2) * D, S3 + (idx - B3) * D)))
    kk = tl.load(row[:, None] + col, mask=valid[:, None] & md[None, :], other=0.0)
    return kk.to(DOT_T), valid


@triton.jit
def _gather(IDX, n, stride_in, k0, k_hi, S0, S1, S2, S3, B1, B2, B3, col, md, D: tl.constexpr,
            BLOCK_K: tl.constexpr, DOT_T: tl.constexpr):
    """Rows k0 .. k0 + BLOCK_K of query n's list -> (rows [BLOCK_K, D], valid [BLOCK_K])."""
    return _rows(_block_idx(IDX, n, stride_in, k0, k_hi, BLOCK_K), S0, S1, S2, S3, B1, B2, B3, col, md, D, DOT_T)


@triton.jit
def _attend(q, kk, valid, m_i, l_i, acc, scale, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """One block of rows into the online softmax (m, l) and the weighted sum acc."""
    if IEEE:  # fp32 (interpreter / fp32 sources): exact products, not tf32
        s = tl.dot(q, tl.trans(kk), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(kk)) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_T), kk, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_T), kk)
    return m_new, l_i, acc


@triton.jit
def _softmax_start(SINK, offs_h, mh, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr):
    """(m, l) before the first row: a split's partial softmax starts empty (the merge kernel adds
    the sink); unsplit, it starts from the sink (m = sink, l = 1)."""
    if SPLIT:
        m_i = tl.full([BLOCK_H], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
    else:
        m_i = tl.load(SINK + offs_h, mask=mh, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    return m_i, l_i


@triton.jit
def _store_lse(LSE, n, sp, H, offs_h, mh, m_i, l_i):
    """A split's log-sum-exp per head (-inf where it saw no live row)."""
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    tl.store(LSE + (n * tl.num_programs(1) + sp) * H + offs_h, lse, mask=mh)


@triton.jit
def _program(H, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's (query, split, heads, channels, head mask, channel mask)."""
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    return tl.program_id(0).to(tl.int64), tl.program_id(1), offs_h, offs_d, offs_h < H, offs_d < D


@triton.jit
def _sparse_attn_kernel(Q, IDX, S0, S1, S2, S3, SINK, OUT, LSE, B1, B2, B3, K, H, scale, chunk,
                        stride_qn, stride_qh, stride_in, stride_on, stride_os, stride_oh,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr,
                        SPLIT: tl.constexpr, SKIP: tl.constexpr):
    """SKIP: a block of -1 entries only runs no product."""
    n, sp, offs_h, offs_d, mh, md = _program(H, D, BLOCK_H, BLOCK_D)
    q = tl.load(Q + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mh[:, None] & md[None, :], other=0.0).to(DOT_T)
    m_i, l_i = _softmax_start(SINK, offs_h, mh, SPLIT, BLOCK_H)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    col = offs_d[None, :]
    k_lo = sp * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        idx = _block_idx(IDX, n, stride_in, k0, k_hi, BLOCK_K)
        if SKIP:
            if tl.max(idx, 0) >= 0:  # a block of -1 entries only (a list's padding) runs no product
                kk, valid = _rows(idx, S0, S1, S2, S3, B1, B2, B3, col, md, D, DOT_T)
                m_i, l_i, acc = _attend(q, kk, valid, m_i, l_i, acc, scale, DOT_T, IEEE)
        else:
            kk, valid = _rows(idx, S0, S1, S2, S3, B1, B2, B3, col, md, D, DOT_T)
            m_i, l_i, acc = _attend(q, kk, valid, m_i, l_i, acc, scale, DOT_T, IEEE)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    optr = OUT + n * stride_on + sp * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(optr, out.to(OUT.dtype.element_ty), mask=mh[:, None] & md[None, :])
    if SPLIT:
        _store_lse(LSE, n, sp, H, offs_h, mh, m_i, l_i)


@triton.jit
def _attend_t(qt, kk, valid, m_i, l_i, acc, scale, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """:func:`_attend` with the products swapped (rows as the M side: s^T = K q^T [BLOCK_K,
    heads], acc^T += K^T p^T [D, heads]), so that both products have an M of >= 64 (the
    Hopper tensor cores' warpgroup tile) where a block of heads alone is 16 or 32."""
    if IEEE:
        s = tl.dot(kk, qt, input_precision="ieee") * scale
    else:
        s = tl.dot(kk, qt) * scale
    s = tl.where(valid[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    if IEEE:
        acc = acc * alpha[None, :] + tl.dot(tl.trans(kk), p.to(DOT_T), input_precision="ieee")
    else:
        acc = acc * alpha[None, :] + tl.dot(tl.trans(kk), p.to(DOT_T))
    return m_new, l_i, acc


@triton.jit
def _sparse_attn_t_kernel(Q, IDX, S0, S1, S2, S3, SINK, OUT, LSE, B1, B2, B3, K, H, scale, chunk,
                          stride_qn, stride_qh, stride_in, stride_on, stride_os, stride_oh,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr,
                          SPLIT: tl.constexpr, STAGES: tl.constexpr):
    """:func:`_sparse_attn_kernel` on the swapped products (:func:`_attend_t`): the state is
    kept transposed ([D, heads]) and stored back as [heads, D]; the row loop is software
    pipelined over STAGES blocks."""
    n, sp, offs_h, offs_d, mh, md = _program(H, D, BLOCK_H, BLOCK_D)
    qt = tl.load(Q + n * stride_qn + offs_h[None, :] * stride_qh + offs_d[:, None],
                 mask=mh[None, :] & md[:, None], other=0.0).to(DOT_T)
    m_i, l_i = _softmax_start(SINK, offs_h, mh, SPLIT, BLOCK_H)
    acc = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)
    col = offs_d[None, :]
    k_lo = sp * chunk
    k_hi = tl.minimum(k_lo + chunk, K)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        kk, valid = _gather(IDX, n, stride_in, k0, k_hi, S0, S1, S2, S3, B1, B2, B3, col, md, D, BLOCK_K, DOT_T)
        m_i, l_i, acc = _attend_t(qt, kk, valid, m_i, l_i, acc, scale, DOT_T, IEEE)
    out = acc / tl.maximum(l_i, 1e-30)[None, :]
    optr = OUT + n * stride_on + sp * stride_os + offs_h[None, :] * stride_oh + offs_d[:, None]
    tl.store(optr, out.to(OUT.dtype.element_ty), mask=mh[None, :] & md[:, None])
    if SPLIT:
        _store_lse(LSE, n, sp, H, offs_h, mh, m_i, l_i)


@triton.jit
def _merge_splits_kernel(PART, LSE, SINK, OUT, H, NSPLIT, stride_on, stride_oh,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    # a program per (query, head block, BLOCK_D channels): the partials ([splits, H, D] fp32
    # per query, several times the rows' bytes at small batch) are read by many programs at once
    n = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mh = offs_h < H
    md = offs_d < D
    m = tl.load(SINK + offs_h, mask=mh, other=0.0).to(tl.float32)
    for s in range(0, NSPLIT):
        m = tl.maximum(m, tl.load(LSE + (n * NSPLIT + s) * H + offs_h, mask=mh, other=float("-inf")))
    den = tl.exp(tl.load(SINK + offs_h, mask=mh, other=0.0).to(tl.float32) - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(0, NSPLIT):
        wgt = tl.exp(tl.load(LSE + (n * NSPLIT + s) * H + offs_h, mask=mh, other=float("-inf")) - m)
        part = tl.load(PART + ((n * NSPLIT + s) * H + offs_h[:, None]) * D + offs_d[None, :],
                       mask=mh[:, None] & md[None, :], other=0.0)
        acc += wgt[:, None] * part
        den += wgt
    out = acc / den[:, None]
    tl.store(OUT + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=mh[:, None] & md[None, :])


def _interpreting() -> bool:
    return interpreting()


def _num_splits(N: int, head_blocks: int, K: int, block_k: int, device, rule: str = "waves2") -> int:
    """Splits of the index list: "waves2" until the grid covers ~2 waves of the GPU (>= one
    block each); "wave1" as many as one wave holds (none once the unsplit grid has as many
    programs as the GPU has SMs)."""
    if rule not in ("waves2", "wave1"):
        raise ValueError(f"split rule {rule!r}: use waves2 or wave1")
    if device.type != "cuda" or N == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // (N * head_blocks)) if rule == "waves2" else sms // (N * head_blocks)
    return max(1, min(want, triton.cdiv(max(K, 1), block_k)))


def sparse_attention(q: torch.Tensor, idx: torch.Tensor, sources: Sequence[torch.Tensor],
                     sink: torch.Tensor, scale: float, block_k: int = 128, block_h: int | None = None,
                     num_warps: int = 8, num_splits: int | None = None) -> torch.Tensor:
    """Triton sparse attention; shapes in the module docstring. Returns [N, H, D] in q's dtype.

    The launch the floor bench measured fastest (H100, 2026-12-07, ``reports/h100/floor.csv``):
    the swapped products (rows as the M side, :func:`_sparse_attn_t_kernel`) over ``block_k``
    rows a step, no software pipelining; num_splits None: the "wave1" rule (1 off the GPU);
    block_h None: 32 heads on the GPU, 16 under the interpreter."""
    return _sparse_attention(q, idx, sources, sink, scale, block_k, block_h, num_warps, num_splits, swap=True,
                             stages=1, split_rule="wave1")


def _sparse_attention(q, idx, sources, sink, scale: float, block_k: int, block_h: int | None, num_warps: int,
                      num_splits: int | None, swap: bool = False, stages: int = 2,
                      split_rule: str = "waves2", skip: bool = True) -> torch.Tensor:
    """:func:`sparse_attention` with the launch switches the benchmark times
    (``_launched.sparse_attention_launched``): swap runs the products with the rows as their M side
    (:func:`_sparse_attn_t_kernel`, the row loop pipelined over ``stages`` blocks);
    split_rule picks the splits when num_splits is None (:func:`_num_splits`); skip:
    :func:`_sparse_attn_kernel`'s SKIP (the swapped kernel runs every block: nothing there)."""
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
    K = idx.shape[1]
    out = torch.empty_like(q)
    if N == 0:
        return out
    interp = _interpreting()
    # bf16/fp16 dots on the GPU; fp32 under TRITON_INTERPRET (its bf16 tl.dot is wrong)
    dot_t = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32)
    dot_t = tl.float32 if interp else dot_t
    block_h = block_h or (16 if interp or H <= 16 else 32)
    block_d = triton.next_power_of_2(max(D, 16))
    hblocks = triton.cdiv(H, block_h)
    nsplit = num_splits or _num_splits(N, hblocks, K, block_k, q.device, split_rule)
    nsplit = max(1, min(nsplit, triton.cdiv(max(K, 1), block_k)))
    chunk = triton.cdiv(triton.cdiv(max(K, 1), nsplit), block_k) * block_k
    nsplit = triton.cdiv(max(K, 1), chunk)
    sink32 = sink.float().contiguous()
    common = dict(D=D, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_K=block_k, DOT_T=dot_t,
                  IEEE=dot_t == tl.float32, num_warps=num_warps)
    kernel = _sparse_attn_t_kernel if swap else _sparse_attn_kernel
    common.update(STAGES=int(stages)) if swap else common.update(SKIP=bool(skip))
    if nsplit == 1:
        kernel[(N, 1, hblocks)](
            q, idx, srcs[0], srcs[1], srcs[2], srcs[3], sink32, out, sink32, bounds[1], bounds[2],
            bounds[3], K, H, scale, chunk, q.stride(0), q.stride(1), idx.stride(0), out.stride(0), 0,
            out.stride(1), SPLIT=False, **common)
        return out
    part = torch.empty(N, nsplit, H, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(N, nsplit, H, dtype=torch.float32, device=q.device)
    kernel[(N, nsplit, hblocks)](
        q, idx, srcs[0], srcs[1], srcs[2], srcs[3], sink32, part, lse, bounds[1], bounds[2], bounds[3],
        K, H, scale, chunk, q.stride(0), q.stride(1), idx.stride(0), part.stride(0), part.stride(1),
        part.stride(2), SPLIT=True, **common)
    merge_d = min(block_d, 128)
    _merge_splits_kernel[(N, hblocks, triton.cdiv(D, merge_d))](part, lse, sink32, out, H, nsplit, out.stride(0),
                                                                out.stride(1), D=D, BLOCK_D=merge_d, BLOCK_H=block_h,
                                                                num_warps=4)
    return out
