"""Tree attention over a KV cache plus each query's tree ancestors (GQA or one latent head).

    out = tree_attention(q, k_cache, v_cache, cache_lens, q_pos, k_tree, v_tree, tree_bits,
                         window=0, sink=None)

Shapes (Q queries per sequence, S cache rows, T tree rows, W = ceil(T / 64)):

    q           [B, Q, Hq, D]
    k_cache     [B, S, Hkv, D]   rows < cache_lens[b] are sequence b's committed tokens
    v_cache     [B, S, Hkv, D]   (may be k_cache itself: one latent, K == V)
    cache_lens  int64 [B]
    q_pos       int64 [B, Q]     the query's position (only ``window`` reads it)
    k_tree      [B, T, Hkv, D]   this round's rows (tree nodes, or draft scratch rows)
    v_tree      [B, T, Hkv, D]
    tree_bits   int64 [B, Q, W]  bit m % 64 of word m // 64 set: tree row m is visible to the
                                 query (its ancestors-or-self; ``simtree.kernels.gdn``'s TreeMeta
                                 ``bits`` layout)
    -> out      [B, Q, Hq, D]    in q's dtype

Scores are scaled by D^-1/2 (both models' attention; the reference and the kernel take any
``scale``).  Query head h reads KV head h // (Hq / Hkv).  ``window`` > 0 keeps only cache rows at positions
> q_pos - window (sliding-window attention; tree rows are assumed inside the window).  ``sink``
[Hq] adds a per-head logit that takes softmax mass and contributes no value.

Every query sees at least one row (its own tree row), so no softmax is empty.  The Triton
kernel reads the lengths and bits from device memory (no host sync, static shapes: CUDA-graph
capturable, cost grows with each sequence's own length); :func:`tree_attention_ref` is the
plain torch form (float64-capable, the CPU path and the tests' reference).
"""
from __future__ import annotations

import torch

from simtree.errors import SimtreeError

from .forms import current

__all__ = ["tree_attention", "tree_attention_ref", "chain_bits"]


def chain_bits(B: int, Q: int, device) -> torch.Tensor:
    """int64 [B, Q, W]: query t sees rows 0..t (a causal chain of Q rows)."""
    W = (Q + 63) // 64
    rows = torch.arange(Q, device=device)
    cols = torch.arange(64 * W, device=device)
    mask = (cols[None, :] <= rows[:, None]).to(torch.int64).view(Q, W, 64)
    words = (mask << torch.arange(64, device=device)).sum(-1)    # disjoint bits: sum == or
    return words.expand(B, Q, W).contiguous()


def _bit_mask(bits: torch.Tensor, T: int) -> torch.Tensor:
    """[B, Q, W] words -> bool [B, Q, T]."""
    cols = torch.arange(T, device=bits.device)
    return ((bits[..., cols // 64] >> (cols % 64)) & 1).bool()


def _check(q, k_cache, v_cache, cache_lens, q_pos, k_tree, v_tree, tree_bits) -> None:
    B, Q, Hq, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise SimtreeError(f"tree attention: cache must be [B={B}, S, Hkv, D={D}], got k {tuple(k_cache.shape)}, "
                           f"v {tuple(v_cache.shape)}")
    Hkv = k_cache.shape[2]
    if Hq % Hkv or k_tree.shape[0] != B or k_tree.shape[2:] != (Hkv, D) or v_tree.shape != k_tree.shape:
        raise SimtreeError(f"tree attention: tree rows must be [B, T, Hkv={Hkv}, D={D}] with Hq={Hq} a multiple "
                           f"of Hkv, got {tuple(k_tree.shape)}")
    W = (k_tree.shape[1] + 63) // 64
    if tuple(tree_bits.shape) != (B, Q, W) or tuple(q_pos.shape) != (B, Q) or tuple(cache_lens.shape) != (B,):
        raise SimtreeError(f"tree attention: bits {tuple(tree_bits.shape)}, q_pos {tuple(q_pos.shape)}, "
                           f"lengths {tuple(cache_lens.shape)} do not fit B={B}, Q={Q}, W={W}")


def tree_attention_ref(q, k_cache, v_cache, cache_lens, q_pos, k_tree, v_tree, tree_bits, *,
                       scale: float, window: int = 0, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: one softmax over [cache rows | tree rows (| sink)] per query and head,
    computed in float32 (float64 for float64 inputs)."""
    B, Q, Hq, D = q.shape
    S, Hkv, T = k_cache.shape[1], k_cache.shape[2], k_tree.shape[1]
    G = Hq // Hkv
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = torch.cat([k_cache, k_tree], 1).to(dt)                      # [B, S+T, Hkv, D]
    vals = torch.cat([v_cache, v_tree], 1).to(dt)
    qg = q.to(dt).view(B, Q, Hkv, G, D)
    s = torch.einsum("bqhgd,bkhd->bqhgk", qg, keys) * scale            # [B, Q, Hkv, G, S+T]
    rows = torch.arange(S, device=q.device)
    vis = rows[None, None, :] < cache_lens[:, None, None]              # [B, 1, S]
    if window:
        vis = vis & (rows[None, None, :] > q_pos[:, :, None] - window)
    vis = torch.cat([vis.expand(B, Q, S), _bit_mask(tree_bits, T)], -1)
    s = s.masked_fill(~vis[:, :, None, None, :], float("-inf"))
    if sink is not None:
        col = sink.to(dt).view(1, 1, Hkv, G, 1).expand(B, Q, Hkv, G, 1)
        s = torch.cat([s, col], -1)
    p = torch.softmax(s, -1)[..., :S + T]
    out = torch.einsum("bqhgk,bkhd->bqhgd", p, vals)
    return out.reshape(B, Q, Hq, D).to(q.dtype)


def _use_triton(device: torch.device) -> bool:
    """The Triton kernel on CUDA unless the layer forms ask for the torch form
    (``forms.set_forms(tree_attention="torch")``)."""
    choice = current().tree_attention
    return choice == "triton" or (choice == "auto" and device.type == "cuda")


def tree_attention(q, k_cache, v_cache, cache_lens, q_pos, k_tree, v_tree, tree_bits, *,
                   window: int = 0, sink: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring: the Triton kernel on CUDA, the torch form elsewhere."""
    _check(q, k_cache, v_cache, cache_lens, q_pos, k_tree, v_tree, tree_bits)
    scale = q.shape[-1] ** -0.5
    if not _use_triton(q.device):
        return tree_attention_ref(q, k_cache, v_cache, cache_lens, q_pos, k_tree, v_tree, tree_bits,
                                  scale=scale, window=window, sink=sink)
    from ._attention_kernel import tree_attention_triton
    return tree_attention_triton(q, k_cache, v_cache, cache_lens, q_pos, k_tree, v_tree, tree_bits,
                                 scale=scale, window=window, sink=sink)
