"""The deferred commit's launches (``deferred.py`` holds the entries and the math): what the
entries call with the device's backend, and what tests and benchmarks call with a
``FoldLaunch`` of their own (``_launch.py``).

    launched_fold_pending   the standalone fold of a ``GDNPendingPath`` (``_fold_pending_kernel``
                            or torch)
    launched_defer_commit   the accepted path kept (Triton ``_defer_commit_kernel`` or torch)
    launched_fold_round     the standalone fold of a ``GDNPendingRound`` (``_round_fold_kernel``
                            or torch)
    round_fold_args         a ``GDNPendingRound`` as the verify walks take it (FOLD 3 / 4)
    fold_mode / fold_args / fold_dot16   how a verify walk folds (``_launched.py`` passes them)
"""
from __future__ import annotations

import torch

from simtree.errors import SimtreeError

from . import _launch as rule
from ._launch import FoldLaunch, LaunchNotApplicable
from ._commit_torch import _check_accepted, _commit_torch
from .cache import GDNTreeCache
from .pending import GDNPendingPath, GDNPendingRound
from .reference import _l2norm, gdn_fold_pending_ref

__all__ = ["launched_fold_pending", "launched_defer_commit", "launched_fold_round",
           "check_pending", "fold_mode",
           "fold_args", "round_fold_args", "round_dot16", "fold_dot16", "FOLD_BLOCK_K",
           "FOLD_BLOCK_P", "FOLD_REGISTERS"]

# the fold's products: K rows of the state tile (in memory) and path rows per step (docs/math)
FOLD_BLOCK_K, FOLD_BLOCK_P = 32, 16
# fp32 registers per thread the walk may spend on the whole folded tile: below it the tile is
# folded in registers and is the walk's S0; above it (BV = 128 at two warps: 256) the fold goes
# through memory in FOLD_BLOCK_K-row pieces and the walk reads the tile back from L2
FOLD_REGISTERS = 64


def fold_mode(K: int, block_v: int, num_warps: int) -> int:
    """The walk's FOLD switch: 2 (in registers) where the [K, block_v] fp32 tile takes at most
    FOLD_REGISTERS registers per thread, else 1 (in memory)."""
    return 2 if K * block_v <= FOLD_REGISTERS * 32 * num_warps else 1


def fold_dot16(pending: GDNPendingPath) -> bool:
    """bf16 fold products where the pending u is bf16 (as the standalone commit's
    ``commit_dot16``); never through the interpreter."""
    return pending.u.dtype == torch.bfloat16 and not rule.INTERPRET


def fold_args(pending: GDNPendingPath) -> tuple:
    """The pending buffers as the kernels take them (``_fold_state``'s pointers and P)."""
    return (pending.k, pending.w, pending.u, pending.decay, pending.on, pending.length,
            pending.rows)


def _fold_ask(launch: FoldLaunch | None) -> FoldLaunch:
    if launch is not None and not isinstance(launch, FoldLaunch):
        raise SimtreeError(f"launch must be a FoldLaunch, got {type(launch).__name__}")
    return launch or FoldLaunch()


ENTRIES = {GDNPendingPath: "gdn_tree_verify_folding, gdn_defer_commit, gdn_fold_pending",
           GDNPendingRound: "gdn_tree_verify_folding_round, GDNPendingRound.arm, gdn_fold_round"}


def check_pending(pending, form: type) -> None:
    """One-line error where ``pending`` is not of ``form`` (``GDNPendingPath`` or
    ``GDNPendingRound``: each form has entries of its own)."""
    if not isinstance(pending, form):
        other = type(pending)
        raise SimtreeError(f"pending must be a {form.__name__} here, got a {other.__name__}"
                           + (f" (its entries: {ENTRIES[other]})" if other in ENTRIES else ""))


def launched_fold_pending(state: torch.Tensor, pending: GDNPendingPath,
                          sequences: torch.Tensor | None = None, *,
                          launch: FoldLaunch | None = None) -> None:
    """``gdn_fold_pending`` as ``launch`` asks (None: the backend by device, Triton on CUDA
    and torch elsewhere; block_v 64, block_k K, 4 warps)."""
    ask = _fold_ask(launch)
    check_pending(pending, GDNPendingPath)
    pending.check_state(state)
    B, HV, K, V = state.shape
    if rule.pick_backend(ask.backend, state.device) == "torch":
        _fold_torch(state, pending, sequences, lambda: gdn_fold_pending_ref(state, pending).float())
        return
    from ._deferred_kernels import _fold_pending_kernel
    BV = min(V, ask.block_v or 64)
    sel = pending.length if sequences is None else sequences.to(state.device, torch.int8)
    _fold_pending_kernel[(V // BV, B * HV)](
        state, *fold_args(pending)[:6], sel, pending.rows, H=pending.k.shape[2], HV=HV, K=K,
        V=V, BV=BV, BK=min(K, ask.block_k or K), BP=FOLD_BLOCK_P, DOT16=fold_dot16(pending),
        SELECT=sequences is not None, num_warps=ask.num_warps or 4)


def _fold_torch(state, pending, sequences, folded) -> None:
    """The torch backend's standalone fold: ``folded()`` (the whole state with every waiting
    path folded) taken where the ``on`` flags (and ``sequences``) say, those flags cleared."""
    on = pending.on.bool()
    if sequences is not None:
        on &= sequences.to(on.device).bool()[:, None, None]
    if bool(on.any()):
        state.copy_(torch.where(on[:, :, None, :], folded(), state))
        pending.on.masked_fill_(on, 0)


def round_fold_args(pending: GDNPendingRound) -> dict:
    """A ``GDNPendingRound`` as the verify walks and ``_round_fold_kernel`` take it."""
    c = pending.cache
    B, HV, V = pending.on.shape
    path = rule.commit_launch_config(B, HV, V, c.meta.max_nodes, round_dot16(pending)).path
    return dict(rk_ptr=pending.k, ru_ptr=c.u, rG_ptr=c.G, rbits_ptr=c.meta.bits,
                rcu_ptr=pending.cu_nodes, racc_ptr=pending.accepted, pon_ptr=pending.on,
                RW=pending.words, RL2NORM=c.qk_l2norm, RPATH=bool(path))


def round_dot16(pending: GDNPendingRound) -> bool:
    """bf16 fold products where the round's u is bf16 (as the commit's ``commit_dot16``)."""
    return pending.cache.u.dtype == torch.bfloat16 and not rule.INTERPRET


def launched_fold_round(state: torch.Tensor, pending: GDNPendingRound,
                        sequences: torch.Tensor | None = None, *,
                        launch: FoldLaunch | None = None) -> None:
    """``gdn_fold_round`` as ``launch`` asks (None: the backend by device; block_v 64,
    block_k 32, i.e. [32, BV] fp32 pieces, 4 warps)."""
    ask = _fold_ask(launch)
    check_pending(pending, GDNPendingRound)
    pending.check_state(state)
    if not pending.armed:
        return
    B, HV, K, V = state.shape
    if rule.pick_backend(ask.backend, state.device) == "torch":
        def committed():
            now = state.clone()
            _commit_torch(now, pending.k, pending.cache, pending.cu_nodes, pending.accepted)
            return now
        _fold_torch(state, pending, sequences, committed)
        return
    from ._deferred_kernels import _round_fold_kernel
    BV = min(V, ask.block_v or 64)
    args = round_fold_args(pending)
    sel = pending.accepted if sequences is None else sequences.to(state.device, torch.int8)
    _round_fold_kernel[(V // BV, B * HV)](
        state, *(args[n] for n in ("rk_ptr", "ru_ptr", "rG_ptr", "rbits_ptr", "rcu_ptr",
                                   "racc_ptr", "pon_ptr")), sel,
        H=pending.k.shape[1], HV=HV, K=K, V=V, W=args["RW"], BV=BV,
        BK=min(K, ask.block_k or FOLD_BLOCK_K), BT=FOLD_BLOCK_P, L2NORM=args["RL2NORM"],
        DOT16=round_dot16(pending), SELECT=sequences is not None, PATH=args["RPATH"],
        num_warps=ask.num_warps or 4)


def launched_defer_commit(state: torch.Tensor, pending: GDNPendingPath, k: torch.Tensor,
                          cache: GDNTreeCache, parents, cu_nodes, accepted: torch.Tensor, *,
                          check: bool = True, launch: FoldLaunch | None = None) -> None:
    """``gdn_defer_commit`` as ``launch`` asks (None: the backend by device; block_v 64,
    4 warps; a block_k raises ``LaunchNotApplicable``)."""
    ask = _fold_ask(launch)
    if ask.block_k is not None:
        raise LaunchNotApplicable("block_k is the standalone folds' (state rows per piece): the "
                                  "deferred commit reads no state in pieces")
    check_pending(pending, GDNPendingPath)
    pending.check_state(state)
    _check_accepted(accepted, cu_nodes, check)
    B, HV, K, V = state.shape
    H = k.shape[1]
    if pending.u.dtype != cache.u.dtype and pending.u.dtype != torch.float32:
        raise SimtreeError(f"pending u is {pending.u.dtype}, the verify's u {cache.u.dtype}")
    if rule.pick_backend(ask.backend, state.device) == "torch":
        _defer_torch(state, pending, k, cache, cu_nodes, accepted, _commit_torch)
        return
    from ._deferred_kernels import _defer_commit_kernel
    dot = rule.commit_dot16(cache)
    BV = min(V, ask.block_v or 64)
    _defer_commit_kernel[(V // BV, B * HV)](
        state, k.contiguous().float() if k.dtype == torch.float64 else k.contiguous(), cache.u,
        cache.G, cache.meta.bits, cu_nodes.to(state.device, torch.int64),
        accepted.to(state.device, torch.int64), pending.k, pending.w, pending.u, pending.decay,
        pending.on, pending.length, pending.rows, H=H, HV=HV, K=K, V=V, W=cache.meta.words,
        BT=16, BV=BV, L2NORM=cache.qk_l2norm, PREC="ieee", DOT16=dot,
        num_warps=ask.num_warps or 4)


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
