"""The K-streamed tree verify for trees of one sub-chunk (n <= BT): ``VerifyLaunch(stream=1)``.

One program per (sequence, value head, V block of BV columns), as ``_tree_verify_kernel``'s,
but the state tile [K, BV] fp32 is never held whole: the program streams it in BK-row
pieces (a ``tl.range`` loop Triton pipelines, ``num_stages``) and accumulates what the
single-sub-chunk math needs of it,

    KS = K_rows S0,  QS = Q_rows S0                      [BT, BV] fp32
    kk = K_rows K_rows^T,  qk = Q_rows K_rows^T          [BT, BT] fp32 (the rows' squares too)

on the raw q / k rows; the L2 norms and the scale multiply the sums after the loop (a row
scale commutes with the products).  The epilogue is the untransposed walk's math for
sub-chunk 0 with ``dot(xk, s0)`` / ``dot(xq, s0)`` replaced by KS / QS:

    rhs = b (V - e^G KS),  u = (I + A)^-1 rhs,  o = e^G QS + (Q K^T o D o M) u

u, G and o go where the walk stores them (the commit and the next round's fold read them).
The registers a program holds are a piece, the accumulators and the rows - not the tile -
so more programs fit an SM and the state loads overlap the products (docs/kernels/gdn_floor.md).

FOLD (a ``GDNPendingRound``, FOLD 3 / 4's semantics): the prologue gathers the round
before's accepted path once (its ancestor bits: up to BT path rows, the round's trees of at
most BT nodes), with each path row's weight e^{G_a - G_m} / |k_m| (the norm over all K) and
its u row; each state piece is folded as it arrives (S = e^{G_a} S + K_path[:, piece]^T (w U))
on the columns whose ``on`` flag waits, stored back in place, then used.  The flags are
cleared after the loop in the same program: no sequence of calls folds a round twice, and a
verify whose round is never armed leaves the state folded once, as FOLD 3 / 4 do
(``_round_fold.py``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._bits import _popcount64, _select_bit64
from ._round_fold import _round_at
from ._tree_kernels import (_ancestor_sums, _anc_tile, _masked_blocks, _unit_lower_inverse,
                            _verify_program)


@triton.jit
def _inv_norms(ss, mult, L2NORM: tl.constexpr):
    """mult / |x| from the rows' sums of squares ``ss`` (L2NORM), else mult."""
    if L2NORM:
        return mult / tl.maximum(tl.sqrt(ss), 1e-6)
    return tl.where(ss == ss, mult, mult)


@triton.jit
def _round_path(rk_ptr, ru_ptr, rG_ptr, rbits_ptr, rcu_ptr, racc_ptr, pon, i_b, i_hv, i_h, o_v,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                RW: tl.constexpr, BP: tl.constexpr, L2NORM: tl.constexpr):
    """The round before's accepted path, gathered once: (flags ``on`` [BV], the columns'
    decay (e^{G_a} where on, else 1) [BV], path rows' k row pointers [BP, 1] and their mask
    [BP], weights e^{G_a - G_m} / |k_m| [BP], u rows [BP, BV] fp32 (zero off the waiting
    columns)).  Nothing waits in this tile: the mask is all off (the loads then move nothing;
    a sequence not armed may hold any accepted node, so its row is not read either)."""
    on = tl.load(pon) != 0
    any_on = tl.max(on.to(tl.int32), axis=0) > 0
    bos, a = _round_at(rcu_ptr, racc_ptr, i_b)
    arow = bos + a
    Ga = tl.load(rG_ptr + arow * HV + i_hv, mask=any_on, other=0.)
    # the round's trees have at most BP <= 64 nodes: a's path is in its first ancestor word
    word = tl.load(rbits_ptr + arow * RW, mask=any_on, other=0).to(tl.uint64, bitcast=True)
    cnt = tl.where(any_on, _popcount64(word).to(tl.int64), 0)   # path rows to fold here
    slot = tl.arange(0, BP)
    pv = slot < cnt
    pcol = tl.where(pv, bos + _select_bit64(word + tl.zeros([BP], dtype=tl.uint64), slot), bos)
    Gm = tl.load(rG_ptr + pcol * HV + i_hv, mask=pv, other=0.)
    wgt = tl.where(pv, tl.exp(tl.where(pv, Ga - Gm, 0.)), 0.)
    krow = rk_ptr + (pcol * H + i_h)[None, :] * K
    if L2NORM:
        kf = tl.load(krow + tl.arange(0, K)[:, None], mask=pv[None, :], other=0.).to(tl.float32)
        wgt = wgt / tl.maximum(tl.sqrt(tl.sum(kf * kf, axis=0)), 1e-6)
    uc = tl.load(ru_ptr + (pcol * HV + i_hv)[:, None] * V + o_v[None, :],
                 mask=pv[:, None] & on[None, :], other=0.).to(tl.float32)
    return on, tl.where(on, tl.exp(Ga), 1.), krow, pv, wgt, uc


@triton.jit
def _tree_verify_stream_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, bits_ptr,
                               bits32_ptr, cu_ptr, o_ptr, u_ptr, G_ptr, scale,
                               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                               V: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                               BV: tl.constexpr, BK: tl.constexpr, LOG_BT: tl.constexpr,
                               L2NORM: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                               STAGES: tl.constexpr = 2, FOLD: tl.constexpr = False,
                               rk_ptr=None, ru_ptr=None, rG_ptr=None, rbits_ptr=None,
                               rcu_ptr=None, racc_ptr=None, pon_ptr=None, RW: tl.constexpr = 1,
                               RL2NORM: tl.constexpr = True, FOLD_DOT16: tl.constexpr = False):
    """One tree of n <= BT nodes per (sequence, value head, V block), the state streamed in
    BK-row pieces (module docstring); q, k raw (L2-normalised here where L2NORM), any dtype;
    the [*, K] products on DT operands at PREC, as the walk's."""
    i_v, i_b, i_hv, i_h, bos, n = _verify_program(cu_ptr, H, HV, 0)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_r = o_t < n
    grow = bos + o_t
    # prologue: every load that no state piece depends on, issued together
    b_r = tl.load(beta_ptr + grow * HV + i_hv, mask=m_r, other=0.)
    v_r = tl.load(v_ptr + (grow * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_r[:, None],
                  other=0.).to(tl.float32)
    G = _ancestor_sums(g_ptr, bits32_ptr, bits32_ptr, bos, n, o_t, m_r, i_hv, HV, 2 * W, BT,
                       False)
    anc = _anc_tile(bits_ptr, grow, m_r, 0, BT, W) & m_r[None, :]
    if FOLD:
        pon = pon_ptr + (i_b * HV + i_hv).to(tl.int64) * V + o_v
        on, dcol, krow, pv, wgt, uc = _round_path(rk_ptr, ru_ptr, rG_ptr, rbits_ptr, rcu_ptr,
                                                  racc_ptr, pon, i_b, i_hv, i_h, o_v, H, HV, K,
                                                  V, RW, BT, RL2NORM)
    kbase = k_ptr + (grow * H + i_h)[:, None] * K
    qbase = q_ptr + (grow * H + i_h)[:, None] * K
    sbase = s0_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V + o_v[None, :]
    KS = tl.zeros([BT, BV], dtype=tl.float32)
    QS = tl.zeros([BT, BV], dtype=tl.float32)
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    ssk = tl.zeros([BT], dtype=tl.float32)
    ssq = tl.zeros([BT], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        o_k = k0 + tl.arange(0, BK)
        sp = sbase + o_k[:, None] * V
        S = tl.load(sp)                                                      # [BK, BV] fp32
        xk = tl.load(kbase + o_k[None, :], mask=m_r[:, None], other=0.).to(tl.float32)
        xq = tl.load(qbase + o_k[None, :], mask=m_r[:, None], other=0.).to(tl.float32)
        if FOLD:   # the waiting columns: e^{G_a} S + K_path[:, piece]^T (w U), stored back
            kw = tl.load(krow + o_k[:, None], mask=pv[None, :], other=0.).to(tl.float32) \
                * wgt[None, :]                                               # [BK, BP]
            S = S * dcol[None, :]
            if FOLD_DOT16:
                S = tl.dot(kw.to(tl.bfloat16), uc.to(tl.bfloat16), acc=S)
            else:
                S = S + tl.dot(kw, uc, input_precision="ieee")
            tl.store(sp, S, mask=on[None, :])
        ssk += tl.sum(xk * xk, axis=1)
        ssq += tl.sum(xq * xq, axis=1)
        xkd, xqd, sd = xk.to(DT), xq.to(DT), S.to(DT)
        xkt = tl.trans(xkd)
        kk += tl.dot(xkd, xkt, input_precision=PREC)
        qk += tl.dot(xqd, xkt, input_precision=PREC)
        KS += tl.dot(xkd, sd, input_precision=PREC)
        QS += tl.dot(xqd, sd, input_precision=PREC)
    if FOLD:   # after every piece of this tile is stored: the round is folded here
        tl.store(pon, tl.zeros([BV], dtype=tl.int8), mask=on)
    # epilogue: the walk's single-sub-chunk math on the normalised sums
    rk = _inv_norms(ssk, 1., L2NORM)
    rq = _inv_norms(ssq, scale, L2NORM)
    a_cc, p_cc = _masked_blocks(kk * rk[:, None] * rk[None, :], qk * rq[:, None] * rk[None, :],
                                b_r, anc, G, G)
    eG = tl.exp(G)[:, None]
    rhs = b_r[:, None] * (v_r - eG * (KS * rk[:, None]))
    u = tl.dot(_unit_lower_inverse(tl.where(o_t[:, None] > o_t[None, :], a_cc, 0.), BT, LOG_BT,
                                   PREC), rhs, input_precision=PREC)
    acc = eG * (QS * rq[:, None]) + tl.dot(p_cc, u, input_precision=PREC)
    off = (grow * HV + i_hv)[:, None] * V + o_v[None, :]
    tl.store(u_ptr + off, u, mask=m_r[:, None])
    tl.store(G_ptr + grow * HV + i_hv, G, mask=m_r)   # every V block: the same values
    tl.store(o_ptr + off, acc.to(o_ptr.dtype.element_ty), mask=m_r[:, None])
