"""Triton GDN tree verify (one pass, no state written) and accepted-path commit.

Math (DESIGN §1, one value head): with G_j = g_j + G_parent(j) and M the ancestor-or-self
mask in topological order,

    (I + A) U = diag(b) (V - diag(e^G) K S0),   A_jm = b_j (k_j.k_m) e^{G_j - G_m}, m < j
    o_j = e^{G_j} S0^T q_j + sum_{m <= j} e^{G_j - G_m} (q_j.k_m) u_m
    S*  = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T

One program per (sequence, value head, V block).  The S0 tile [K, BV] is loaded from HBM
once (the compiler keeps it in shared memory).  Nodes go in sub-chunks of BT (16 by default)
in topological order; for sub-chunk c (rows r) the right-hand side is

    rhs_r = b_r (v_r - e^{G_r} S0^T k_r) - b_r sum_{c' < c} (K_c K_{c'}^T o D o M)[r] U_{c'}

(D = e^{G_r - G_m}), i.e. earlier sub-chunks enter only through their solved u, re-read from
the u buffer the commit needs anyway (off-diagonal blocks are ancestor-masked too), so trees
of any size work and the work is one [BT, K] x [K, 2 BT] and one [2 BT, BT] x [BT, BV] dot
per sub-chunk pair (rows stacked [k; q], see the kernel): no tile grows with n, and ptxas
(sm_90) reports no spills at BV <= 128.  The diagonal block is inverted by block doubling,
T_{2s} = T_s - T_s E_s T_s (E_s = the s x s blocks just below the diagonal of each 2s
block), which only ever multiplies true sub-inverses: unlike the Neumann series sum (-A)^p
it never forms the huge path counts of a deep chain.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _anc_tile(bits_ptr, grow, m_r, c2, BT: tl.constexpr, W: tl.constexpr):
    """[BT, BT] bool: column node (sub-chunk c2) is an ancestor-or-self of row node (global grow).

    BT divides 64, so a sub-chunk's columns all live in one 64-bit word of each row."""
    word = tl.load(bits_ptr + grow * W + (c2 * BT) // 64, mask=m_r, other=0)
    shift = ((c2 * BT) % 64 + tl.arange(0, BT)).to(tl.int64)
    return ((word[:, None] >> shift[None, :]) & 1) != 0


@triton.jit
def _rows_normed(ptr, grow, m_r, i_h, mult, H: tl.constexpr, K: tl.constexpr,
                 L2NORM: tl.constexpr, DT: tl.constexpr = tl.float32):
    """Rows of q or k [BT, K] in DT, L2-normalised in fp32 (optionally) and times ``mult``."""
    o_k = tl.arange(0, K)
    x = tl.load(ptr + (grow * H + i_h)[:, None] * K + o_k[None, :], mask=m_r[:, None],
                other=0.).to(tl.float32)
    if L2NORM:
        x = x * (mult / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-6))[:, None]
    else:
        x = x * mult
    return x.to(DT)


@triton.jit
def _decay(anc, Gr, Gc):
    """e^{G_r - G_c} on ancestor pairs, 0 elsewhere (exp never sees unrelated, possibly
    hugely positive differences)."""
    return tl.where(anc, tl.exp(tl.where(anc, Gr[:, None] - Gc[None, :], 0.)), 0.)


@triton.jit
def _halves(x, BT: tl.constexpr, N: tl.constexpr):
    """[2 BT, N] -> (rows [0, BT), rows [BT, 2 BT))."""
    return tl.split(tl.permute(tl.reshape(x, [2, BT, N]), (1, 2, 0)))


@triton.jit
def _stack(top, bot, BT: tl.constexpr, N: tl.constexpr):
    """([BT, N], [BT, N]) -> [2 BT, N], top rows first."""
    return tl.reshape(tl.permute(tl.join(top, bot), (2, 0, 1)), [2 * BT, N])


@triton.jit
def _tree_verify_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, bits_ptr, cu_ptr,
                        pairs_ptr, npairs_ptr, NC, o_ptr, u_ptr, G_ptr, scale,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        W: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                        LOG_BT: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                        DT: tl.constexpr):
    """Rows are stacked [k rows; q rows] of one sub-chunk ([2 BT, *] tiles): one dot gives
    both k_r.k_m (the solve) and q_r.k_m (the output), and the stacked accumulator Z holds
    [rhs; acc].  X^T [K, 2 BT] is the loop-invariant operand of the inner loop, as the B
    operand of kc @ X^T, so it is split across warps instead of replicated in each.  The
    [*, K] dots (normalised q/k, S0) take DT operands: bf16 for 16-bit inputs (as fla does;
    half the registers of tf32 operands), fp32 otherwise; the [*, BT] dots on u stay fp32."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    n = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
    o_t = tl.arange(0, BT)
    o_s = tl.arange(0, 2 * BT)
    is_q = o_s >= BT
    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, K)
    # int64: B*HV*K*V can pass 2^31; S0 [K, BV] is read once per program
    s0 = tl.load(s0_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]).to(DT)
    eye = o_t[:, None] == o_t[None, :]
    for c in range(0, tl.cdiv(n, BT)):
        rows = c * BT + (o_s % BT)                      # [2 BT]: the sub-chunk twice
        m_r = rows < n
        grow = bos + rows
        # two loads (a per-row pointer select would defeat vectorised loads), then stacked
        xo = (bos + c * BT + o_t) * H + i_h
        m_d = c * BT + o_t < n
        x = _stack(tl.load(k_ptr + xo[:, None] * K + o_k[None, :], mask=m_d[:, None], other=0.),
                   tl.load(q_ptr + xo[:, None] * K + o_k[None, :], mask=m_d[:, None], other=0.),
                   BT, K).to(tl.float32)
        mult = tl.where(is_q, scale, 1.)
        if L2NORM:
            mult = mult / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-6)
        x = (x * mult[:, None]).to(DT)                   # [k_r / |k_r|; scale q_r / |q_r|]
        # G_r = sum of g over ancestors-or-self, read off the mask sub-chunk by sub-chunk
        G = tl.zeros([2 * BT], dtype=tl.float32)
        for c2 in range(0, c + 1):
            cols = c2 * BT + o_t
            m_c = cols < n
            gc = tl.load(g_ptr + (bos + cols) * HV + i_hv, mask=m_c, other=0.)
            anc = _anc_tile(bits_ptr, grow, m_r, c2, BT, W) & m_c[None, :]
            G += tl.sum(tl.where(anc, gc[None, :], 0.), axis=1)
        b_r = tl.load(beta_ptr + grow * HV + i_hv, mask=m_r, other=0.).to(tl.float32)
        v_r = tl.load(v_ptr + (grow * HV + i_hv)[:, None] * V + o_v[None, :],
                      mask=(m_r & ~is_q)[:, None], other=0.).to(tl.float32)   # k rows only
        eG = tl.exp(G)
        xs = eG[:, None] * tl.dot(x, s0, input_precision=PREC)          # e^G [k; q] S0
        Z = tl.where(is_q[:, None], xs, b_r[:, None] * (v_r - xs))       # [rhs; acc] so far
        xt = tl.trans(x)
        w = tl.where(is_q, 1., -b_r)
        # earlier sub-chunks (all full, c2 < c) enter only through their solved u.  A pair
        # (c, c2) with no ancestor of any row of c inside c2 adds exactly zero (P is
        # ancestor-masked), so the loop walks only the c2 listed in pairs[i_b, c] (built once
        # per round, meta.subchunk_pairs): a loop, not a branch, so loads still pipeline.
        # Chains and BFS-ordered EAGLE trees keep every pair; wide or DFS-ordered ones drop many.
        pc = pairs_ptr + (i_b * NC + c) * NC
        for i in range(0, tl.load(npairs_ptr + i_b * NC + c)):
            c2 = tl.load(pc + i).to(tl.int64)
            gcol = bos + c2 * BT + o_t
            kc = _rows_normed(k_ptr, gcol, gcol >= 0, i_h, 1., H, K, L2NORM, DT)
            Gc = tl.load(G_ptr + gcol * HV + i_hv)
            dec = _decay(_anc_tile(bits_ptr, grow, m_r, c2, BT, W), G, Gc) * w[:, None]
            P = tl.trans(tl.dot(kc, xt, input_precision=PREC)) * dec      # [2 BT, BT]
            uc = tl.load(u_ptr + (gcol * HV + i_hv)[:, None] * V + o_v[None, :])
            Z += tl.dot(P, uc, input_precision=PREC)
        # diagonal block: A (strictly lower, ancestor-masked), (I + A)^-1 by block doubling
        drow = c * BT + o_t
        kd = _rows_normed(k_ptr, bos + drow, m_d, i_h, 1., H, K, L2NORM, DT)
        Gd, _ = _halves(G[:, None], BT, 1)
        Gd = tl.reshape(Gd, [BT])
        anc = _anc_tile(bits_ptr, grow, m_r, c, BT, W) & m_d[None, :]
        P = tl.trans(tl.dot(kd, xt, input_precision=PREC)) * _decay(anc, G, Gd)
        kk, qk = _halves(P, BT, BT)
        bd, _ = _halves(b_r[:, None], BT, 1)
        A = tl.where(o_t[:, None] > o_t[None, :], tl.reshape(bd, [BT])[:, None] * kk, 0.)
        # level s=1 is exact without dots (T_1 = I, so T_2 = I - E_1); then s = 2^lv -> 2s
        T = tl.where(eye, 1., 0.) - tl.where(((o_t[:, None] >> 1) == (o_t[None, :] >> 1)), A, 0.)
        for lv in tl.static_range(1, LOG_BT):
            E = tl.where(((o_t[:, None] >> (lv + 1)) == (o_t[None, :] >> (lv + 1)))
                         & ((o_t[:, None] >> lv) != (o_t[None, :] >> lv)), A, 0.)
            T = T - tl.dot(tl.dot(T, E, input_precision=PREC), T, input_precision=PREC)
        rhs, acc = _halves(Z, BT, BV)
        u = tl.dot(T, rhs, input_precision=PREC)
        acc += tl.dot(qk, u, input_precision=PREC)
        dg = bos + drow
        tl.store(u_ptr + (dg * HV + i_hv)[:, None] * V + o_v[None, :], u, mask=m_d[:, None])
        # every V block stores the same G (identical values), so each reads back its own
        tl.store(G_ptr + dg * HV + i_hv, Gd, mask=m_d)
        tl.store(o_ptr + (dg * HV + i_hv)[:, None] * V + o_v[None, :],
                 acc.to(o_ptr.dtype.element_ty), mask=m_d[:, None])
        tl.debug_barrier()   # later sub-chunks of this program read the u and G just stored


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
        kc = _rows_normed(k_ptr, gcol, on_path, i_h, 1., H, K, L2NORM)
        w = tl.where(on_path, tl.exp(tl.where(on_path, Ga - Gm, 0.)), 0.)
        uc = tl.load(u_ptr + (gcol * HV + i_hv)[:, None] * V + o_v[None, :], mask=on_path[:, None], other=0.)
        S += tl.dot(tl.trans(kc * w[:, None]), uc, input_precision=PREC)
    tl.store(sp, S)
