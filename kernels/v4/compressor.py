"""The V4 KV compressor: online (one token at a time) and batched (a list of windows) forms.

Per token at position p (fp32):  kv_p = Wkv x_p,  s_p = Wgate x_p + ape[p % r]   ([C] each,
C = coff * dim; coff = 2 for the overlapping C4 compressor, 1 otherwise).

Entry i completes at the token p = i*r + r - 1 and pools a window of S = coff * r slots:

    C4   slots 0..r-1   = tokens (i-1)r .. ir-1, first half of the channels  [:dim]
         slots r..2r-1  = tokens ir .. ir+r-1,   second half of the channels [dim:]
    C128 slots 0..r-1   = tokens ir .. ir+r-1 (all channels)

    entry_i = RoPE_{i*r}( RMSNorm( sum_slots kv * softmax_slots(s) ) )   (softmax per channel,
              RoPE on the last rope_dim channels)

Slots with no token (the previous window of entry 0) hold kv = 0, s = -inf.

Buffer layout (the persistent "partially-filled" state, per sequence): kv_state, score_state
[S, C]; rows [off, off + r) with off = r for C4 (0 for C128) are the *current* window, slot
p % r; for C4 rows [0, r) hold the previous (completed) window — copied from the current
rows each time an entry completes.  Both forms call :func:`pool_window` on the same [S, C]
slot layout, so they agree to the last bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["CompressorParams", "random_compressor", "project", "pool_window", "online_step",
           "init_state", "apply_rope", "proj_dtype", "matmul_t"]


@dataclass
class CompressorParams:
    """wkv, wgate [C, hidden]; ape [ratio, C]; norm [dim]."""

    wkv: torch.Tensor
    wgate: torch.Tensor
    ape: torch.Tensor
    norm: torch.Tensor
    ratio: int
    dim: int
    rope_dim: int
    overlap: bool
    eps: float = 1e-6
    theta: float = 10000.0
    freqs: tuple | None = None     # the model's inverse frequencies (YaRN); None: theta^(-2i / rope_dim)

    def inv_freq(self) -> np.ndarray:
        """rope_dim / 2 inverse frequencies (float64) of the entries' RoPE."""
        if self.freqs is not None:
            return np.asarray(self.freqs, dtype=np.float64)
        return self.theta ** (-np.arange(self.rope_dim // 2, dtype=np.float64) * 2.0 / self.rope_dim)

    @property
    def coff(self) -> int:
        return 2 if self.overlap else 1

    @property
    def num_slots(self) -> int:
        return self.coff * self.ratio

    @property
    def cur_offset(self) -> int:
        """First buffer row of the current window."""
        return self.ratio if self.overlap else 0

    def to(self, device=None, dtype=None) -> "CompressorParams":
        t = lambda v: v.to(device=device, dtype=dtype)  # noqa: E731
        return CompressorParams(t(self.wkv), t(self.wgate), t(self.ape), t(self.norm), self.ratio,
                                self.dim, self.rope_dim, self.overlap, self.eps, self.theta, self.freqs)


def random_compressor(dim: int, ratio: int, hidden: int, rope_dim: int, overlap: bool,
                      gen: torch.Generator, dtype=torch.float64, eps: float = 1e-6,
                      theta: float = 10000.0) -> CompressorParams:
    c = (2 if overlap else 1) * dim
    w = lambda *s, sc=1.0: (torch.randn(*s, generator=gen, dtype=torch.float64) * sc).to(dtype)  # noqa: E731
    return CompressorParams(w(c, hidden, sc=hidden ** -0.5), w(c, hidden, sc=hidden ** -0.5),
                            w(ratio, c, sc=0.5), 1.0 + w(dim, sc=0.1), ratio, dim, rope_dim,
                            overlap, eps, theta)


_FREQS: dict = {}


def device_freqs(inv, device) -> torch.Tensor:
    """float64 inverse frequencies ``inv`` on ``device``, copied from the host once per (values,
    device): a round's CUDA graph may read them but cannot copy host data while it is captured
    (the warm-up before capture fills this cache)."""
    arr = np.ascontiguousarray(np.asarray(inv, dtype=np.float64))
    key = (arr.tobytes(), str(torch.device(device)))
    out = _FREQS.get(key)
    if out is None:
        out = _FREQS[key] = torch.as_tensor(arr, device=device)
    return out


def apply_rope(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float, inv=None) -> torch.Tensor:
    """Rotate the last ``rope_dim`` channels of x [..., d] by position pos [...] (half-split;
    ``inv``: the inverse frequencies, else theta^(-2i / rope_dim))."""
    half = rope_dim // 2
    if inv is None:
        freqs = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / rope_dim)
    else:
        freqs = device_freqs(inv, x.device)
    ang = pos.to(torch.float64).unsqueeze(-1) * freqs
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    nope, r1, r2 = x[..., :-rope_dim], x[..., -rope_dim:-half], x[..., -half:]
    return torch.cat([nope, r1 * cos - r2 * sin, r1 * sin + r2 * cos], dim=-1)


def proj_dtype(p: CompressorParams) -> torch.dtype:
    """The dtype the projections come out in: the position bias's (fp32; float64 in a float64
    model), whatever the weights are stored in."""
    return p.ape.dtype


def matmul_t(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] @ w[C, K]^T (+ bias [N, C]) in ``out_dtype``, written into ``out`` where given.
    A 16-bit weight (the checkpoint's bf16 compressor projections) meets x at the weight's dtype
    (x is rounded to it: every caller passes the layer's bf16 normed input, exact there): on CUDA
    the tensor cores with an fp32 output, one launch with the bias (a bf16 x bf16 product is exact
    in fp32, so this is fp32 arithmetic of the same operands at half the weight bytes of an fp32
    copy); elsewhere both operands upcast (the same products)."""
    if w.dtype == out_dtype:
        r = torch.matmul(x.to(out_dtype), w.T, out=out)
        if bias is not None:            # a product, then the bias: the float64 reference's order
            r += bias
        return r
    if x.is_cuda and w.dtype in (torch.bfloat16, torch.float16) and out_dtype == torch.float32:
        xs = x.to(w.dtype)
        kw = {} if out is None else {"out": out}
        if bias is None:
            return torch.mm(xs, w.T, out_dtype=out_dtype, **kw)
        return torch.addmm(bias.to(out_dtype), xs, w.T, out_dtype=out_dtype, **kw)
    r = x.to(w.dtype).to(out_dtype) @ w.T.to(out_dtype)
    if bias is not None:
        r = r + bias
    if out is None:
        return r
    out.copy_(r)
    return out


def project(p: CompressorParams, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, hidden], pos [N] -> kv, score [N, C] in ``proj_dtype(p)`` (fp32)."""
    dt = proj_dtype(p)
    kv = matmul_t(x, p.wkv, dt)
    score = matmul_t(x, p.wgate, dt, bias=p.ape[pos % p.ratio])
    return kv, score


def pool_window(p: CompressorParams, kv_slots: torch.Tensor, score_slots: torch.Tensor,
                entry: torch.Tensor) -> torch.Tensor:
    """kv_slots, score_slots [M, S, C] (buffer layout), entry [M] -> entries [M, dim]."""
    if p.overlap:
        r, d = p.ratio, p.dim
        kv_slots = torch.cat([kv_slots[:, :r, :d], kv_slots[:, r:, d:]], dim=1)
        score_slots = torch.cat([score_slots[:, :r, :d], score_slots[:, r:, d:]], dim=1)
    pooled = (kv_slots * torch.softmax(score_slots, dim=1)).sum(dim=1)
    normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + p.eps) * p.norm
    return apply_rope(normed, entry * p.ratio, p.rope_dim, p.theta, p.inv_freq())


def init_state(p: CompressorParams, batch: int | None = None, dtype=None, device=None):
    """Empty buffers: kv 0, score -inf; [S, C] or [batch, S, C]."""
    shape = (p.num_slots, p.coff * p.dim) if batch is None else (batch, p.num_slots, p.coff * p.dim)
    dtype = dtype or proj_dtype(p)
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.full(shape, float("-inf"), dtype=dtype, device=device))


def online_step(p: CompressorParams, kv_state: torch.Tensor, score_state: torch.Tensor,
                kv: torch.Tensor, score: torch.Tensor, pos: int) -> torch.Tensor | None:
    """Feed one token (kv, score [C]) at position pos; updates the [S, C] buffers in place.

    Returns the completed entry [dim] when pos closes a window, else None.
    """
    slot = p.cur_offset + pos % p.ratio
    kv_state[slot] = kv
    score_state[slot] = score
    if (pos + 1) % p.ratio:
        return None
    entry = pool_window(p, kv_state.unsqueeze(0), score_state.unsqueeze(0),
                        torch.tensor([pos // p.ratio], device=kv.device))[0]
    if p.overlap:  # the completed window becomes the next entry's first half
        kv_state[:p.ratio] = kv_state[p.ratio:].clone()
        score_state[:p.ratio] = score_state[p.ratio:].clone()
    return entry
