"""The deferred commit's fold of one state tile (docs/math/gdn_tree_solve.md, "The commit
deferred"): device functions the verify walks (``_tree_kernels.py``, FOLD) and the standalone
fold (``_deferred_kernels.py``) call; their own module, so both import it and neither the other.

    _fold_state   the tile folded in memory, BK state rows at a time (any tile size); a walk
                  then reads the folded tile back (from L2: this program just wrote it)
    _folded_tile  the whole [K, BV] tile folded in registers and returned: the walk's S0 with
                  no read-back (where the fp32 tile fits the registers:
                  ``_launched_deferred.fold_mode``)
    _tile_and_flags  a whole state tile and its ``on`` flags (``_round_fold`` too)

Both fold only where the tile's ``on`` columns say a path waits, and clear them in the same
program, so no sequence of calls folds a path twice.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _path_sum(S, pk_ptr, pw_ptr, pu_ptr, n, P, i_b, i_hv, i_h, o_k, o_v, H: tl.constexpr,
              HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BP: tl.constexpr,
              DOT16: tl.constexpr):
    """S + sum_{p < n} w_p k_p[o_k] u_p[o_v]^T over sequence i_b's pending rows, BP per product
    ([len(o_k), BP] x [BP, BV]); DOT16: bf16 operands and fp32 accumulation (a bf16 u buffer,
    as ``_fold_rows``), else exact fp32."""
    o_p = tl.arange(0, BP)
    for p0 in range(0, n, BP):
        rows = p0 + o_p
        m = rows < n
        r = (i_b * P + rows).to(tl.int64)
        kk = tl.load(pk_ptr + (r * H + i_h)[:, None] * K + o_k[None, :], mask=m[:, None], other=0.)
        w = tl.load(pw_ptr + r * HV + i_hv, mask=m, other=0.)
        uu = tl.load(pu_ptr + (r * HV + i_hv)[:, None] * V + o_v[None, :], mask=m[:, None],
                     other=0.)
        kw = tl.trans(kk * w[:, None])
        if DOT16:
            S = tl.dot(kw.to(tl.bfloat16), uu.to(tl.bfloat16), acc=S)
        else:
            S += tl.dot(kw, uu.to(tl.float32), input_precision="ieee")
    return S


@triton.jit
def _fold_state(s_ptr, pk_ptr, pw_ptr, pu_ptr, pdec_ptr, pon_ptr, plen_ptr, P, i_b, i_hv, i_h,
                o_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BP: tl.constexpr, DOT16: tl.constexpr):
    """Fold the pending path of sequence i_b into its state tile (value head i_hv, columns o_v)
    in memory, BK state rows at a time: S* = d S + sum_p w_p k_p u_p^T where it waits."""
    pon = pon_ptr + (i_b * HV + i_hv).to(tl.int64) * V + o_v
    on = tl.load(pon) != 0
    if tl.max(on.to(tl.int32), axis=0) > 0:
        n = tl.load(plen_ptr + i_b)
        dec = tl.load(pdec_ptr + i_b * HV + i_hv)
        sbase = s_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V
        for k0 in tl.static_range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            sp = sbase + o_k[:, None] * V + o_v[None, :]
            s_old = tl.load(sp)
            S = _path_sum(dec * s_old, pk_ptr, pw_ptr, pu_ptr, n, P, i_b, i_hv, i_h, o_k, o_v,
                          H, HV, K, V, BP, DOT16)
            tl.store(sp, tl.where(on[None, :], S, s_old))
        tl.store(pon, tl.zeros(on.shape, dtype=tl.int8))


@triton.jit
def _tile_and_flags(s_ptr, pon_ptr, i_b, i_hv, o_v, HV: tl.constexpr, K: tl.constexpr,
                    V: tl.constexpr):
    """The whole [K, BV] state tile of (i_b, i_hv, o_v): its pointers and fp32 values, and its
    ``on`` flags' pointers and values (bool: a path waits for the column)."""
    o_k = tl.arange(0, K)
    sp = s_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    pon = pon_ptr + (i_b * HV + i_hv).to(tl.int64) * V + o_v
    return sp, tl.load(sp), pon, tl.load(pon) != 0


@triton.jit
def _folded_tile(s_ptr, pk_ptr, pw_ptr, pu_ptr, pdec_ptr, pon_ptr, plen_ptr, P, i_b, i_hv, i_h,
                 o_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BP: tl.constexpr, DOT16: tl.constexpr):
    """The state tile [K, BV] fp32 of (i_b, i_hv, o_v) with its waiting path folded in (stored
    back, its ``on`` columns cleared) or as stored where none waits: one read, at most one
    write, and the caller keeps the tile in registers."""
    o_k = tl.arange(0, K)
    sp, S, pon, on = _tile_and_flags(s_ptr, pon_ptr, i_b, i_hv, o_v, HV, K, V)
    if tl.max(on.to(tl.int32), axis=0) > 0:
        n = tl.load(plen_ptr + i_b)
        dec = tl.load(pdec_ptr + i_b * HV + i_hv)
        S = tl.where(on[None, :], _path_sum(dec * S, pk_ptr, pw_ptr, pu_ptr, n, P, i_b, i_hv,
                                            i_h, o_k, o_v, H, HV, K, V, BP, DOT16), S)
        tl.store(sp, S)
        tl.store(pon, tl.zeros(on.shape, dtype=tl.int8))
    return S
