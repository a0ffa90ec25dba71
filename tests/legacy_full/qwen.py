"""Qwen3.6-style GDN hybrid at full size (random weights) with its MTP draft layer.

Layers follow the model YAML (``gdn`` / ``attn`` kinds, dense SwiGLU MLP): x += mixer(RMSNorm x);
x += MLP(RMSNorm x).  The GDN mixer is Qwen's (kernels/gdn): in_proj -> qkv, z, b, a;
tree causal conv (kernel 4, over ancestors) + SiLU; q/k L2-normalised inside the kernel;
g = -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b); tree verify through
``simtree.kernels.gdn``; out = W_o (RMSNorm(o) * SiLU(z)).  Gated attention: GQA with per-head
q/k RMSNorm, RoPE on the first quarter of the head dims, output gate sigmoid(g) per head, tree
verify = attention over the cache plus the node's ancestors (:mod:`.attention`).

The MTP draft layer (YAML ``draft:``): x = W_fc [RMSNorm(embed(token)); RMSNorm(hidden)], one
gated-attention block with its own KV cache, the dense MLP, shared embedding and LM head.

Interface the engine drives (B sequences, n nodes per sequence, static shapes):
``verify(state, tokens, parents)`` -> (hidden [B*n, h], pending) leaves the state untouched;
``commit(state, pending, accepted)`` writes the accepted root paths (attention rows, GDN state
via ``gdn_tree_commit``, conv state via ``conv_state_commit``) and advances the lengths;
``decode(state, tokens)`` is one plain step; ``draft_forward`` runs the MTP layer over draft rows held
in a scratch area until ``DraftState.commit`` moves them into its cache.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from simtree.errors import SimtreeError
from simtree.kernels.gdn import (conv_state_commit, gdn_tree_commit, gdn_tree_verify,
                                 gdn_tree_verify_recurrent, tree_causal_conv, verify_round_meta)
from simtree.models import ModelShape

from .attention import tree_attention
from .layers import DraftState, batch_rows, rms_norm, rope, swiglu
from .params import Spec, linear, make_weights

__all__ = ["QwenModel", "QwenState", "param_specs", "ROPE_FRACTION", "ROPE_THETA"]

ROPE_FRACTION = 0.25     # partial_rotary_factor of Qwen3-Next / Qwen3.6: RoPE on 64 of 256 dims
ROPE_THETA = 10_000_000.0   # ASSUMPTION: Qwen3-Next's rope_theta as remembered; only angles change


def _dims(shape: ModelShape) -> dict:
    a, g = shape.attn, shape.gdn
    d = dict(h=shape.hidden, V=shape.vocab, I=int(shape.mlp["intermediate"]), Hq=int(a["q_heads"]),
             Hkv=int(a["kv_heads"]), D=int(a["head_dim"]), gate=bool(a.get("output_gate", False)))
    d["rope"] = int(a.get("rope_dim", max(2, int(d["D"] * ROPE_FRACTION) // 2 * 2)))
    if g:
        d.update(gH=int(g["key_heads"]), gHV=int(g["value_heads"]), gK=int(g["key_dim"]),
                 gV=int(g["value_dim"]), W=int(g.get("conv_kernel", 4)))
        d["conv"] = 2 * d["gH"] * d["gK"] + d["gHV"] * d["gV"]
    return d


def _attn_specs(p: str, d: dict, out_gain: float) -> list[Spec]:
    q_out = d["Hq"] * d["D"] * (2 if d["gate"] else 1)
    return [linear(p + "q", q_out, d["h"]), linear(p + "k", d["Hkv"] * d["D"], d["h"]),
            linear(p + "v", d["Hkv"] * d["D"], d["h"]), Spec(p + "q_norm", (d["D"],), "const", 1.0),
            Spec(p + "k_norm", (d["D"],), "const", 1.0), linear(p + "o", d["h"], d["Hq"] * d["D"], out_gain)]


def _gdn_specs(p: str, d: dict, out_gain: float) -> list[Spec]:
    HV, V = d["gHV"], d["gV"]
    return [linear(p + "qkvz", d["conv"] + HV * V, d["h"]), linear(p + "ba", 2 * HV, d["h"]),
            Spec(p + "conv", (d["conv"], d["W"]), "normal", d["W"] ** -0.5),
            Spec(p + "A_log", (HV,), "log_uniform", 16.0, torch.float32),
            Spec(p + "dt_bias", (HV,), "const", 1.0, torch.float32),
            Spec(p + "gnorm", (V,), "const", 1.0), linear(p + "out", d["h"], HV * V, out_gain)]


def _block_specs(p: str, kind: str, d: dict, out_gain: float) -> list[Spec]:
    mixer = _gdn_specs(p, d, out_gain) if kind == "gdn" else _attn_specs(p, d, out_gain)
    return [Spec(p + "ln1", (d["h"],), "const", 1.0), Spec(p + "ln2", (d["h"],), "const", 1.0), *mixer,
            linear(p + "gate_up", 2 * d["I"], d["h"]), linear(p + "down", d["h"], d["I"], out_gain)]


def param_specs(shape: ModelShape) -> list[Spec]:
    """Every weight of the target and its MTP layer (what :class:`QwenModel` allocates)."""
    bad = sorted(set(shape.layer_kinds) - {"gdn", "attn"})
    if bad or shape.mlp.get("kind") != "dense":
        raise SimtreeError(f"model {shape.name!r} is not a dense GDN hybrid (layer kinds {bad}, mlp "
                           f"{shape.mlp.get('kind')!r}): the Qwen runtime builds gdn / attn layers with a dense MLP")
    if shape.draft.get("attention", "attn") != "attn":
        raise SimtreeError(f"model {shape.name!r}: the Qwen MTP layer is a full-attention block, "
                           f"draft.attention is {shape.draft.get('attention')!r}")
    d = _dims(shape)
    out_gain = 1.0 / math.sqrt(2 * shape.num_layers)
    specs = [Spec("embed", (d["V"], d["h"])), linear("lm_head", d["V"], d["h"]),
             Spec("norm", (d["h"],), "const", 1.0)]
    for i, kind in enumerate(shape.layer_kinds):
        specs += _block_specs(f"layers.{i}.", kind, d, out_gain)
    specs += [Spec("mtp.enorm", (d["h"],), "const", 1.0), Spec("mtp.hnorm", (d["h"],), "const", 1.0),
              linear("mtp.fc", d["h"], 2 * d["h"]), *_block_specs("mtp.", "attn", d, out_gain),
              Spec("mtp.norm", (d["h"],), "const", 1.0)]
    return specs


@dataclass
class QwenState:
    """Persistent state of B sequences.  Attention caches [B, max_len + 1, Hkv, D] per layer
    (row max_len is a trash row: writes of rows that are not committed land there); GDN state
    [B, HV, K, V] fp32 and conv state [B, conv_dim, W-1] per GDN layer; ``lengths`` int64 [B]."""

    lengths: torch.Tensor
    max_len: int
    k: dict = field(default_factory=dict)
    v: dict = field(default_factory=dict)
    ssm: dict = field(default_factory=dict)
    conv: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        return [self.lengths, *self.k.values(), *self.v.values(), *self.ssm.values(), *self.conv.values()]


@dataclass
class Pending:
    """What a verify hands its commit: the round's tree tables and each layer's rows."""

    B: int
    n: int
    parents: torch.Tensor     # [B*n] local
    cu: torch.Tensor          # [B+1]
    meta: object              # kernels.gdn TreeMeta (bits, depth, anc, seq_ids)
    layers: dict


class QwenModel:
    family = "gdn_hybrid"
    deployment = "1 GPU"

    def __init__(self, shape: ModelShape, device="cuda", dtype=torch.bfloat16, seed: int = 0):
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        self.d = _dims(shape)
        self.w = make_weights(param_specs(shape), self.device, dtype, seed)
        self.kinds = shape.layer_kinds
        # the GDN decode step as the profile's gdn_decode_step times it: the state read and
        # written once by the recurrent kernel (CUDA); elsewhere verify + commit of one node
        self.fused_decode = self.device.type == "cuda" and dtype != torch.float64
        self.capturable = True

    @property
    def hidden(self) -> int:
        return self.d["h"]

    @property
    def vocab(self) -> int:
        return self.d["V"]

    # ---- state -----------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int) -> QwenState:
        d, dev = self.d, self.device
        st = QwenState(torch.zeros(batch, dtype=torch.int64, device=dev), max_len)
        for i, kind in enumerate(self.kinds):
            if kind == "attn":
                st.k[i] = torch.zeros(batch, max_len + 1, d["Hkv"], d["D"], dtype=self.dtype, device=dev)
                st.v[i] = torch.zeros_like(st.k[i])
            else:
                st.ssm[i] = torch.zeros(batch, d["gHV"], d["gK"], d["gV"], dtype=torch.float32, device=dev)
                st.conv[i] = torch.zeros(batch, d["conv"], d["W"] - 1, dtype=self.dtype, device=dev)
        return st

    def new_draft_state(self, st: QwenState, scratch_rows: int) -> DraftState:
        d = self.d
        k = torch.zeros(st.batch_size, st.max_len + 1, d["Hkv"], d["D"], dtype=self.dtype, device=self.device)
        sk = torch.zeros(st.batch_size, scratch_rows, d["Hkv"], d["D"], dtype=self.dtype, device=self.device)
        return DraftState(st.lengths.clone(), st.max_len, k, torch.zeros_like(k), sk, torch.zeros_like(sk))

    @torch.no_grad()
    def reset(self, st: QwenState, ds: DraftState | None = None) -> None:
        """Empty every sequence (same tensors: CUDA graphs keep reading them)."""
        st.lengths.zero_()
        for t in [*st.ssm.values(), *st.conv.values()]:
            t.zero_()
        if ds is not None:
            ds.lengths.zero_()

    @torch.no_grad()
    def fill_random(self, st: QwenState, ds: DraftState | None, context_len: int, seed: int = 0) -> None:
        """A context of ``context_len`` tokens of random content (timing runs: the values do not
        change the work); GDN states at the scale of a real state (unit-norm keys)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for t in [*st.k.values(), *st.v.values(), *st.conv.values(), *(ds.tensors()[:2] if ds else [])]:
            t.normal_(generator=gen)
        for t in st.ssm.values():
            t.normal_(0.0, 0.1, generator=gen)
        st.lengths.fill_(context_len)

    # ---- pieces ----------------------------------------------------------------------------
    def _gdn_inputs(self, i: int, h: torch.Tensor, conv_state, parents, cu, meta):
        d, w, p = self.d, self.w, f"layers.{i}."
        N = h.shape[0]
        qkvz = F.linear(h, w[p + "qkvz"])
        qkv, z = qkvz[:, :d["conv"]], qkvz[:, d["conv"]:]
        gdt = torch.float64 if self.dtype == torch.float64 else torch.float32   # gates: the kernels' fp32
        b, a = F.linear(h, w[p + "ba"]).to(gdt).chunk(2, -1)
        mixed = tree_causal_conv(qkv.contiguous(), conv_state, w[p + "conv"], parents, cu,
                                 activation="silu", meta=meta)
        hk = d["gH"] * d["gK"]
        q = mixed[:, :hk].reshape(N, d["gH"], d["gK"]).contiguous()
        k = mixed[:, hk:2 * hk].reshape(N, d["gH"], d["gK"]).contiguous()
        v = mixed[:, 2 * hk:].reshape(N, d["gHV"], d["gV"]).contiguous()
        g = -w[p + "A_log"].to(gdt).exp() * F.softplus(a + w[p + "dt_bias"].to(gdt))
        return qkv.contiguous(), q, k, v, g, torch.sigmoid(b), z

    def _gdn_out(self, i: int, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        d, p = self.d, f"layers.{i}."
        o = rms_norm(o.to(self.dtype), self.w[p + "gnorm"]) * F.silu(z.reshape(o.shape))
        return F.linear(o.reshape(o.shape[0], -1), self.w[p + "out"])

    def _attn_qkv(self, p: str, h: torch.Tensor, pos: torch.Tensor):
        """h [..., h] at positions pos [...] -> q [..., Hq, D], k, v [..., Hkv, D], gate or None."""
        d, w = self.d, self.w
        qg = F.linear(h, w[p + "q"]).unflatten(-1, (d["Hq"], -1))
        q, gate = (qg[..., :d["D"]], qg[..., d["D"]:]) if d["gate"] else (qg, None)
        k = F.linear(h, w[p + "k"]).unflatten(-1, (d["Hkv"], d["D"]))
        v = F.linear(h, w[p + "v"]).unflatten(-1, (d["Hkv"], d["D"]))
        q = rope(rms_norm(q, w[p + "q_norm"]), pos, d["rope"], ROPE_THETA)
        k = rope(rms_norm(k, w[p + "k_norm"]), pos, d["rope"], ROPE_THETA)
        return q.contiguous(), k.contiguous(), v.contiguous(), gate

    def _attn_out(self, p: str, o: torch.Tensor, gate) -> torch.Tensor:
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return F.linear(o.flatten(-2), self.w[p + "o"])

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        return x + swiglu(rms_norm(x, self.w[p + "ln2"]), self.w[p + "gate_up"], self.w[p + "down"])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(hidden, self.w["norm"]), self.w["lm_head"])

    @functools.lru_cache(maxsize=16)
    def _cu(self, B: int, n: int) -> torch.Tensor:
        return torch.arange(0, B * n + 1, n, dtype=torch.int64, device=self.device)

    def _meta(self, parents: torch.Tensor, B: int, n: int):
        d = self.d
        return verify_round_meta(parents, self._cu(B, n), n, d.get("gHV", 1), d.get("gV", 16))

    # ---- target: verify / commit / decode ----------------------------------------------------
    @torch.no_grad()
    def verify(self, st: QwenState, tokens: torch.Tensor, parents: torch.Tensor):
        """tokens, parents int64 [B, n] (parents local, -1 at the root, topological) ->
        (hidden [B*n, h] before the final norm, Pending).  Node j sits at position
        lengths[b] + depth_j and sees the cache plus its ancestors; the state is not written."""
        B, n = tokens.shape
        flat = parents.reshape(-1)
        cu = self._cu(B, n)
        meta = self._meta(flat, B, n)
        pos = st.lengths[:, None] + meta.depth.view(B, n)
        bits = meta.bits.view(B, n, -1)
        x = self.w["embed"][tokens.reshape(-1)]
        layers = {}
        for i, kind in enumerate(self.kinds):
            p = f"layers.{i}."
            h = rms_norm(x, self.w[p + "ln1"])
            if kind == "gdn":
                qkv, q, k, v, g, beta, z = self._gdn_inputs(i, h, st.conv[i], flat, cu, meta)
                o, cache = gdn_tree_verify(q, k, v, g, beta, st.ssm[i], flat, cu, scale=self.d["gK"] ** -0.5,
                                           meta=meta, check=False)
                x = x + self._gdn_out(i, o, z)
                layers[i] = (qkv, k, cache)
            else:
                q, k, v, gate = self._attn_qkv(p, h.view(B, n, -1), pos)
                o = tree_attention(q, st.k[i][:, :st.max_len], st.v[i][:, :st.max_len], st.lengths, pos, k, v, bits,
                                   scale=self.d["D"] ** -0.5)
                x = x + self._attn_out(p, o, gate).view(B * n, -1)
                layers[i] = (k, v)
            x = self._mlp(p, x)
        return x, Pending(B, n, flat, cu, meta, layers)

    @torch.no_grad()
    def commit(self, st: QwenState, pend: Pending, accepted: torch.Tensor) -> None:
        """Fold each tree's root path to ``accepted`` (LOCAL node index, int64 [B]) into the state."""
        B, n, meta = pend.B, pend.n, pend.meta
        depth = meta.depth.view(B, n)
        row = (pend.cu[:-1] + accepted)                                          # flat accepted row [B]
        j = torch.arange(n, device=self.device)
        on_path = ((meta.bits[row][:, j // 64] >> (j % 64)) & 1).bool()          # [B, n]
        dest = torch.where(on_path, st.lengths[:, None] + depth, st.max_len)     # trash row elsewhere
        rows = batch_rows(B, n, self.device)
        for i, kind in enumerate(self.kinds):
            if kind == "gdn":
                qkv, k, cache = pend.layers[i]
                gdn_tree_commit(st.ssm[i], k, cache, pend.parents, pend.cu, accepted, check=False)
                conv_state_commit(st.conv[i], qkv, pend.parents, pend.cu, accepted, meta=meta)
            else:
                k, v = pend.layers[i]
                st.k[i].index_put_((rows, dest), k)
                st.v[i].index_put_((rows, dest), v)
        st.lengths += depth.gather(1, accepted[:, None])[:, 0] + 1

    @functools.lru_cache(maxsize=16)
    def _decode_tables(self, B: int):
        parents = torch.full((B,), -1, dtype=torch.int64, device=self.device)
        return parents, self._meta(parents, B, 1), torch.zeros(B, dtype=torch.int64, device=self.device)

    @torch.no_grad()
    def decode(self, st: QwenState, tokens: torch.Tensor) -> torch.Tensor:
        """One plain step: tokens [B] at positions lengths -> hidden [B, h]; advances the state."""
        B = tokens.shape[0]
        parents, meta, zero = self._decode_tables(B)
        cu = self._cu(B, 1)
        pos = st.lengths[:, None]
        one = torch.ones(B, 1, 1, dtype=torch.int64, device=self.device)
        rows = batch_rows(B, 1, self.device)
        x = self.w["embed"][tokens]
        for i, kind in enumerate(self.kinds):
            p = f"layers.{i}."
            h = rms_norm(x, self.w[p + "ln1"])
            if kind == "gdn":
                qkv, q, k, v, g, beta, z = self._gdn_inputs(i, h, st.conv[i], parents, cu, meta)
                scale = self.d["gK"] ** -0.5
                if self.fused_decode:
                    o, _ = gdn_tree_verify_recurrent(q, k, v, g, beta, st.ssm[i], parents, cu, scale=scale,
                                                     node_states=st.ssm[i], check=False)
                else:
                    o, cache = gdn_tree_verify(q, k, v, g, beta, st.ssm[i], parents, cu, scale=scale, meta=meta,
                                               check=False)
                    gdn_tree_commit(st.ssm[i], k, cache, parents, cu, zero, check=False)
                conv_state_commit(st.conv[i], qkv, parents, cu, zero, meta=meta)
                x = x + self._gdn_out(i, o, z)
            else:
                q, k, v, gate = self._attn_qkv(p, h[:, None], pos)
                o = tree_attention(q, st.k[i][:, :st.max_len], st.v[i][:, :st.max_len], st.lengths, pos, k, v, one,
                                   scale=self.d["D"] ** -0.5)
                st.k[i].index_put_((rows, pos), k)
                st.v[i].index_put_((rows, pos), v)
                x = x + self._attn_out(p, o, gate)[:, 0]
            x = self._mlp(p, x)
        st.lengths += 1
        return x

    # ---- MTP draft layer ---------------------------------------------------------------------
    @torch.no_grad()
    def draft_forward(self, ds: DraftState, tokens, prev_hidden, pos, rows, bits) -> torch.Tensor:
        """MTP rows: tokens [B, Q] at positions pos [B, Q] with the hidden state before them
        prev_hidden [B, Q, h]; each row's K/V go to scratch row ``rows`` [B, Q] and it attends
        to the MTP cache plus the scratch rows in ``bits`` [B, Q, W].  -> hidden [B, Q, h]."""
        w = self.w
        B, Q = tokens.shape
        e = rms_norm(w["embed"][tokens], w["mtp.enorm"])
        x = F.linear(torch.cat([e, rms_norm(prev_hidden, w["mtp.hnorm"])], -1), w["mtp.fc"])
        q, k, v, gate = self._attn_qkv("mtp.", rms_norm(x, w["mtp.ln1"]), pos)
        b = batch_rows(B, Q, self.device)
        ds.scratch_k.index_put_((b, rows), k)
        ds.scratch_v.index_put_((b, rows), v)
        o = tree_attention(q, ds.k[:, :ds.max_len], ds.v[:, :ds.max_len], ds.lengths, pos, ds.scratch_k,
                           ds.scratch_v, bits, scale=self.d["D"] ** -0.5)
        x = x + self._attn_out("mtp.", o, gate)
        return self._mlp("mtp.", x)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(hidden, self.w["mtp.norm"]), self.w["lm_head"])
