"""The round before folded straight from its own buffers (docs/math/gdn_tree_solve.md, "The
commit deferred", the launch-free form): device functions the verify walks (FOLD 3 / 4) and
the standalone ``_round_fold_kernel`` call.

Where ``GDNPendingPath`` holds copies of the accepted path's rows (written by the deferred
commit's launch), ``GDNPendingRound`` keeps references to the round before's k, u, G and
ancestor bits and its accepted nodes; the fold gathers the path from the ancestor bits (as
the standalone commit's gathered path walk does) and runs

    S* = e^{G_a} S + sum_{m on a's root path} e^{G_a - G_m} k_m u_m^T

on the state tile as it loads it.  A round then takes one GDN launch (the walk) and a memset
(the ``on`` flags armed after acceptance) instead of walk + commit kernel.

    _round_folded_tile  the whole [K, BV] tile folded in registers and returned (the walk's S0)
    _round_fold_state   the tile folded in memory, BK state rows at a time (any tile size)

Both fold only where the tile's ``on`` columns say the round waits and clear them in the same
program, so no sequence of calls folds a round twice (abort-safe as the pending path is).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._bits import _popcount64, _select_bit64
from ._fold_kernel import _tile_and_flags


@triton.jit
def _round_rows(S, k_ptr, u_ptr, G_ptr, gcol, on, Ga, i_h, i_hv, o_k, o_v, col_on,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                L2NORM: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr,
                FULL: tl.constexpr):
    """S + sum over the rows ``gcol`` that are ``on`` of e^{G_a - G_m} k_m[o_k] u_m[o_v]^T: one
    [len(o_k), BT] x [BT, BV] product; only the columns ``col_on`` take their u (the others
    add exact zeros).  k rows L2-normalised over all K (L2NORM) as the verify used them -
    FULL: o_k is all K rows (one load), else a piece of them.  DOT16: bf16 operands with
    fp32 accumulation (a bf16 u buffer), else fp32 at PREC - the standalone commit's sums."""
    Gm = tl.load(G_ptr + gcol * HV + i_hv, mask=on, other=0.)
    wgt = tl.where(on, tl.exp(tl.where(on, Ga - Gm, 0.)), 0.)
    krow = k_ptr + (gcol * H + i_h)[:, None] * K
    kp = tl.load(krow + o_k[None, :], mask=on[:, None], other=0.).to(tl.float32)
    if L2NORM:
        kf = kp
        if not FULL:
            kf = tl.load(krow + tl.arange(0, K)[None, :], mask=on[:, None],
                         other=0.).to(tl.float32)
        kp = kp * (1. / tl.maximum(tl.sqrt(tl.sum(kf * kf, axis=1)), 1e-6))[:, None]
    uc = tl.load(u_ptr + (gcol * HV + i_hv)[:, None] * V + o_v[None, :],
                 mask=on[:, None] & col_on[None, :], other=0.)
    kw = tl.trans(kp * wgt[:, None])
    if DOT16:
        return tl.dot(kw.to(tl.bfloat16), uc.to(tl.bfloat16), acc=S)
    return S + tl.dot(kw, uc.to(tl.float32), input_precision=PREC)


@triton.jit
def _round_path_sum(S, k_ptr, u_ptr, G_ptr, bits_ptr, bos, a, Ga, i_h, i_hv, o_k, o_v, col_on,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    W: tl.constexpr, BT: tl.constexpr, L2NORM: tl.constexpr,
                    PREC: tl.constexpr, DOT16: tl.constexpr, FULL: tl.constexpr,
                    PATH: tl.constexpr):
    """S + the sum over local node a's root path (tree at flat row bos), BT rows per
    ``_round_rows`` product, as the standalone commit walks it (``_commit_tile``): PATH: the
    path's nodes gathered from a's ancestor bits (slot s = the word's s-th set bit); else
    nodes 0..a in stored order, the off-path ones masked."""
    arow = bos + a
    o_t = tl.arange(0, BT)
    if PATH:
        for w in range(0, a // 64 + 1):
            word = tl.load(bits_ptr + arow * W + w).to(tl.uint64, bitcast=True)
            cnt = _popcount64(word).to(tl.int64)   # ancestors-or-self of a: none past a
            for s0 in range(0, cnt, BT):
                slot = s0 + o_t
                on = slot < cnt
                gcol = tl.where(on, bos + w * 64 + _select_bit64(
                    word + tl.zeros([BT], dtype=tl.uint64), slot), bos)
                S = _round_rows(S, k_ptr, u_ptr, G_ptr, gcol, on, Ga, i_h, i_hv, o_k, o_v,
                                col_on, H, HV, K, V, L2NORM, PREC, DOT16, FULL)
    else:
        for c in range(0, a // BT + 1):
            cols = c * BT + o_t
            word = tl.load(bits_ptr + arow * W + (c * BT) // 64)
            on = (((word >> ((c * BT) % 64 + o_t).to(tl.int64)) & 1) != 0) & (cols <= a)
            S = _round_rows(S, k_ptr, u_ptr, G_ptr, bos + cols, on, Ga, i_h, i_hv, o_k, o_v,
                            col_on, H, HV, K, V, L2NORM, PREC, DOT16, FULL)
    return S


@triton.jit
def _round_at(rcu_ptr, racc_ptr, i_b):
    """(first flat row, accepted local node) of sequence i_b in the round before: loaded
    beside the state tile and the flags, before the branch on the flags (in bounds whatever
    they hold), so the fold's chain of dependent loads is one step shorter."""
    return tl.load(rcu_ptr + i_b).to(tl.int64), tl.load(racc_ptr + i_b).to(tl.int64)


@triton.jit
def _round_folded_tile(s_ptr, rk_ptr, ru_ptr, rG_ptr, rbits_ptr, rcu_ptr, racc_ptr, pon_ptr,
                       i_b, i_hv, i_h, o_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                       L2NORM: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr,
                       PATH: tl.constexpr):
    """The state tile [K, BV] fp32 of (i_b, i_hv, o_v) with the round before folded in
    (stored back, its ``on`` columns cleared) or as stored where none waits: one read, at
    most one write, the tile kept in registers by the caller."""
    o_k = tl.arange(0, K)
    sp, S, pon, on = _tile_and_flags(s_ptr, pon_ptr, i_b, i_hv, o_v, HV, K, V)
    bos, a = _round_at(rcu_ptr, racc_ptr, i_b)
    if tl.max(on.to(tl.int32), axis=0) > 0:
        Ga = tl.load(rG_ptr + (bos + a) * HV + i_hv)
        # the waiting columns scaled by e^{G_a} and given their path sum, the others times 1
        # plus exact zeros: no second copy of the tile stays live
        S = _round_path_sum(S * tl.where(on, tl.exp(Ga), 1.)[None, :], rk_ptr, ru_ptr, rG_ptr,
                            rbits_ptr, bos, a, Ga, i_h, i_hv, o_k, o_v, on, H, HV, K, V, W, BT,
                            L2NORM, PREC, DOT16, True, PATH)
        tl.store(sp, S, mask=on[None, :])
        tl.store(pon, tl.zeros(on.shape, dtype=tl.int8))
    return S


@triton.jit
def _round_fold_state(s_ptr, rk_ptr, ru_ptr, rG_ptr, rbits_ptr, rcu_ptr, racc_ptr, pon_ptr,
                      i_b, i_hv, i_h, o_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                      L2NORM: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr,
                      PATH: tl.constexpr):
    """The round before folded into the state tile of (i_b, i_hv, o_v) in memory, BK state
    rows at a time (a [BK, BV] fp32 piece in registers), where its ``on`` columns wait.
    PATH: the path walk of ``_round_path_sum`` (the commit rule's, ``round_fold_args``)."""
    pon = pon_ptr + (i_b * HV + i_hv).to(tl.int64) * V + o_v
    on = tl.load(pon) != 0
    bos, a = _round_at(rcu_ptr, racc_ptr, i_b)
    if tl.max(on.to(tl.int32), axis=0) > 0:
        Ga = tl.load(rG_ptr + (bos + a) * HV + i_hv)
        sbase = s_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V
        eGa = tl.exp(Ga)
        for k0 in range(0, K, BK):   # a loop, not unrolled: one piece's path work live at once
            o_k = k0 + tl.arange(0, BK)
            sp = sbase + o_k[:, None] * V + o_v[None, :]
            S = _round_path_sum(eGa * tl.load(sp), rk_ptr, ru_ptr, rG_ptr, rbits_ptr, bos, a,
                                Ga, i_h, i_hv, o_k, o_v, on, H, HV, K, V, W, BT, L2NORM, PREC,
                                DOT16, BK == K, PATH)
            tl.store(sp, S, mask=on[None, :])
        tl.store(pon, tl.zeros(on.shape, dtype=tl.int8))
