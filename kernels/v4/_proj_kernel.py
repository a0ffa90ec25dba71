"""The compressors' projections of a round's nodes in one launch (Triton): for a CSA layer both
compressors (the KV one and the indexer's), kv and score, four fp32 GEMMs.

    proj[0] = x Wkv^T,   proj[1] = x Wgate^T + ape[pos % r]      x [N, hidden], proj [2, N, C]

At verify sizes (N <= a few dozen rows) these GEMMs are reads of the fp32 weights (42 MB for a
V4-Flash CSA layer, 8 us at 4.8 TB/s) and little else; cuBLAS's SGEMM tiles them for large
M and leaves most of the GPU idle at N = 4 (62-172 us measured for the four on the H200 at
N = 4-256, reports/h200/v4/bench_v4.csv, proj_us).  Here every program owns BN output
columns of one of the (up to) four weights and streams its [BN, hidden] slice once, all N
rows in one tile (fp32 products, float32 accumulation: the math of the torch form, summed in
another order; 3xTF32 products past 32 rows); the score's positional bias ape[pos % r] is
added in the same program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from simtree.kernels._triton import interpreting

from .compressor import CompressorParams

__all__ = ["project_compressors", "project_compressors_torch", "fits", "MAX_ROWS"]

MAX_ROWS = 256     # every row in one tile; more rows than this: cuBLAS takes them


@triton.jit
def _mm(X, W, rows, rmask, cols, cmask, K, s_xn, BK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        PREC: tl.constexpr):
    kk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        km = k0 + kk < K
        x = tl.load(X + rows[:, None] * s_xn + k0 + kk[None, :], mask=rmask[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(W + cols.to(tl.int64)[None, :] * K + k0 + kk[:, None], mask=km[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.dot(x, w, input_precision=PREC)
    return acc


@triton.jit
def _one(X, WKV, WG, APE, POS, OUT, which, pid_n, pid_m, N, C, K, s_xn,
         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < C
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows < N
    if which == 0:
        acc = _mm(X, WKV, rows, rmask, cols, cmask, K, s_xn, BK, BM, BN, PREC)
    else:
        acc = _mm(X, WG, rows, rmask, cols, cmask, K, s_xn, BK, BM, BN, PREC)
        pm = tl.load(POS + rows, mask=rmask, other=0).to(tl.int64)
        acc += tl.load(APE + pm[:, None] * C + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    tl.store(OUT + which * N * C + rows.to(tl.int64)[:, None] * C + cols[None, :], acc,
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _proj_kernel(X, WKV1, WG1, APE1, OUT1, C1, WKV2, WG2, APE2, OUT2, C2, POS, N, K, s_xn,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    pid_n = tl.program_id(0)
    which = tl.program_id(1)
    pid_m = tl.program_id(2)
    if which < 2:
        if pid_n * BN < C1:
            _one(X, WKV1, WG1, APE1, POS, OUT1, which, pid_n, pid_m, N, C1, K, s_xn, BM, BN, BK, PREC)
    else:
        if pid_n * BN < C2:
            _one(X, WKV2, WG2, APE2, POS, OUT2, which - 2, pid_n, pid_m, N, C2, K, s_xn, BM, BN, BK, PREC)


def fits(comps: list[CompressorParams], rows: int) -> bool:
    """Whether :func:`project_compressors` runs these compressors at ``rows`` rows."""
    return (1 <= len(comps) <= 2 and rows <= MAX_ROWS
            and all(t.dtype == torch.float32 and t.is_contiguous() for p in comps for t in (p.wkv, p.wgate, p.ape)))


def project_compressors_torch(comps: list[CompressorParams], x: torch.Tensor, pos_mod: torch.Tensor) -> list:
    """Reference: [2, N, C] per compressor, two torch GEMMs each (the current form)."""
    out = []
    for p in comps:
        xw = x.to(p.wkv.dtype)
        out.append(torch.stack([xw @ p.wkv.T, p.ape[pos_mod] + xw @ p.wgate.T]))
    return out


def project_compressors(comps: list[CompressorParams], x: torch.Tensor, pos_mod: torch.Tensor,
                        block_n: int = 16) -> list[torch.Tensor]:
    """x [N, hidden] (N <= MAX_ROWS; any float dtype, widened to fp32 as loaded) through one or
    two compressors of fp32 weights -> their [2, N, C] (kv; score + ape[pos_mod]), one launch."""
    if not fits(comps, x.shape[0]):
        raise ValueError(f"project_compressors: one or two compressors of contiguous fp32 weights, at most "
                         f"{MAX_ROWS} rows (got {len(comps)}, {x.shape[0]} rows)")
    N, K = x.shape
    outs = [x.new_empty((2, N, p.wkv.shape[0]), dtype=torch.float32) for p in comps]
    if N == 0:
        return outs
    x, pos_mod = x.contiguous(), pos_mod.contiguous()
    a = comps[0]
    b, ob = (comps[1], outs[1]) if len(comps) == 2 else (a, outs[0])
    C1, C2 = a.wkv.shape[0], b.wkv.shape[0]
    bm = max(16, triton.next_power_of_2(N))
    # few rows: fp32 FMAs, the weights' stream is the cost; many: 3xTF32 on the tensor cores
    # (fp32's accuracy, ~1e-6 relative), as the products outgrow the CUDA cores
    prec = "ieee" if bm <= 32 or interpreting() else "tf32x3"
    grid = (triton.cdiv(max(C1, C2), block_n), 2 * len(comps), triton.cdiv(N, bm))
    _proj_kernel[grid](x, a.wkv, a.wgate, a.ape, outs[0], C1, b.wkv, b.wgate, b.ape, ob, C2, pos_mod, N, K,
                       x.stride(0), BM=bm, BN=block_n, BK=max(16, min(128, 4096 // bm)), PREC=prec,
                       num_warps=4 if bm <= 16 else 8, num_stages=4 if bm <= 64 else 3)
    return outs
