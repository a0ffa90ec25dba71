"""Triton GDN tree verify (one pass, no state written) and accepted-path commit.

Math (docs/math/gdn_tree_solve.md, one value head): with G_j = g_j + G_parent(j) and M the ancestor-or-self
mask in topological order,

    (I + A) U = diag(b) (V - diag(e^G) K S0),   A_jm = b_j (k_j.k_m) e^{G_j - G_m}, m < j
    o_j = e^{G_j} S0^T q_j + sum_{m <= j} e^{G_j - G_m} (q_j.k_m) u_m
    S*  = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T

One program per (sequence, value head, V block).  The S0 tile [K, BV] is loaded from HBM
once.  Nodes go in sub-chunks of BT (16 or 32) in topological order; for sub-chunk c (rows r)

    rhs_r = b_r (v_r - e^{G_r} S0^T k_r) - b_r sum_{c' < c} (K_c K_{c'}^T o D o M)[r] U_{c'}

(D = e^{G_r - G_m}), i.e. earlier sub-chunks enter only through their solved u, re-read from
the u buffer the commit needs anyway (off-diagonal blocks are ancestor-masked too), so trees
of any size work and no tile grows with n.  The kernel may walk the nodes in another
topological order (ORDER: depth-first, larger subtree first, ``TreeMeta.heavy_first``): a
branch then stays in few sub-chunks and about half the pairs drop out at 128 nodes
(reports/h200/gdn/tuning/pairs.md).
A pre-pass (``_qk_prenorm_kernel``, where the launch rule turns it on) writes the
normalised, scaled q and k rows in the dot dtype and every node's G once per layer, so the
verify kernel neither redoes the row norms for each sub-chunk and pair nor the G prologue in
each V block.
k rows and q rows are separate [BT, K] tiles: stacking them into one [2 BT, K] tile halves
the dot count, but its reshapes cost more than the dots (docs/kernels/gdn_launch.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._bits import _popcount64, _select_bit64
from ._fold_kernel import _fold_state, _folded_tile
from ._round_fold import _round_fold_state, _round_folded_tile

# the kernels one verify call launches (pre-pass, K-side kernel, one of the walks), by the
# names the profiling scripts (tune_gdn, gdn_kernel_times, ncu_gdn.sh, ncu_summary) pick them by;
# the CUDA walk and K-side kernel (cuda/walk.cu, not Triton kernels) by the names inside their
# instances' names
WALK_KERNELS = ("_tree_verify_kernel", "_tree_verify_t_kernel")
VERIFY_KERNELS = ("_qk_prenorm_kernel", "_tree_kside_kernel") + WALK_KERNELS
CUDA_WALK_KERNEL, CUDA_KSIDE_KERNEL = "walk_kernel", "kside_kernel"
# what the Nsight scripts profile and summarise: every kernel of a verify, whichever walk runs
PROFILED_WALKS = WALK_KERNELS + (CUDA_WALK_KERNEL,)
PROFILED_KERNELS = VERIFY_KERNELS + (CUDA_WALK_KERNEL, CUDA_KSIDE_KERNEL)


@triton.jit
def _anc_tile(bits_ptr, grow, m_r, c2, BT: tl.constexpr, W: tl.constexpr):
    """[BT, BT] bool: column node (sub-chunk c2) is an ancestor-or-self of row node (global grow).

    BT divides 64, so a sub-chunk's columns all live in one 64-bit word of each row."""
    word = tl.load(bits_ptr + grow * W + (c2 * BT) // 64, mask=m_r, other=0)
    shift = ((c2 * BT) % 64 + tl.arange(0, BT)).to(tl.int64)
    return ((word[:, None] >> shift[None, :]) & 1) != 0


@triton.jit
def _node_rows(order_ptr, bos, local, m, ORDER: tl.constexpr):
    """Flat rows of q/k/v/g/beta/o/u/G of the nodes at kernel positions ``local``: the kernel
    walks the nodes in ``order`` (ORDER, a renumbering whose ancestor bits it is given) or as
    stored.  Masked-off positions get row ``bos`` (their loads and stores are masked too)."""
    if ORDER:
        return tl.load(order_ptr + bos + local, mask=m, other=0).to(tl.int64)
    else:
        return bos + local


@triton.jit
def _rows_normed(ptr, grow, m_r, i_h, mult, H: tl.constexpr, K: tl.constexpr,
                 L2NORM: tl.constexpr, DT: tl.constexpr = tl.float32, READY: tl.constexpr = False):
    """Rows of q or k [BT, K] in DT, L2-normalised in fp32 (optionally) and times ``mult``;
    READY: the rows were normalised and scaled already (``_qk_prenorm_kernel``), loaded as DT."""
    o_k = tl.arange(0, K)
    x = tl.load(ptr + (grow * H + i_h)[:, None] * K + o_k[None, :], mask=m_r[:, None],
                other=0.)
    if READY:
        return x.to(DT)
    x = x.to(tl.float32)
    if L2NORM:
        x = x * (mult / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-6))[:, None]
    else:
        x = x * mult
    return x.to(DT)


@triton.jit
def _qk_prenorm_kernel(q_ptr, k_ptr, qn_ptr, kn_ptr, R, scale, g_ptr, bits32_ptr, order_ptr,
                       cu_ptr, G_ptr, NR, K: tl.constexpr, BR: tl.constexpr,
                       L2NORM: tl.constexpr, HV: tl.constexpr, W: tl.constexpr,
                       NT: tl.constexpr, ORDER: tl.constexpr, G_PASS: tl.constexpr,
                       HVB: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr = False):
    """Once per layer, what every V block of a head would otherwise redo: programs < NR write
    qn = scale * q / |q|, kn = k / |k| (norms in fp32, stored in the outputs' dtype) for BR of
    the R = N * H rows each, so the verify kernel skips the row reductions of every sub-chunk
    and of every earlier sub-chunk it pairs with; G_PASS: the programs after them write G of
    RB nodes of one tree for HVB value heads each (``_G_tile``).  PDL: the next kernel (launched
    programmatically dependent) may start once every program here has; it waits for this
    grid's writes before it reads them (``tl.extra.cuda.gdc_wait``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid < NR:
        rows = (pid * BR + tl.arange(0, BR)).to(tl.int64)
        m = rows < R
        off = rows[:, None] * K + tl.arange(0, K)[None, :]
        tl.store(qn_ptr + off, _rows_normed(q_ptr, rows, m, 0, scale, 1, K, L2NORM,
                                            qn_ptr.dtype.element_ty), mask=m[:, None])
        tl.store(kn_ptr + off, _rows_normed(k_ptr, rows, m, 0, 1., 1, K, L2NORM,
                                            kn_ptr.dtype.element_ty), mask=m[:, None])
    elif G_PASS:
        HBLK: tl.constexpr = (HV + HVB - 1) // HVB
        RBLK: tl.constexpr = NT // RB
        t = pid - NR
        _G_tile(g_ptr, bits32_ptr, order_ptr, cu_ptr, G_ptr, t // (HBLK * RBLK),
                (t // RBLK) % HBLK, t % RBLK, HV, HVB, 2 * W, NT, RB, ORDER)


@triton.jit
def _G_tile(g_ptr, bits32_ptr, order_ptr, cu_ptr, G_ptr, i_b, i_hb, i_r, HV: tl.constexpr,
            HVB: tl.constexpr, W2: tl.constexpr, NT: tl.constexpr, RB: tl.constexpr,
            ORDER: tl.constexpr):
    """G = M g for RB rows (i_r) of tree i_b and HVB value heads (i_hb): M [RB, NT] the rows'
    ancestor-or-self bits (kernel order), expanded once for all HVB heads, g [NT, HVB]; one
    exact fp32 product (M is 0/1).  G goes to the nodes' stored rows (``order``)."""
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    n = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
    if i_r * RB < n:
        o_h = i_hb * HVB + tl.arange(0, HVB)
        m_h = o_h < HV
        o_n = tl.arange(0, NT)
        m_n = o_n < n
        gt = tl.load(g_ptr + _node_rows(order_ptr, bos, o_n, m_n, ORDER)[:, None] * HV
                     + o_h[None, :], mask=m_n[:, None] & m_h[None, :], other=0.)
        rows = i_r * RB + tl.arange(0, RB)
        m_r = rows < n
        w = tl.load(bits32_ptr + (bos + rows)[:, None] * W2 + (o_n // 32)[None, :],
                    mask=m_r[:, None] & m_n[None, :], other=0)
        anc = ((w >> (o_n % 32)[None, :]) & 1).to(tl.float32)
        srow = _node_rows(order_ptr, bos, rows, m_r, ORDER)
        tl.store(G_ptr + srow[:, None] * HV + o_h[None, :],
                 tl.dot(anc, gt, input_precision="ieee"), mask=m_r[:, None] & m_h[None, :])


@triton.jit
def _decay(anc, Gr, Gc):
    """e^{G_r - G_c} on ancestor pairs, 0 elsewhere (exp never sees unrelated, possibly
    hugely positive differences)."""
    return tl.where(anc, tl.exp(tl.where(anc, Gr[:, None] - Gc[None, :], 0.)), 0.)


@triton.jit
def _masked_blocks(kk, qk, b_r, anc, Gr, Gc):
    """One value head's masked blocks of a (row, column) sub-chunk pair from its k.k and q.k
    dots: a = b_r (K K_c^T o D o M) and p = (Q K_c^T o D o M), D = e^{Gr - Gc} on the ancestor
    pairs ``anc`` (M).  The diagonal block's A is a's strictly lower part."""
    dec = _decay(anc, Gr, Gc)
    return b_r[:, None] * kk * dec, qk * dec


@triton.jit
def _ancestor_sum(g_ptr, bits_ptr, order_ptr, bos, n, prow, m_r, c, i_hv, HV: tl.constexpr,
                  W: tl.constexpr, BT: tl.constexpr, ORDER: tl.constexpr):
    """G_r = sum of g over the ancestors-or-self of rows r of sub-chunk c ([BT]); ``prow`` =
    bos + kernel positions (the ancestor bits are in kernel order)."""
    o_t = tl.arange(0, BT)
    G = tl.zeros([BT], dtype=tl.float32)
    for c2 in range(0, c + 1):
        cols = c2 * BT + o_t
        m_c = cols < n
        gc = tl.load(g_ptr + _node_rows(order_ptr, bos, cols, m_c, ORDER) * HV + i_hv, mask=m_c,
                     other=0.)
        anc = _anc_tile(bits_ptr, prow, m_r, c2, BT, W) & m_c[None, :]
        G += tl.sum(tl.where(anc, gc[None, :], 0.), axis=1)
    return G


@triton.jit
def _ancestor_sums(g_ptr, bits32_ptr, order_ptr, bos, n, rows, m_rows, i_hv, HV: tl.constexpr,
                   W2: tl.constexpr, NT: tl.constexpr, ORDER: tl.constexpr):
    """G of the given rows (local node indices, NT >= n) at once: ancestor columns 32 at a time
    (the int32 halves of the mask words, W2 per row), unrolled, so no load waits on another."""
    HB: tl.constexpr = 32 if NT > 32 else NT
    o_hb = tl.arange(0, HB)
    G = tl.where(m_rows, 0., 0.)
    for j0 in tl.static_range(0, NT, HB):
        w32 = tl.load(bits32_ptr + (bos + rows) * W2 + j0 // 32, mask=m_rows, other=0)
        m_c = j0 + o_hb < n
        gc = tl.load(g_ptr + _node_rows(order_ptr, bos, j0 + o_hb, m_c, ORDER) * HV + i_hv,
                     mask=m_c, other=0.)
        on = ((w32[:, None] >> (j0 % 32 + o_hb)[None, :]) & 1) != 0
        G += tl.sum(tl.where(on, gc[None, :], 0.), axis=1)
    return G


@triton.jit
def _store_G(g_ptr, bits32_ptr, order_ptr, G_ptr, bos, n, i_hv, HV: tl.constexpr,
             W: tl.constexpr, NT: tl.constexpr, ORDER: tl.constexpr):
    """G of every node of one (sequence, value head) into G_ptr (NT >= n nodes)."""
    o_n = tl.arange(0, NT)
    tl.store(G_ptr + _node_rows(order_ptr, bos, o_n, o_n < n, ORDER) * HV + i_hv,
             _ancestor_sums(g_ptr, bits32_ptr, order_ptr, bos, n, o_n, o_n < n, i_hv, HV,
                            2 * W, NT, ORDER),
             mask=o_n < n)


@triton.jit
def _chunk_rows(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, bits_ptr, G_ptr, order_ptr, bos, n, c,
                i_h, i_hv, o_v, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, L2NORM: tl.constexpr,
                DT: tl.constexpr, G_STORED: tl.constexpr, ORDER: tl.constexpr,
                READY: tl.constexpr):
    """What sub-chunk c needs that no earlier sub-chunk changes: normalised k and q rows, beta,
    v [BT, BV] and G (read back when already stored, else summed over the ancestors)."""
    rows = c * BT + tl.arange(0, BT)
    m_r = rows < n
    grow = _node_rows(order_ptr, bos, rows, m_r, ORDER)
    xk = _rows_normed(k_ptr, grow, m_r, i_h, 1., H, K, L2NORM, DT, READY)
    xq = _rows_normed(q_ptr, grow, m_r, i_h, scale, H, K, L2NORM, DT, READY)
    b_r = tl.load(beta_ptr + grow * HV + i_hv, mask=m_r, other=0.)
    v_r = tl.load(v_ptr + (grow * HV + i_hv)[:, None] * V + o_v[None, :], mask=m_r[:, None],
                  other=0.).to(tl.float32)
    if G_STORED:
        G = tl.load(G_ptr + grow * HV + i_hv, mask=m_r, other=0.)
    else:
        G = _ancestor_sum(g_ptr, bits_ptr, order_ptr, bos, n, bos + rows, m_r, c, i_hv, HV, W, BT,
                          ORDER)
    return xk, xq, b_r, v_r, G


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, LOG_BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for strictly lower A [BT, BT] by block doubling: T_{2s} = T_s - T_s E_s T_s
    (E_s = the s x s blocks just below the diagonal of each 2s block), which only ever
    multiplies true sub-inverses: unlike the Neumann series it never forms the huge path
    counts of a deep chain.  Level s = 1 is exact without dots (T_1 = I, so T_2 = I - E_1)."""
    o_t = tl.arange(0, BT)
    T = tl.where(o_t[:, None] == o_t[None, :], 1., 0.) - tl.where(
        ((o_t[:, None] >> 1) == (o_t[None, :] >> 1)), A, 0.)
    for lv in tl.static_range(1, LOG_BT):
        E = tl.where(((o_t[:, None] >> (lv + 1)) == (o_t[None, :] >> (lv + 1)))
                     & ((o_t[:, None] >> lv) != (o_t[None, :] >> lv)), A, 0.)
        T = T - tl.dot(tl.dot(T, E, input_precision=PREC), T, input_precision=PREC)
    return T


@triton.jit
def _tile_slot(ptr, i_b, i_hv, slot, slots, HV: tl.constexpr, BT: tl.constexpr):
    """Two [BT, BT] tiles at ``slot`` of the ``slots`` that (sequence i_b, value head i_hv)
    holds in a K-side buffer: where ``_tree_kside_kernel`` writes them and the walks read them
    (``cuda/walk.cu``'s copies spell the same layout: change both together)."""
    return ptr + ((i_b * HV + i_hv).to(tl.int64) * slots + slot) * 2 * BT * BT


@triton.jit
def _diag_tiles(diag_ptr, i_b, i_hv, c, NC, HV: tl.constexpr, BT: tl.constexpr):
    """Sub-chunk c's diagonal tiles (T_c, then P_cc): slot c of NC."""
    return _tile_slot(diag_ptr, i_b, i_hv, c, NC, HV, BT)


@triton.jit
def _pair_tiles(pair_ptr, i_b, i_hv, c, i, NC, HV: tl.constexpr, BT: tl.constexpr):
    """The tiles (a, then p) of sub-chunk c's i-th pair: slot c (c - 1) / 2 + i of the
    NC (NC - 1) / 2 pairs."""
    return _tile_slot(pair_ptr, i_b, i_hv, (c * (c - 1)) // 2 + i, NC * (NC - 1) // 2, HV, BT)


@triton.jit
def _verify_program(cu_ptr, H: tl.constexpr, HV: tl.constexpr, PDL: tl.constexpr):
    """(V block, sequence, value head, key head, first row, nodes) of a verify program (grid:
    V blocks x sequences * value heads); PDL 1: first waits for the grid before it."""
    if PDL == 1:
        tl.extra.cuda.gdc_wait()
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    return i_v, i_b, i_hv, i_hv // (HV // H), bos, tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos


@triton.jit
def _tree_verify_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, bits_ptr, bits32_ptr,
                        order_ptr, cu_ptr, pairs_ptr, npairs_ptr, NC, o_ptr, u_ptr, G_ptr, scale,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        W: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                        LOG_BT: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                        DT: tl.constexpr, NT: tl.constexpr, UDT: tl.constexpr,
                        PREFETCH: tl.constexpr, ORDER: tl.constexpr,
                        QK_READY: tl.constexpr = False, G_READY: tl.constexpr = False,
                        diag_ptr=None, pair_ptr=None, KSIDE: tl.constexpr = False,
                        SDT: tl.constexpr = tl.float32, PDL: tl.constexpr = 0,
                        EARLY: tl.constexpr = False, pk_ptr=None, pw_ptr=None, pu_ptr=None,
                        pdec_ptr=None, pon_ptr=None, plen_ptr=None, P=0,
                        FOLD: tl.constexpr = 0, FOLD_BK: tl.constexpr = 32,
                        FOLD_BP: tl.constexpr = 16, FOLD_DOT16: tl.constexpr = False,
                        rk_ptr=None, ru_ptr=None, rG_ptr=None, rbits_ptr=None, rcu_ptr=None,
                        racc_ptr=None, RW: tl.constexpr = 1, RL2NORM: tl.constexpr = True,
                        RPATH: tl.constexpr = False):
    """One program per (sequence, value head, V block); sub-chunks of BT nodes in order.

    Per sub-chunk c (rows r): rhs = b (V - e^G K S0) and acc = e^G Q S0, minus/plus the
    ancestor-masked terms of the earlier sub-chunks listed in pairs[b, c] (their solved u,
    re-read from the u buffer the commit needs anyway), then u_c = (I + A_cc)^-1 rhs and
    o_c = acc + (Q K^T o D o M)_cc u_c.  The [*, K] dots take DT operands (bf16 for 16-bit
    inputs, as fla does), the dots on T fp32 (tf32 or ieee), the earlier-sub-chunk dots on u
    UDT (fp32, or bf16 like fla's v_new).  NT > 0 (a power of two >= every tree's size): G of
    all nodes first, in one round of loads; NT = 0: G per sub-chunk (trees of any size).
    ORDER: nodes are walked in the order ``order_ptr`` gives (bits, pairs and positions in
    that numbering; every per-node tensor, u and G included, stays in stored rows).
    QK_READY: q and k come normalised and scaled (``_qk_prenorm_kernel``), in DT; G_READY
    (with NT > 0): that pre-pass wrote G too.  KSIDE: the products that need no V column
    (each sub-chunk's inverse and diagonal output block, each pair's two masked blocks) come
    from ``_tree_kside_kernel``'s tiles, so the sequential walk keeps only the dots on V;
    SDT: the dtype of those diagonal tiles and of the right-hand operands they multiply
    (bf16 like fla's solved inverse and its u product, or fp32).  PDL (launched
    programmatically dependent on the kernel before): 1 waits for that grid before anything
    else; 2 (the kernel before is the pre-pass or the K-side kernel, which were launched
    after everything that writes S0) loads its S0 tile first, then waits.  EARLY (with KSIDE):
    each sub-chunk's diagonal tiles are loaded at the top of its step, so their latency hides
    behind the S0 products and the pairs, instead of after the pairs.  FOLD (the deferred
    commit, ``deferred.py``): the pending path of the round before is folded into this
    program's state tile first - 2: in registers, the folded tile is S0 (``_folded_tile``);
    1: in memory, BK rows at a time, then read back as S0 (``_fold_state``); 3 and 4 the
    same from the round before's own buffers (``GDNPendingRound``, ``_round_fold.py``: r*
    pointers, RW its ancestor-bit words, RPATH its path walk)."""
    i_v, i_b, i_hv, i_h, bos, n = _verify_program(cu_ptr, H, HV, PDL)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, K)
    if FOLD == 2:   # the folded tile stays in registers as S0
        s0 = _folded_tile(s0_ptr, pk_ptr, pw_ptr, pu_ptr, pdec_ptr, pon_ptr, plen_ptr, P, i_b,
                          i_hv, i_h, o_v, H, HV, K, V, FOLD_BP, FOLD_DOT16).to(DT)
    elif FOLD == 3:
        s0 = _round_folded_tile(s0_ptr, rk_ptr, ru_ptr, rG_ptr, rbits_ptr, rcu_ptr, racc_ptr,
                                pon_ptr, i_b, i_hv, i_h, o_v, H, HV, K, V, RW, FOLD_BP, RL2NORM,
                                "ieee", FOLD_DOT16, RPATH).to(DT)
    else:
        if FOLD == 1:
            _fold_state(s0_ptr, pk_ptr, pw_ptr, pu_ptr, pdec_ptr, pon_ptr, plen_ptr, P, i_b, i_hv,
                        i_h, o_v, H, HV, K, V, FOLD_BK, FOLD_BP, FOLD_DOT16)
            tl.debug_barrier()   # the folded tile, stored by this program's threads, read as S0
        if FOLD == 4:
            _round_fold_state(s0_ptr, rk_ptr, ru_ptr, rG_ptr, rbits_ptr, rcu_ptr, racc_ptr,
                              pon_ptr, i_b, i_hv, i_h, o_v, H, HV, K, V, RW, FOLD_BK, FOLD_BP,
                              RL2NORM, "ieee", FOLD_DOT16, RPATH)
            tl.debug_barrier()
        # int64: B*HV*K*V can pass 2^31; S0 [K, BV] is read once per program
        s0 = tl.load(s0_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V
                     + o_v[None, :]).to(DT)
    if PDL == 2:   # everything below may read what the kernels before wrote
        tl.extra.cuda.gdc_wait()
    if NT > 0:   # every node's G up front (one round of loads), read back below
        if not G_READY:   # else the pre-pass wrote it
            _store_G(g_ptr, bits32_ptr, order_ptr, G_ptr, bos, n, i_hv, HV, W, NT, ORDER)
            tl.debug_barrier()
    lower = o_t[:, None] > o_t[None, :]
    tt = o_t[:, None] * BT + o_t[None, :]
    # PREFETCH: the rows of each sub-chunk are loaded one sub-chunk ahead (they do not depend
    # on the solve), so their load latency hides behind the previous sub-chunk's dots
    if PREFETCH:
        xk, xq, b_r, v_r, G = _chunk_rows(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, bits_ptr, G_ptr,
                                          order_ptr, bos, n, 0, i_h, i_hv, o_v, scale, H, HV, K,
                                          V, W, BT, L2NORM, DT, NT > 0, ORDER, QK_READY)
    for c in range(0, tl.cdiv(n, BT)):
        rows = c * BT + o_t
        m_r = rows < n
        prow = bos + rows      # row of the ancestor bits (kernel order)
        if not PREFETCH:
            xk, xq, b_r, v_r, G = _chunk_rows(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, bits_ptr,
                                              G_ptr, order_ptr, bos, n, c, i_h, i_hv, o_v, scale,
                                              H, HV, K, V, W, BT, L2NORM, DT, NT > 0, ORDER,
                                              QK_READY)
        if KSIDE and EARLY:
            dp = _diag_tiles(diag_ptr, i_b, i_hv, c, NC, HV, BT) + tt
            t_cc = tl.load(dp)
            p_cc = tl.load(dp + BT * BT)
        eG = tl.exp(G)[:, None]
        rhs = b_r[:, None] * (v_r - eG * tl.dot(xk, s0, input_precision=PREC))
        acc = eG * tl.dot(xq, s0, input_precision=PREC)
        # earlier sub-chunks: a pair (c, c2) with no ancestor of any row of c inside c2 adds
        # exactly zero (everything is ancestor-masked), so the loop walks only the c2 listed
        # in pairs[i_b, c] (built once per round, meta.subchunk_pairs): a loop, not a
        # branch, so loads still pipeline.  The benchmark's BFS-ordered EAGLE trees keep every
        # pair; depth-first order (ORDER) about half of them at 128 nodes.
        pc = pairs_ptr + (i_b * NC + c) * NC
        for i in range(0, tl.load(npairs_ptr + i_b * NC + c)):
            c2 = tl.load(pc + i).to(tl.int64)
            scol = _node_rows(order_ptr, bos, c2 * BT + o_t, o_t >= 0, ORDER)
            uc = tl.load(u_ptr + (scol * HV + i_hv)[:, None] * V + o_v[None, :]).to(UDT)
            if KSIDE:
                tp = _pair_tiles(pair_ptr, i_b, i_hv, c, i, NC, HV, BT) + tt
                a_rc = tl.load(tp)
                p_rc = tl.load(tp + BT * BT)
            else:
                kct = tl.trans(_rows_normed(k_ptr, scol, o_t >= 0, i_h, 1., H, K, L2NORM, DT,
                                            QK_READY))
                a_rc, p_rc = _masked_blocks(
                    tl.dot(xk, kct, input_precision=PREC), tl.dot(xq, kct, input_precision=PREC),
                    b_r, _anc_tile(bits_ptr, prow, m_r, c2, BT, W), G,
                    tl.load(G_ptr + scol * HV + i_hv))
            rhs -= tl.dot(a_rc.to(UDT), uc, input_precision=PREC)
            acc += tl.dot(p_rc.to(UDT), uc, input_precision=PREC)
        # diagonal block: A (strictly lower, ancestor-masked) and its unit-lower inverse
        if KSIDE:
            if not EARLY:
                dp = _diag_tiles(diag_ptr, i_b, i_hv, c, NC, HV, BT) + tt
                t_cc = tl.load(dp)
                p_cc = tl.load(dp + BT * BT)
            u = tl.dot(t_cc, rhs.to(SDT), input_precision=PREC)
            acc += tl.dot(p_cc, u.to(SDT), input_precision=PREC)
        else:
            xkt = tl.trans(xk)
            a_cc, p_cc = _masked_blocks(
                tl.dot(xk, xkt, input_precision=PREC), tl.dot(xq, xkt, input_precision=PREC), b_r,
                _anc_tile(bits_ptr, prow, m_r, c, BT, W) & m_r[None, :], G, G)
            u = tl.dot(_unit_lower_inverse(tl.where(lower, a_cc, 0.), BT, LOG_BT, PREC), rhs,
                       input_precision=PREC)
            acc += tl.dot(p_cc, u, input_precision=PREC)
        G_c = G
        if PREFETCH:
            xk, xq, b_r, v_r, G = _chunk_rows(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, bits_ptr,
                                              G_ptr, order_ptr, bos, n, c + 1, i_h, i_hv, o_v,
                                              scale, H, HV, K, V, W, BT, L2NORM, DT, NT > 0,
                                              ORDER, QK_READY)
        srow = _node_rows(order_ptr, bos, rows, m_r, ORDER)   # re-read: shorter live range
        tl.store(u_ptr + (srow * HV + i_hv)[:, None] * V + o_v[None, :], u, mask=m_r[:, None])
        # every V block stores the same G (identical values), so each reads back its own
        if NT == 0:
            tl.store(G_ptr + srow * HV + i_hv, G_c, mask=m_r)
        tl.store(o_ptr + (srow * HV + i_hv)[:, None] * V + o_v[None, :],
                 acc.to(o_ptr.dtype.element_ty), mask=m_r[:, None])
        tl.debug_barrier()   # later sub-chunks of this program read the u and G just stored


@triton.jit
def _kside_heads(kk, qk, anc, m_r, grow, scol, beta_ptr, G_ptr, out_ptr, i_b, i_hv0, c, i, NC,
                 HV: tl.constexpr, BT: tl.constexpr, LOG_BT: tl.constexpr, PREC: tl.constexpr,
                 HVB: tl.constexpr, DIAG: tl.constexpr):
    """From one key head's k.k / q.k blocks (``kk``, ``qk``) of rows ``grow``, the two tiles of
    each of the value heads i_hv0 .. i_hv0 + HVB - 1 (beta and the decays are per value head):
    DIAG, sub-chunk c's T_c = (I + A_cc)^-1 and P_cc; else the i-th pair's a and p, the
    column decays from the earlier sub-chunk's stored rows ``scol``."""
    o_t = tl.arange(0, BT)
    tt = o_t[:, None] * BT + o_t[None, :]
    for j in tl.static_range(HVB):
        i_hv = i_hv0 + j
        G = tl.load(G_ptr + grow * HV + i_hv, mask=m_r, other=0.)
        b_r = tl.load(beta_ptr + grow * HV + i_hv, mask=m_r, other=0.)
        if DIAG:
            a, p = _masked_blocks(kk, qk, b_r, anc, G, G)
            a = _unit_lower_inverse(tl.where(o_t[:, None] > o_t[None, :], a, 0.), BT, LOG_BT, PREC)
            tp = _diag_tiles(out_ptr, i_b, i_hv, c, NC, HV, BT) + tt
        else:
            a, p = _masked_blocks(kk, qk, b_r, anc, G, tl.load(G_ptr + scol * HV + i_hv))
            tp = _pair_tiles(out_ptr, i_b, i_hv, c, i, NC, HV, BT) + tt
        tl.store(tp, a.to(out_ptr.dtype.element_ty))
        tl.store(tp + BT * BT, p.to(out_ptr.dtype.element_ty))


@triton.jit
def _tree_kside_kernel(q_ptr, k_ptr, beta_ptr, bits_ptr, order_ptr, cu_ptr, pairs_ptr, npairs_ptr,
                       NC, G_ptr, diag_ptr, pair_ptr, scale, H: tl.constexpr,
                       HV: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                       LOG_BT: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                       DT: tl.constexpr, ORDER: tl.constexpr, READY: tl.constexpr,
                       HVB: tl.constexpr, PDL: tl.constexpr = False):
    """The verify's products that need no V column, one program per (sub-chunk c, sequence,
    HVB value heads of one key head) (their k.k and q.k dots are shared; beta and the decays
    are per value head):

        diag  [c]    T_c = (I + A_cc)^-1 and P_cc = (Q_c K_c^T o D o M)     (diag_ptr's dtype)
        pairs [c, i] a = b_r (K_c K_c2^T o D o M), p = (Q_c K_c2^T o D o M)  (c2 = pairs[c, i])

    at slot c (c - 1) / 2 + i of each (sequence, value head) (pair_ptr's dtype, the one the
    verify casts them to).  Independent of every other program (G comes from the pre-pass),
    so the inverses and masked dots leave the verify's sequential walk over sub-chunks.
    PDL: launched programmatically dependent on the pre-pass (waits for its writes before
    reading anything) and lets the verify start once every program here has."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    c, i_bh = tl.program_id(0), tl.program_id(1)
    NB: tl.constexpr = HV // HVB
    i_b, i_hv0 = i_bh // NB, (i_bh % NB) * HVB
    i_h = i_hv0 // (HV // H)
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    n = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
    if c * BT < n:
        rows = c * BT + tl.arange(0, BT)
        m_r = rows < n
        prow = bos + rows
        grow = _node_rows(order_ptr, bos, rows, m_r, ORDER)
        xk = _rows_normed(k_ptr, grow, m_r, i_h, 1., H, K, L2NORM, DT, READY)
        xq = _rows_normed(q_ptr, grow, m_r, i_h, scale, H, K, L2NORM, DT, READY)
        xkt = tl.trans(xk)
        _kside_heads(tl.dot(xk, xkt, input_precision=PREC), tl.dot(xq, xkt, input_precision=PREC),
                     _anc_tile(bits_ptr, prow, m_r, c, BT, W) & m_r[None, :], m_r, grow, grow,
                     beta_ptr, G_ptr, diag_ptr, i_b, i_hv0, c, 0, NC, HV, BT, LOG_BT, PREC, HVB,
                     True)
        o_t = tl.arange(0, BT)
        pc = pairs_ptr + (i_b * NC + c) * NC
        for i in range(0, tl.load(npairs_ptr + i_b * NC + c)):
            c2 = tl.load(pc + i).to(tl.int64)
            scol = _node_rows(order_ptr, bos, c2 * BT + o_t, o_t >= 0, ORDER)
            kct = tl.trans(_rows_normed(k_ptr, scol, o_t >= 0, i_h, 1., H, K, L2NORM, DT, READY))
            _kside_heads(tl.dot(xk, kct, input_precision=PREC),
                         tl.dot(xq, kct, input_precision=PREC),
                         _anc_tile(bits_ptr, prow, m_r, c2, BT, W), m_r, grow, scol, beta_ptr,
                         G_ptr, pair_ptr, i_b, i_hv0, c, i, NC, HV, BT, LOG_BT, PREC, HVB, False)


@triton.jit
def _fold_rows(S, k_ptr, u_ptr, G_ptr, gcol, on, Ga, i_h, i_hv, o_v, H: tl.constexpr,
               HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L2NORM: tl.constexpr,
               PREC: tl.constexpr, DOT16: tl.constexpr = False):
    """S + sum over the rows ``gcol`` that are ``on`` of e^{G_a - G_m} k_m u_m^T: one
    [K, BT] x [BT, BV] product (DOT16: bf16 operands, fp32 accumulation, as fla folds its bf16
    v_new into the state; else fp32 at PREC)."""
    Gm = tl.load(G_ptr + gcol * HV + i_hv, mask=on, other=0.)
    kc = _rows_normed(k_ptr, gcol, on, i_h, 1., H, K, L2NORM)
    w = tl.where(on, tl.exp(tl.where(on, Ga - Gm, 0.)), 0.)
    uc = tl.load(u_ptr + (gcol * HV + i_hv)[:, None] * V + o_v[None, :], mask=on[:, None],
                 other=0.)
    kw = tl.trans(kc * w[:, None])
    if DOT16:
        return tl.dot(kw.to(tl.bfloat16), uc.to(tl.bfloat16), acc=S)
    return S + tl.dot(kw, uc.to(tl.float32), input_precision=PREC)


@triton.jit
def _tree_commit_kernel(s_ptr, k_ptr, u_ptr, G_ptr, bits_ptr, cu_ptr, acc_ptr,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        W: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                        L2NORM: tl.constexpr, PREC: tl.constexpr, PATH: tl.constexpr = False,
                        DOT16: tl.constexpr = False):
    """S* = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T, in place, per (seq, head, V block)
    (``_commit_tile``)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    _commit_tile(s_ptr, k_ptr, u_ptr, G_ptr, bits_ptr, i_b, i_hv, bos,
                 tl.load(acc_ptr + i_b).to(tl.int64), i_v * BV + tl.arange(0, BV), H, HV, K, V, W,
                 BT, L2NORM, PREC, PATH, DOT16)


@triton.jit
def _commit_tile(s_ptr, k_ptr, u_ptr, G_ptr, bits_ptr, i_b, i_hv, bos, a, o_v,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 W: tl.constexpr, BT: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                 PATH: tl.constexpr, DOT16: tl.constexpr):
    """The commit of one (sequence i_b, value head i_hv, V columns o_v) state tile, accepted
    LOCAL node a of the tree starting at flat row bos.

    The sum runs over the accepted node a's root path (its ancestor bits), BT rows per
    product.  PATH = False: nodes 0..a in stored order, BT at a time, off-path rows masked
    (a // BT + 1 products).  PATH = True: for each 64-node word of a's ancestor bits, its
    path nodes are gathered BT at a time (slot s = the word's s-th set bit,
    ``_select_bit64``), so one product folds up to BT path nodes however far apart they are
    stored (a root path holds depth + 1 nodes).  DOT16: the products on bf16 operands
    (``_fold_rows``), for a u buffer in bf16."""
    i_h = i_hv // (HV // H)
    arow = bos + a
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    sp = s_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    Ga = tl.load(G_ptr + arow * HV + i_hv)
    S = tl.exp(Ga) * tl.load(sp)
    if PATH:
        for w in range(0, a // 64 + 1):
            word = tl.load(bits_ptr + arow * W + w).to(tl.uint64, bitcast=True)
            # the bits are ancestors-or-self of a, so none lies past a: no masking needed
            cnt = _popcount64(word).to(tl.int64)
            for s0 in range(0, cnt, BT):
                slot = s0 + o_t
                valid = slot < cnt
                gcol = bos + w * 64 + _select_bit64(word + tl.zeros([BT], dtype=tl.uint64), slot)
                S = _fold_rows(S, k_ptr, u_ptr, G_ptr, tl.where(valid, gcol, bos), valid, Ga,
                               i_h, i_hv, o_v, H, HV, K, V, L2NORM, PREC, DOT16)
    else:
        for c in range(0, a // BT + 1):
            cols = c * BT + o_t
            word = tl.load(bits_ptr + arow * W + (c * BT) // 64)
            on_path = (((word >> ((c * BT) % 64 + o_t).to(tl.int64)) & 1) != 0) & (cols <= a)
            S = _fold_rows(S, k_ptr, u_ptr, G_ptr, bos + cols, on_path, Ga, i_h, i_hv, o_v, H,
                           HV, K, V, L2NORM, PREC, DOT16)
    tl.store(sp, S)


@triton.jit
def _tree_verify_t_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, s0_ptr, order_ptr, cu_ptr, pairs_ptr,
                          npairs_ptr, NC, o_ptr, u_ptr, G_ptr, diag_ptr, pair_ptr,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                          DT: tl.constexpr, UDT: tl.constexpr, SDT: tl.constexpr,
                          ORDER: tl.constexpr, PDL: tl.constexpr = 0, pk_ptr=None,
                          pw_ptr=None, pu_ptr=None, pdec_ptr=None, pon_ptr=None, plen_ptr=None,
                          P=0, FOLD: tl.constexpr = 0, FOLD_BK: tl.constexpr = 32,
                          FOLD_BP: tl.constexpr = 16, FOLD_DOT16: tl.constexpr = False,
                          rk_ptr=None, ru_ptr=None, rG_ptr=None, rbits_ptr=None, rcu_ptr=None,
                          racc_ptr=None, RW: tl.constexpr = 1, RL2NORM: tl.constexpr = True,
                          RPATH: tl.constexpr = False):
    """``_tree_verify_kernel``'s walk with the K-side tiles, transposed: the value dimension
    is the rows of every V-side tile (rhs^T, acc^T, u^T are [BV, BT]), so every product is
    [BV, *] x [*, BT] with M = BV (a warpgroup's wgmma on Hopper at 4 warps) instead of
    M = BT node rows, and S0^T [BV, K] is the loop-invariant left operand:

        rhs^T = (V^T - S0^T K^T e^G) b - sum_{c2} U_{c2}^T a_{c, c2}^T,   u^T = rhs^T T_c^T
        acc^T = S0^T Q^T e^G + sum_{c2} U_{c2}^T p_{c, c2}^T + u^T P_cc^T

    q and k come normalised and scaled and G written (the pre-pass with its G pass); T_c,
    P_cc and the pair tiles from ``_tree_kside_kernel``, read transposed.  Same buffers as the
    untransposed walk (u and o in stored rows).  FOLD: the pending path folded in first, as in
    ``_tree_verify_kernel`` (2 and 3: in registers, the tile transposed there)."""
    i_v, i_b, i_hv, i_h, bos, n = _verify_program(cu_ptr, H, HV, PDL)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, K)
    if FOLD == 2:
        s0t = tl.trans(_folded_tile(s0_ptr, pk_ptr, pw_ptr, pu_ptr, pdec_ptr, pon_ptr, plen_ptr,
                                    P, i_b, i_hv, i_h, o_v, H, HV, K, V, FOLD_BP,
                                    FOLD_DOT16)).to(DT)                      # [BV, K]
    elif FOLD == 3:
        s0t = tl.trans(_round_folded_tile(s0_ptr, rk_ptr, ru_ptr, rG_ptr, rbits_ptr, rcu_ptr,
                                          racc_ptr, pon_ptr, i_b, i_hv, i_h, o_v, H, HV, K, V,
                                          RW, FOLD_BP, RL2NORM, "ieee", FOLD_DOT16,
                                          RPATH)).to(DT)
    else:
        if FOLD == 1:
            _fold_state(s0_ptr, pk_ptr, pw_ptr, pu_ptr, pdec_ptr, pon_ptr, plen_ptr, P, i_b, i_hv,
                        i_h, o_v, H, HV, K, V, FOLD_BK, FOLD_BP, FOLD_DOT16)
            tl.debug_barrier()
        if FOLD == 4:
            _round_fold_state(s0_ptr, rk_ptr, ru_ptr, rG_ptr, rbits_ptr, rcu_ptr, racc_ptr,
                              pon_ptr, i_b, i_hv, i_h, o_v, H, HV, K, V, RW, FOLD_BK, FOLD_BP,
                              RL2NORM, "ieee", FOLD_DOT16, RPATH)
            tl.debug_barrier()
        s0t = tl.load(s0_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V + o_k[None, :] * V
                      + o_v[:, None]).to(DT)                                 # [BV, K]
    if PDL == 2:
        tl.extra.cuda.gdc_wait()
    ttt = o_t[:, None] + o_t[None, :] * BT      # a stored [BT, BT] tile, read transposed
    for c in range(0, tl.cdiv(n, BT)):
        rows = c * BT + o_t
        m_r = rows < n
        grow = _node_rows(order_ptr, bos, rows, m_r, ORDER)
        dp = _diag_tiles(diag_ptr, i_b, i_hv, c, NC, HV, BT) + ttt
        t_t = tl.load(dp)                                                    # T_c^T
        p_t = tl.load(dp + BT * BT)                                          # P_cc^T
        kt = tl.load(k_ptr + (grow * H + i_h)[None, :] * K + o_k[:, None], mask=m_r[None, :],
                     other=0.).to(DT)                                        # [K, BT]
        qt = tl.load(q_ptr + (grow * H + i_h)[None, :] * K + o_k[:, None], mask=m_r[None, :],
                     other=0.).to(DT)
        b_r = tl.load(beta_ptr + grow * HV + i_hv, mask=m_r, other=0.)
        eG = tl.exp(tl.load(G_ptr + grow * HV + i_hv, mask=m_r, other=0.))[None, :]
        off = (grow * HV + i_hv)[None, :] * V + o_v[:, None]                # [BV, BT]
        vt = tl.load(v_ptr + off, mask=m_r[None, :], other=0.).to(tl.float32)
        rhs = b_r[None, :] * (vt - eG * tl.dot(s0t, kt, input_precision=PREC))
        acc = eG * tl.dot(s0t, qt, input_precision=PREC)
        pc = pairs_ptr + (i_b * NC + c) * NC
        for i in range(0, tl.load(npairs_ptr + i_b * NC + c)):
            c2 = tl.load(pc + i).to(tl.int64)
            scol = _node_rows(order_ptr, bos, c2 * BT + o_t, o_t >= 0, ORDER)
            uc = tl.load(u_ptr + (scol * HV + i_hv)[None, :] * V + o_v[:, None]).to(UDT)
            tp = _pair_tiles(pair_ptr, i_b, i_hv, c, i, NC, HV, BT) + ttt
            rhs -= tl.dot(uc, tl.load(tp).to(UDT), input_precision=PREC)
            acc += tl.dot(uc, tl.load(tp + BT * BT).to(UDT), input_precision=PREC)
        u = tl.dot(rhs.to(SDT), t_t, input_precision=PREC)
        acc += tl.dot(u.to(SDT), p_t, input_precision=PREC)
        tl.store(u_ptr + off, u, mask=m_r[None, :])
        tl.store(o_ptr + off, acc.to(o_ptr.dtype.element_ty), mask=m_r[None, :])
        tl.debug_barrier()   # later sub-chunks of this program read the u just stored
