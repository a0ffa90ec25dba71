"""One-launch accepted-path refresh (Triton): every row the commit moves, all sequences at once.

Program ranges of a single grid (counts fixed by the plan, so it replays in a CUDA graph; a
device plan's padding rows have destination -1 and are skipped):

    [0, A)            window rows     win_pool[win_dst[i]]  <- node_kv[win_src[i]]
    [A, A+E)          entries         comp_pool[e_comp[i]]  <- comp_entries[e_src[i]]
                                      idx_pool[e_idx[i]]    <- idx_entries[e_src[i]]  (CSA)
    [A+E, A+E+4G)     buffer rebuild  (sequence g, plane kv|score, compressor comp|idx):
                      row s of the [S, C] buffer <- map[g, s] = a row of [buffers B*S | node
                      projections N] (-1 keeps it).  A program reads all S source rows of a
                      channel block before it writes any, so a C4 "previous half <- current
                      half" copy reads the pre-commit rows even where the same commit
                      overwrites them (the ordering the two-step torch form needs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_commit"]


@triton.jit
def _copy_row(DST, SRC, IDST, ISRC, i, W, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    d = tl.load(IDST + i + offs * 0).to(tl.int64)
    s = tl.load(ISRC + i + offs * 0).to(tl.int64)
    for c0 in range(0, W, BLOCK):
        m = (c0 + offs < W) & (d >= 0)   # -1: a padding row of a device plan
        v = tl.load(SRC + s * W + c0 + offs, mask=m)
        tl.store(DST + d * W + c0 + offs, v.to(DST.dtype.element_ty), mask=m)


@triton.jit
def _rebuild(BUF, PROJ, MAP, SEQ, g, plane, B, N, S, C, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    os_ = tl.arange(0, BLOCK_S)
    oc = tl.arange(0, BLOCK_C)
    ms = os_ < S
    b = tl.load(SEQ + g + os_ * 0).to(tl.int64)
    src = tl.load(MAP + g * S + os_, mask=ms, other=-1).to(tl.int64)
    BS = B * S
    buf = BUF + plane * BS * C          # [2, B, S, C]: plane 0 kv, 1 score
    proj = PROJ + plane * N * C         # [2, N, C]
    from_buf = (src >= 0) & (src < BS)
    from_proj = src >= BS
    for c0 in range(0, C, BLOCK_C):
        mc = (c0 + oc < C)[None, :]
        vb = tl.load(buf + src[:, None] * C + c0 + oc[None, :], mask=from_buf[:, None] & mc, other=0.0)
        vp = tl.load(proj + (src - BS)[:, None] * C + c0 + oc[None, :], mask=from_proj[:, None] & mc, other=0.0)
        v = tl.where(from_proj[:, None], vp.to(buf.dtype.element_ty), vb)
        rows = b * S + os_
        tl.store(buf + rows[:, None] * C + c0 + oc[None, :], v, mask=(src >= 0)[:, None] & mc)


@triton.jit
def _commit_kernel(WIN, NODE_KV, WIN_DST, WIN_SRC, A, D,
                   CPOOL, CENT, IPOOL, IENT, E_COMP, E_IDX, E_SRC, E, DC, DI,
                   CBUF, CPROJ, IBUF, IPROJ, MAP, SEQ, G, B, N, S, CC, CI,
                   HAS_IDX: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    if pid < A:
        _copy_row(WIN, NODE_KV, WIN_DST, WIN_SRC, pid, D, BLOCK_D)
    elif pid < A + E:
        i = pid - A
        _copy_row(CPOOL, CENT, E_COMP, E_SRC, i, DC, BLOCK_D)
        if HAS_IDX:
            _copy_row(IPOOL, IENT, E_IDX, E_SRC, i, DI, BLOCK_D)
    else:
        j = pid - A - E
        g = j // 4
        plane = j % 2
        if (j // 2) % 2 == 0:
            _rebuild(CBUF, CPROJ, MAP, SEQ, g, plane, B, N, S, CC, BLOCK_S, BLOCK_C)
        elif HAS_IDX:
            _rebuild(IBUF, IPROJ, MAP, SEQ, g, plane, B, N, S, CI, BLOCK_S, BLOCK_C)


def _nonempty(t: torch.Tensor, dummy: torch.Tensor) -> torch.Tensor:
    """Empty index tensors (null data pointers) are swapped for a never-read stand-in."""
    return t if t.numel() else dummy


def _stacked(stacked, pair):
    return stacked if stacked is not None else torch.stack(pair)


def fused_commit(cache, scratch, cp) -> None:
    """Device part of the refresh in one launch (see the module docstring)."""
    win = cache.window.pool
    A = cp.win_dst.numel()
    E = 0 if cp.entry_src is None else cp.entry_src.numel()
    G = 0 if cp.buf_map is None else cp.buf_map.shape[0]
    if A + E + G == 0:
        return
    dummy = cp.win_dst if A else (cp.entry_src if E else cp.buf_seq)
    has_idx = cache.idx is not None
    if cache.ratio:
        cpool, cent = cache.comp.pool, scratch.comp_entries
        cbuf, cproj = cache.comp_buf, _stacked(scratch.comp_proj_stacked, scratch.comp_proj)
        S, CC = cbuf.shape[2], cbuf.shape[3]
        ipool, ient = (cache.idx.pool, scratch.idx_entries) if has_idx else (cpool, cent)
        ibuf, iproj = (cache.idx_buf, _stacked(scratch.idx_proj_stacked, scratch.idx_proj)) if has_idx else (cbuf, cproj)
        CI = ibuf.shape[3]
        e_comp, e_idx = cp.entry_dst_comp, cp.entry_dst_idx if has_idx else cp.entry_dst_comp
        bmap, bseq, e_src = cp.buf_map, cp.buf_seq, cp.entry_src
        e_comp, e_idx, e_src, bmap, bseq = (_nonempty(t, dummy) for t in (e_comp, e_idx, e_src, bmap, bseq))
        dc, di = cpool.shape[1], ipool.shape[1]
    else:
        cpool = cent = ipool = ient = cbuf = cproj = ibuf = iproj = win
        e_comp = e_idx = e_src = bmap = bseq = dummy
        S = CC = CI = dc = di = 1
    N = scratch.node_kv.shape[0]
    _commit_kernel[(A + E + 4 * G,)](
        win, scratch.node_kv, _nonempty(cp.win_dst, dummy), _nonempty(cp.win_src, dummy), A, win.shape[1],
        cpool, cent, ipool, ient, e_comp, e_idx, e_src, E, dc, di,
        cbuf, cproj, ibuf, iproj, bmap, bseq, G, cache.batch, N, S, CC, CI,
        HAS_IDX=has_idx, BLOCK_D=min(512, triton.next_power_of_2(max(win.shape[1], dc, di))),
        BLOCK_S=triton.next_power_of_2(S), BLOCK_C=max(16, min(256, 4096 // triton.next_power_of_2(S))),
        num_warps=4)
