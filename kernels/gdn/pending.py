"""What a deferred commit keeps for the next verify: each sequence's accepted path of the round
before, as the fold needs it (docs/math/gdn_tree_solve.md, "The commit deferred").

    S* = d S0 + sum_{p < len} w_p k_p u_p^T,   d = e^{G_a},  w_p = e^{G_a - G_m(p)}

over the path rows p (root first) of the accepted node a.  Layouts (P path rows per sequence):

    k       [B, P, H, K]  fp32   the path's keys, L2-normalised (as the verify used them)
    w       [B, P, HV]    fp32   e^{G_a - G_m}
    u       [B, P, HV, V]        the verify's solved u rows (fp32, or bf16 as the verify stored u)
    decay   [B, HV]       fp32   e^{G_a}
    length  [B]           int32  path rows held (<= P)
    on      [B, HV, V]    int8   1 where the path is not folded yet: the program that folds
                                 a state tile clears its own columns in the same kernel, so
                                 no sequence of calls folds a path twice
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from simtree.errors import SimtreeError

__all__ = ["GDNPendingPath", "new_pending", "GDNPendingRound", "new_pending_round"]


@dataclass
class GDNPendingPath:
    k: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    decay: torch.Tensor
    length: torch.Tensor
    on: torch.Tensor

    @property
    def rows(self) -> int:
        """P: the longest accepted path it holds; a longer one is committed at once instead."""
        return int(self.k.shape[1])

    def clear(self, sequences: torch.Tensor | None = None) -> None:
        """Drop the waiting paths (of ``sequences``, bool [B], or all): a slot given to a new
        sequence must not fold its predecessor's path."""
        if sequences is None:
            self.on.zero_()
        else:
            self.on.masked_fill_(sequences.to(self.on.device)[:, None, None], 0)

    def check_state(self, state: torch.Tensor) -> None:
        B, HV, K, V = state.shape
        if tuple(self.on.shape) != (B, HV, V) or self.k.shape[3] != K or self.u.shape[3] != V:
            raise SimtreeError(f"pending path of {tuple(self.on.shape)} [B, HV, V] and K "
                               f"{self.k.shape[3]} does not fit the state {tuple(state.shape)}")
        if state.dtype != torch.float32 or not state.is_contiguous():
            raise SimtreeError("a deferred commit needs a contiguous fp32 state (it is "
                               "rewritten in place)")


def new_pending(batch: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                rows: int, device, u_dtype=torch.float32) -> GDNPendingPath:
    """An empty pending path (nothing to fold) for ``rows`` path rows per sequence."""
    if rows < 1:
        raise SimtreeError(f"a pending path holds at least one row, got {rows}")
    z = dict(device=device, dtype=torch.float32)
    return GDNPendingPath(
        k=torch.zeros(batch, rows, key_heads, key_dim, **z),
        w=torch.zeros(batch, rows, value_heads, **z),
        u=torch.zeros(batch, rows, value_heads, value_dim, device=device, dtype=u_dtype),
        decay=torch.ones(batch, value_heads, **z),
        length=torch.zeros(batch, dtype=torch.int32, device=device),
        on=torch.zeros(batch, value_heads, value_dim, dtype=torch.int8, device=device))


@dataclass
class GDNPendingRound:
    """The round before kept by reference, for the fold with no deferred-commit launch
    (``_round_fold.py``): that round's keys k [N, H, K] (as its verify took them), its
    ``GDNTreeCache`` (u, G, the ancestor bits of its ``TreeMeta``), cu_nodes [B+1] and the
    accepted LOCAL nodes [B] (int64), and ``on`` [B, HV, V] int8 as ``GDNPendingPath``'s.
    Those buffers must stay as they are until the next verify (or the standalone fold) has
    folded them: the caller keeps two rounds' buffers (double-buffered).  ``arm`` after
    acceptance is the whole commit stage: the references and a memset of ``on``."""
    on: torch.Tensor
    k: torch.Tensor | None = None
    cache: object = None
    cu_nodes: torch.Tensor | None = None
    accepted: torch.Tensor | None = None

    @property
    def armed(self) -> bool:
        """Whether a round was ever armed (else nothing can wait)."""
        return self.cache is not None

    @property
    def words(self) -> int:
        """Ancestor-bit words per node of the round before."""
        return int(self.cache.meta.bits.shape[1])

    def arm(self, k: torch.Tensor, cache, cu_nodes: torch.Tensor, accepted: torch.Tensor,
            sequences: torch.Tensor | None = None, *, check: bool = True) -> None:
        """The round just verified (its keys, ``GDNTreeCache`` and accepted nodes) waits for
        the next verify (for ``sequences``, bool [B], or all).  Every other sequence must have
        nothing waiting (the verify of this round folded it): the references are the whole
        batch's, so a round still waiting there would be folded from this round's buffers.
        ``check`` (with ``sequences``; a host sync): refuse, changing nothing, where one does."""
        dev = self.on.device
        if sequences is not None and check:
            waiting = self.on.bool().any(dim=(1, 2)) & ~sequences.to(dev, torch.bool)
            if bool(waiting.any()):
                raise SimtreeError(
                    f"cannot arm a round for some sequences while sequences "
                    f"{torch.nonzero(waiting).flatten().tolist()} still wait on the round before "
                    f"(fold them first: gdn_fold_round, or a verify folding the round)")
        self.k = k.float() if k.dtype == torch.float64 else k
        self.cache = cache
        self.cu_nodes = cu_nodes.to(dev, torch.int64)
        self.accepted = accepted.to(dev, torch.int64)
        if sequences is None:
            self.on.fill_(1)
        else:
            self.on.masked_fill_(sequences.to(dev)[:, None, None], 1)

    def clear(self, sequences: torch.Tensor | None = None) -> None:
        """Drop the waiting round (of ``sequences``, bool [B], or all)."""
        GDNPendingPath.clear(self, sequences)

    def check_state(self, state: torch.Tensor) -> None:
        B, HV, K, V = state.shape
        if tuple(self.on.shape) != (B, HV, V) or (self.armed and (
                tuple(self.cache.u.shape[1:]) != (HV, V) or self.k.shape[2] != K)):
            raise SimtreeError(f"pending round of {tuple(self.on.shape)} [B, HV, V] does not "
                               f"fit the state {tuple(state.shape)}")
        if state.dtype != torch.float32 or not state.is_contiguous():
            raise SimtreeError("a deferred commit needs a contiguous fp32 state (it is "
                               "rewritten in place)")


def new_pending_round(batch: int, value_heads: int, value_dim: int, device) -> GDNPendingRound:
    """An empty pending round (nothing to fold)."""
    return GDNPendingRound(on=torch.zeros(batch, value_heads, value_dim, dtype=torch.int8,
                                          device=device))
