"""The deferred commit's fold of one state tile (docs/math/gdn_tree_solve.md, "The commit
deferred"): a device function the verify walks (``_tree_kernels.py``, FOLD) and the standalone
fold (``_deferred_kernels.py``) call; its own module, so both import it and neither the other.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fold_state(s_ptr, pk_ptr, pw_ptr, pu_ptr, pdec_ptr, pon_ptr, plen_ptr, P, i_b, i_hv, i_h,
                o_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BP: tl.constexpr, DOT16: tl.constexpr):
    """Fold the pending path of sequence i_b into its state tile (value head i_hv, columns
    o_v) where its ``on`` columns say it waits, then clear them.  BP path rows per product
    ([BK, BP] x [BP, BV]); DOT16: bf16 operands and fp32 accumulation (a bf16 u buffer, as
    ``_fold_rows``), else exact fp32."""
    pon = pon_ptr + (i_b * HV + i_hv).to(tl.int64) * V + o_v
    on = tl.load(pon) != 0
    if tl.max(on.to(tl.int32), axis=0) > 0:
        n = tl.load(plen_ptr + i_b)
        dec = tl.load(pdec_ptr + i_b * HV + i_hv)
        o_p = tl.arange(0, BP)
        sbase = s_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V
        for k0 in tl.static_range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            sp = sbase + o_k[:, None] * V + o_v[None, :]
            s_old = tl.load(sp)
            S = dec * s_old
            for p0 in range(0, n, BP):
                rows = p0 + o_p
                m = rows < n
                r = (i_b * P + rows).to(tl.int64)
                kk = tl.load(pk_ptr + (r * H + i_h)[:, None] * K + o_k[None, :], mask=m[:, None],
                             other=0.)
                w = tl.load(pw_ptr + r * HV + i_hv, mask=m, other=0.)
                uu = tl.load(pu_ptr + (r * HV + i_hv)[:, None] * V + o_v[None, :],
                             mask=m[:, None], other=0.)
                kw = tl.trans(kk * w[:, None])
                if DOT16:
                    S = tl.dot(kw.to(tl.bfloat16), uu.to(tl.bfloat16), acc=S)
                else:
                    S += tl.dot(kw, uu.to(tl.float32), input_precision="ieee")
            tl.store(sp, tl.where(on[None, :], S, s_old))
        tl.store(pon, tl.zeros(on.shape, dtype=tl.int8))
