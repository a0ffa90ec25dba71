"""Quantise latent rows into FlashMLA's V4 FP8 layout in one launch (Triton).

Same format as flashmla._quantize_rows / PackedRows: row i of a packed space lives in block
i // page at slot i % page; a block holds page data rows of 576 bytes (448 float8_e4m3 NoPE
values, then 64 bfloat16 RoPE values) followed by page scale rows of 8 bytes (7 e8m0
power-of-two scales, one per 64 NoPE values: 2^ceil(log2(amax / 448)), biased by 127).

    rows [n, 512] (bf16 / fp32), row_ids [n] -> written into raw [num_blocks, block_bytes] uint8

One program per row: [8, 64] tiles (7 NoPE tiles + the RoPE tile), amax per tile, scale,
convert, store bytes (the RoPE tile as 16-bit words).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pack_rows_triton"]


@triton.jit
def _pack_kernel(ROWS, IDS, RAW8, RAW16, stride_r, BLOCK_BYTES, PAGE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, 8)
    c = tl.arange(0, 64)
    x = tl.load(ROWS + r * stride_r + t[:, None] * 64 + c[None, :]).to(tl.float32)      # [8, 64]
    dst = tl.load(IDS + r + t * 0).to(tl.int64)                                         # [8] (broadcast)
    blk = dst // PAGE
    off = dst % PAGE
    base = blk * BLOCK_BYTES + off * 576                                                 # data row
    amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-30)
    e = tl.minimum(tl.maximum(tl.ceil(tl.log2(amax / 448.0)), -127.0), 127.0)
    q = (x / tl.exp2(e)[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    nope = (t < 7)[:, None] & (c >= 0)[None, :]
    tl.store(RAW8 + base[:, None] + t[:, None] * 64 + c[None, :], q, mask=nope)
    rope = x.to(tl.bfloat16).to(tl.int16, bitcast=True)
    tl.store(RAW16 + (base[:, None] + 448) // 2 + c[None, :], rope, mask=(t == 7)[:, None] & (c >= 0)[None, :])
    sbyte = tl.where(t < 7, (e + 127.0).to(tl.int32), 0).to(tl.uint8)
    tl.store(RAW8 + blk * BLOCK_BYTES + PAGE * 576 + off * 8 + t, sbyte)


def pack_rows_triton(raw: torch.Tensor, page: int, row_ids: torch.Tensor, rows: torch.Tensor) -> None:
    """raw [nb, block_bytes] uint8 (contiguous; block_bytes even) <- rows [n, 512] at row_ids [n]."""
    n = rows.shape[0]
    if n == 0:
        return
    rows = rows.contiguous()
    _pack_kernel[(n,)](rows, row_ids.contiguous(), raw, raw.view(torch.int16), rows.stride(0), raw.shape[1],
                       PAGE=page, num_warps=2)
