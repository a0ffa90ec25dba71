"""Plain-torch V4 attention, one token at a time (the float64 ground truth).

Per token at position p of one sequence (``decode_step``):
 1. append its latent kv to the token list; feed x to the compressor(s) (online form);
 2. visible = the last ``window`` tokens (p-window, p] plus compressed entries i < (p+1)//r —
    all of them for HCA, the indexer's top-k for CSA (score_i = sum_h w_h ReLU(q_h . k_i));
 3. o_h = sum_j softmax_j([q_h . k_j * D^-0.5 ..., sink_h]) k_j   (K == V, the sink only
    adds exp(sink_h) to the denominator).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .compressor import CompressorParams, init_state, online_step, project, random_compressor
from .config import V4AttnConfig

__all__ = ["V4LayerWeights", "V4Inputs", "SeqState", "random_layer_weights", "random_inputs",
           "attend_dense", "indexer_scores", "decode_step", "decode_tokens", "empty_state"]


@dataclass
class V4LayerWeights:
    """comp: the layer's KV compressor (None for SWA); indexer: CSA's own C4 compressor of the
    indexer keys (None otherwise); sink [H]: the per-head attention sink logit."""

    kind: str
    comp: CompressorParams | None
    indexer: CompressorParams | None
    sink: torch.Tensor

    def to(self, device=None, dtype=None) -> "V4LayerWeights":
        mv = lambda c: None if c is None else c.to(device, dtype)  # noqa: E731
        return V4LayerWeights(self.kind, mv(self.comp), mv(self.indexer), self.sink.to(device=device, dtype=dtype))


@dataclass
class V4Inputs:
    """Per-token inputs of the attention path, N tokens (or tree nodes):
    q [N, H, D] queries; kv [N, D] latent; x [N, hidden] compressor input;
    iq [N, Hi, Di] indexer queries; iw [N, Hi] indexer head weights."""

    q: torch.Tensor
    kv: torch.Tensor
    x: torch.Tensor
    iq: torch.Tensor
    iw: torch.Tensor

    def select(self, rows) -> "V4Inputs":
        return V4Inputs(self.q[rows], self.kv[rows], self.x[rows], self.iq[rows], self.iw[rows])

    def to(self, device=None, dtype=None) -> "V4Inputs":
        return V4Inputs(*(t.to(device=device, dtype=dtype) for t in (self.q, self.kv, self.x, self.iq, self.iw)))


@dataclass
class SeqState:
    """Unpaged state of one sequence after ``length`` tokens: kv [length, D] every token's
    latent (only the last ``window`` are ever read); comp [E, D]; idx [E, Di]; the compressor
    buffers (see compressor.py) — None where the layer kind has no such part."""

    length: int
    kv: torch.Tensor
    comp: torch.Tensor | None = None
    idx: torch.Tensor | None = None
    comp_kv: torch.Tensor | None = None
    comp_score: torch.Tensor | None = None
    idx_kv: torch.Tensor | None = None
    idx_score: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def clone(self) -> "SeqState":
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        return SeqState(self.length, c(self.kv), c(self.comp), c(self.idx), c(self.comp_kv),
                        c(self.comp_score), c(self.idx_kv), c(self.idx_score))


def random_layer_weights(cfg: V4AttnConfig, kind: str, seed: int = 0, dtype=torch.float64,
                         device=None) -> V4LayerWeights:
    gen = torch.Generator().manual_seed(seed)
    r = cfg.ratio(kind)
    comp = idx = None
    if r:
        comp = random_compressor(cfg.head_dim, r, cfg.hidden, cfg.rope_dim, r == 4, gen, dtype,
                                 cfg.norm_eps, cfg.rope_theta)
    if kind == "csa":
        idx = random_compressor(cfg.indexer_dim, cfg.csa_ratio, cfg.hidden, cfg.rope_dim,
                                cfg.csa_ratio == 4, gen, dtype, cfg.norm_eps, cfg.rope_theta)
    sink = torch.randn(cfg.num_heads, generator=gen, dtype=torch.float64).to(dtype)
    return V4LayerWeights(kind, comp, idx, sink).to(device)


def random_inputs(cfg: V4AttnConfig, n: int, gen: torch.Generator, dtype=torch.float64, device=None) -> V4Inputs:
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64, device=gen.device).to(dtype=dtype, device=device)  # noqa: E731
    return V4Inputs(r(n, cfg.num_heads, cfg.head_dim), r(n, cfg.head_dim), r(n, cfg.hidden),
                    r(n, cfg.indexer_heads, cfg.indexer_dim), r(n, cfg.indexer_heads).abs())


def empty_state(cfg: V4AttnConfig, w: V4LayerWeights, dtype=torch.float64, device=None) -> SeqState:
    st = SeqState(0, torch.zeros(0, cfg.head_dim, dtype=dtype, device=device))
    if w.comp is not None:
        st.comp = torch.zeros(0, cfg.head_dim, dtype=dtype, device=device)
        st.comp_kv, st.comp_score = init_state(w.comp, dtype=dtype, device=device)
    if w.indexer is not None:
        st.idx = torch.zeros(0, cfg.indexer_dim, dtype=dtype, device=device)
        st.idx_kv, st.idx_score = init_state(w.indexer, dtype=dtype, device=device)
    return st


def attend_dense(q: torch.Tensor, keys: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D], keys [M, D] (== values), sink [H] -> [H, D]."""
    logits = torch.cat([q @ keys.T * scale, sink.unsqueeze(1)], dim=1)
    probs = torch.softmax(logits, dim=1)[:, :-1]
    return probs @ keys


def indexer_scores(iq: torch.Tensor, iw: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """iq [..., Hi, Di], iw [..., Hi], keys [E, Di] -> [..., E]: sum_h w_h ReLU(q_h . k)."""
    return (torch.relu(iq @ keys.T) * iw.unsqueeze(-1)).sum(-2)


def decode_step(cfg: V4AttnConfig, w: V4LayerWeights, st: SeqState, inp: V4Inputs, t: int) -> torch.Tensor:
    """Decode token t of ``inp`` at position st.length; mutates st; returns o [H, D]."""
    p = st.length
    pos = torch.tensor([p], device=st.kv.device)
    st.kv = torch.cat([st.kv, inp.kv[t:t + 1]])
    st.length = p + 1
    if w.comp is not None:
        kv, s = project(w.comp, inp.x[t:t + 1], pos)
        entry = online_step(w.comp, st.comp_kv, st.comp_score, kv[0], s[0], p)
        if entry is not None:
            st.comp = torch.cat([st.comp, entry.unsqueeze(0)])
    if w.indexer is not None:
        kv, s = project(w.indexer, inp.x[t:t + 1], pos)
        entry = online_step(w.indexer, st.idx_kv, st.idx_score, kv[0], s[0], p)
        if entry is not None:
            st.idx = torch.cat([st.idx, entry.unsqueeze(0)])
    keys = st.kv[max(0, p + 1 - cfg.window):]
    if w.comp is not None and st.comp.shape[0]:
        comp = st.comp
        if w.indexer is not None and comp.shape[0] > cfg.topk:
            score = indexer_scores(inp.iq[t], inp.iw[t], st.idx)
            comp = comp[torch.topk(score, cfg.topk).indices]
        keys = torch.cat([keys, comp])
    return attend_dense(inp.q[t], keys, w.sink, cfg.scale)


def decode_tokens(cfg: V4AttnConfig, w: V4LayerWeights, st: SeqState, inp: V4Inputs) -> torch.Tensor:
    """Sequentially decode every token of inp (N tokens); mutates st; returns o [N, H, D]."""
    outs = [decode_step(cfg, w, st, inp, t) for t in range(inp.q.shape[0])]
    return torch.stack(outs) if outs else inp.q.new_zeros(0, cfg.num_heads, cfg.head_dim)
