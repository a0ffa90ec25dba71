"""CSA lightning-indexer scores of tree nodes against the persistent indexer keys (Triton + torch).

    score[n, e] = sum_h w[n, h] * ReLU(q[n, h] . k_e)        (fp32)

    iq [N, Hi, Di], iw [N, Hi]        per-node indexer queries and head weights
    pool [P, Di]                      the paged indexer-key pool
    rows [B, E]                       flat pool rows of sequence b's entries (-1 = none)
    pad_nodes [B, nmax]               flat node ids of tree b (-1 pad)
    out [N, >= E]                     scores written into out[:, :E] (-inf where rows < 0)

Every node of tree b scans the same keys, so the Triton kernel runs one program per
(sequence, block of BLOCK_E entries): it loads the key block once and loops over the tree's
nodes, each a [Hi, Di] x [Di, BLOCK_E] tl.dot — keys move once per sequence, not per node
(a node's q [64, 128] is re-read from L2 per key block: 2 * 64 * 128 * 128 flops per 16 KB
at BLOCK_E = 128, compute-bound rather than L2-bound).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from simtree.kernels._triton import interpreting

__all__ = ["indexer_scores", "indexer_scores_torch", "selection_to_list"]


@triton.jit
def _score_block(q, w, keys, IEEE: tl.constexpr):
    """sum_h w_h ReLU(q_h . k_e): q [Hi, Di], w [Hi], keys [E, Di] -> [E] fp32."""
    if IEEE:
        s = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(keys))
    return tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)


@triton.jit
def _node_query(IQ, IW, node, offs_h, offs_d, mh, md, stride_qn, stride_qh, stride_wn, DOT_T: tl.constexpr):
    """q [Hi, Di] (DOT_T) and w [Hi] fp32 of a node id broadcast over the head lanes (-1: zeros)."""
    nc = tl.maximum(node, 0)
    live = node >= 0
    q = tl.load(IQ + nc[:, None] * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=(mh & live)[:, None] & md[None, :], other=0.0).to(DOT_T)
    w = tl.load(IW + nc * stride_wn + offs_h, mask=mh & live, other=0.0).to(tl.float32)
    return q, w


@triton.jit
def _persistent_block(IQ, IW, POOL, ROWS, PAD, OUT, b, blk, E, NMAX, offs_h, offs_d, mh, md, Di,
                      stride_qn, stride_qh, stride_wn, stride_rb, stride_on,
                      BLOCK_E: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """A block of persistent keys, loaded once, against every node of tree b."""
    offs_e = blk * BLOCK_E + tl.arange(0, BLOCK_E)
    me = offs_e < E
    rows = tl.load(ROWS + b * stride_rb + offs_e, mask=me, other=-1).to(tl.int64)
    live_e = rows >= 0
    keys = tl.load(POOL + tl.maximum(rows, 0)[:, None] * Di + offs_d[None, :],
                   mask=live_e[:, None] & md[None, :], other=0.0).to(DOT_T)
    for t in range(0, NMAX):
        # node ids broadcast per lane (scalar masks trip the interpreter)
        node = tl.load(PAD + b * NMAX + t + offs_h * 0).to(tl.int64)
        q, w = _node_query(IQ, IW, node, offs_h, offs_d, mh, md, stride_qn, stride_qh, stride_wn, DOT_T)
        score = tl.where(live_e, _score_block(q, w, keys, IEEE), float("-inf"))
        node_e = tl.load(PAD + b * NMAX + t + offs_e * 0).to(tl.int64)
        tl.store(OUT + tl.maximum(node_e, 0) * stride_on + offs_e, score, mask=me & (node_e >= 0))


@triton.jit
def _scratch_node(IQ, IW, POOL, PAD, OUT, SKEYS, VIS, b, t, E, NMAX, SMAX, offs_h, offs_d, mh, md, Di,
                  stride_qn, stride_qh, stride_wn, stride_on, stride_vn,
                  BLOCK_S: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """Node t of tree b against the scratch keys on its own path -> columns E..E+SMAX."""
    offs_s = tl.arange(0, BLOCK_S)
    node = tl.load(PAD + b * NMAX + t + offs_h * 0).to(tl.int64)
    q, w = _node_query(IQ, IW, node, offs_h, offs_d, mh, md, stride_qn, stride_qh, stride_wn, DOT_T)
    node_s = tl.load(PAD + b * NMAX + t + offs_s * 0).to(tl.int64)
    ms = (offs_s < SMAX) & (node_s >= 0)
    vis = tl.load(VIS + tl.maximum(node_s, 0) * stride_vn + offs_s, mask=ms, other=-1).to(tl.int64)
    keys = tl.load(SKEYS + tl.maximum(vis, 0)[:, None] * Di + offs_d[None, :],
                   mask=(vis >= 0)[:, None] & md[None, :], other=0.0)
    keys = keys.to(POOL.dtype.element_ty).to(DOT_T)  # scratch keys rounded like pool rows
    score = tl.where(vis >= 0, _score_block(q, w, keys, IEEE), float("-inf"))
    tl.store(OUT + tl.maximum(node_s, 0) * stride_on + E + offs_s, score, mask=ms)


@triton.jit
def _indexer_kernel(IQ, IW, POOL, ROWS, PAD, OUT, SKEYS, VIS, E, NMAX, Hi, Di, SMAX, EBLOCKS,
                    stride_qn, stride_qh, stride_wn, stride_rb, stride_on, stride_vn,
                    BLOCK_E: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
                    BLOCK_S: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_DI)
    mh = offs_h < Hi
    md = offs_d < Di
    # the branches live in helpers: tensors of different shapes must not share a name
    if blk < EBLOCKS:
        _persistent_block(IQ, IW, POOL, ROWS, PAD, OUT, b, blk, E, NMAX, offs_h, offs_d, mh, md, Di,
                          stride_qn, stride_qh, stride_wn, stride_rb, stride_on, BLOCK_E, DOT_T, IEEE)
    else:
        _scratch_node(IQ, IW, POOL, PAD, OUT, SKEYS, VIS, b, blk - EBLOCKS, E, NMAX, SMAX, offs_h, offs_d,
                      mh, md, Di, stride_qn, stride_qh, stride_wn, stride_on, stride_vn, BLOCK_S, DOT_T, IEEE)


def indexer_scores_torch(iq, iw, pool, rows, pad_nodes, out, chunk: int = 2048) -> torch.Tensor:
    """Reference of :func:`indexer_scores` (in iq's dtype, chunked over entries)."""
    B, nmax = pad_nodes.shape
    N, Hi, Di = iq.shape
    E = rows.shape[1]
    q_pad = iq[pad_nodes.clamp(min=0)].reshape(B, nmax * Hi, Di)
    w_pad = iw[pad_nodes.clamp(min=0)].to(iq.dtype).reshape(B, nmax, Hi, 1)
    flat = out.new_empty(B, nmax, E)
    for c0 in range(0, E, chunk):
        r = rows[:, c0:c0 + chunk]
        keys = pool[r.clamp(min=0)].to(iq.dtype)                                # [B, c, Di]
        s = torch.relu(torch.bmm(q_pad, keys.transpose(1, 2))).reshape(B, nmax, Hi, -1)
        flat[:, :, c0:c0 + chunk] = (s * w_pad).sum(2).masked_fill((r < 0).unsqueeze(1), float("-inf"))
    live = pad_nodes >= 0
    out[pad_nodes[live], :E] = flat[live]
    return out


def indexer_scores(iq: torch.Tensor, iw: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor,
                   pad_nodes: torch.Tensor, out: torch.Tensor, scratch_keys: torch.Tensor | None = None,
                   scratch_vis: torch.Tensor | None = None, block_e: int = 128,
                   num_warps: int = 8) -> torch.Tensor:
    """Triton indexer scan; shapes in the module docstring.  Writes and returns ``out``.

    With scratch_keys [M, Di] and scratch_vis [N, Smax] (rows of scratch_keys on each node's
    path, -1 pad) it also writes out[:, E:E+Smax] (-inf where vis < 0), in the same launch."""
    B, nmax = pad_nodes.shape
    N, Hi, Di = iq.shape
    E = rows.shape[1]
    smax = 0 if scratch_vis is None else scratch_vis.shape[1]
    if N == 0 or (E == 0 and smax == 0):
        return out
    interp = interpreting()
    dot_t = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(pool.dtype, tl.float32)
    dot_t = tl.float32 if interp else dot_t
    iq, iw, rows, pad = iq.contiguous(), iw.contiguous(), rows.contiguous(), pad_nodes.contiguous()
    if smax:
        # no scratch entries at all: every vis is -1, the pool is a never-read stand-in
        skeys = scratch_keys.contiguous() if scratch_keys.shape[0] else pool
        vis = scratch_vis.contiguous()
    else:
        skeys, vis = pool, pad
    eblocks = triton.cdiv(E, block_e)
    _indexer_kernel[(B, eblocks + (nmax if smax else 0))](
        iq, iw, pool, rows, pad, out, skeys, vis, E, nmax, Hi, Di, smax, eblocks, iq.stride(0), iq.stride(1),
        iw.stride(0), rows.stride(0), out.stride(0), vis.stride(0), BLOCK_E=block_e,
        BLOCK_HI=max(16, triton.next_power_of_2(Hi)), BLOCK_DI=max(16, triton.next_power_of_2(Di)),
        BLOCK_S=max(16, triton.next_power_of_2(max(smax, 1))), DOT_T=dot_t, IEEE=dot_t == tl.float32,
        num_warps=num_warps)
    return out


@triton.jit
def copy_window(WIN, OUT, n, W, stride_win, stride_out, BLOCK_W: tl.constexpr):
    """OUT[n, :W] = WIN[n, :W]: the list's window part."""
    ow = tl.arange(0, BLOCK_W)
    for w0 in range(0, W, BLOCK_W):
        m = w0 + ow < W
        tl.store(OUT + n * stride_out + w0 + ow, tl.load(WIN + n * stride_win + w0 + ow, mask=m).to(OUT.dtype.element_ty),
                 mask=m)


@triton.jit
def selected_rows(sel, val, mask, seq, n, PROWS, VIS, EMAX, PC, BASE, stride_pr, stride_vis):
    """Selected columns sel of [persistent | scratch] -> base + (pool row, or PC + scratch id);
    -1 where the score is -inf or nothing is there."""
    from_p = sel < EMAX
    prow = tl.load(PROWS + seq * stride_pr + sel, mask=mask & from_p, other=-1).to(tl.int64)
    srow = tl.load(VIS + n * stride_vis + (sel - EMAX), mask=mask & (sel >= EMAX), other=-1).to(tl.int64)
    row = tl.where(from_p, prow, tl.where(srow >= 0, srow + PC, -1))
    return tl.where((val == float("-inf")) | (row < 0), -1, row + BASE)


@triton.jit
def _finalize_kernel(SEL, VAL, WIN, PROWS, VIS, SEQ, OUT, K, W, EMAX, PC, BASE,
                     stride_sel, stride_win, stride_pr, stride_vis, stride_out,
                     BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    copy_window(WIN, OUT, n, W, stride_win, stride_out, BLOCK_W)
    ok = tl.arange(0, BLOCK_K)
    seq = tl.load(SEQ + n + ok * 0).to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        mk = k0 + ok < K
        sel = tl.load(SEL + n * stride_sel + k0 + ok, mask=mk, other=0).to(tl.int64)
        val = tl.load(VAL + n * stride_sel + k0 + ok, mask=mk, other=float("-inf"))
        row = selected_rows(sel, val, mk, seq, n, PROWS, VIS, EMAX, PC, BASE, stride_pr, stride_vis)
        tl.store(OUT + n * stride_out + W + k0 + ok, row.to(OUT.dtype.element_ty), mask=mk)


def selection_to_list(sel: torch.Tensor, val: torch.Tensor, win_idx: torch.Tensor, persist_rows: torch.Tensor,
                      vis: torch.Tensor, node_seq: torch.Tensor, comp_rows: int, base: int) -> torch.Tensor:
    """Top-k columns -> the attention index list, in one launch.

    sel, val [N, k] (torch.topk of [persistent | scratch] scores); win_idx [N, W]; persist_rows
    [B, E] (compressed-pool rows); vis [N, Smax] (scratch entry ids).  Returns int32
    [N, W + k] = [win_idx | base + (pool row, or comp_rows + scratch id)], -1 where nothing."""
    N, K = sel.shape
    W = win_idx.shape[1]
    out = torch.empty(N, W + K, dtype=torch.int32, device=sel.device)
    if N == 0:
        return out
    sel, val, win_idx, persist_rows, vis = (x.contiguous() for x in (sel, val, win_idx, persist_rows, vis))
    pr = persist_rows if persist_rows.shape[1] else vis  # E == 0: never read
    _finalize_kernel[(N,)](sel, val, win_idx, pr, vis, node_seq, out, K, W, persist_rows.shape[1], comp_rows, base,
                           sel.stride(0), win_idx.stride(0), pr.stride(0), vis.stride(0), out.stride(0),
                           BLOCK_K=min(512, max(16, triton.next_power_of_2(max(K, 1)))),
                           BLOCK_W=min(256, max(16, triton.next_power_of_2(max(W, 1)))), num_warps=4)
    return out
