"""Tiny GDN-hybrid causal LM (Qwen3.5/3.6 pattern scaled down) and its inference paths.

Blocks: x += Mixer(RMSNorm(x)); x += MLP(RMSNorm(x)), mixer = Gated DeltaNet
("linear_attention") or causal softmax attention with RoPE ("full_attention"); the default
target is 4 layers [GDN, GDN, GDN, attention], the default draft 2 attention layers.

Three ways to run it, all with the same weights:

* ``forward(ids)``               [B, T] -> logits [B, T, V]; training (full sequences).
* ``step(tokens, cache)``        [B] -> [B, V]; plain greedy decoding: the sequential GDN
                                 recurrence (docs/math/gdn_tree_solve.md) and a KV cache. The ground truth.
* ``verify(batch, cache)``       one forward over a whole :class:`TreeBatch` of draft trees
                                 (every node sees only its ancestors and the cache) ->
                                 logits [N, V] and a :class:`Pending` record; the cache is not
                                 touched.  ``commit(cache, batch, pending, accepted)`` then
                                 writes only the accepted root path: attention KV rows, the
                                 GDN state (``gdn_tree_commit``) and the conv state
                                 (``conv_state_commit``).  Rejected branches never reach the
                                 cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from simtree.errors import SimtreeError, check_int
from simtree.kernels.gdn import ops as gdn_ops
from simtree.runtime.cache import Cache, Pending
from simtree.trees.tree import DraftTree, TreeBatch

__all__ = ["ModelConfig", "HybridLM", "Cache", "Pending"]

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class ModelConfig:
    """Hugging Face style fields (names follow Qwen3-Next's config.json)."""

    vocab_size: int = 260
    hidden_size: int = 128
    intermediate_size: int = 384
    layer_types: list = field(default_factory=lambda: ["linear_attention"] * 3 + ["full_attention"])
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    model_type: str = "simtree_gdn_hybrid"

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    def validate(self) -> "ModelConfig":
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise SimtreeError(f"config layer_types[{i}] = {t!r}: expected one of {LAYER_TYPES}")
        if not self.layer_types:
            raise SimtreeError("config layer_types is empty: the model needs at least one layer")
        ints = ("vocab_size", "hidden_size", "intermediate_size", "linear_num_key_heads",
                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings")
        for name in ints:
            setattr(self, name, check_int(getattr(self, name), f"config {name}"))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise SimtreeError("config linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SimtreeError("config num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise SimtreeError(f"config head_dim = {self.head_dim}: RoPE needs an even head_dim")
        return self


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., T, H, D], pos [..., T] -> rotate-half RoPE."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d)
    ang = pos.to(x.dtype)[..., None] * inv  # [..., T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).unsqueeze(-2)
    sin = torch.cat([ang.sin(), ang.sin()], -1).unsqueeze(-2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def tree_attention_meta(batch: TreeBatch, cache_lens, device) -> dict:
    """The round's full-attention layout, built on the host and copied once: ``mask`` bool
    [B, max nodes, max cache + max nodes] (node j of tree b sees cache rows < cache_lens[b] and
    its ancestors-or-self among the tree columns; padded node rows see cache row 0 only, so no
    softmax row is empty), ``local`` [N] each flat node's index in its tree."""
    B, nmax, lmax = batch.batch_size, batch.max_nodes, max(int(n) for n in cache_lens)
    mask = np.zeros((B, nmax, lmax + nmax), dtype=bool)
    mask[:, :, 0] = True
    for b, (t, n) in enumerate(zip(batch.trees, cache_lens)):
        mask[b, :t.num_nodes, 0] = False
        mask[b, :t.num_nodes, :int(n)] = True
        mask[b, :t.num_nodes, lmax:lmax + t.num_nodes] = t.ancestor_mask
    local = np.arange(batch.total_nodes) - batch.cu_nodes[batch.seq_ids]
    return {"mask": torch.as_tensor(mask).to(device), "local": torch.as_tensor(local).to(device),
            "max_nodes": nmax, "max_cache": lmax}


class Attention(nn.Module):
    """Causal GQA attention with RoPE; KV cache [B, L, Hkv, D] per layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.hkv, self.dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.h * self.dh, bias=False)
        self.k_proj = nn.Linear(d, self.hkv * self.dh, bias=False)
        self.v_proj = nn.Linear(d, self.hkv * self.dh, bias=False)
        self.o_proj = nn.Linear(self.h * self.dh, d, bias=False)

    def _qkv(self, x, pos):
        q = _rope(self.q_proj(x).unflatten(-1, (self.h, self.dh)), pos, self.theta)
        k = _rope(self.k_proj(x).unflatten(-1, (self.hkv, self.dh)), pos, self.theta)
        return q, k, self.v_proj(x).unflatten(-1, (self.hkv, self.dh))

    def _attend(self, q, k, v, mask):
        """q [.., Tq, H, D], k/v [.., Tk, Hkv, D], mask bool [.., Tq, Tk] -> [.., Tq, H*D]."""
        rep = self.h // self.hkv
        k, v = k.repeat_interleave(rep, -2), v.repeat_interleave(rep, -2)
        s = torch.einsum("...qhd,...khd->...hqk", q, k) / math.sqrt(self.dh)
        s = s.masked_fill(~mask.unsqueeze(-3), float("-inf"))
        return torch.einsum("...hqk,...khd->...qhd", s.softmax(-1), v).flatten(-2)

    def forward(self, x):  # [B, T, d]
        t = x.shape[1]
        q, k, v = self._qkv(x, torch.arange(t, device=x.device).expand(x.shape[0], t))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        return self.o_proj(self._attend(q, k, v, causal))

    def step(self, x, cache, i):  # x [B, d]; writes row lengths[b] of the layer's cache
        lens = cache.lengths
        q, k, v = self._qkv(x[:, None], lens[:, None])
        rows = torch.arange(x.shape[0], device=x.device)
        cache.k[i][rows, lens] = k[:, 0]
        cache.v[i][rows, lens] = v[:, 0]
        mask = (torch.arange(cache.k[i].shape[1], device=x.device) <= lens[:, None])[:, None]
        return self.o_proj(self._attend(q, cache.k[i], cache.v[i], mask)[:, 0])

    def verify(self, x, batch, meta, cache, i):  # x [N, d] flat tree nodes
        seq, att = meta["seq_ids"], meta["attn"]
        pos = cache.lengths[seq] + meta["depth"]
        q, k, v = self._qkv(x[:, None], pos[:, None])
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
        # one batched attention over [B, max nodes] padded trees: keys = the first max-cache
        # rows of each sequence's cache, then its tree nodes (``tree_attention_meta``'s mask
        # keeps a node to its own cache length and its ancestors-or-self)
        B, nmax, lmax = att["mask"].shape[0], att["max_nodes"], att["max_cache"]
        rows = (seq, att["local"])
        qp = q.new_zeros(B, nmax, *q.shape[1:]).index_put_(rows, q)
        kp = k.new_zeros(B, nmax, *k.shape[1:]).index_put_(rows, k)
        vp = v.new_zeros(B, nmax, *v.shape[1:]).index_put_(rows, v)
        keys = torch.cat([cache.k[i][:, :lmax], kp], 1)
        vals = torch.cat([cache.v[i][:, :lmax], vp], 1)
        out = self._attend(qp, keys, vals, att["mask"])[rows]
        return self.o_proj(out), {"k": k, "v": v}

    def commit(self, cache, pend, i, rows, dst_seq, dst_pos):
        """Write the accepted rows' K/V at (dst_seq, dst_pos) of the layer's cache."""
        cache.k[i][dst_seq, dst_pos] = pend["k"][rows]
        cache.v[i][dst_seq, dst_pos] = pend["v"][rows]


class GatedDeltaNet(nn.Module):
    """Qwen3-Next style GDN mixer (docs/math/gdn_tree_solve.md): conv(k=4)+SiLU on qkv, L2-normed q/k,
    g = -exp(A_log) softplus(x W_a + dt_bias), beta = sigmoid(x W_b),
    out = W_o (RMSNorm(o) * SiLU(x W_z))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.w = cfg.linear_conv_kernel_dim
        d = cfg.hidden_size
        self.conv_dim = 2 * self.h * self.dk + self.hv * self.dv
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(d, self.hv, bias=False)
        self.in_proj_a = nn.Linear(d, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.w, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.hv).uniform_(1, 16)))
        self.norm = RMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, d, bias=False)

    def _split(self, mixed, x):
        """mixed [..., conv_dim] (after conv+SiLU) -> q, k [..., H, K], v [..., HV, V], g, beta."""
        hk = self.h * self.dk
        q = mixed[..., :hk].unflatten(-1, (self.h, self.dk))
        k = mixed[..., hk:2 * hk].unflatten(-1, (self.h, self.dk))
        v = mixed[..., 2 * hk:].unflatten(-1, (self.hv, self.dv))
        g = -self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias)
        return q, k, v, g, torch.sigmoid(self.in_proj_b(x))

    def _out(self, o, x):
        z = self.in_proj_z(x).unflatten(-1, (self.hv, self.dv))
        return self.out_proj((self.norm(o) * F.silu(z)).flatten(-2))

    def forward(self, x):  # [B, T, d]; training
        t = x.shape[1]
        mixed = self.conv1d(F.pad(self.in_proj_qkv(x).transpose(1, 2), (self.w - 1, 0)))[..., :t]
        q, k, v, g, beta = self._split(F.silu(mixed.transpose(1, 2)), x)
        o = gdn_ops.chain_gdn(q, k, v, g, beta)
        return self._out(o, x)

    def step(self, x, cache, i):  # x [B, d]: sequential recurrence, updates state + conv state
        qkv = self.in_proj_qkv(x)
        window = torch.cat([cache.conv[i], qkv[:, :, None]], -1)  # [B, D, W]
        cache.conv[i].copy_(window[:, :, 1:])
        mixed = F.silu((window * self.conv1d.weight[:, 0]).sum(-1))
        q, k, v, g, beta = self._split(mixed, x)
        o = gdn_ops.recurrent_step(q, k, v, g, beta, cache.state[i])  # updates state in place
        return self._out(o, x)

    def verify(self, x, batch, meta, cache, i):  # x [N, d]
        qkv = self.in_proj_qkv(x)
        mixed = gdn_ops.tree_conv(qkv, cache.conv[i], self.conv1d.weight[:, 0], meta)
        q, k, v, g, beta = self._split(mixed, x)
        o, gcache = gdn_ops.tree_verify(q, k, v, g, beta, cache.state[i], meta)
        return self._out(o, x), {"qkv": qkv, "k": k, "gdn": gcache}

    def commit(self, cache, pend, i, meta, accepted):
        gdn_ops.tree_commit(cache.state[i], pend["k"], pend["gdn"], meta, accepted)
        gdn_ops.conv_commit(cache.conv[i], pend["qkv"], meta, accepted)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    @property
    def mixer(self):
        return self.linear_attn if self.layer_type == "linear_attention" else self.self_attn


class HybridLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg.validate()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        nn.init.normal_(self.embed_tokens.weight, std=0.02)

    def _head(self, x):
        return self.lm_head(self.norm(x))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V] (training; causal)."""
        x = self.embed_tokens(ids)
        for blk in self.layers:
            x = x + blk.mixer(blk.input_layernorm(x))
            x = x + blk.mlp(blk.post_attention_layernorm(x))
        return self._head(x)

    def prefers_depth_first(self, batch: TreeBatch) -> bool:
        """Whether this round's trees are worth storing depth-first (``TreeBatch.depth_first``,
        host work once per round): GDN layers, and the kernel's saving above the host's cost
        (``kernels.gdn.depth_first_pays``)."""
        return ("linear_attention" in self.config.layer_types
                and gdn_ops.depth_first_pays(batch.max_nodes, batch.batch_size))

    def new_cache(self, batch_size: int, max_len: int) -> Cache:
        p = self.embed_tokens.weight
        return Cache(self.config, batch_size, max_len, p.dtype, p.device)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: Cache) -> torch.Tensor:
        """tokens [B] at positions cache.lengths -> next-token logits [B, V]; advances the cache."""
        if int(cache.lengths.max()) >= cache.max_len:
            raise SimtreeError(f"cache is full ({cache.max_len} tokens): allocate a longer cache")
        x = self.embed_tokens(tokens)
        for i, blk in enumerate(self.layers):
            x = x + blk.mixer.step(blk.input_layernorm(x), cache, i)
            x = x + blk.mlp(blk.post_attention_layernorm(x))
        cache.lengths += 1
        return self._head(x)

    @torch.no_grad()
    def verify(self, batch: TreeBatch, cache: Cache,
               lens: list[int] | None = None) -> tuple[torch.Tensor, Pending]:
        """Score every node of B draft trees in one pass -> (logits [N, V], Pending).

        Node j sees the cache of its sequence plus its ancestors (RoPE position
        cache_len + depth); the cache itself is left unchanged.  ``lens``: the cache lengths
        when the caller already read them this round (else read here, one host sync).
        """
        if batch.batch_size != cache.batch_size:
            raise SimtreeError(f"{batch.batch_size} trees for a cache of {cache.batch_size} sequences")
        if lens is None:
            lens = cache.lengths.tolist()  # the round's one host read of the cache lengths
        elif len(lens) != cache.batch_size:
            raise SimtreeError(f"{len(lens)} cache lengths for a cache of {cache.batch_size} sequences")
        need = max(n + t.max_depth + 1 for n, t in zip(lens, batch.trees))
        if need > cache.max_len:
            raise SimtreeError(f"tree does not fit the cache ({need} > {cache.max_len} tokens)")
        dev = self.embed_tokens.weight.device
        gdn = "linear_attention" in self.config.layer_types
        # with GDN layers, seq_ids and depth come with the round's GDN metadata (same values,
        # one copy): not copied twice
        meta = batch.to_torch(dev, ("cu_nodes", "parents", "tokens") if gdn else
                              ("cu_nodes", "parents", "seq_ids", "depth", "tokens"))
        meta["cache_lens"] = lens
        if gdn:
            gdn_ops.round_meta(meta, batch, self.config.linear_num_value_heads,
                               self.config.linear_value_head_dim)
            meta["seq_ids"], meta["depth"] = meta["gdn"].seq_ids, meta["gdn"].depth
        if "full_attention" in self.config.layer_types:  # shared by every attention layer
            meta["attn"] = tree_attention_meta(batch, lens, dev)
        x = self.embed_tokens(meta["tokens"])
        layers = []
        for i, blk in enumerate(self.layers):
            h, pend = blk.mixer.verify(blk.input_layernorm(x), batch, meta, cache, i)
            layers.append(pend)
            x = x + h
            x = x + blk.mlp(blk.post_attention_layernorm(x))
        return self._head(x), Pending(layers, meta)

    @torch.no_grad()
    def prefill(self, cache: Cache, prompts: list[list[int]]) -> torch.Tensor:
        """Commit each prompt into its (empty or partly filled) sequence -> last logits [B, V].

        Runs as chain verifies + commits of at most ``gdn_ops.PREFILL_CHUNK`` tokens per
        sequence (see gdn_ops for why the chunk is bounded)."""
        if len(prompts) != cache.batch_size or any(len(p) == 0 for p in prompts):
            raise SimtreeError(f"prefill needs one non-empty prompt per sequence ({cache.batch_size})")
        last = []
        for b, prompt in enumerate(prompts):
            view = cache.narrow(b)
            for s in range(0, len(prompt), gdn_ops.PREFILL_CHUNK):
                chunk = [int(t) for t in prompt[s:s + gdn_ops.PREFILL_CHUNK]]
                batch = TreeBatch([DraftTree.chain(len(chunk), chunk)])
                logits, pend = self.verify(batch, view)
                self.commit(view, batch, pend, [len(chunk) - 1])
            last.append(logits[-1])
        return torch.stack(last)

    @torch.no_grad()
    def commit(self, cache: Cache, batch: TreeBatch, pending: Pending, accepted) -> None:
        """Fold the root path of each tree's accepted node (LOCAL index, int [B]) into the cache."""
        accepted = np.asarray(accepted, np.int64).reshape(-1)
        dev = cache.lengths.device
        paths = [t.path_to(int(a)) for t, a in zip(batch.trees, accepted)]
        counts = np.array([len(r) for r in paths], np.int64)
        seq = np.repeat(np.arange(len(paths)), counts)
        # flat verify rows of every accepted path, and where they land: (sequence, cache row)
        rows = np.concatenate(paths) + batch.cu_nodes[seq]
        first = np.cumsum(counts) - counts
        pos = np.asarray(pending.meta["cache_lens"], np.int64)[seq] + np.arange(rows.size) - first[seq]
        rows_t, seq_t, pos_t = (torch.as_tensor(x, device=dev) for x in (rows, seq, pos))
        accepted_t = torch.as_tensor(accepted, device=dev)
        for i, blk in enumerate(self.layers):
            if blk.layer_type == "full_attention":
                blk.self_attn.commit(cache, pending.layers[i], i, rows_t, seq_t, pos_t)
            else:
                blk.linear_attn.commit(cache, pending.layers[i], i, pending.meta, accepted_t)
        cache.lengths += torch.as_tensor(counts, device=dev)
