"""RoPE angles for a model: one table of cos | sin per position, built once on the host.

    table = RopeTable(rope_dim=64, theta=1e7, device="cuda")
    table.ensure(max_len + 2)          # before any CUDA graph reads it
    cs = table.rows(pos)               # [N, 64] float32: cos [32] | sin [32] at positions pos [N]
                                       # (float64 tables for float64 models)

A round gathers the rows of its positions once (one index op) and every layer's fused
``norm_rope`` reads them; the angles themselves are computed in float64 on the host, once per
table size, never per layer or on the device.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from simtree.errors import SimtreeError

__all__ = ["RopeTable", "inv_freq"]


def inv_freq(rope_dim: int, theta: float, yarn: dict | None = None) -> np.ndarray:
    """The rope_dim / 2 inverse frequencies theta^(-2i / rope_dim), YaRN-blended where ``yarn``
    ({factor, original_max_position_embeddings, beta_fast, beta_slow}; cos / sin unscaled: V4's
    compressed layers keep attention_factor 1).  Rounded to float32 as transformers keeps them;
    the angles are then taken in float64.  The float32 arithmetic is torch's, as transformers does
    it (numpy's float32 power can differ from torch's in the last bit)."""
    if rope_dim < 2 or rope_dim % 2:
        raise SimtreeError(f"rope_dim must be even and >= 2, got {rope_dim}")
    d = int(rope_dim)
    pos_freqs = float(theta) ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    extra = 1.0 / pos_freqs
    if not yarn:
        return extra.numpy().astype(np.float64)
    factor = float(yarn["factor"])
    orig = float(yarn["original_max_position_embeddings"])
    fast, slow = float(yarn.get("beta_fast") or 32), float(yarn.get("beta_slow") or 1)

    def corr(rot: float) -> float:
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(fast), corr(slow)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    keep = 1 - torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    inter = 1.0 / (factor * pos_freqs)
    return (inter * (1 - keep) + extra * keep).numpy().astype(np.float64)


class RopeTable:
    def __init__(self, rope_dim: int, theta: float, device, length: int = 0, dtype=torch.float32,
                 freqs: np.ndarray | None = None):
        if rope_dim < 2 or rope_dim % 2:
            raise SimtreeError(f"rope_dim must be even and >= 2, got {rope_dim}")
        self.rope_dim, self.theta, self.device = int(rope_dim), float(theta), torch.device(device)
        # freqs: the model's own inverse frequencies (:func:`inv_freq`); None: theta^(-2i / rope_dim)
        self.freqs = None if freqs is None else np.asarray(freqs, dtype=np.float64)
        self.dtype = torch.float64 if dtype == torch.float64 else torch.float32   # float64 models: float64
        self.table = torch.empty(0, self.rope_dim, dtype=self.dtype, device=self.device)
        self.ensure(length)

    @property
    def length(self) -> int:
        return int(self.table.shape[0])

    def ensure(self, length: int) -> None:
        """At least ``length`` positions (rebuilt larger; a CUDA graph captured before a rebuild
        keeps reading the old table, so size it before capturing)."""
        if length <= self.length:
            return
        n = max(int(length), 2 * self.length, 64)
        inv = self.freqs if self.freqs is not None else \
            self.theta ** (-np.arange(0, self.rope_dim, 2, dtype=np.float64) / self.rope_dim)
        ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
        cs = np.concatenate([np.cos(ang), np.sin(ang)], 1)
        self.table = torch.as_tensor(cs, dtype=self.dtype, device=self.device)

    def rows(self, pos: torch.Tensor) -> torch.Tensor:
        """cos | sin [pos.numel(), rope_dim] of positions ``pos`` (any shape, flattened)."""
        return self.table[pos.reshape(-1)]
