"""The accepted-path commit: the state of each tree's accepted node folded in once, from what
the verify cached (no rollback, no per-node states).

    S* = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T     (m over a's root path)
"""
from __future__ import annotations

import torch

from simtree.errors import SimtreeError

from . import launch as rule
from .cache import GDNTreeCache
from .launch import CommitLaunch
from .reference import _l2norm

__all__ = ["gdn_tree_commit"]


def _check_accepted(accepted, cu_nodes, check):
    B = cu_nodes.numel() - 1
    if accepted.numel() != B:
        raise SimtreeError(f"accepted must have one node per tree ({B}), got {accepted.numel()}")
    if check:
        counts = (cu_nodes[1:] - cu_nodes[:-1]).to(accepted.device)
        bad = (accepted < 0) | (accepted >= counts)
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0])
            raise SimtreeError(f"accepted node {int(accepted[b])} of tree {b} is outside [0, {int(counts[b]) - 1}]")


def gdn_tree_commit(state, k, cache: GDNTreeCache, parents, cu_nodes, accepted, *,
                    check: bool = True, launch: CommitLaunch | None = None) -> None:
    """In place: state[b] <- S* = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T.

    Args: state [B, HV, K, V] contiguous fp32 (the verify's S0, rewritten); k [N, H, K] the
    verify's keys; ``cache`` its ``GDNTreeCache``; accepted int64 [B]: LOCAL index of each
    tree's last accepted node (0 = only the root, which is still folded in: every node, the
    root included, is a real token).  ``check``: accepted nodes inside their trees (a host
    sync).  ``launch``: a ``CommitLaunch`` (None: the backend by device, the rest by
    ``commit_launch_config``).
    """
    if launch is not None and not isinstance(launch, CommitLaunch):
        raise SimtreeError(f"launch must be a CommitLaunch, got {type(launch).__name__}")
    ask = launch or CommitLaunch()
    _check_accepted(accepted, cu_nodes, check)
    B, HV, K, V = state.shape
    H = k.shape[1]
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise SimtreeError("state must be a contiguous fp32 tensor (it is updated in place)")
    if rule.pick_backend(ask.backend, state.device) == "torch":
        _commit_torch(state, k, cache, cu_nodes, accepted)
        return
    from .tree_verify import _tree_commit_kernel
    dot = rule.commit_dot16(cache, ask.dot16)
    cfg = rule.commit_launch_config(B, HV, V, cache.meta.max_nodes, dot)
    BV = min(V, ask.block_v or cfg.block_v)
    if BV < 16 or BV & (BV - 1):
        raise SimtreeError(f"commit block_v must be a power of two >= 16, got {BV}")
    _tree_commit_kernel[(V // BV, B * HV)](
        state, k.contiguous().float() if k.dtype == torch.float64 else k.contiguous(),
        cache.u, cache.G, cache.meta.bits, cu_nodes.to(state.device, torch.int64),
        accepted.to(state.device, torch.int64),
        H=H, HV=HV, K=K, V=V, W=cache.meta.words, BT=ask.block_t or cfg.block_t, BV=BV,
        L2NORM=cache.qk_l2norm, PREC="ieee", PATH=bool(cfg.path if ask.path is None else ask.path),
        DOT16=dot,
        num_warps=ask.num_warps or cfg.num_warps)


def _commit_torch(state, k, cache: GDNTreeCache, cu_nodes, accepted) -> None:
    """The commit in torch: only the accepted root paths fold in; their rows are gathered, tree
    by tree (root first), into [B, L, ...] (L the longest path) and folded with one batched
    product, in fp64."""
    B, HV, K, V = state.shape
    H = k.shape[1]
    dev = state.device
    cu = cu_nodes.to(dev, torch.int64)
    meta = cache.meta
    seq = meta.seq_ids.to(dev, torch.int64)
    local = torch.arange(seq.numel(), device=dev) - cu[seq]
    last = cu[:-1] + accepted.to(dev, torch.int64)                       # accepted row [B]
    on_path = ((meta.bits[last[seq], local // 64] >> (local % 64)) & 1).bool()  # [N]
    idx = torch.nonzero(on_path).squeeze(1)                             # path rows [P]
    ps = seq[idx]
    plen = meta.depth.to(dev, torch.int64)[last] + 1                    # path lengths [B]
    pos = torch.arange(idx.numel(), device=dev) - (torch.cumsum(plen, 0) - plen)[ps]
    L = int(plen.max())
    G = cache.G.double()
    w = torch.exp(G[last[ps]] - G[idx])                                 # e^{G_a - G_m} <= 1
    kn = _l2norm(k[idx].double(), cache.qk_l2norm).repeat_interleave(HV // H, dim=1)
    kw = torch.zeros((B, L, HV, K), dtype=torch.float64, device=dev)
    kw[ps, pos] = kn * w[..., None]
    up = torch.zeros((B, L, HV, V), dtype=torch.float64, device=dev)
    up[ps, pos] = cache.u[idx].double()
    fold = kw.permute(0, 2, 3, 1) @ up.transpose(1, 2)                  # [B, HV, K, V]
    decay = torch.exp(G[last])                                          # [B, HV]
    state.copy_((decay[:, :, None, None] * state.double() + fold).float())
