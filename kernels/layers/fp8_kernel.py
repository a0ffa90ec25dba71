"""Triton block-scaled FP8 GEMM, grouped over experts: the activations quantised in the kernel.

    y[r] = x[r] @ dequant(w[e])^T  for the rows r of expert e (offs[e-1] <= r < offs[e])

x [M, K] (bf16 / fp16 / fp32) is quantised per row and 128 input channels as it is loaded (scale =
amax / 448, power-of-two rounded up when ``pow2``), multiplied with the float8_e4m3fn weight
tile on the tensor cores, and each 128-channel step's product scaled by the row's and the
weight block's scales in float32 - the math of :func:`simtree.kernels.layers.fp8.linear_emulated`.

Row tiles are assigned to experts in the kernel (each program reads the E expert ends, counts
the row tiles of the experts before it), so the launch grid depends only on M and E: no host
sync, a CUDA graph replays it for any routing.  A dense linear is the case E = 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from simtree.kernels._triton import interpreting
from simtree.quant import FP8_BLOCK

__all__ = ["grouped_fp8_gemm", "block_m"]

FP8_MAX = tl.constexpr(448.0)   # a constexpr: Triton kernels read no other globals


@triton.jit
def _grouped_fp8_kernel(X, W, WS, OFFS, Y, M, N, K, E, s_xm, s_we, s_wn, s_se, s_sn, s_ym,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_POW2: tl.constexpr,
                        POW2: tl.constexpr, ROUND: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # which expert's row tile this program is: the experts' tile counts, summed in order
    ei = tl.arange(0, E_POW2)
    ends = tl.load(OFFS + ei, mask=ei < E, other=0).to(tl.int32)
    ends = tl.where(ei < E, ends, M)
    starts = tl.load(OFFS + ei - 1, mask=(ei >= 1) & (ei < E), other=0).to(tl.int32)
    starts = tl.where(ei < E, starts, M)
    tiles = (ends - starts + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)
    e = tl.sum((cum <= pid_m).to(tl.int32), 0)
    if e >= E:
        return
    first = tl.sum(tl.where(ei == e, cum - tiles, 0), 0)
    row0 = tl.sum(tl.where(ei == e, starts, 0), 0) + (pid_m - first) * BM
    row_end = tl.sum(tl.where(ei == e, ends, 0), 0)

    rows = row0 + tl.arange(0, BM)
    rmask = rows < row_end
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < N
    kk = tl.arange(0, BK)
    e64 = e.to(tl.int64)
    x_ptr = X + rows.to(tl.int64)[:, None] * s_xm + kk[None, :]
    w_ptr = W + e64 * s_we + cols.to(tl.int64)[None, :] * s_wn + kk[:, None]
    ws_ptr = WS + e64 * s_se + (cols // BK).to(tl.int64) * s_sn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        kmask = kk < K - kb * BK
        x = tl.load(x_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-10)
        xs = amax / FP8_MAX
        if POW2:
            xs = tl.exp2(tl.ceil(tl.log2(xs)))
        v = tl.clamp(x / xs[:, None], -FP8_MAX, FP8_MAX)
        if ROUND:   # round to the e4m3 grid first (the interpreter's cast mis-rounds at binade edges)
            step = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(v), 0.015625))) - 3.0)
            r = tl.abs(v) / step
            f = tl.floor(r)
            up = (r - f > 0.5) | ((r - f == 0.5) & (f - 2.0 * tl.floor(f * 0.5) == 1.0))   # to nearest, ties even
            v = tl.where(v < 0, -1.0, 1.0) * tl.where(up, f + 1.0, f) * step
        xq = v.to(tl.float8e4nv)
        w = tl.load(w_ptr, mask=kmask[:, None] & cmask[None, :], other=0.0)
        ws = tl.load(ws_ptr + kb, mask=cmask, other=0.0)
        acc += tl.dot(xq, w) * xs[:, None] * ws[None, :]
        x_ptr += BK
        w_ptr += BK
    y_ptr = Y + rows.to(tl.int64)[:, None] * s_ym + cols[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def block_m(rows: int, experts: int) -> int:
    """Row tile: 16 when an expert's rows are few (decoding), 64 once they fill a tile."""
    return 16 if rows < 32 * max(1, experts) else 64


def grouped_fp8_gemm(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, offs: torch.Tensor,
                     pow2: bool = False) -> torch.Tensor:
    """x [M, K] sorted by expert, w [E, N, K] float8_e4m3fn, scale_inv [E, ceil(N/128), ceil(K/128)]
    float32, offs [E] int32 (expert e's rows end at offs[e]) -> [M, N] in x's dtype."""
    M, K = x.shape
    E, N, _ = w.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    bm, bn = block_m(M, E), 128
    grid = (triton.cdiv(M, bm) + E, triton.cdiv(N, bn))
    _grouped_fp8_kernel[grid](x, w, scale_inv, offs, y, M, N, K, E, x.stride(0), w.stride(0), w.stride(1),
                              scale_inv.stride(0), scale_inv.stride(1), y.stride(0), BM=bm, BN=bn, BK=FP8_BLOCK,
                              E_POW2=max(2, triton.next_power_of_2(E)), POW2=bool(pow2),
                              ROUND=interpreting(), num_warps=4,
                              num_stages=3)
    return y
