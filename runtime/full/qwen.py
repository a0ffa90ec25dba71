"""Qwen3.6-style GDN hybrid at full size (random weights) with its MTP draft layer, composed of
``simtree.kernels.layers.qwen`` (the layer code the profiler times too).

Interface the engine drives (B sequences, n nodes per sequence, static shapes):
``verify(state, tokens, parents)`` -> (hidden [B*n, h], pending) leaves the state untouched;
``commit(state, pending, accepted)`` writes the accepted root paths (attention rows, GDN and
conv state) and advances the lengths (with the layer form ``gdn_commit="deferred"`` the GDN
state's part waits for the next verify or decode, which folds it in as it reads the state);
``decode(state, tokens)`` is one plain step;
``greedy(hidden)`` the float32-logit argmax; ``draft_forward`` runs the MTP layer over draft
rows held in a scratch area until ``DraftState.commit`` moves them into its cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from simtree.kernels.gdn import new_pending
from simtree.kernels.layers import forms, head, ops, qwen as L
from simtree.kernels.layers.weights import make_weights, weights_from
from simtree.models import ModelShape

from .layers import DraftState

__all__ = ["QwenModel", "QwenState", "param_specs"]


def param_specs(shape: ModelShape):
    """Every weight of the target and its MTP layer (what :class:`QwenModel` allocates)."""
    return L.model_specs(shape)


@dataclass
class QwenState:
    """Persistent state of B sequences: attention caches [B, max_len + 1, 2, Hkv, D] per layer
    (row max_len: trash), GDN state [B, HV, K, V] fp32 and conv state [B, W-1, C] per GDN layer,
    ``lengths`` int64 [B]; ``gdn_path``: per GDN layer, the accepted path a deferred commit keeps
    for the next verify (``GDNPendingPath``, made at the first deferred commit)."""

    lengths: torch.Tensor
    max_len: int
    kv: dict = field(default_factory=dict)
    ssm: dict = field(default_factory=dict)
    conv: dict = field(default_factory=dict)
    gdn_path: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        return [self.lengths, *self.kv.values(), *self.ssm.values(), *self.conv.values()]


@dataclass
class Pending:
    """What a verify hands its commit: the round's metadata and each layer's rows."""

    round: L.QwenRound
    layers: dict
    features: torch.Tensor | None = None    # [T, len(taps) * h]: the tapped layers' outputs (block drafters)


class QwenModel:
    family = "gdn_hybrid"
    deployment = "1 GPU"
    capturable = True
    # path rows a deferred GDN commit keeps per sequence; a deeper accepted path is committed
    # into the state at once (by the same kernel)
    defer_path_rows = 16

    def __init__(self, shape: ModelShape, device="cuda", dtype=torch.bfloat16, seed: int = 0,
                 weights: dict | None = None):
        """Random weights (seeded), or ``weights`` {name: tensor} (a checkpoint's, see
        simtree.checkpoints) with the parameters it lacks made at random: ``random_weights``
        names them."""
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        if self.device.type != "cuda":
            self.deployment = f"1 {self.device.type.upper()}"
        self.d = L.QwenDims.of(shape)
        specs = param_specs(shape)
        given = weights_from(specs, weights or {}, self.device, dtype)
        missing = [s for s in specs if s.name not in given]
        self.random_weights = [s.name for s in missing]
        self.w = {**make_weights(missing, self.device, dtype, seed), **given}
        self.kinds = shape.layer_kinds
        self.has_gdn = "gdn" in self.kinds
        self._layer_w = [L.prepare(self._sub(f"layers.{i}."), dtype) for i in range(len(self.kinds))]
        self._mtp_w = self._sub("mtp.")
        self.tables = L.RoundTables(self.d, self.device, dtype=dtype)

    def _sub(self, prefix: str) -> dict:
        return {k[len(prefix):]: v for k, v in self.w.items() if k.startswith(prefix)}

    @property
    def hidden(self) -> int:
        return self.d.h

    @property
    def draft_window(self) -> int:
        """The MTP layer's attention window in positions (0: it sees its whole cache)."""
        return 0

    @property
    def vocab(self) -> int:
        return self.d.vocab

    # ---- state -----------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int) -> QwenState:
        d, dev = self.d, self.device
        self.tables.rope.ensure(max_len + 2)
        st = QwenState(torch.zeros(batch, dtype=torch.int64, device=dev), max_len)
        for i, kind in enumerate(self.kinds):
            if kind == "attn":
                st.kv[i] = L.new_cache(d, batch, max_len, self.dtype, dev)
            else:
                st.ssm[i] = torch.zeros(batch, d.gHV, d.gK, d.gV, dtype=torch.float32, device=dev)
                st.conv[i] = torch.zeros(batch, d.W - 1, d.conv, dtype=self.dtype, device=dev)
        return st

    def new_draft_state(self, st: QwenState, scratch_rows: int) -> DraftState:
        kv = L.new_cache(self.d, st.batch_size, st.max_len, self.dtype, self.device)
        scratch = torch.zeros(st.batch_size, scratch_rows, 2, self.d.Hkv, self.d.D, dtype=self.dtype, device=self.device)
        return DraftState(st.lengths.clone(), st.max_len, kv, scratch)

    @torch.no_grad()
    def reset(self, st: QwenState, ds: DraftState | None = None) -> None:
        """Empty every sequence (same tensors: CUDA graphs keep reading them)."""
        st.lengths.zero_()
        for t in [*st.ssm.values(), *st.conv.values()]:
            t.zero_()
        for path in st.gdn_path.values():
            path.clear()
        if ds is not None:
            ds.lengths.zero_()

    @torch.no_grad()
    def fill_random(self, st: QwenState, ds: DraftState | None, context_len: int, seed: int = 0) -> None:
        """A context of ``context_len`` tokens of random content (timing runs: the values do not
        change the work); GDN states at the scale of a real state (unit-norm keys)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for t in [*st.kv.values(), *st.conv.values(), *([ds.kv] if ds else [])]:
            t.normal_(generator=gen)
        for t in st.ssm.values():
            t.normal_(0.0, 0.1, generator=gen)
        for path in st.gdn_path.values():
            path.clear()
        st.lengths.fill_(context_len)

    # ---- target: verify / commit / decode ----------------------------------------------------
    def _forward(self, st: QwenState, tokens: torch.Tensor, rm: L.QwenRound, taps=()):
        d = self.d
        x = head.embed(self.w["embed"], tokens)
        pending, tapped = {}, []
        for i, kind in enumerate(self.kinds):
            w = self._layer_w[i]
            if kind == "gdn":
                x, pending[i] = L.gdn_layer(w, d, x, st.ssm[i], st.conv[i], rm, st.gdn_path.get(i))
            else:
                x, pending[i] = L.attn_layer(w, d, x, st.kv[i], rm)
            if i in taps:
                tapped.append(x)
        return x, pending, (torch.cat(tapped, -1) if tapped else None)

    @torch.no_grad()
    def verify(self, st: QwenState, tokens: torch.Tensor, parents: torch.Tensor, taps=()):
        """tokens, parents int64 [B, n] (parents local, -1 at the root, topological) ->
        (hidden [B*n, h] after the final norm, Pending).  Node j sits at position
        lengths[b] + depth_j and sees the cache plus its ancestors; the state is not written
        (but for a deferred commit's waiting path, folded in).  ``taps``: layers whose outputs
        (the residual stream after them) ``Pending.features`` keeps, concatenated (a block
        drafter's context)."""
        rm = L.round_meta(self.d, self.tables, st.lengths, parents, st.max_len + 1, self.has_gdn)
        x, layers, feats = self._forward(st, tokens, rm, taps)
        return self._final_norm(x), Pending(rm, layers, feats)

    @torch.no_grad()
    def commit(self, st: QwenState, pend: Pending, accepted: torch.Tensor) -> None:
        """Fold each tree's root path to ``accepted`` (LOCAL node index, int64 [B]) into the state."""
        rm = pend.round
        cm = L.commit_meta(self.d, self.tables, rm, accepted, st.max_len + 1, self.has_gdn)
        defer = forms.current().gdn_commit == "deferred"
        for i, kind in enumerate(self.kinds):
            if kind == "gdn":
                path = self._gdn_path(st, i, pend.layers[i][2].u.dtype) if defer else None
                L.gdn_commit(self.d, st.ssm[i], st.conv[i], pend.layers[i], rm, cm, path)
            else:
                L.attn_commit(st.kv[i], pend.layers[i], cm.kv_rows)
        L.advance(st.lengths, cm)

    def _gdn_path(self, st: QwenState, i: int, u_dtype):
        """Layer i's deferred-commit buffers, made on first use (nothing waits in them here: the
        verify before this commit folded it)."""
        path = st.gdn_path.get(i)
        if path is None or path.u.dtype != u_dtype:
            d = self.d
            path = st.gdn_path[i] = new_pending(st.batch_size, d.gH, d.gHV, d.gK, d.gV, self.defer_path_rows,
                                                self.device, u_dtype)
        return path

    @torch.no_grad()
    def decode(self, st: QwenState, tokens: torch.Tensor) -> torch.Tensor:
        """One plain step: tokens [B] at positions lengths -> hidden [B, h] (after the final
        norm); advances the state."""
        rm = L.round_meta(self.d, self.tables, st.lengths, None, st.max_len + 1, self.has_gdn)
        x, _, _ = self._forward(st, tokens, rm)
        L.advance(st.lengths, rm.commit)
        return self._final_norm(x)

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The target's hidden rows as the LM head and the MTP layer read them: after the final
        norm (SGLang's qwen3_5_mtp feeds the MTP layer the normed hidden state)."""
        return ops.rms_norm(x, self.w["norm"], self.d.eps)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax of the float32 logits of (normed) hidden [T, h] -> int64 [T]."""
        return self.logits(hidden).argmax(-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of (normed) hidden rows (the lossless check's top-2 gaps)."""
        return head.logits_fp32(hidden, self.w["lm_head"])

    # ---- MTP draft layer ---------------------------------------------------------------------
    @torch.no_grad()
    def draft_forward(self, ds: DraftState, tokens, prev_hidden, pos, rows, bits) -> torch.Tensor:
        """MTP rows: tokens [B, Q] at positions pos [B, Q] with the hidden state before them
        prev_hidden [B, Q, h]; each row's K/V go to scratch row ``rows`` [B, Q] and it attends
        to the MTP cache plus the scratch rows in ``bits`` [B, Q, W].  -> hidden [B, Q, h] after
        the MTP layer's own norm: what its logits and, as SGLang chains it, the next draft step
        read."""
        out = L.mtp_forward(self._mtp_w, self.d, self.w["embed"], tokens, prev_hidden, self.tables.rope.rows(pos),
                            pos, rows, bits, ds.kv, ds.scratch, ds.lengths)
        return ops.rms_norm(out.reshape(-1, out.shape[-1]), self.w["mtp.norm"], self.d.eps).view(out.shape)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the MTP layer's (normed) hidden rows [..., h]."""
        lead = hidden.shape[:-1]
        return head.logits_fp32(hidden.reshape(-1, hidden.shape[-1]), self.w["lm_head"]).view(*lead, -1)
