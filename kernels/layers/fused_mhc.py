"""Triton kernels of DeepSeek-V4's hyper-connections (kernels/layers/mhc.py; torch forms:
reference.py), the layer form ``v4_hc="fused"``: hc_pre in three launches (mix partials,
weights, collapse), hc_post in one (merge), hc_head in two (mix partials, collapse).  The mix
splits K = hc h over programs; the kernel that reads the partials sums the splits in a fixed
order (no atomics: runs are bitwise reproducible).  All arithmetic in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from simtree.errors import SimtreeError

from .fused import _pow2

__all__ = ["hc_weights", "hc_mix_partials", "hc_weights_partials", "hc_mix", "hc_collapse", "hc_head", "hc_merge"]

_MIX_BT, _MIX_BK = 16, 64      # the mix's row block, K step
_MIX_PROGRAMS = 528            # the mix's programs to aim for: 4 per SM of an H100 (132 SMs); the fastest
                               # of 132 / 264 / 528 at 1-256 tokens but 64 (profiler/bench/v4_launch.py, H100)
# the mix's products: "tf32x3" (three TF32 tensor-core products: x's bf16 values are exact in
# TF32 and fn's fp32 is carried as a high and a low TF32 part, ~fp32 accuracy) or "ieee" (fp32 FMAs)
_MIX_PRECISION = "tf32x3"


def _mix_splits(T: int, K: int, n: int, x_bytes: int, bt: int = _MIX_BT, bk: int = _MIX_BK,
                programs: int = _MIX_PROGRAMS) -> tuple[int, int]:
    """(splits S, channels per split) of the mix of T rows of K channels (x_bytes each) with n
    rows of fn: enough programs at small T to stream fn at bandwidth, one split per row block
    once the rows alone fill the GPU, and the partials' traffic (written and read, 8 (n + 1)
    bytes a row and split) at most 1/8 of the mix's reads.  A function of the shapes only."""
    T = max(T, 1)
    steps = triton.cdiv(K, bk)
    cap = (4 * n * K + x_bytes * T * K) // (64 * T * (n + 1))
    S = max(1, min(steps, programs // triton.cdiv(T, bt), cap))
    chunk = triton.cdiv(steps, S) * bk
    return triton.cdiv(K, chunk), chunk


@triton.jit
def _hc_mix_kernel(X, FN, P, s_x, T, K, CHUNK, N: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, PRECISION: tl.constexpr):
    """Split s (program 0) of a row block (program 1): partial x . fn_n [BT, N] and sum x^2 [BT]."""
    s = tl.program_id(0)
    rows = tl.program_id(1) * BT + tl.arange(0, BT)
    mr = rows < T
    n = tl.arange(0, NB)
    mn = n < N
    acc = tl.zeros([BT, NB], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for k0 in range(s * CHUNK, s * CHUNK + CHUNK, BK):
        k = k0 + tl.arange(0, BK)
        mk = k < K
        x = tl.load(X + rows[:, None].to(tl.int64) * s_x + k[None, :], mask=mr[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        f = tl.load(FN + n[None, :].to(tl.int64) * K + k[:, None], mask=mn[None, :] & mk[:, None], other=0.0)
        acc += tl.dot(x, f, input_precision=PRECISION)
        ss += tl.sum(x * x, 1)
    out = P + (s * T + rows.to(tl.int64)) * (N + 1)
    tl.store(out[:, None] + n[None, :], acc, mask=mr[:, None] & mn[None, :])
    tl.store(out + N, ss, mask=mr)


def hc_mix_partials(x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """x [T, hc, h] (rows of unit column stride), fn [n, hc h] fp32 -> partials [S, T, n + 1] fp32
    (reference.hc_mix_partials, K split S ways)."""
    return _hc_mix_partials(x, fn, _MIX_BT, _MIX_BK, _MIX_PROGRAMS, _MIX_PRECISION, 4)


def _hc_mix_partials(x, fn, bt: int, bk: int, programs: int, precision: str, num_warps: int) -> torch.Tensor:
    """:func:`hc_mix_partials` under a launch: row block, K step, programs aimed at, products'
    precision, warps (``_launched.hc_mix_partials_launched``: profiler/bench/v4_launch.py times them)."""
    T = x.shape[0]
    flat = x.reshape(T, x.shape[1] * x.shape[2])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    K, n = flat.shape[1], fn.shape[0]
    if fn.dim() != 2 or fn.shape[1] != K:
        raise SimtreeError(f"hyper-connection mix: fn is {tuple(fn.shape)}, the streams need [n, {K}]")
    S, chunk = _mix_splits(T, K, n, flat.element_size(), bt, bk, programs)
    p = torch.empty((S, T, n + 1), dtype=torch.float32, device=x.device)
    if T:
        _hc_mix_kernel[(S, triton.cdiv(T, bt))](flat, fn.float().contiguous(), p, flat.stride(0), T, K, chunk,
                                                N=n, NB=_pow2(n), BT=bt, BK=bk, PRECISION=precision,
                                                num_warps=num_warps)
    return p


def _split_block(S: int) -> int:
    return min(64, max(2, triton.next_power_of_2(S)))


@triton.jit
def _mix_sum(M, off, mask, s_p, S, SB: tl.constexpr):
    """sum over splits s < S of M[s s_p + off] (off [L]), in a fixed order."""
    sp = tl.arange(0, SB)
    acc = tl.zeros_like(off).to(tl.float32)
    for s0 in range(0, S, SB):
        s = s0 + sp
        v = tl.load(M + s[:, None].to(tl.int64) * s_p + off[None, :], mask=(s < S)[:, None] & mask[None, :],
                    other=0.0)
        acc += tl.sum(v, 0)
    return acc


@triton.jit
def _mix_scale(M, s_p, S, N, dim, norm_eps, SB: tl.constexpr):
    """rsqrt(mean square + eps) of a token's mix from its partials' sums of squares (column N)."""
    j = tl.arange(0, 2)
    return tl.rsqrt(tl.sum(_mix_sum(M, j * 0 + N, j == 0, s_p, S, SB), 0) / dim + norm_eps)


@triton.jit
def _hc_weights_kernel(M, BASE, SCALE, PRE, POST, COMB, s_m, s_p, S, dim, iters, eps, norm_eps, HC: tl.constexpr,
                       B: tl.constexpr, RMS: tl.constexpr, SB: tl.constexpr):
    """One token: its pre / post [HC] and Sinkhorn-normalised comb [HC, HC] (padded to B), from
    m [T, n] (S = 1) or, RMS, from the mix's partials [S, T, n + 1]."""
    t = tl.program_id(0).to(tl.int64)
    Mt = M + t * s_m
    i = tl.arange(0, B)
    mi = i < HC
    r = 1.0
    if RMS:
        r = _mix_scale(Mt, s_p, S, (2 + HC) * HC, dim, norm_eps, SB)
    s0 = tl.load(SCALE)
    s1 = tl.load(SCALE + 1)
    s2 = tl.load(SCALE + 2)
    pre = tl.sigmoid(_mix_sum(Mt, i, mi, s_p, S, SB) * r * s0 + tl.load(BASE + i, mask=mi, other=0.0)) + eps
    post = 2 * tl.sigmoid(_mix_sum(Mt, HC + i, mi, s_p, S, SB) * r * s1 + tl.load(BASE + HC + i, mask=mi, other=0.0))
    tl.store(PRE + t * HC + i, pre, mask=mi)
    tl.store(POST + t * HC + i, post, mask=mi)
    row = i[:, None]
    c = i[None, :]
    mc = (row < HC) & (c < HC)
    off = 2 * HC + row * HC + c
    q = tl.arange(0, B * B)                       # comb's [B, B] flat: one split-sum for both axes
    mq = (q // B < HC) & (q % B < HC)
    z = tl.reshape(_mix_sum(Mt, 2 * HC + (q // B) * HC + q % B, mq, s_p, S, SB), [B, B])
    z = z * r * s2 + tl.load(BASE + off, mask=mc, other=0.0)
    z = tl.where(mc, z, -1e30)
    z = tl.exp(z - tl.max(z, 1)[:, None])
    z = tl.where(mc, z / tl.sum(z, 1)[:, None] + eps, 0.0)
    z = z / (tl.sum(z, 0)[None, :] + eps)
    for _ in range(iters - 1):
        z = z / (tl.sum(z, 1)[:, None] + eps)
        z = z / (tl.sum(z, 0)[None, :] + eps)
    tl.store(COMB + t * HC * HC + row * HC + c, z, mask=mc)


def _hc_of(n: int) -> int:
    return int(round((-2 + (4 + 4 * n) ** 0.5) / 2))


def _weights(m, base, scale, iters, eps, T, n, s_m, s_p, S, dim, norm_eps, rms: bool):
    hc = _hc_of(n)
    pre, post = m.new_empty(T, hc), m.new_empty(T, hc)
    comb = m.new_empty(T, hc, hc)
    # the partials' [SB, B * B] tiles want B tight; m alone keeps the padding it always had
    block = triton.next_power_of_2(hc) if rms else _pow2(hc)
    if T:
        _hc_weights_kernel[(T,)](m, base.contiguous(), scale.contiguous(), pre, post, comb, s_m, s_p, S, dim, iters,
                                 eps, norm_eps, HC=hc, B=block, RMS=rms, SB=_split_block(S), num_warps=1)
    return pre, post, comb


def hc_weights(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float):
    """reference.hc_weights in one launch (one program per token)."""
    T, n = m.shape
    return _weights(m, base, scale, iters, eps, T, n, m.stride(0), 0, 1, 0, 0.0, False)


def hc_weights_partials(p: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float, dim: int,
                        norm_eps: float):
    """reference.hc_weights of m = reference.hc_mix_reduce(p, dim, norm_eps), the mix's partials
    p [S, T, n + 1] summed by the weights' launch itself."""
    S, T, n1 = p.shape
    return _weights(p.contiguous(), base.float(), scale.float(), iters, eps, T, n1 - 1, n1, T * n1, S, dim, norm_eps,
                    True)


@triton.jit
def _hc_mix_reduce_kernel(P, M, s_p, S, N, dim, norm_eps, NB: tl.constexpr, SB: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, NB)
    Pt = P + t * (N + 1)
    m = _mix_sum(Pt, n, n < N, s_p, S, SB) * _mix_scale(Pt, s_p, S, N, dim, norm_eps, SB)
    tl.store(M + t * N + n, m, mask=n < N)


def hc_mix(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hc, h], fn [n, hc h] fp32 -> m [T, n] fp32 = RMSNorm(flat x) @ fn^T (two launches)."""
    p = hc_mix_partials(x, fn)
    S, T, n1 = p.shape
    m = p.new_empty(T, n1 - 1)
    if T:
        _hc_mix_reduce_kernel[(T,)](p, m, T * n1, S, n1 - 1, x[0].numel(), float(eps), NB=_pow2(n1 - 1),
                                    SB=_split_block(S), num_warps=1)
    return m


@triton.jit
def _hc_collapse_kernel(X, PRE, BASE, SCALE, OUT, s_xt, s_xj, s_pre, s_p, S, h, dim, eps, norm_eps,
                        HC: tl.constexpr, HB: tl.constexpr, HEAD: tl.constexpr, SB: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Token t (program 0), channels block (program 1): sum_j pre_j x_j, pre [T, HC] or, HEAD,
    hc_head's sigmoid(scale m + base) + eps of the mix's partials [S, T, HC + 1]."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mc = c < h
    j = tl.arange(0, HB)
    mj = j < HC
    if HEAD:
        Pt = PRE + t * s_pre
        m = _mix_sum(Pt, j, mj, s_p, S, SB) * _mix_scale(Pt, s_p, S, HC, dim, norm_eps, SB)
        pre = tl.sigmoid(m * tl.load(SCALE) + tl.load(BASE + j, mask=mj, other=0.0)) + eps
    else:
        pre = tl.load(PRE + t * s_pre + j, mask=mj, other=0.0)
    pre = tl.where(mj, pre, 0.0)
    x = tl.load(X + t * s_xt + j[:, None] * s_xj + c[None, :], mask=mj[:, None] & mc[None, :], other=0.0)
    y = tl.sum(pre[:, None] * x.to(tl.float32), 0)
    tl.store(OUT + t * h + c, y.to(OUT.dtype.element_ty), mask=mc)


def _block_h(h: int, T: int) -> int:
    """Channels a collapse / merge program: 512, 2048 from 64 tokens on (H100, v4_launch.py: at 256
    tokens the merge took 44 us with 512 against 10.7 with 2048; below 64 tokens neither wins
    throughout - at 16 the collapse favours 2048, the merge 512 - and 512 is kept)."""
    return min(2048 if T >= 64 else 512, _pow2(h))


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _collapse(x, pre, base, scale, eps, s_pre, s_p, S, norm_eps, head: bool, block=None, num_warps=4):
    x = _unit(x)
    T, hc, h = x.shape
    out = torch.empty((T, h), dtype=x.dtype, device=x.device)
    block = min(block or _block_h(h, T), _pow2(h))
    if T:
        _hc_collapse_kernel[(T, triton.cdiv(h, block))](x, pre, base, scale, out, x.stride(0), x.stride(1), s_pre, s_p,
                                                        S, h, hc * h, eps, norm_eps, HC=hc,
                                                        HB=triton.next_power_of_2(hc), HEAD=head, SB=_split_block(S),
                                                        BLOCK=block, num_warps=num_warps)
    return out


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x [T, hc, h] (unit channel stride), pre [T, hc] -> sum_j pre_j x_j [T, h] in x's dtype
    (fp32 sums; reads x once)."""
    return _hc_collapse(x, pre, None, 4)


def _hc_collapse(x, pre, block: int | None, num_warps: int) -> torch.Tensor:
    """:func:`hc_collapse` under a launch: ``block`` channels a program (None: min(512, h)), warps."""
    pre = pre.float().contiguous()
    return _collapse(x, pre, pre, pre, 0.0, x.shape[1], 0, 1, 0.0, False, block, num_warps)


def hc_head(x: torch.Tensor, p: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """mhc.hc_head of x [T, hc, h] from its mix's partials p [S, T, hc + 1]: the
    weights sigmoid(scale m + base) + eps computed by every program, then the collapse."""
    S, T, n1 = p.shape
    return _collapse(x, p.contiguous(), base.float().contiguous(), scale.float().contiguous(), float(eps), n1, T * n1,
                     S, float(norm_eps), True)


@triton.jit
def _hc_merge_kernel(X, O, POST, COMB, OUT, s_xt, s_xj, s_o, h, HC: tl.constexpr, HB: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Token t (program 0), channels block (program 1): new x_k = post_k o + sum_j comb[j, k] x_j."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mc = c < h
    j = tl.arange(0, HB)
    mj = j < HC
    x = tl.load(X + t * s_xt + j[:, None] * s_xj + c[None, :], mask=mj[:, None] & mc[None, :], other=0.0)
    x = x.to(tl.float32)
    o = tl.load(O + t * s_o + c, mask=mc, other=0.0).to(tl.float32)
    for k in tl.static_range(HC):
        w = tl.load(COMB + (t * HC + j) * HC + k, mask=mj, other=0.0)
        y = tl.load(POST + t * HC + k) * o + tl.sum(w[:, None] * x, 0)
        tl.store(OUT + (t * HC + k) * h + c, y.to(OUT.dtype.element_ty), mask=mc)


def hc_merge(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """x [T, hc, h], out [T, h] (unit channel strides), post [T, hc], comb [T, hc, hc] -> new x
    [T, hc, h] contiguous in x's dtype (fp32 sums, one rounding; reads x once)."""
    return _hc_merge(x, out, post, comb, None, 4)


def _hc_merge(x, out, post, comb, block: int | None, num_warps: int) -> torch.Tensor:
    """:func:`hc_merge` under a launch: ``block`` channels a program (None: the rule), warps."""
    x, out = _unit(x), _unit(out)
    T, hc, h = x.shape
    if out.shape != (T, h) or post.shape != (T, hc) or comb.shape != (T, hc, hc):
        raise SimtreeError(f"hyper-connection merge: streams {tuple(x.shape)} need out [{T}, {h}], post [{T}, {hc}], "
                           f"comb [{T}, {hc}, {hc}]; got {tuple(out.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}")
    new = torch.empty((T, hc, h), dtype=x.dtype, device=x.device)
    block = min(block or _block_h(h, T), _pow2(h))
    if T:
        _hc_merge_kernel[(T, triton.cdiv(h, block))](x, out, post.float().contiguous(), comb.float().contiguous(), new,
                                                     x.stride(0), x.stride(1), out.stride(0), h, HC=hc,
                                                     HB=triton.next_power_of_2(hc), BLOCK=block, num_warps=num_warps)
    return new
