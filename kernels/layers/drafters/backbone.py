"""The block backbone the three drafter families share: one forward over a block of rows.

    st = BackboneState.new(cfg, batch, max_len, ctx_rows, dtype, device)
    w = prepare(make_weights(drafter_specs(cfg), device, dtype), cfg)
    hid = backbone_forward(w, cfg, st, rope_cs, feats, n_new, anchor)    # [B, L, h], final-normed

A round hands the drafter ``ctx_rows`` (static) new context rows per sequence - the target's
hidden states of the tokens it accepted last round, ``target_layers`` of them concatenated,
``feats`` [B, A, F*h], of which the first ``n_new`` [B] are real - and the anchor token (the
token after them, the target's own next token).  The context rows are projected once
(x_ctx = RMSNorm(fc(feats))) and every draft layer reads them through its K/V projection only
(DeepSpec's ``Qwen3DSparkAttention``: k_ctx = k_proj(target_hidden)); the block rows (the anchor
embedding, then ``block_len - 1`` mask-token embeddings) go through the layers.  Each block
query attends to the layer's cache (the context of earlier rounds, rows < lengths), the round's
real context rows and every block row (no causal mask inside the block).  The context rows'
K/V are then committed to each layer's cache at rows lengths + i (rows i >= n_new: the trash
row) and lengths advance by n_new.  Positions: context row i at lengths + i, block row j at
lengths + n_new + j.

Everything is static in shape and free of host syncs: a forward is capturable in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from ..attention import tree_attention
from ..head import embed
from ..opcount import kernel_core
from ..qwen import EPS, attn_post, mlp
from .config import DrafterConfig

__all__ = ["BackboneState", "backbone_forward", "prepare", "block_bits", "block_positions"]


@dataclass
class BackboneState:
    """Per-layer KV caches [B, S + 1, 2, Hkv, D] (row S: trash) and the committed lengths [B]."""

    caches: list[torch.Tensor]
    lengths: torch.Tensor
    ctx_rows: int

    @classmethod
    def new(cls, cfg: DrafterConfig, batch: int, max_len: int, ctx_rows: int, dtype, device) -> "BackboneState":
        d = cfg.dims
        caches = [torch.zeros(batch, max_len + 1, 2, d.Hkv, d.D, dtype=dtype, device=device)
                  for _ in range(cfg.layers)]
        return cls(caches, torch.zeros(batch, dtype=torch.int64, device=device), int(ctx_rows))

    @property
    def max_len(self) -> int:
        return self.caches[0].shape[1] - 1


def block_bits(n_new: torch.Tensor, A: int, L: int) -> torch.Tensor:
    """int64 [B, L, W]: every block row sees context rows i < n_new and all L block rows
    (tree rows: the A context rows, then the L block rows)."""
    B, T = n_new.shape[0], A + L
    W = (T + 63) // 64
    cols = torch.arange(64 * W, device=n_new.device)
    seen = ((cols[None, :] < n_new[:, None]) | ((cols[None, :] >= A) & (cols[None, :] < T))).to(torch.int64)
    words = (seen.view(B, W, 64) << torch.arange(64, device=n_new.device)).sum(-1)    # disjoint bits: sum == or
    return words[:, None, :].expand(B, L, W).contiguous()


def block_positions(lengths: torch.Tensor, n_new: torch.Tensor, A: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(context positions [B, A], block positions [B, L])."""
    dev = lengths.device
    return (lengths[:, None] + torch.arange(A, device=dev), (lengths + n_new)[:, None] + torch.arange(L, device=dev))


def prepare(w: dict, cfg: DrafterConfig) -> dict:
    """The drafter's weights plus ``layers``: one dict per draft layer (names without the
    ``layers.<i>.`` prefix), split once, not per call."""
    out = dict(w)
    out["layers"] = [{k.split(".", 2)[2]: v for k, v in w.items() if k.startswith(f"layers.{i}.")}
                     for i in range(cfg.layers)]
    return out


def _kv(w: dict, d, proj: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """K (normed, rotated) and V from the K | V columns proj [N, 2 Hkv D] -> [N, 2, Hkv, D]."""
    N, kvd = proj.shape[0], d.Hkv * d.D
    kv = torch.empty(N, 2, d.Hkv, d.D, dtype=proj.dtype, device=proj.device)
    ops.norm_rope_into(proj[:, :kvd].view(N, d.Hkv, d.D), w["k_norm"], cs, 0, False, EPS, True, kv[:, 0])
    kv[:, 1].copy_(proj[:, kvd:].view(N, d.Hkv, d.D))
    return kv


def backbone_forward(w: dict, cfg: DrafterConfig, st: BackboneState, rope, feats: torch.Tensor,
                     n_new: torch.Tensor, anchor: torch.Tensor, commit: bool = True) -> torch.Tensor:
    """The block's final-normed hidden states [B, L, h] (module docstring).  ``w``: the drafter's
    weights after :func:`prepare` (``embed``, ``lm_head`` may be the target's); ``rope``: a :class:`RopeTable`
    (sized past max_len + A + L); ``commit``: write the context rows and advance lengths."""
    d, L, A = cfg.dims, cfg.block_len, st.ctx_rows
    B = anchor.shape[0]
    dev = anchor.device
    ctx_pos, blk_pos = block_positions(st.lengths, n_new, A, L)
    cs_ctx, cs_blk = rope.rows(ctx_pos), rope.rows(blk_pos)
    bits = block_bits(n_new, A, L)
    x_ctx = ops.rms_norm(F.linear(feats.reshape(B * A, -1), w["fc"]), w["hidden_norm"], EPS)
    toks = torch.full((B, L), cfg.mask_token, dtype=torch.int64, device=dev)
    toks[:, 0] = anchor
    x = embed(w["embed"], toks)
    S = st.max_len
    rows = torch.where(torch.arange(A, device=dev)[None, :] < n_new[:, None], ctx_pos, S)
    kv_rows = (rows + (torch.arange(B, device=dev) * (S + 1))[:, None]).reshape(-1)
    for lw, cache in zip(w["layers"], st.caches):
        proj = F.linear(ops.rms_norm(x, lw["ln1"], EPS), lw["qkv"])
        q = ops.norm_rope(proj[:, :d.q_out].view(B * L, d.Hq, d.D), lw["q_norm"], cs_blk, 0, False, EPS, True)
        kv_blk = _kv(lw, d, proj[:, d.q_out:], cs_blk)
        kv_ctx = _kv(lw, d, F.linear(x_ctx, lw["qkv"][d.q_out:]), cs_ctx)
        rows_kv = torch.cat([kv_ctx.view(B, A, 2, d.Hkv, d.D), kv_blk.view(B, L, 2, d.Hkv, d.D)], 1)
        with kernel_core("tree_attention"):
            o = tree_attention(q.view(B, L, d.Hq, d.D), cache[:, :S, 0], cache[:, :S, 1], st.lengths, blk_pos,
                               rows_kv[:, :, 0], rows_kv[:, :, 1], bits)
        x = mlp(lw, d, attn_post(lw, d, x, o.view(B * L, d.Hq, d.D), None))
        if commit:
            cache.view(-1, 2, d.Hkv, d.D).index_copy_(0, kv_rows, kv_ctx)
    if commit:
        st.lengths += n_new
    return ops.rms_norm(x, w["norm"], EPS).view(B, L, -1)
