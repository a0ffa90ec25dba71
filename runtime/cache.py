"""Persistent decoding state of the runtime models, and what a verify hands to its commit."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Cache", "Pending"]


class Cache:
    """Persistent per-sequence decoding state for B sequences (all tensors batch-first).

    lengths int64 [B]: tokens in the cache; attention k/v [B, max_len, Hkv, D] per layer;
    GDN state [B, HV, K, V] and conv state [B, conv_dim, W-1] per layer.  Layers of the other
    type hold None.  ``narrow(b)`` gives a view of sequence b (in-place updates reach self).
    """

    def __init__(self, cfg, batch_size: int, max_len: int, dtype, device="cpu"):
        self.cfg, self.max_len = cfg, max_len
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.k, self.v, self.state, self.conv = [], [], [], []
        for t in cfg.layer_types:
            att = t == "full_attention"
            kv = (batch_size, max_len, cfg.num_key_value_heads, cfg.head_dim)
            conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
                cfg.linear_num_value_heads * cfg.linear_value_head_dim
            st = (batch_size, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            self.k.append(torch.zeros(kv, dtype=dtype, device=device) if att else None)
            self.v.append(torch.zeros(kv, dtype=dtype, device=device) if att else None)
            # the recurrent state is stored in fp32 (the GDN kernels' contract; see simtree.kernels.gdn.ops)
            self.state.append(None if att else torch.zeros(st, dtype=torch.float32, device=device))
            self.conv.append(None if att else torch.zeros(batch_size, conv_dim, cfg.linear_conv_kernel_dim - 1,
                                                          dtype=dtype, device=device))

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def narrow(self, b: int) -> "Cache":
        view = object.__new__(Cache)
        view.cfg, view.max_len = self.cfg, self.max_len
        view.lengths = self.lengths[b:b + 1]
        for name in ("k", "v", "state", "conv"):
            setattr(view, name, [None if t is None else t[b:b + 1] for t in getattr(self, name)])
        return view

    def snapshot(self) -> list:
        """Clones of every persistent tensor (tests: rejected branches must not change them)."""
        out = [self.lengths.clone()]
        for name in ("k", "v", "state", "conv"):
            out += [t.clone() for t in getattr(self, name) if t is not None]
        return out


@dataclass
class Pending:
    """What one verify produced that commit needs (per layer), plus the tree metadata."""

    layers: list
    meta: dict
