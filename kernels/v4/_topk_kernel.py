"""The CSA indexer's top-k and the attention list in one launch (Triton), replacing torch.topk
(a sort for k = 512) plus the list kernel (_indexer_kernels.selection_to_list).

    scores [N, L] fp32     [persistent | scratch] scores of every node (-inf: not visible)
    out int32 [N, W + k]   [win_idx | base + (pool row, or comp_rows + scratch id)], -1 where
                           fewer than k entries are visible

One program per node holds its whole score row in registers (L <= MAX_ROW) and finds the k-th
largest score by a radix search over its 32 bits: scores map to order-preserving integers
(the float's bits, the magnitude flipped for negatives), and the threshold t is built bit by
bit, most significant first, keeping a bit wherever at least k entries are >= the candidate.
The selection is every entry above t plus the lowest-numbered entries equal to t up to k; a
prefix sum gives each its slot.  The k entries come out in column order, not by score: the
attention that reads the list sums over them in any order.  The score row is read once (4
bytes per node and entry, against the 256 bytes per entry of keys the scan reads once per
sequence: at n <= 16 nodes at most a quarter of the scan's bytes, so the scan and the
selection stay two launches; docs/math/v4_compression.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._indexer_kernels import copy_window, selected_rows

__all__ = ["topk_to_list", "topk_to_list_torch", "MAX_ROW"]

MAX_ROW = 8192      # longest score row one program selects from (32K tokens of context)


@triton.jit
def _ordered(s):
    """fp32 -> int32 with the floats' order (the magnitude bits flipped for negatives)."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _topk_list_kernel(S, WIN, PROWS, VIS, SEQ, OUT, L, K, W, EMAX, PC, BASE,
                      stride_s, stride_win, stride_pr, stride_vis, stride_out,
                      BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    copy_window(WIN, OUT, n, W, stride_win, stride_out, BLOCK_W)
    col = tl.arange(0, BLOCK_L)
    live = col < L
    s = tl.load(S + n * stride_s + col, mask=live, other=float("-inf"))
    u = tl.where(live, _ordered(s), -2147483648)     # padding below -inf
    # the threshold's bits in unsigned space (t_u = t + 2^31, an int64 scalar; the keys stay
    # int32): keep each bit, most significant first, where k entries still reach it
    t_u = tl.zeros((), tl.int64)
    step = tl.full((), 2147483648, tl.int64)
    for _ in range(32):                         # t_u's bits below step are still 0
        cand = t_u + step
        thr = (cand - 2147483648).to(tl.int32)
        t_u = tl.where(tl.sum((u >= thr).to(tl.int32), 0) >= K, cand, t_u)
        step = step // 2
    t = (t_u - 2147483648).to(tl.int32)
    above = live & (u > t)
    tied = live & (u == t)
    room = K - tl.sum(above.to(tl.int32), 0)
    take = above | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= room))
    slot = tl.cumsum(take.to(tl.int32), 0) - 1
    taken = tl.sum(take.to(tl.int32), 0)
    seq = tl.load(SEQ + n + col * 0).to(tl.int64)
    row = selected_rows(col.to(tl.int64), s, take, seq, n, PROWS, VIS, EMAX, PC, BASE, stride_pr, stride_vis)
    tl.store(OUT + n * stride_out + W + slot, row.to(OUT.dtype.element_ty), mask=take)
    # the slots no entry took (fewer than k columns): -1, disjoint from the ones written above
    tl.store(OUT + n * stride_out + W + col, tl.full((BLOCK_L,), -1, tl.int32).to(OUT.dtype.element_ty),
             mask=(col >= taken) & (col < K))


def topk_to_list_torch(scores: torch.Tensor, k: int, win_idx: torch.Tensor, persist_rows: torch.Tensor,
                       vis: torch.Tensor, node_seq: torch.Tensor, comp_rows: int, base: int) -> torch.Tensor:
    """Reference: torch.topk, then the same row mapping (int32 [N, W + k], by score)."""
    val, sel = torch.topk(scores, k, dim=1)
    emax = persist_rows.shape[1]
    from_p = sel < emax
    prow = (persist_rows[node_seq[:, None].long(), sel.clamp(max=max(emax - 1, 0))] if emax
            else torch.full_like(sel, -1))
    srow = vis.gather(1, (sel - emax).clamp(min=0, max=max(vis.shape[1] - 1, 0))) if vis.shape[1] else \
        torch.full_like(sel, -1)
    row = torch.where(from_p, prow, torch.where(srow >= 0, srow + comp_rows, -1))
    row = torch.where(torch.isneginf(val) | (row < 0), -1, row + base)
    return torch.cat([win_idx.to(torch.int32), row.to(torch.int32)], 1)


def topk_to_list(scores: torch.Tensor, k: int, win_idx: torch.Tensor, persist_rows: torch.Tensor,
                 vis: torch.Tensor, node_seq: torch.Tensor, comp_rows: int, base: int) -> torch.Tensor:
    """The top-``k`` columns of each row of ``scores`` [N, L] (k <= L <= MAX_ROW) as the
    attention list int32 [N, W + k] (module docstring; the same set as
    :func:`topk_to_list_torch`, in column order)."""
    N, L = scores.shape
    W = win_idx.shape[1]
    out = torch.empty(N, W + k, dtype=torch.int32, device=scores.device)
    if N == 0:
        return out
    if not 0 < k <= L <= MAX_ROW:
        raise ValueError(f"topk_to_list: k = {k} of rows of {L} (at most {MAX_ROW})")
    scores, win_idx, persist_rows, vis = (x.contiguous() for x in (scores.float(), win_idx, persist_rows, vis))
    pr = persist_rows if persist_rows.shape[1] else vis      # E == 0: never read
    vs = vis if vis.shape[1] else win_idx                    # no scratch column: never read
    _topk_list_kernel[(N,)](scores, win_idx, pr, vs, node_seq, out, L, k, W, persist_rows.shape[1], comp_rows, base,
                            scores.stride(0), win_idx.stride(0), pr.stride(0), vs.stride(0), out.stride(0),
                            BLOCK_L=max(16, triton.next_power_of_2(L)),
                            BLOCK_W=min(256, max(16, triton.next_power_of_2(max(W, 1)))),
                            num_warps=4 if L <= 1024 else (8 if L <= 2048 else 16))
    return out
