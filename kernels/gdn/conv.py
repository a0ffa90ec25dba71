"""Short causal conv over tree ancestors (Qwen's kernel-4 conv in front of the delta rule).

Node j's window is (its W-1 nearest ancestors, reaching into the committed conv state when
j is shallower than W-1, then j) -- never the flattened order.  Vectorised torch gathers:
a few small ops that run as they are on CPU and GPU.
"""
from __future__ import annotations

import torch

from simtree.errors import SimtreeError

from .meta import TreeMeta, tree_meta


def _tap_inputs(x, conv_state, meta: TreeMeta, nodes: torch.Tensor, W: int) -> list[torch.Tensor]:
    """Inputs at distance t = 0..W-1 behind each node in ``nodes`` [M] -> list of [M, D]."""
    depth = meta.depth[nodes]
    seq = meta.seq_ids[nodes]
    taps = [x[nodes]]
    for t in range(1, W):
        anc = meta.anc[nodes, t - 1]                           # W <= 4: 3 stored ancestors
        from_x = x[anc.clamp_min(0)]
        slot = (W - 1 - (t - depth)).clamp(0, W - 2)          # conv_state is oldest first
        from_state = conv_state[seq, :, slot]
        taps.append(torch.where((t <= depth)[:, None], from_x, from_state.to(x.dtype)))
    return taps


def _check(x, conv_state, weight, parents, cu_nodes):
    if x.dim() != 2 or weight.dim() != 2 or conv_state.dim() != 3:
        raise SimtreeError(f"conv shapes: x must be [N, D], conv_state [B, D, W-1], weight [D, W]; "
                           f"got {tuple(x.shape)}, {tuple(conv_state.shape)}, {tuple(weight.shape)}")
    N, D = x.shape
    B = cu_nodes.numel() - 1
    W = weight.shape[1]
    if weight.shape[0] != D or tuple(conv_state.shape) != (B, D, W - 1) or parents.numel() != N:
        raise SimtreeError(f"conv shape mismatch: x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}, "
                           f"weight {tuple(weight.shape)}, {parents.numel()} parents, {B} trees")
    if W < 2 or W > 4:
        raise SimtreeError(f"conv kernel width must be 2..4, got {W}")


def tree_causal_conv(x, conv_state, weight, parents, cu_nodes, bias=None, activation="silu",
                     meta: TreeMeta | None = None):
    """x [N, D], conv_state [B, D, W-1] (oldest first), weight [D, W] -> [N, D] (x's dtype)."""
    _check(x, conv_state, weight, parents, cu_nodes)
    if activation not in ("silu", None, "none"):
        raise SimtreeError(f"unknown conv activation {activation!r}: use 'silu' or None")
    meta = meta or tree_meta(parents.to(x.device), cu_nodes.to(x.device))
    W = weight.shape[1]
    nodes = torch.arange(x.shape[0], device=x.device)
    taps = _tap_inputs(x, conv_state, meta, nodes, W)
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    wf = weight.to(dt)
    y = sum(taps[t].to(dt) * wf[:, W - 1 - t] for t in range(W))
    if bias is not None:
        y = y + bias.to(dt)
    if activation == "silu":
        y = torch.nn.functional.silu(y)
    return y.to(x.dtype)


def conv_state_commit(conv_state, x, parents, cu_nodes, accepted, meta: TreeMeta | None = None):
    """In place: conv_state[b] <- the last W-1 inputs along tree b's accepted root path."""
    B, D, Wm1 = conv_state.shape
    if x.dim() != 2 or x.shape[1] != D or accepted.numel() != B or cu_nodes.numel() != B + 1:
        raise SimtreeError(f"conv commit shape mismatch: conv_state {tuple(conv_state.shape)}, "
                           f"x {tuple(x.shape)}, accepted {tuple(accepted.shape)}")
    meta = meta or tree_meta(parents.to(x.device), cu_nodes.to(x.device))
    rows = cu_nodes[:-1].to(x.device) + accepted.to(device=x.device, dtype=torch.int64)
    taps = _tap_inputs(x, conv_state, meta, rows, Wm1 + 1)   # taps[t]: distance t behind a
    new = torch.stack([taps[Wm1 - 1 - i] for i in range(Wm1)], dim=2)   # oldest first
    conv_state.copy_(new.to(conv_state.dtype))
