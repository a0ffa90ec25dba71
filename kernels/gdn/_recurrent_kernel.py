"""Per-branch recurrent tree verify: the baseline serving engines run today.

One sequential program per (sequence, value head, V block) walks the tree in topological
order; for every node it reloads the PARENT's full state from HBM (the root: S0), applies
one delta-rule step, stores that node's state [K, BV] and writes the output.  Memory traffic
is 2 * n * K * V * 4 bytes per head: this is what the tree kernel removes.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _recurrent_tree_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, par_ptr, cu_ptr,
                           o_ptr, ns_ptr, scale,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_b).to(tl.int64)
    eos = tl.load(cu_ptr + i_b + 1).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    tile = o_k[:, None] * V + o_v[None, :]
    s0 = s0_ptr + (i_b * HV + i_hv).to(tl.int64) * K * V
    for j in range(bos, eos):
        p = tl.load(par_ptr + j)
        root_tile = (tl.zeros([K, BV], dtype=tl.int32) + (p < 0).to(tl.int32)) != 0
        prow = bos + tl.maximum(p, 0)
        # node states [N, HV, K, V] reach 25 GB at b=64, n=128: int64 offsets
        h = tl.load(s0 + tile, mask=root_tile, other=0.)
        h += tl.load(ns_ptr + (prow * HV + i_hv) * K * V + tile, mask=~root_tile, other=0.)
        q = tl.load(q_ptr + (j * H + i_h) * K + o_k).to(tl.float32)
        k = tl.load(k_ptr + (j * H + i_h) * K + o_k).to(tl.float32)
        if L2NORM:
            q = q / tl.maximum(tl.sqrt(tl.sum(q * q)), 1e-6)
            k = k / tl.maximum(tl.sqrt(tl.sum(k * k)), 1e-6)
        q = q * scale
        v = tl.load(v_ptr + (j * HV + i_hv) * V + o_v).to(tl.float32)
        g = tl.load(g_ptr + j * HV + i_hv).to(tl.float32)
        b = tl.load(beta_ptr + j * HV + i_hv).to(tl.float32)
        h *= tl.exp(g)
        u = b * (v - tl.sum(h * k[:, None], axis=0))
        h += k[:, None] * u[None, :]
        o = tl.sum(h * q[:, None], axis=0)
        tl.store(o_ptr + (j * HV + i_hv) * V + o_v, o.to(o_ptr.dtype.element_ty))
        tl.store(ns_ptr + (j * HV + i_hv) * K * V + tile, h)
        tl.debug_barrier()   # a child reloads this state in a later iteration
