"""The commit deferred into the next round's verify: one state read and one state write per round
(docs/math/gdn_tree_solve.md, "The commit deferred").

    pend = new_pending(B, H, HV, K, V, rows, device)
    out, cache = gdn_tree_verify_folding(q, k, v, g, beta, state, pend, parents, cu)  # folds first
    gdn_defer_commit(state, pend, k, cache, parents, cu, accepted)   # token rows only
    ...                                                              # next round's verify folds
    gdn_fold_pending(state, pend)          # standalone: before a sequence leaves, the last round

Every verify of a state with waiting paths must be given its ``pending`` (it folds them and
clears their ``on`` flags in the same kernel); an aborted round (a verify whose round is not
committed) leaves the state committed up to the round before and nothing waiting.  A path
longer than ``pending.rows`` is committed into the state at once by the deferred commit.
The backend goes by the device (Triton on CUDA, the torch form elsewhere).

The launch-free form keeps the round before by reference instead of copying its path rows
(entries of its own; no runtime uses it, the floor benchmark times it):

    pr = new_pending_round(B, HV, V, device)
    out, cache = gdn_tree_verify_folding_round(q, k, v, g, beta, state, pr, parents, cu)
    pr.arm(k, cache, cu, accepted)      # the commit stage: references and a memset of the flags
    ...                                 # next verify folds from these buffers (keep them alive)
    gdn_fold_round(state, pr)           # standalone, as above
"""
from __future__ import annotations

import torch

from ._launched_deferred import launched_defer_commit, launched_fold_pending, launched_fold_round
from .cache import GDNTreeCache
from .pending import GDNPendingPath, GDNPendingRound, new_pending, new_pending_round

__all__ = ["GDNPendingPath", "new_pending", "GDNPendingRound", "new_pending_round",
           "gdn_defer_commit", "gdn_fold_pending", "gdn_fold_round"]


def gdn_fold_pending(state: torch.Tensor, pending: GDNPendingPath,
                     sequences: torch.Tensor | None = None) -> None:
    """The standalone commit of the waiting paths, in place: state[b] <- d S + sum w k u^T
    where sequence b's path waits (and ``sequences`` [B] bool selects it, None: all); their
    ``on`` flags cleared.  A no-op where nothing waits.  state [B, HV, K, V] contiguous fp32."""
    launched_fold_pending(state, pending, sequences)


def gdn_fold_round(state: torch.Tensor, pending: GDNPendingRound,
                   sequences: torch.Tensor | None = None) -> None:
    """``gdn_fold_pending`` for the launch-free form: the round ``pending`` holds committed
    into ``state`` where its ``on`` flags (and ``sequences``) say so, those flags cleared."""
    launched_fold_round(state, pending, sequences)


def gdn_defer_commit(state: torch.Tensor, pending: GDNPendingPath, k: torch.Tensor,
                     cache: GDNTreeCache, parents, cu_nodes, accepted: torch.Tensor, *,
                     check: bool = True) -> None:
    """The commit stage deferred: each tree's root path to ``accepted`` (LOCAL index, int64 [B])
    kept in ``pending`` for the next verify to fold (k normalised, w = e^{G_a - G_m}, the
    verify's u, d = e^{G_a}); a path of more than ``pending.rows`` nodes is committed into
    ``state`` now (the standalone commit's path walk).  ``state`` must hold nothing waiting
    (the verify of ``cache`` folded it).  Args as ``gdn_tree_commit``; ``check``: accepted
    nodes inside their trees (a host sync)."""
    launched_defer_commit(state, pending, k, cache, parents, cu_nodes, accepted, check=check)
