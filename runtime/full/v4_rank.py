"""One rank of DeepSeek-V4-Flash under expert parallelism (EP over 8 GPUs, attention data
parallel), random weights or a checkpoint's (``weights``: :mod:`simtree.checkpoints.deepseek_v4`),
with its MTP draft layer, composed of ``simtree.kernels.layers.v4``.

The hidden state it hands the drafter (``hidden``, ``verify``'s rows) is the hyper-connection
streams before the final collapse, [N, hc * h]: the MTP layer reads every stream.

The rank holds every attention layer, the shared expert and its routed experts: 32 of 256 at
full size, whether from ``ModelShape.shard("ep=8")`` (which already holds the rank's 32) or
from the whole model split over ``ep_ranks`` (:func:`simtree.kernels.layers.v4.rank_experts`).
Each token is routed to ``experts_per_token`` of the rank's experts (V4's routing over the
rank's router rows, or its hash table): under uniform routing a rank's experts process the same experts_per_token x T (token,
expert) pairs as in the real deployment.  The all-to-all dispatch and combine are NOT run
(every report row's deployment is :data:`DEPLOYMENT`, "ep=8 rank", which the reports' words say
means the all-to-all not run).

A round's index lists are the kernels' device plans, built in static shapes inside the round
(no host sync): the rank is CUDA-graph captured like the Qwen model.  Their context bound
(``max_context``, the CSA indexer's scan width) is the state's capacity.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from simtree.errors import SimtreeError
from simtree.checkpoints.deepseek_v4 import dequantised_projection
from simtree.checkpoints.quantized import SCALE_SUFFIX
from simtree.kernels.layers import head, v4 as L
from simtree.kernels.layers.weights import make_weights
from simtree.kernels.v4 import V4Cache
from simtree.models import ModelShape, shape_from_config

from .layers import DraftState

__all__ = ["V4Rank", "V4State", "param_specs", "default_ep_ranks", "DEPLOYMENT"]

DEPLOYMENT = "ep={ep} rank"      # one rank run alone: the all-to-all not run (the reports say so beside it)
default_ep_ranks = L.default_ep_ranks


def param_specs(shape: ModelShape, ep_ranks: int | None = None, dtype=torch.bfloat16):
    """Every weight of one EP rank and its MTP layer (what :class:`V4Rank` allocates)."""
    return L.model_specs(shape, ep_ranks, dtype)


def _checked(weights: dict, specs, device, dtype) -> dict:
    """A checkpoint's weights on the device at the runtime's dtypes, each checked against the
    rank's parameter list (every one present but the MTP layer's, no other, the spec's shape)."""
    by_name = {s.name: s for s in specs}
    extra = sorted(set(weights) - set(by_name))
    if extra:
        raise SimtreeError(f"checkpoint: weight {extra[0]} is not a parameter of this V4 rank")
    absent = [n for n in by_name if n not in weights and not n.startswith("mtp.") and not _float_base(weights, n)]
    if absent:
        raise SimtreeError(f"checkpoint: missing weight {absent[0]}")
    out = {}
    for name, t in weights.items():
        s = by_name[name]
        if tuple(t.shape) != tuple(s.shape):
            raise SimtreeError(f"checkpoint: weight {name} has shape {tuple(t.shape)}, the rank needs {tuple(s.shape)}")
        out[name] = t.to(device=device, dtype=dtype if dequantised_projection(name, t, s.dtype) else s.dtype or dtype)
    return out


def _float_base(weights: dict, name: str) -> bool:
    """``name`` is the block scales of an attention linear the checkpoint gave in a float dtype."""
    base = weights.get(name[:-len(SCALE_SUFFIX)]) if name.endswith(SCALE_SUFFIX) else None
    return base is not None and base.is_floating_point() and base.element_size() > 1


@dataclass
class V4State:
    """B sequences: one paged ``V4Cache`` per layer and the lengths on the device (int64 [B])
    (the caches' host ``lens`` are not kept: the device plans read the device lengths)."""

    lengths: torch.Tensor
    max_len: int
    caches: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def max_context(self) -> int:
        return self.max_len - 1


@dataclass
class Pending:
    round: L.V4Round
    scratch: dict             # layer -> VerifyScratch
    features: torch.Tensor | None = None    # [T, len(taps) * h]: the tapped layers' streams, averaged


class V4Rank:
    family = "v4"
    capturable = True

    def __init__(self, shape: ModelShape, device="cuda", dtype=torch.bfloat16, seed: int = 0,
                 ep_ranks: int | None = None, weights: dict | None = None):
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        self.ep_ranks = L.rank_experts(shape, ep_ranks)[1]
        self.d = L.V4Dims.of(shape, ep_ranks)
        self.deployment = DEPLOYMENT.format(ep=self.ep_ranks)
        specs = param_specs(shape, ep_ranks, dtype)
        if weights is None:
            self.w = make_weights(specs, self.device, dtype, seed)
        else:       # a checkpoint's: the MTP layer drawn at random where it had none
            self.w = _checked(weights, specs, self.device, dtype)
            self.w.update(make_weights([s for s in specs if s.name not in self.w and not _float_base(self.w, s.name)],
                                       self.device, dtype, seed))
        self.kinds = shape.layer_kinds
        self.cfg = L.attn_config(self.d)
        self._layer_w = [self._sub(f"layers.{i}.") for i in range(len(self.kinds))]
        self._mtp_w = self._sub("mtp.")
        self.layer_weights = [L.layer_weights(w, kind, self.d) for w, kind in zip(self._layer_w, self.kinds)]
        self.first_of_kind = {}
        for i, kind in enumerate(self.kinds):
            self.first_of_kind.setdefault(kind, i)
        self.ropes = L.rope_tables(self.d, self.device, dtype)
        self.rope = self.ropes["main"]          # the MTP layer's (SWA)
        on_gpu = self.device.type == "cuda" and dtype != torch.float64
        self.impl = "triton" if on_gpu else "torch"
        self._const = {}

    @classmethod
    def from_checkpoint(cls, folder, device="cuda", dtype=torch.bfloat16, ep_rank: int = 0, ep_ranks: int = 1,
                        seed: int = 0, note=print) -> "V4Rank":
        """The rank of a DeepSeek-V4 checkpoint folder (``ep_ranks`` > 1: expert-parallel rank
        ``ep_rank``, its experts only).  Without MTP weights the drafter is random (``note`` says so)."""
        from simtree.checkpoints import deepseek_v4 as ckpt
        whole = shape_from_config(folder)
        E = int(whole.mlp["n_experts"])
        if ep_ranks < 1 or E % ep_ranks or not 0 <= ep_rank < ep_ranks:
            raise SimtreeError(f"{folder}: {E} experts do not make rank {ep_rank} of {ep_ranks} expert-parallel ranks")
        shape = whole if ep_ranks == 1 else dataclasses.replace(
            whole, mlp={**whole.mlp, "n_experts": E // ep_ranks, "ep_ranks": ep_ranks, "ep_rank": ep_rank})
        w, has_mtp = ckpt.load_weights(folder, shape, param_specs(shape, None, dtype), device, dtype)
        if not has_mtp:
            note(f"{folder}: no MTP weights (mtp.*): the speculative modes draft with a random MTP layer "
                 "(acceptance means nothing; the output stays lossless)")
        return cls(shape, device, dtype, seed, None, weights=w)

    def _sub(self, prefix: str) -> dict:
        return {k[len(prefix):]: v for k, v in self.w.items() if k.startswith(prefix)}

    @property
    def hidden(self) -> int:
        """Width of the hidden rows handed to the drafter: the hc streams, hc * h."""
        return self.d.hc * self.d.h

    @property
    def draft_window(self) -> int:
        """The MTP layer's sliding window in positions (its SWA block)."""
        return int(self.d.window)

    @property
    def vocab(self) -> int:
        return self.d.vocab

    # ---- state -----------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int) -> V4State:
        for table in self.ropes.values():
            table.ensure(max_len + 2)
        st = V4State(torch.zeros(batch, dtype=torch.int64, device=self.device), max_len)
        sdt = torch.float64 if self.dtype == torch.float64 else torch.float32
        for i, lw in enumerate(self.layer_weights):
            st.caches[i] = V4Cache(self.cfg, lw, batch, max_len, dtype=self.dtype, state_dtype=sdt,
                                   device=self.device, seed=0)
        return st

    def new_draft_state(self, st: V4State, scratch_rows: int) -> DraftState:
        B, D = st.batch_size, self.d.D
        kv = torch.zeros(B, st.max_len + 1, 1, 1, D, dtype=self.dtype, device=self.device)
        scratch = torch.zeros(B, scratch_rows, 1, 1, D, dtype=self.dtype, device=self.device)
        return DraftState(st.lengths.clone(), st.max_len, kv, scratch)      # one latent: K == V

    @torch.no_grad()
    def reset(self, st: V4State, ds: DraftState | None = None) -> None:
        """Empty every sequence: lengths 0, compressor buffers back to kv 0, score -inf."""
        st.lengths.zero_()
        for cache in st.caches.values():
            for buf in (cache.comp_buf, cache.idx_buf):
                if buf is not None:
                    buf[0].zero_()
                    buf[1].fill_(float("-inf"))
        if ds is not None:
            ds.lengths.zero_()

    @torch.no_grad()
    def fill_random(self, st: V4State, ds: DraftState | None, context_len: int, seed: int = 0) -> None:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for cache in st.caches.values():
            for t in cache.persistent_tensors().values():
                t.normal_(generator=gen)
        if ds is not None:
            ds.kv.normal_(generator=gen)
        st.lengths.fill_(context_len)

    def _kinds(self, st: V4State) -> dict:
        return {kind: (st.caches[i], self.layer_weights[i]) for kind, i in self.first_of_kind.items()}

    # ---- target: verify / commit / decode ----------------------------------------------------
    @torch.no_grad()
    def verify(self, st: V4State, tokens: torch.Tensor, parents: torch.Tensor, taps=()):
        """As QwenModel.verify: (hidden [B*n, hc * h], the streams; Pending); the caches are not
        written.  The tree's tokens reach the hash-routed layers.  ``taps``: as QwenModel's, each
        tapped layer's hc streams averaged to one h-wide row (ASSUMPTION: a V4 block drafter
        reads one row per tapped layer, as it does for a one-stream target)."""
        rm = L.round_meta(self.ropes, self._kinds(st), st.lengths, parents, st.max_context)
        ids = tokens.reshape(-1)
        x = L.embed_streams(self.d, self.w["embed"], ids)
        scratch, tapped = {}, []
        for i, kind in enumerate(self.kinds):
            x, scratch[i] = L.layer(self._layer_w[i], self.d, kind, x, st.caches[i], self.layer_weights[i], rm,
                                    self.impl, ids)
            if i in taps:
                tapped.append(x.mean(1))
        feats = torch.cat(tapped, -1) if tapped else None
        return x.reshape(x.shape[0], -1), Pending(rm, scratch, feats)

    @torch.no_grad()
    def commit(self, st: V4State, pend: Pending, accepted: torch.Tensor) -> None:
        rm = pend.round
        cplans = L.commit_plans(self._kinds(st), rm, accepted)
        for i, kind in enumerate(self.kinds):
            L.attn_commit(kind, st.caches[i], pend.scratch[i], cplans[kind], self.impl)
        L.advance(st.lengths, rm, accepted)

    @torch.no_grad()
    def decode(self, st: V4State, tokens: torch.Tensor) -> torch.Tensor:
        """One plain step through the same tree kernels (one-node trees): -> hidden [B, h]."""
        B = tokens.shape[0]
        hidden, pend = self.verify(st, tokens[:, None], self._roots(B))
        self.commit(st, pend, self._zeros(B))
        return hidden

    def _roots(self, B: int) -> torch.Tensor:
        """[B, 1] one-node trees (made once: a decode step inside a CUDA graph allocates nothing new)."""
        if ("roots", B) not in self._const:
            self._const["roots", B] = torch.full((B, 1), -1, dtype=torch.int64, device=self.device)
        return self._const["roots", B]

    def _zeros(self, B: int) -> torch.Tensor:
        if ("zeros", B) not in self._const:
            self._const["zeros", B] = torch.zeros(B, dtype=torch.int64, device=self.device)
        return self._const["zeros", B]

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return head.greedy(L.hc_collapse(self.w, self.d, hidden), self.w["norm"], self.w["lm_head"], self.d.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head.logits_fp32(L.final_hidden(self.w, self.d, hidden), self.w["lm_head"])

    # ---- MTP draft layer ---------------------------------------------------------------------
    @torch.no_grad()
    def draft_forward(self, ds: DraftState, tokens, prev_hidden, pos, rows, bits) -> torch.Tensor:
        """As QwenModel.draft_forward; SWA (window, sink) over the MTP's own latent cache."""
        return L.mtp_forward(self._mtp_w, self.d, self.w["embed"], self.w["mtp.sink"], tokens, prev_hidden,
                             self.rope.rows(pos), pos, rows, bits, ds.kv, ds.scratch, ds.lengths)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        lead = hidden.shape[:-1]
        return head.logits_fp32(L.final_hidden(self.w, self.d, hidden, "mtp."), self.w["lm_head"]).view(*lead, -1)
