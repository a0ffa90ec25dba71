"""The buffers one round shape's stages read (:class:`RoundLayout`): an engine holds one per shape
it may run and switches between them per round (``FullEngine.use``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .allocation import DeviceAllocation
from .drafting import RoundShape, TreeBuffers, own_row_bits

__all__ = ["RoundLayout"]


@dataclass
class RoundLayout:
    """``tree`` [B, nodes] buffers; ``own_bits`` the draft steps' scratch-row bits; ``path_cols``
    and ``chain`` the accepted path's rows and their causal bits; ``alloc`` the device rule of
    cost_aware / batch_alloc (None: a fixed budget)."""

    rs: RoundShape
    tree: TreeBuffers
    own_bits: list
    path_cols: torch.Tensor
    chain: torch.Tensor
    alloc: DeviceAllocation | None

    @classmethod
    def of(cls, rs: RoundShape, batch_size: int, device, chain: torch.Tensor, costs=None,
           max_len: int = 0) -> "RoundLayout":
        """``chain``: the causal bits of the accepted path's rows, as wide as the engine's scratch;
        ``costs`` and ``max_len``: what cost_aware's and batch_alloc's rule decides with."""
        alloc = None if rs.alloc == "fixed" else DeviceAllocation(costs, rs, batch_size, max_len, device)
        return cls(rs, TreeBuffers.empty(batch_size, rs.nodes, device),
                   own_row_bits(rs, device) if rs.num_steps > 1 else [], torch.arange(rs.path_rows, device=device),
                   chain, alloc)
