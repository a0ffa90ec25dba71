"""The MTP layer's draft state, shared by both full-scale models."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["batch_rows", "DraftState"]


@functools.lru_cache(maxsize=64)
def batch_rows(B: int, Q: int, device: torch.device) -> torch.Tensor:
    """int64 [B, Q]: each row's batch index."""
    return torch.arange(B, device=device)[:, None].expand(B, Q).contiguous()


@dataclass
class DraftState:
    """The MTP layer's KV cache ``kv`` [B, max_len + 1, P, Hkv, D] (P = 2: K | V; P = 1: one
    latent, K == V; entry q holds (hidden_q, token_q+1); between rounds its ``lengths`` equal
    the target's; row max_len: trash) and ``scratch`` [B, rows, P, Hkv, D] for draft rows not
    committed yet."""

    lengths: torch.Tensor
    max_len: int
    kv: torch.Tensor
    scratch: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.kv, self.scratch]

    def commit(self, rows: torch.Tensor, dest: torch.Tensor) -> None:
        """Scratch rows [B, P] -> cache rows ``dest`` [B, P] (max_len: the trash row)."""
        B, R, S1 = rows.shape[0], self.scratch.shape[1], self.kv.shape[1]
        b = batch_rows(*rows.shape, rows.device)
        src = self.scratch.view(B * R, *self.scratch.shape[2:])[(b * R + rows).reshape(-1)]
        self.kv.view(B * S1, *self.kv.shape[2:]).index_copy_(0, (b * S1 + dest).reshape(-1), src)
