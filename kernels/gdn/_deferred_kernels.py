"""Triton kernels of the deferred commit (docs/math/gdn_tree_solve.md, "The commit deferred").

    _fold_pending_kernel the standalone fold (``_fold_kernel._fold_state``, which the verify
                         walks call first where they fold).
    _defer_commit_kernel the commit stage when deferred: the accepted path's token rows (k, w, u)
                         gathered into the pending buffers (no state traffic); a path longer
                         than the buffers hold is committed into the state at once instead.
    _round_fold_kernel   the standalone fold of a waiting ``GDNPendingRound`` (``_round_fold``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._bits import _popcount64, _select_bit64
from ._fold_kernel import _fold_state
from ._round_fold import _round_fold_state
from ._tree_kernels import _commit_tile, _rows_normed


@triton.jit
def _fold_program(sel_ptr, HV: tl.constexpr, SELECT: tl.constexpr):
    """(V block, sequence, value head, whether to fold) of a standalone fold's program (grid:
    V blocks x sequences * value heads); SELECT: only where ``sel`` [B] is non-zero."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = i_bh // HV
    go = True
    if SELECT:
        go = tl.load(sel_ptr + i_b) != 0
    return i_v, i_b, i_bh % HV, go


@triton.jit
def _fold_pending_kernel(s_ptr, pk_ptr, pw_ptr, pu_ptr, pdec_ptr, pon_ptr, plen_ptr, sel_ptr, P,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BV: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                         DOT16: tl.constexpr, SELECT: tl.constexpr):
    """The standalone fold, one program per (V block, sequence * value head); SELECT: only the
    sequences whose ``sel`` entry is non-zero."""
    i_v, i_b, i_hv, go = _fold_program(sel_ptr, HV, SELECT)
    if go:
        _fold_state(s_ptr, pk_ptr, pw_ptr, pu_ptr, pdec_ptr, pon_ptr, plen_ptr, P, i_b, i_hv,
                    i_hv // (HV // H), i_v * BV + tl.arange(0, BV), H, HV, K, V, BK, BP, DOT16)


@triton.jit
def _path_length(bits_ptr, arow, a, W: tl.constexpr):
    """Nodes on the root path of local node a (row arow): its ancestor-or-self bits."""
    n = a * 0
    for w in range(0, a // 64 + 1):
        n += _popcount64(tl.load(bits_ptr + arow * W + w).to(tl.uint64, bitcast=True)).to(tl.int64)
    return n


@triton.jit
def _defer_commit_kernel(s_ptr, k_ptr, u_ptr, G_ptr, bits_ptr, cu_ptr, acc_ptr,
                         pk_ptr, pw_ptr, pu_ptr, pdec_ptr, pon_ptr, plen_ptr, P,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         W: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                         L2NORM: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr):
    """Per (V block, sequence * value head): the accepted path's rows into the pending buffers
    (root first; u for this V block, w and the decay by the first V block, k by the first
    value head of each key head) and its ``on`` columns set; a path of more than P nodes is
    committed into the state now (``_commit_tile``) and its columns cleared."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    a = tl.load(acc_ptr + i_b).to(tl.int64)
    arow = bos + a
    o_v = i_v * BV + tl.arange(0, BV)
    pon = pon_ptr + (i_b * HV + i_hv).to(tl.int64) * V + o_v
    n = _path_length(bits_ptr, arow, a, W)
    if n <= P:
        Ga = tl.load(G_ptr + arow * HV + i_hv)
        o_t = tl.arange(0, BT)
        base = a * 0
        for w in range(0, a // 64 + 1):
            word = tl.load(bits_ptr + arow * W + w).to(tl.uint64, bitcast=True)
            cnt = _popcount64(word).to(tl.int64)
            for s0 in range(0, cnt, BT):
                slot = s0 + o_t
                valid = slot < cnt
                gcol = tl.where(valid, bos + w * 64
                                + _select_bit64(word + tl.zeros([BT], dtype=tl.uint64), slot), bos)
                dst = (i_b * P + base + slot).to(tl.int64)
                uc = tl.load(u_ptr + (gcol * HV + i_hv)[:, None] * V + o_v[None, :],
                             mask=valid[:, None], other=0.)
                tl.store(pu_ptr + (dst * HV + i_hv)[:, None] * V + o_v[None, :],
                         uc.to(pu_ptr.dtype.element_ty), mask=valid[:, None])
                if i_v == 0:
                    Gm = tl.load(G_ptr + gcol * HV + i_hv, mask=valid, other=0.)
                    tl.store(pw_ptr + dst * HV + i_hv, tl.exp(tl.where(valid, Ga - Gm, 0.)),
                             mask=valid)
                    if i_hv % (HV // H) == 0:
                        kc = _rows_normed(k_ptr, gcol, valid, i_h, 1., H, K, L2NORM)
                        tl.store(pk_ptr + (dst * H + i_h)[:, None] * K
                                 + tl.arange(0, K)[None, :], kc, mask=valid[:, None])
            base += cnt
        if i_v == 0:
            tl.store(pdec_ptr + i_b * HV + i_hv, tl.exp(Ga))
            if i_hv == 0:
                tl.store(plen_ptr + i_b, n.to(tl.int32))
        tl.store(pon, tl.full(o_v.shape, 1, dtype=tl.int8))
    else:
        _commit_tile(s_ptr, k_ptr, u_ptr, G_ptr, bits_ptr, i_b, i_hv, bos, a, o_v, H, HV, K, V,
                     W, BT, L2NORM, PREC, True, DOT16)
        tl.store(pon, tl.zeros(o_v.shape, dtype=tl.int8))


@triton.jit
def _round_fold_kernel(s_ptr, rk_ptr, ru_ptr, rG_ptr, rbits_ptr, rcu_ptr, racc_ptr, pon_ptr,
                       sel_ptr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, W: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                       BT: tl.constexpr, L2NORM: tl.constexpr, DOT16: tl.constexpr,
                       SELECT: tl.constexpr, PATH: tl.constexpr):
    """The standalone fold of a waiting round (``GDNPendingRound``), one program per (V block,
    sequence * value head); SELECT: only the sequences whose ``sel`` entry is non-zero."""
    i_v, i_b, i_hv, go = _fold_program(sel_ptr, HV, SELECT)
    if go:
        _round_fold_state(s_ptr, rk_ptr, ru_ptr, rG_ptr, rbits_ptr, rcu_ptr, racc_ptr, pon_ptr,
                          i_b, i_hv, i_hv // (HV // H), i_v * BV + tl.arange(0, BV), H, HV, K, V,
                          W, BK, BT, L2NORM, "ieee", DOT16, PATH)
