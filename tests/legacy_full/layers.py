"""Building blocks shared by the full-scale models: norms, RoPE, SwiGLU MLP, routed experts.

Every op keeps static shapes and reads counts on the device (no host sync), so a forward
built from them can be captured in a CUDA graph; the only exception is the per-expert loop
that stands in for ``torch._grouped_mm`` where that kernel does not run (float64, or no
kernel for the device): :func:`grouped_mm_capturable` says which one a model gets.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "rope", "swiglu", "route_topk", "routed_experts", "grouped_mm_capturable",
           "batch_rows", "DraftState", "EPS"]

EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


@functools.lru_cache(maxsize=32)
def _inv_freq(rope_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    return theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=device) / rope_dim)


def rope(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float, last: bool = False) -> torch.Tensor:
    """Rotate-half RoPE on ``rope_dim`` channels of x [..., H, D] at positions pos [...]: the
    first ``rope_dim`` channels (Qwen's partial rotary) or, ``last``, the last ones (V4: the
    448 no-RoPE channels come first).  Angles in float64, applied in x's dtype."""
    half = rope_dim // 2
    ang = pos.to(torch.float64)[..., None] * _inv_freq(rope_dim, float(theta), x.device)   # [..., half]
    cos, sin = ang.cos().to(x.dtype)[..., None, :], ang.sin().to(x.dtype)[..., None, :]
    lo, hi = (x.shape[-1] - rope_dim, x.shape[-1]) if last else (0, rope_dim)
    r1, r2 = x[..., lo:lo + half], x[..., lo + half:hi]
    rot = torch.cat([r1 * cos - r2 * sin, r1 * sin + r2 * cos], -1)
    return torch.cat([x[..., :lo], rot, x[..., hi:]], -1)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(SiLU(gate x) * up x); w_gate_up [2I, h] (gate rows first), w_down [h, I]."""
    a, b = F.linear(x, w_gate_up).chunk(2, -1)
    return F.linear(F.silu(a) * b, w_down)


def route_topk(x: torch.Tensor, w_router: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax gate over the experts (fp32), the top ``topk`` renormalised: (ids [T, k], weights [T, k])."""
    probs = torch.softmax(F.linear(x, w_router).float(), -1)
    w, ids = probs.topk(topk, -1)
    return ids, w / w.sum(-1, keepdim=True)


_GROUPED_MM = {"ok": hasattr(torch, "_grouped_mm")}   # off after the first failure on this device


def grouped_mm_capturable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether routed experts run as ``torch._grouped_mm`` (no host sync) here."""
    return torch.device(device).type == "cuda" and dtype == torch.bfloat16 and _GROUPED_MM["ok"]


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of x [M, in] times w[e] [out, in]^T -> [M, out]."""
    if grouped_mm_capturable(x.device, x.dtype):
        try:
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        except RuntimeError as exc:    # a build without the kernel for this GPU: the loop below
            _GROUPED_MM["ok"] = False
            warnings.warn(f"torch._grouped_mm failed ({' '.join(str(exc).split())[:160]}): routed experts "
                          "run one GEMM per expert, with a host sync", RuntimeWarning, stacklevel=2)
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):     # host loop: CPU / float64 reference path
        if end > start:
            out[start:end] = F.linear(x[start:end], w[e])
        start = end
    return out


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, h]; experts' w_gate_up
    [E, 2I, h], w_down [E, h, I].  The T*k (token, expert) pairs are sorted by expert (stable),
    run as one grouped GEMM per projection, and put back in (token, slot) order before the
    weighted sum, so every token's result is summed in the same order whatever the batch."""
    T, k = ids.shape
    E = w_gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    xs = x.index_select(0, order // k)
    a, b = _grouped_linear(xs, w_gate_up, offs).chunk(2, -1)
    y = _grouped_linear(F.silu(a) * b, w_down, offs)
    back = torch.empty_like(y).index_copy_(0, order, y)
    return (back.view(T, k, -1) * weights.to(y.dtype)[..., None]).sum(1)


@functools.lru_cache(maxsize=64)
def batch_rows(B: int, Q: int, device: torch.device) -> torch.Tensor:
    """int64 [B, Q]: each row's batch index (index_put_ into [B, S, ...] tensors)."""
    return torch.arange(B, device=device)[:, None].expand(B, Q).contiguous()


@dataclass
class DraftState:
    """The MTP layer's KV cache [B, max_len + 1, Hkv, D] (entry q holds (hidden_q, token_q+1);
    between rounds its ``lengths`` equal the target's) and scratch rows [B, rows, Hkv, D] for
    draft rows not committed yet."""

    lengths: torch.Tensor
    max_len: int
    k: torch.Tensor
    v: torch.Tensor
    scratch_k: torch.Tensor
    scratch_v: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.scratch_k, self.scratch_v]

    def commit(self, rows: torch.Tensor, dest: torch.Tensor) -> None:
        """Scratch rows [B, P] -> cache rows ``dest`` [B, P] (max_len: the trash row)."""
        b = batch_rows(*rows.shape, rows.device)
        self.k.index_put_((b, dest), self.scratch_k[b, rows])
        if self.v is not self.k:
            self.v.index_put_((b, dest), self.scratch_v[b, rows])
