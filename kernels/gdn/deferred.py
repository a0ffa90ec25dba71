"""The commit deferred into the next round's verify: one state read and one state write per round
(docs/math/gdn_tree_solve.md, "The commit deferred").

    pend = new_pending(B, H, HV, K, V, rows, device)
    out, cache = gdn_tree_verify(q, k, v, g, beta, state, parents, cu, pending=pend)  # folds first
    gdn_defer_commit(state, pend, k, cache, parents, cu, accepted)   # token rows only
    ...                                                              # next round's verify folds
    gdn_fold_pending(state, pend)          # standalone: before a sequence leaves, the last round

Every verify of a state with waiting paths must be given its ``pending`` (it folds them and
clears their ``on`` flags in the same kernel); an aborted round (a verify whose round is not
committed) leaves the state committed up to the round before and nothing waiting.  A path
longer than ``pending.rows`` is committed into the state at once by the deferred commit.
The backend goes by the device (Triton on CUDA, the torch form elsewhere).
"""
from __future__ import annotations

import torch

from simtree.errors import SimtreeError

from . import _launch as rule
from .cache import GDNTreeCache
from .pending import GDNPendingPath, new_pending
from .reference import _l2norm, gdn_fold_pending_ref

__all__ = ["GDNPendingPath", "new_pending", "gdn_defer_commit", "gdn_fold_pending",
           "FOLD_BLOCK_K", "FOLD_BLOCK_P"]

# the fold's products: K rows of the state tile and path rows per step (docs/math)
FOLD_BLOCK_K, FOLD_BLOCK_P = 32, 16


def fold_dot16(pending: GDNPendingPath) -> bool:
    """bf16 fold products where the pending u is bf16 (as the standalone commit's
    ``commit_dot16``); never through the interpreter."""
    return pending.u.dtype == torch.bfloat16 and not rule.INTERPRET


def fold_args(pending: GDNPendingPath) -> tuple:
    """The pending buffers as the kernels take them (``_fold_state``'s pointers and P)."""
    return (pending.k, pending.w, pending.u, pending.decay, pending.on, pending.length,
            pending.rows)


def gdn_fold_pending(state: torch.Tensor, pending: GDNPendingPath,
                     sequences: torch.Tensor | None = None, *, backend: str = "auto") -> None:
    """The standalone commit of the waiting paths, in place: state[b] <- d S + sum w k u^T
    where sequence b's path waits (and ``sequences`` [B] bool selects it, None: all); their
    ``on`` flags cleared.  A no-op where nothing waits."""
    pending.check_state(state)
    B, HV, K, V = state.shape
    if rule.pick_backend(backend, state.device) == "torch":
        on = pending.on.bool()
        if sequences is not None:
            on &= sequences.to(on.device).bool()[:, None, None]
        if bool(on.any()):
            state.copy_(torch.where(on[:, :, None, :], gdn_fold_pending_ref(state, pending).float(),
                                    state))
            pending.on.masked_fill_(on, 0)
        return
    from ._deferred_kernels import _fold_pending_kernel
    BV = min(V, 64)
    sel = pending.length if sequences is None else sequences.to(state.device, torch.int8)
    _fold_pending_kernel[(V // BV, B * HV)](
        state, *fold_args(pending)[:6], sel, pending.rows, H=pending.k.shape[2], HV=HV, K=K,
        V=V, BV=BV, BK=K, BP=FOLD_BLOCK_P, DOT16=fold_dot16(pending),
        SELECT=sequences is not None, num_warps=4)


def gdn_defer_commit(state: torch.Tensor, pending: GDNPendingPath, k: torch.Tensor,
                     cache: GDNTreeCache, parents, cu_nodes, accepted: torch.Tensor, *,
                     check: bool = True, backend: str = "auto") -> None:
    """The commit stage deferred: each tree's root path to ``accepted`` (LOCAL index, int64 [B])
    kept in ``pending`` for the next verify to fold (k normalised, w = e^{G_a - G_m}, the
    verify's u, d = e^{G_a}); a path of more than ``pending.rows`` nodes is committed into
    ``state`` now (the standalone commit's path walk).  ``state`` must hold nothing waiting
    (the verify of ``cache`` folded it).  Args as ``gdn_tree_commit``; ``check``: accepted
    nodes inside their trees (a host sync)."""
    from ._launched import _check_accepted, _commit_torch
    pending.check_state(state)
    _check_accepted(accepted, cu_nodes, check)
    B, HV, K, V = state.shape
    H = k.shape[1]
    if pending.u.dtype != cache.u.dtype and pending.u.dtype != torch.float32:
        raise SimtreeError(f"pending u is {pending.u.dtype}, the verify's u {cache.u.dtype}")
    if rule.pick_backend(backend, state.device) == "torch":
        _defer_torch(state, pending, k, cache, cu_nodes, accepted, _commit_torch)
        return
    from ._deferred_kernels import _defer_commit_kernel
    dot = rule.commit_dot16(cache)
    BV = min(V, 64)
    _defer_commit_kernel[(V // BV, B * HV)](
        state, k.contiguous().float() if k.dtype == torch.float64 else k.contiguous(), cache.u,
        cache.G, cache.meta.bits, cu_nodes.to(state.device, torch.int64),
        accepted.to(state.device, torch.int64), pending.k, pending.w, pending.u, pending.decay,
        pending.on, pending.length, pending.rows, H=H, HV=HV, K=K, V=V, W=cache.meta.words,
        BT=16, BV=BV, L2NORM=cache.qk_l2norm, PREC="ieee", DOT16=dot, num_warps=4)


def _defer_torch(state, pending: GDNPendingPath, k, cache: GDNTreeCache, cu_nodes, accepted,
                 commit_now) -> None:
    """``gdn_defer_commit`` in torch, sequence by sequence (host indexing: the CPU backend)."""
    meta = cache.meta
    dev = state.device
    cu = cu_nodes.to(dev, torch.int64)
    last = cu[:-1] + accepted.to(dev, torch.int64)
    plen = meta.depth.to(dev)[last] + 1
    long = plen > pending.rows
    if bool(long.any()):
        now = state.clone()
        commit_now(now, k, cache, cu_nodes, accepted)
        state.copy_(torch.where(long[:, None, None, None], now, state))
    G = cache.G.double()
    for b in range(state.shape[0]):
        if bool(long[b]):
            pending.on[b] = 0
            continue
        a = int(last[b])
        local = torch.arange(int(cu[b + 1] - cu[b]), device=dev)
        on_path = ((meta.bits[a, local // 64] >> (local % 64)) & 1).bool()
        rows = cu[b] + torch.nonzero(on_path).squeeze(1)          # root first (topological)
        n = rows.numel()
        pending.k[b, :n] = _l2norm(k[rows].double(), cache.qk_l2norm).float()
        pending.w[b, :n] = torch.exp(G[a] - G[rows]).float()
        pending.u[b, :n] = cache.u[rows].to(pending.u.dtype)
        pending.decay[b] = torch.exp(G[a]).float()
        pending.length[b] = n
        pending.on[b] = 1
