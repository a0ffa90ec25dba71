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

import numpy as np
import torch

from simtree.errors import SimtreeError

__all__ = ["RopeTable"]


class RopeTable:
    def __init__(self, rope_dim: int, theta: float, device, length: int = 0, dtype=torch.float32):
        if rope_dim < 2 or rope_dim % 2:
            raise SimtreeError(f"rope_dim must be even and >= 2, got {rope_dim}")
        self.rope_dim, self.theta, self.device = int(rope_dim), float(theta), torch.device(device)
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
        inv = self.theta ** (-np.arange(0, self.rope_dim, 2, dtype=np.float64) / self.rope_dim)
        ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
        cs = np.concatenate([np.cos(ang), np.sin(ang)], 1)
        self.table = torch.as_tensor(cs, dtype=self.dtype, device=self.device)

    def rows(self, pos: torch.Tensor) -> torch.Tensor:
        """cos | sin [pos.numel(), rope_dim] of positions ``pos`` (any shape, flattened)."""
        return self.table[pos.reshape(-1)]
