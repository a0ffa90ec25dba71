"""Triton kernels of the layers' fused ops (their torch forms, the definitions: reference.py).

One launch each where torch would launch three to ten: the norms, gates and activations a
layer runs between its GEMMs, the GDN layer's short conv over tree ancestors and its state
commit (DeepSeek-V4's hyper-connections: fused_mhc.py).  Every kernel reads rows through their
strides (slices of a fused projection's output need no copy) and computes in float32.  Launch
details only; the math is in reference.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "gated_rms_norm", "silu_mul", "sigmoid_mul", "gdn_gates", "norm_rope", "tree_conv",
           "gather_rows"]


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(int(n)))


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@triton.jit
def _rms_norm_kernel(X, W, OUT, s_x, s_o, D, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < D
    x = tl.load(X + row * s_x + c, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    if HAS_W:
        y = y * tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + row * s_o + c, y.to(OUT.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """x [T, D] with unit column stride (any row stride) -> [T, D] contiguous."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    T, D = x2.shape
    out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    block = _pow2(D)
    if T:
        _rms_norm_kernel[(T,)](x2, weight if weight is not None else x2, out, x2.stride(0), D, D, float(eps),
                               HAS_W=weight is not None, BLOCK=block, num_warps=_warps(block))
    return out.view(x.shape)


@triton.jit
def _gated_norm_kernel(O, Z, W, OUT, s_z, H, V, eps, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.arange(0, BLOCK)
    m = c < V
    o = tl.load(O + (n * H + h) * V + c, mask=m, other=0.0).to(tl.float32)
    z = tl.load(Z + n * s_z + h * V + c, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    y = o * tl.rsqrt(tl.sum(o * o, 0) / V + eps) * w * (z / (1.0 + tl.exp(-z)))
    tl.store(OUT + (n * H + h) * V + c, y.to(OUT.dtype.element_ty), mask=m)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o [N, H, V] contiguous, z [N, H*V] (unit column stride) -> [N, H*V]."""
    N, H, V = o.shape
    out = torch.empty((N, H * V), dtype=o.dtype, device=o.device)
    if N:
        _gated_norm_kernel[(N, H)](o.contiguous(), z, weight, out, z.stride(0), H, V, float(eps),
                                   BLOCK=_pow2(V), num_warps=4)
    return out


@triton.jit
def _silu_mul_kernel(GU, OUT, s_gu, I, limit, BLOCK: tl.constexpr, CLAMP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    a = tl.load(GU + t * s_gu + c, mask=m, other=0.0).to(tl.float32)
    b = tl.load(GU + t * s_gu + I + c, mask=m, other=0.0).to(tl.float32)
    if CLAMP:   # V4's swiglu_limit: gate clamped above, up both ways
        a = tl.minimum(a, limit)
        b = tl.minimum(tl.maximum(b, -limit), limit)
    tl.store(OUT + t * I + c, (a / (1.0 + tl.exp(-a)) * b).to(OUT.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(gate) * up of gu [T, 2I] = [gate | up]; ``limit`` > 0: reference.swiglu's clamp."""
    T, I2 = gu.shape
    I = I2 // 2
    out = torch.empty((T, I), dtype=gu.dtype, device=gu.device)
    block = min(2048, _pow2(I))
    if T:
        _silu_mul_kernel[(T, triton.cdiv(I, block))](gu, out, gu.stride(0), I, float(limit), BLOCK=block,
                                                     CLAMP=limit > 0, num_warps=4)
    return out


@triton.jit
def _sigmoid_mul_kernel(O, G, OUT, s_ot, s_oh, s_gt, s_gh, H, D, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.arange(0, BLOCK)
    m = c < D
    o = tl.load(O + t * s_ot + h * s_oh + c, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + t * s_gt + h * s_gh + c, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + (t * H + h) * D + c, (o / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty), mask=m)


def sigmoid_mul(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o, gate [T, H, D] (unit column stride) -> [T, H*D]."""
    T, H, D = o.shape
    out = torch.empty((T, H * D), dtype=o.dtype, device=o.device)
    if T:
        _sigmoid_mul_kernel[(T, H)](o, gate, out, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1), H, D,
                                    BLOCK=_pow2(D), num_warps=4)
    return out


@triton.jit
def _gdn_gates_kernel(BA, NEG_A, DT_BIAS, G, BETA, s_ba, HV, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < HV
    b = tl.load(BA + n * s_ba + c, mask=m, other=0.0).to(tl.float32)
    a = tl.load(BA + n * s_ba + HV + c, mask=m, other=0.0).to(tl.float32)
    a = a + tl.load(DT_BIAS + c, mask=m, other=0.0)
    sp = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))   # softplus, torch's threshold
    tl.store(G + n * HV + c, tl.load(NEG_A + c, mask=m, other=0.0) * sp, mask=m)
    tl.store(BETA + n * HV + c, 1.0 / (1.0 + tl.exp(-b)), mask=m)


def gdn_gates(ba: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, HV2 = ba.shape
    HV = HV2 // 2
    g = torch.empty((N, HV), dtype=torch.float32, device=ba.device)
    beta = torch.empty_like(g)
    if N:
        _gdn_gates_kernel[(N,)](ba, neg_a.float().contiguous(), dt_bias.float().contiguous(), g, beta,
                                ba.stride(0), HV, BLOCK=_pow2(HV), num_warps=1)
    return g, beta


@triton.jit
def _norm_rope_kernel(X, W, CS, OUT, s_xt, s_xh, s_cs, s_ot, s_oh, H, D, lo, HALF, eps,
                      NORM: tl.constexpr, HAS_W: tl.constexpr, INVERSE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.arange(0, BLOCK)
    m = c < D
    x = tl.load(X + t * s_xt + h * s_xh + c, mask=m, other=0.0).to(tl.float32)
    # rotate-half partner of each rope channel: c + HALF in the first half, c - HALF in the second
    j = c - lo
    first = (j >= 0) & (j < HALF)
    second = (j >= HALF) & (j < 2 * HALF)
    partner = tl.where(first, c + HALF, tl.where(second, c - HALF, c))
    xp = tl.load(X + t * s_xt + h * s_xh + partner, mask=m, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        x = x * r
        xp = xp * r
        if HAS_W:
            x = x * tl.load(W + c, mask=m, other=0.0).to(tl.float32)
            xp = xp * tl.load(W + partner, mask=m, other=0.0).to(tl.float32)
    k = tl.where(second, j - HALF, j)
    rope = first | second
    cos = tl.load(CS + t * s_cs + k, mask=m & rope, other=1.0)
    sin = tl.load(CS + t * s_cs + HALF + k, mask=m & rope, other=0.0)
    if INVERSE:
        sin = -sin
    y = x * cos + tl.where(first, -xp, xp) * sin
    tl.store(OUT + t * s_ot + h * s_oh + c, y.to(OUT.dtype.element_ty), mask=m)


def norm_rope(x: torch.Tensor, weight, cs: torch.Tensor, lo: int, inverse: bool, eps: float, norm: bool,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, D] (unit column stride) -> ``out`` (new [T, H, D] where None; any strides)."""
    T, H, D = x.shape
    if out is None:
        out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T:
        _norm_rope_kernel[(T, H)](x, weight if weight is not None else x, cs, out, x.stride(0), x.stride(1),
                                  cs.stride(0), out.stride(0), out.stride(1), H, D, int(lo), cs.shape[-1] // 2,
                                  float(eps), NORM=bool(norm), HAS_W=weight is not None, INVERSE=bool(inverse),
                                  BLOCK=_pow2(D), num_warps=4 if D <= 256 else 8)
    return out


@triton.jit
def _tree_conv_kernel(X, STATE, IDX, WT, OUT, s_x, N, C, s0, s1, W: tl.constexpr, SILU: tl.constexpr,
                      BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    acc = tl.zeros([BLOCK], tl.float32)
    for t in tl.static_range(W):
        src = tl.load(IDX + n * W + t + c * 0)
        vx = tl.load(X + src * s_x + c, mask=m & (src >= 0), other=0.0).to(tl.float32)
        vs = tl.load(STATE + (-1 - src) * C + c, mask=m & (src < 0), other=0.0).to(tl.float32)
        acc += (vx + vs) * tl.load(WT + c * W + t, mask=m, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    # three row-major blocks: [N, s0] | [N, s1 - s0] | [N, C - s1]
    dst = tl.where(c < s0, n * s0 + c, tl.where(c < s1, N * s0 + n * (s1 - s0) + (c - s0),
                                                N * s1 + n * (C - s1) + (c - s1)))
    tl.store(OUT + dst, acc.to(OUT.dtype.element_ty), mask=m)


def tree_conv(x, state, idx, weight, splits, silu: bool = True) -> torch.Tensor:
    N, C = x.shape
    W = weight.shape[1]
    out = torch.empty(N * C, dtype=x.dtype, device=x.device)
    block = min(1024, _pow2(C))
    if N:
        _tree_conv_kernel[(N, triton.cdiv(C, block))](x, state, idx.contiguous(), weight.contiguous(), out, x.stride(0),
                                                      N, C, int(splits[0]), int(splits[1]), W=W, SILU=bool(silu),
                                                      BLOCK=block, num_warps=4)
    return out


@triton.jit
def _source_row(STATE, X, IDX, b, s, s_x, C, c, m, R: tl.constexpr):
    src = tl.load(IDX + b * R + s + c * 0)
    vx = tl.load(X + src * s_x + c, mask=m & (src >= 0), other=0.0).to(tl.float32)
    vs = tl.load(STATE + (-1 - src) * C + c, mask=m & (src < 0), other=0.0).to(tl.float32)
    return vx + vs


@triton.jit
def _gather_rows_kernel(STATE, X, IDX, s_x, C, R: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    dst = STATE + b * R * C + c
    # every source first (R <= 3: a conv of kernel <= 4): a row may be another row's source
    v0 = _source_row(STATE, X, IDX, b, 0, s_x, C, c, m, R)
    v1 = v0
    v2 = v0
    if R > 1:
        v1 = _source_row(STATE, X, IDX, b, 1, s_x, C, c, m, R)
    if R > 2:
        v2 = _source_row(STATE, X, IDX, b, 2, s_x, C, c, m, R)
    tl.store(dst, v0.to(STATE.dtype.element_ty), mask=m)
    if R > 1:
        tl.store(dst + C, v1.to(STATE.dtype.element_ty), mask=m)
    if R > 2:
        tl.store(dst + 2 * C, v2.to(STATE.dtype.element_ty), mask=m)


def gather_rows(state: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> None:
    """state [B, R, C] contiguous (R <= 3) rows <- sources idx [B, R] (reference.gather_rows)."""
    B, R, C = state.shape
    block = min(1024, _pow2(C))
    if B:
        _gather_rows_kernel[(B, triton.cdiv(C, block))](state, x, idx.contiguous(), x.stride(0), C, R=R, BLOCK=block,
                                                        num_warps=4)
