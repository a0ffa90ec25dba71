"""Bit tricks on the ancestor-bit words (uint64) the tree kernels share: the set-bit count and
the position of the s-th set bit (a path's nodes gathered from its ancestor bits)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _popcount64(x):
    """Set bits of each uint64 (SWAR: pair, nibble and byte sums, then one multiply)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    return (x * 0x0101010101010101) >> 56


@triton.jit
def _select_half(w, s, pos, HALF: tl.constexpr, MASK: tl.constexpr):
    """One halving step of ``_select_bit64``: keep the half of w [2 HALF bits] holding the
    s-th set bit."""
    low = w & MASK
    c = _popcount64(low).to(tl.int64)
    up = c <= s                           # the s-th set bit lies in the upper half
    return tl.where(up, w >> HALF, low), tl.where(up, s - c, s), tl.where(up, pos + HALF, pos)


@triton.jit
def _select_bit64(w, s):
    """Position of the s-th (0-based) set bit of the uint64 words w, elementwise, by halving:
    in registers, no exchange between threads (s beyond the count gives a position >= the
    highest set bit; callers mask those slots)."""
    pos = tl.zeros(s.shape, dtype=tl.int64)
    w, s, pos = _select_half(w, s, pos, 32, 0xFFFFFFFF)
    w, s, pos = _select_half(w, s, pos, 16, 0xFFFF)
    w, s, pos = _select_half(w, s, pos, 8, 0xFF)
    w, s, pos = _select_half(w, s, pos, 4, 0xF)
    w, s, pos = _select_half(w, s, pos, 2, 0x3)
    w, s, pos = _select_half(w, s, pos, 1, 0x1)
    return pos
