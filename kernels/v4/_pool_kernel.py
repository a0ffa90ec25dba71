"""Fused batched compressor pooling (Triton): the M windows completing inside a round's trees.

Same math as compressor.pool_window (per channel softmax over the window's slots, weighted
sum, RMSNorm, RoPE on the last rope_dim channels at position entry * ratio), reading each
slot straight from its source instead of gathering [M, S, C] copies first:

    src [M, S]        virtual rows into [buffers [B*S, C] | node projections [N, C]], -1 = empty
                      slot (kv 0, score -inf); slot s of an overlapping (C4) compressor reads
                      channels [0, dim) for s < r and [dim, 2 dim) for s >= r
    cos, sin [M, rope_dim / 2]   RoPE of each entry (float64 on the host, then cast)
    out [M, dim]

One program per window; the slot loop takes 8 slots a step (16 for C128 windows: 128 slots,
once 128 dependent loads in a row) and keeps an online (max, sum, acc) per channel, split in
three channel groups (NoPE | first rope half | second rope half) so the rotation needs no
shuffles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .compressor import CompressorParams

__all__ = ["pool_windows", "SPLIT_CHANNELS"]

SPLIT_CHANNELS = 64     # channels a program of the split form (pool_windows(split=True)); a power of 2


@triton.jit
def _load_slot(BUF_KV, BUF_S, PKV, PS, src, BS, C, ch, cm):
    live = src >= 0
    from_buf = live & (src < BS)
    from_proj = src >= BS
    kv = tl.load(BUF_KV + src * C + ch, mask=cm & from_buf, other=0.0).to(tl.float32) \
        + tl.load(PKV + (src - BS) * C + ch, mask=cm & from_proj, other=0.0).to(tl.float32)
    sb = tl.load(BUF_S + src * C + ch, mask=cm & from_buf, other=float("-inf")).to(tl.float32)
    sp = tl.load(PS + (src - BS) * C + ch, mask=cm & from_proj, other=float("-inf")).to(tl.float32)
    return kv, tl.where(from_proj, sp, sb)


@triton.jit
def _slots_to_read(SRC, m_id, S, SKIP: tl.constexpr):
    """S, or with SKIP 0 for a padding row: a completing window's last slot is its completing
    token (never empty), while the device plan's padding rows (up to B (n - 1) of them, for a
    static shape) have every slot empty: their slot loop is skipped and they pool to 0 as before."""
    n = S
    if SKIP:
        n = tl.where(tl.load(SRC + m_id * S + S - 1) >= 0, S, 0)
    return n


@triton.jit
def _slots(SRC, m_id, S, slot, R, DIM, OVERLAP: tl.constexpr, SB: tl.constexpr):
    """Window m_id's slots ``slot`` [SB] -> (source rows, first channel) [SB, 1]: slot s of an
    overlapping (C4) compressor reads channels [DIM, 2 DIM) from s >= R on."""
    src = tl.load(SRC + m_id * S + slot, mask=slot < S, other=-1).to(tl.int64)[:, None]
    base = tl.zeros([SB], tl.int32)
    if OVERLAP:
        base = tl.where(slot >= R, DIM, 0)
    return src, base[:, None]


@triton.jit
def _groups(NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """The channel groups' offsets and masks: NoPE [BLOCK_N], each rope half [BLOCK_R]."""
    on = tl.arange(0, BLOCK_N)
    orr = tl.arange(0, BLOCK_R)
    return on, orr, on < NOPE, orr < HALF


@triton.jit
def _online(m, l, acc, kv, s):
    """Fold a block of slots (kv, s [SB, channels]) into the running (max, sum, acc) per channel."""
    m_new = tl.maximum(m, tl.max(s, 0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[None, :])
    return m_new, l * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p * kv, 0)


@triton.jit
def _pool_kernel(BUF_KV, BUF_S, PKV, PS, SRC, COS, SIN, NORM, OUT, BS, C, S, R, eps,
                 DIM: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, OVERLAP: tl.constexpr, SB: tl.constexpr,
                 SKIP: tl.constexpr):
    m_id = tl.program_id(0).to(tl.int64)
    on, orr, mn, mr = _groups(NOPE, HALF, BLOCK_N, BLOCK_R)
    m0 = tl.full([BLOCK_N], -1e30, tl.float32)
    l0 = tl.zeros([BLOCK_N], tl.float32)
    a0 = tl.zeros([BLOCK_N], tl.float32)
    m1 = tl.full([BLOCK_R], -1e30, tl.float32)
    l1 = tl.zeros([BLOCK_R], tl.float32)
    a1 = tl.zeros([BLOCK_R], tl.float32)
    m2 = tl.full([BLOCK_R], -1e30, tl.float32)
    l2 = tl.zeros([BLOCK_R], tl.float32)
    a2 = tl.zeros([BLOCK_R], tl.float32)
    osb = tl.arange(0, SB)
    for s0 in range(0, _slots_to_read(SRC, m_id, S, SKIP), SB):
        # SB slots at a time: their source rows, then [SB, channels] tiles (one round of loads
        # in flight per block instead of one per slot: C128 windows have 128 slots)
        src, base = _slots(SRC, m_id, S, s0 + osb, R, DIM, OVERLAP, SB)
        kv, sc = _load_slot(BUF_KV, BUF_S, PKV, PS, src, BS, C, base + on[None, :], mn[None, :])
        m0, l0, a0 = _online(m0, l0, a0, kv, sc)
        kv, sc = _load_slot(BUF_KV, BUF_S, PKV, PS, src, BS, C, base + NOPE + orr[None, :], mr[None, :])
        m1, l1, a1 = _online(m1, l1, a1, kv, sc)
        kv, sc = _load_slot(BUF_KV, BUF_S, PKV, PS, src, BS, C, base + NOPE + HALF + orr[None, :], mr[None, :])
        m2, l2, a2 = _online(m2, l2, a2, kv, sc)
    x0 = tl.where(mn, a0 / tl.maximum(l0, 1e-30), 0.0)
    x1 = tl.where(mr, a1 / tl.maximum(l1, 1e-30), 0.0)
    x2 = tl.where(mr, a2 / tl.maximum(l2, 1e-30), 0.0)
    _norm_rope_store(x0, x1, x2, m_id, on, orr, mn, mr, COS, SIN, NORM, OUT, eps, DIM, NOPE, HALF)


@triton.jit
def _norm_rope_store(x0, x1, x2, m_id, on, orr, mn, mr, COS, SIN, NORM, OUT, eps, DIM: tl.constexpr,
                     NOPE: tl.constexpr, HALF: tl.constexpr):
    """A pooled entry (NoPE | first rope half | second rope half, fp32) -> RMSNorm, RoPE, stored."""
    ms = (tl.sum(x0 * x0, 0) + tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / DIM
    rinv = 1.0 / tl.sqrt(ms + eps)
    x0 = x0 * rinv * tl.load(NORM + on, mask=mn, other=0.0).to(tl.float32)
    x1 = x1 * rinv * tl.load(NORM + NOPE + orr, mask=mr, other=0.0).to(tl.float32)
    x2 = x2 * rinv * tl.load(NORM + NOPE + HALF + orr, mask=mr, other=0.0).to(tl.float32)
    cos = tl.load(COS + m_id * HALF + orr, mask=mr, other=0.0).to(tl.float32)
    sin = tl.load(SIN + m_id * HALF + orr, mask=mr, other=0.0).to(tl.float32)
    ot = OUT.dtype.element_ty
    tl.store(OUT + m_id * DIM + on, x0.to(ot), mask=mn)
    tl.store(OUT + m_id * DIM + NOPE + orr, (x1 * cos - x2 * sin).to(ot), mask=mr)
    tl.store(OUT + m_id * DIM + NOPE + HALF + orr, (x1 * sin + x2 * cos).to(ot), mask=mr)


@triton.jit
def _pool_part_kernel(BUF_KV, BUF_S, PKV, PS, SRC, X, BS, C, S, R, DIM: tl.constexpr, CB: tl.constexpr,
                      OVERLAP: tl.constexpr, SB: tl.constexpr, SKIP: tl.constexpr):
    """The split form's first launch: window (program 0) x CB channels (program 1), the online
    softmax over every slot of those channels -> the pooled channels, unnormalised, into X [M, DIM]."""
    m_id = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * CB + tl.arange(0, CB)
    mc = c < DIM
    m = tl.full([CB], -1e30, tl.float32)
    l = tl.zeros([CB], tl.float32)
    a = tl.zeros([CB], tl.float32)
    osb = tl.arange(0, SB)
    for s0 in range(0, _slots_to_read(SRC, m_id, S, SKIP), SB):
        src, base = _slots(SRC, m_id, S, s0 + osb, R, DIM, OVERLAP, SB)
        kv, sc = _load_slot(BUF_KV, BUF_S, PKV, PS, src, BS, C, base + c[None, :], mc[None, :])
        m, l, a = _online(m, l, a, kv, sc)
    tl.store(X + m_id * DIM + c, a / tl.maximum(l, 1e-30), mask=mc)


@triton.jit
def _pool_finish_kernel(X, COS, SIN, NORM, OUT, eps, DIM: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """The split form's second launch: a program per window, RMSNorm and RoPE of its pooled row."""
    m_id = tl.program_id(0).to(tl.int64)
    on, orr, mn, mr = _groups(NOPE, HALF, BLOCK_N, BLOCK_R)
    x0 = tl.load(X + m_id * DIM + on, mask=mn, other=0.0)
    x1 = tl.load(X + m_id * DIM + NOPE + orr, mask=mr, other=0.0)
    x2 = tl.load(X + m_id * DIM + NOPE + HALF + orr, mask=mr, other=0.0)
    _norm_rope_store(x0, x1, x2, m_id, on, orr, mn, mr, COS, SIN, NORM, OUT, eps, DIM, NOPE, HALF)


def pool_windows(p: CompressorParams, buf_kv: torch.Tensor, buf_score: torch.Tensor,
                 proj: tuple[torch.Tensor, torch.Tensor], src: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, out_dtype=torch.float32, split: bool = False,
                 skip_padding: bool = False) -> torch.Tensor:
    """buf_kv, buf_score [B, S, C]; proj (kv, score) [N, C]; src [M, S] -> entries [M, dim]
    (computed in fp32, stored as out_dtype: the pool's dtype saves the cast launch).

    ``split`` (the fusion "pool_split", kernels/v4/verify.py): two launches, the first a
    program per (window, SPLIT_CHANNELS channels) over every slot, the second the norm and RoPE
    per window; one program per window reads a C128 window's 128 slots x 512 channels alone.
    ``skip_padding`` (the fusions "pool_live" and "pool_split"): rows whose last slot is empty
    (the device plan's padding, every slot empty) skip their slot loop; they pool to 0 either way."""
    M, S = src.shape
    out = torch.empty(M, p.dim, dtype=out_dtype, device=src.device)
    if M == 0:
        return out
    C = buf_kv.shape[-1]
    nope, half = p.dim - p.rope_dim, p.rope_dim // 2
    args = (buf_kv.contiguous(), buf_score.contiguous(), proj[0].contiguous(), proj[1].contiguous(), src.contiguous())
    blocks = dict(BLOCK_N=triton.next_power_of_2(max(nope, 1)), BLOCK_R=triton.next_power_of_2(half))
    sb = 16 if S >= 64 else 8
    if split:
        x = torch.empty(M, p.dim, dtype=torch.float32, device=src.device)
        cb = SPLIT_CHANNELS
        _pool_part_kernel[(M, triton.cdiv(p.dim, cb))](*args, x, buf_kv.shape[0] * S, C, S, p.ratio, DIM=p.dim,
                                                              CB=cb, OVERLAP=p.overlap, SB=sb,
                                                              SKIP=skip_padding, num_warps=2)
        _pool_finish_kernel[(M,)](x, cos.contiguous(), sin.contiguous(), p.norm.contiguous(), out, p.eps, DIM=p.dim,
                                  NOPE=nope, HALF=half, num_warps=4, **blocks)
        return out
    _pool_kernel[(M,)](*args, cos.contiguous(), sin.contiguous(), p.norm.contiguous(), out,
                       buf_kv.shape[0] * S, C, S, p.ratio, p.eps, DIM=p.dim, NOPE=nope, HALF=half,
                       OVERLAP=p.overlap, SB=sb, SKIP=skip_padding, num_warps=8, **blocks)
    return out
