"""Triton GDN tree verify (one pass, no state written) and accepted-path commit.

Math (DESIGN §1, one value head): with G_j = g_j + G_parent(j) and M the ancestor-or-self
mask in topological order,

    (I + A) U = diag(b) (V - diag(e^G) K S0),   A_jm = b_j (k_j.k_m) e^{G_j - G_m}, m < j
    o_j = e^{G_j} S0^T q_j + sum_{m <= j} e^{G_j - G_m} (q_j.k_m) u_m
    S*  = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T

One program per (sequence, value head, V block).  Nodes are processed in chunks of BT
(<= 64) in topological order; an earlier chunk only enters a later one through its solved u
(off-diagonal blocks are ancestor-masked too), so trees of any size work.  The diagonal block
is inverted by block doubling, T_{2s} = T_s - T_s E_s T_s (E_s = the s x s blocks just below
the diagonal of each 2s block), which only ever multiplies true sub-inverses: unlike the
Neumann series sum (-A)^p it never forms the huge path counts of a deep chain.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _anc_tile(bits_ptr, grow, m_r, c2, BT: tl.constexpr, W: tl.constexpr):
    """[BT, BT] bool: column node (chunk c2) is an ancestor-or-self of row node (global grow).

    BT divides 64, so a chunk's columns all live in one 64-bit word of each row."""
    word = tl.load(bits_ptr + grow * W + (c2 * BT) // 64, mask=m_r, other=0)
    shift = ((c2 * BT) % 64 + tl.arange(0, BT)).to(tl.int64)
    return ((word[:, None] >> shift[None, :]) & 1) != 0


@triton.jit
def _qk_blocks(q_ptr, k_ptr, grow, m_r, gcol, m_c, i_h, H: tl.constexpr, K: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """Raw q_r.k_c and k_r.k_c [BT, BT] plus the squared norms of the column keys."""
    o_k = tl.arange(0, BK)
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    nc = tl.zeros([BT], dtype=tl.float32)
    for kb in tl.static_range(K // BK):
        offs = kb * BK + o_k
        kr = tl.load(k_ptr + (grow * H + i_h)[:, None] * K + offs[None, :], mask=m_r[:, None], other=0.)
        qr = tl.load(q_ptr + (grow * H + i_h)[:, None] * K + offs[None, :], mask=m_r[:, None], other=0.)
        kc = tl.load(k_ptr + (gcol * H + i_h)[:, None] * K + offs[None, :], mask=m_c[:, None], other=0.)
        kc32 = kc.to(tl.float32)
        kk += tl.dot(kr.to(tl.float32), tl.trans(kc32), input_precision=PREC)
        qk += tl.dot(qr.to(tl.float32), tl.trans(kc32), input_precision=PREC)
        nc += tl.sum(kc32 * kc32, axis=1)
    return kk, qk, nc


@triton.jit
def _tree_verify_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, bits_ptr, cu_ptr,
                        o_ptr, u_ptr, G_ptr, scale,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        W: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        LOG_BT: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    n = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    s0 = s0_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V   # int64: B*HV*K*V can pass 2^31
    eye = o_t[:, None] == o_t[None, :]
    for c in range(0, tl.cdiv(n, BT)):
        rows = c * BT + o_t
        m_r = rows < n
        grow = bos + rows
        # G_j = sum of g over ancestors-or-self, read off the mask chunk by chunk
        G = tl.zeros([BT], dtype=tl.float32)
        for c2 in range(0, c + 1):
            cols = c2 * BT + o_t
            m_c = cols < n
            gc = tl.load(g_ptr + (bos + cols) * HV + i_hv, mask=m_c, other=0.)
            anc = _anc_tile(bits_ptr, grow, m_r, c2, BT, W) & m_c[None, :]
            G += tl.sum(tl.where(anc, gc[None, :], 0.), axis=1)
        b_r = tl.load(beta_ptr + grow * HV + i_hv, mask=m_r, other=0.).to(tl.float32)
        # phase 1: diagonal k.k / q.k -> A, the output weights P and (I + A)^-1.  Phases are
        # split so that few [BT, BT] / [BT, BV] tiles are live at once (register pressure).
        kk, qk, nk = _qk_blocks(q_ptr, k_ptr, grow, m_r, grow, m_r, i_h, H, K, BT, BK, PREC)
        if L2NORM:
            rk = 1. / tl.maximum(tl.sqrt(nk), 1e-6)
        else:
            rk = tl.zeros([BT], dtype=tl.float32) + 1.
        anc = _anc_tile(bits_ptr, grow, m_r, c, BT, W) & m_r[None, :]
        dec = tl.where(anc, tl.exp(tl.where(anc, G[:, None] - G[None, :], 0.)), 0.) * rk[None, :]
        A = tl.where(anc & ~eye, b_r[:, None] * rk[:, None] * kk * dec, 0.)
        P = qk * dec                              # q_j.k_m e^{G_j - G_m} / |k_m|, row scale later
        # (I + A)^-1 by block doubling (see module docstring)
        # level s=1 is exact without dots (T_1 = I, so T_2 = I - E_1); then s = 2^lv -> 2s
        T = tl.where(eye, 1., 0.) - tl.where(((o_t[:, None] >> 1) == (o_t[None, :] >> 1)), A, 0.)
        for lv in tl.static_range(1, LOG_BT):
            E = tl.where(((o_t[:, None] >> (lv + 1)) == (o_t[None, :] >> (lv + 1)))
                         & ((o_t[:, None] >> lv) != (o_t[None, :] >> lv)), A, 0.)
            T = T - tl.dot(tl.dot(T, E, input_precision=PREC), T, input_precision=PREC)
        # phase 2: S0 projections k.S0, q.S0 (and the q norms)
        ks = tl.zeros([BT, BV], dtype=tl.float32)
        qs = tl.zeros([BT, BV], dtype=tl.float32)
        nq = tl.zeros([BT], dtype=tl.float32)
        for kb in tl.static_range(K // BK):
            offs = kb * BK + o_k
            kr = tl.load(k_ptr + (grow * H + i_h)[:, None] * K + offs[None, :], mask=m_r[:, None], other=0.).to(tl.float32)
            qr = tl.load(q_ptr + (grow * H + i_h)[:, None] * K + offs[None, :], mask=m_r[:, None], other=0.).to(tl.float32)
            s = tl.load(s0 + offs[:, None] * V + o_v[None, :])
            ks += tl.dot(kr, s, input_precision=PREC)
            qs += tl.dot(qr, s, input_precision=PREC)
            nq += tl.sum(qr * qr, axis=1)
        if L2NORM:
            rq = scale / tl.maximum(tl.sqrt(nq), 1e-6)
        else:
            rq = tl.zeros([BT], dtype=tl.float32) + scale
        eG = tl.exp(G)
        v_r = tl.load(v_ptr + (grow * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_r[:, None], other=0.).to(tl.float32)
        rhs = b_r[:, None] * (v_r - (eG * rk)[:, None] * ks)
        acc = (eG * rq)[:, None] * qs
        # phase 3: earlier chunks enter only through their solved u (ancestor-masked blocks)
        for c2 in range(0, c):
            cols = c2 * BT + o_t
            m_c = cols < n
            gcol = bos + cols
            kkx, qkx, nc = _qk_blocks(q_ptr, k_ptr, grow, m_r, gcol, m_c, i_h, H, K, BT, BK, PREC)
            if L2NORM:
                rc = 1. / tl.maximum(tl.sqrt(nc), 1e-6)
            else:
                rc = tl.zeros([BT], dtype=tl.float32) + 1.
            Gc = tl.load(G_ptr + gcol * HV + i_hv, mask=m_c, other=0.)
            ancx = _anc_tile(bits_ptr, grow, m_r, c2, BT, W) & m_c[None, :]
            decx = tl.where(ancx, tl.exp(tl.where(ancx, G[:, None] - Gc[None, :], 0.)), 0.) * rc[None, :]
            u_c = tl.load(u_ptr + (gcol * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_c[:, None], other=0.)
            rhs -= b_r[:, None] * tl.dot(kkx * rk[:, None] * decx, u_c, input_precision=PREC)
            acc += tl.dot(qkx * rq[:, None] * decx, u_c, input_precision=PREC)
        # phase 4: solve and output
        u = tl.dot(T, rhs, input_precision=PREC)
        acc += tl.dot(P * rq[:, None], u, input_precision=PREC)
        tl.store(u_ptr + (grow * HV + i_hv)[:, None] * V + o_v[None, :], u, mask=m_r[:, None])
        # every V block stores the same G (identical values), so each reads back its own
        tl.store(G_ptr + grow * HV + i_hv, G, mask=m_r)
        tl.store(o_ptr + (grow * HV + i_hv)[:, None] * V + o_v[None, :],
                 acc.to(o_ptr.dtype.element_ty), mask=m_r[:, None])
        tl.debug_barrier()   # later chunks of this program read the u and G just stored


@triton.jit
def _tree_commit_kernel(s_ptr, k_ptr, u_ptr, G_ptr, bits_ptr, cu_ptr, acc_ptr,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        W: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                        L2NORM: tl.constexpr, PREC: tl.constexpr):
    """S* = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T, in place, per (seq, head, V block)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    a = tl.load(acc_ptr + i_b).to(tl.int64)
    arow = bos + a
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    sp = s_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    Ga = tl.load(G_ptr + arow * HV + i_hv)
    S = tl.exp(Ga) * tl.load(sp)
    for c in range(0, a // BT + 1):
        cols = c * BT + o_t
        word = tl.load(bits_ptr + arow * W + (c * BT) // 64)
        on_path = (((word >> ((c * BT) % 64 + o_t).to(tl.int64)) & 1) != 0) & (cols <= a)
        gcol = bos + cols
        Gm = tl.load(G_ptr + gcol * HV + i_hv, mask=on_path, other=0.)
        kc = tl.load(k_ptr + (gcol * H + i_h)[:, None] * K + o_k[None, :], mask=on_path[:, None], other=0.).to(tl.float32)
        if L2NORM:
            kc = kc / tl.maximum(tl.sqrt(tl.sum(kc * kc, axis=1)), 1e-6)[:, None]
        w = tl.where(on_path, tl.exp(tl.where(on_path, Ga - Gm, 0.)), 0.)
        uc = tl.load(u_ptr + (gcol * HV + i_hv)[:, None] * V + o_v[None, :], mask=on_path[:, None], other=0.)
        S += tl.dot(tl.trans(kc * w[:, None]), uc, input_precision=PREC)
    tl.store(sp, S)
