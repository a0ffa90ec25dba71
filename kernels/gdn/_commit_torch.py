"""The GDN accepted-path commit in torch (the CPU's backend, and the GPU's reference) and the
check of the accepted nodes, shared by the standalone and the deferred commit's launches."""
from __future__ import annotations

import torch

from simtree.errors import SimtreeError

from .cache import GDNTreeCache
from .reference import _l2norm


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
