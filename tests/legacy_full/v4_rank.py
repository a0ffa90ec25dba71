"""One rank of DeepSeek-V4-Flash under expert parallelism (EP over 8 GPUs, attention data
parallel), random weights, with its MTP draft layer.

The rank holds every attention layer, the shared expert and ``n_experts / ep_ranks`` routed
experts per layer (32 of 256 at full size).  Each token is routed to ``experts_per_token`` of
the rank's experts by a softmax gate over them: under uniform routing a rank's experts process
the same experts_per_token x T (token, expert) pairs as in the real deployment.  The all-to-all
dispatch and combine are NOT run (:data:`DEPLOYMENT` says so in every report row).

A layer (hyper-connections and FP8/FP4 ignored, as the model YAML says): x += W_ob groups(W_oa
o) with o = tree verify of the SWA / CSA / HCA attention through ``simtree.kernels.v4`` on
q = RoPE(W_qb RMSNorm(W_qa h)), latent kv = RoPE(RMSNorm(W_kv h)) (RoPE on the last
``rope_dim`` channels, removed from o again since K == V), the compressors reading h, the
CSA indexer reading W_iq of the q latent; then x += MoE(RMSNorm x) (routed + shared expert).

The round's index lists come from one swappable object (``plans``, :class:`HostPlans`: the
trees copied to the host - one sync - and ``plan_verify`` / ``plan_commit`` there); a device
builder with the same ``VerifyPlan`` / ``CommitPlan`` fields replaces it without touching the
model.  Host plans have round-dependent shapes, so this model is not CUDA-graph captured
(``capturable`` False); its MTP layer (SWA over its own latent cache through
:mod:`.attention`, window and sink) is.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from simtree.errors import SimtreeError
from simtree.kernels.gdn import tree_meta
from simtree.kernels.v4 import (CompressorParams, V4AttnConfig, V4Cache, V4Inputs, V4LayerWeights,
                                apply_commit, plan_commit, plan_verify, tree_verify)
from simtree.models import ModelShape
from simtree.trees.tree import DraftTree, TreeBatch

from .attention import tree_attention
from .layers import DraftState, batch_rows, rms_norm, rope, route_topk, routed_experts, swiglu
from .params import Spec, linear, make_weights

__all__ = ["V4Rank", "V4State", "HostPlans", "param_specs", "default_ep_ranks", "DEPLOYMENT"]

EP_RANKS = 8
ROPE_THETA = 10000.0      # the kernels' compressor RoPE (V4AttnConfig.rope_theta)
DEPLOYMENT = "ep={ep} rank (all-to-all not run)"


def default_ep_ranks(shape: ModelShape) -> int:
    """8 (the deployment), or fewer where 8 would leave a rank fewer experts than a token picks
    (the tiny test model: 8 experts, 2 per token -> 2 ranks of 4)."""
    m = shape.mlp
    if m["n_experts"] // EP_RANKS >= m["experts_per_token"]:
        return EP_RANKS
    return max(1, m["n_experts"] // (2 * m["experts_per_token"]))


def _dims(shape: ModelShape, ep_ranks: int) -> dict:
    v, m = shape.v4, shape.mlp
    d = dict(h=shape.hidden, V=shape.vocab, H=int(v["q_heads"]), D=int(v["head_dim"]), rope=int(v["rope_dim"]),
             qr=int(v["q_lora_rank"]), G=int(v["o_groups"]), orank=int(v["o_lora_rank"]), window=int(v["window"]),
             csa=int(v["csa_ratio"]), hca=int(v["hca_ratio"]), topk=int(v["index_topk"]), Hi=int(v["index_heads"]),
             Di=int(v["index_head_dim"]), topk_e=int(m["experts_per_token"]), I=int(m["expert_intermediate"]),
             Is=int(m.get("n_shared", 0)) * int(m.get("shared_intermediate", 0)))
    if m["n_experts"] % ep_ranks or m["n_experts"] // ep_ranks < d["topk_e"]:
        raise SimtreeError(f"model {shape.name!r}: {m['n_experts']} experts over {ep_ranks} ranks leave fewer "
                           f"than the {d['topk_e']} a token picks")
    d["E"] = m["n_experts"] // ep_ranks
    return d


def _compressor_specs(p: str, dim: int, ratio: int, overlap: bool, h: int, dt) -> list[Spec]:
    c = (2 if overlap else 1) * dim
    return [linear(p + "wkv", c, h, dtype=dt), linear(p + "wgate", c, h, dtype=dt),
            Spec(p + "ape", (ratio, c), "normal", 0.5, dt), Spec(p + "norm", (dim,), "const", 1.0, dt)]


def _attn_specs(p: str, kind: str, d: dict, out_gain: float, comp_dt) -> list[Spec]:
    h, H, D = d["h"], d["H"], d["D"]
    specs = [linear(p + "wq_a", d["qr"], h), Spec(p + "q_norm", (d["qr"],), "const", 1.0),
             linear(p + "wq_b", H * D, d["qr"]), linear(p + "wkv", D, h), Spec(p + "kv_norm", (D,), "const", 1.0),
             linear(p + "wo_a", d["orank"], H // d["G"] * D, groups=d["G"]),
             linear(p + "wo_b", h, d["G"] * d["orank"], out_gain), Spec(p + "sink", (H,), "normal", 1.0, torch.float32)]
    if kind == "csa":
        specs += _compressor_specs(p + "comp.", D, d["csa"], d["csa"] == 4, h, comp_dt)
        specs += _compressor_specs(p + "idx.", d["Di"], d["csa"], d["csa"] == 4, h, comp_dt)
        specs += [linear(p + "wq_idx", d["Hi"] * d["Di"], d["qr"]), linear(p + "w_idx", d["Hi"], h)]
    elif kind == "hca":
        specs += _compressor_specs(p + "comp.", D, d["hca"], d["hca"] == 4, h, comp_dt)
    return specs


def _moe_specs(p: str, d: dict, out_gain: float) -> list[Spec]:
    specs = [linear(p + "router", d["E"], d["h"]), linear(p + "experts_gu", 2 * d["I"], d["h"], groups=d["E"]),
             linear(p + "experts_down", d["h"], d["I"], out_gain, groups=d["E"])]
    if d["Is"]:
        specs += [linear(p + "shared_gu", 2 * d["Is"], d["h"]), linear(p + "shared_down", d["h"], d["Is"], out_gain)]
    return specs


def _block_specs(p: str, kind: str, d: dict, out_gain: float, comp_dt) -> list[Spec]:
    return [Spec(p + "ln1", (d["h"],), "const", 1.0), Spec(p + "ln2", (d["h"],), "const", 1.0),
            *_attn_specs(p, kind, d, out_gain, comp_dt), *_moe_specs(p, d, out_gain)]


def param_specs(shape: ModelShape, ep_ranks: int | None = None, dtype=torch.bfloat16) -> list[Spec]:
    """Every weight of one EP rank and its MTP layer (what :class:`V4Rank` allocates); the
    compressors in fp32 (float64 in a float64 model), as the kernels' steps keep them."""
    bad = sorted(set(shape.layer_kinds) - {"swa", "csa", "hca"})
    if bad or shape.mlp.get("kind") != "moe":
        raise SimtreeError(f"model {shape.name!r} is not a V4 model (layer kinds {bad}, mlp "
                           f"{shape.mlp.get('kind')!r}): the V4 rank builds swa / csa / hca layers with MoE")
    if shape.draft.get("attention", "swa") != "swa":
        raise SimtreeError(f"model {shape.name!r}: the V4 MTP layer is an SWA block, draft.attention is "
                           f"{shape.draft.get('attention')!r}")
    d = _dims(shape, ep_ranks or default_ep_ranks(shape))
    comp_dt = torch.float64 if dtype == torch.float64 else torch.float32
    out_gain = 1.0 / math.sqrt(2 * shape.num_layers)
    specs = [Spec("embed", (d["V"], d["h"])), linear("lm_head", d["V"], d["h"]), Spec("norm", (d["h"],), "const", 1.0)]
    for i, kind in enumerate(shape.layer_kinds):
        specs += _block_specs(f"layers.{i}.", kind, d, out_gain, comp_dt)
    specs += [Spec("mtp.enorm", (d["h"],), "const", 1.0), Spec("mtp.hnorm", (d["h"],), "const", 1.0),
              linear("mtp.fc", d["h"], 2 * d["h"]), *_block_specs("mtp.", "swa", d, out_gain, comp_dt),
              Spec("mtp.norm", (d["h"],), "const", 1.0)]
    return specs


@dataclass
class V4State:
    """B sequences: one paged ``V4Cache`` per layer (host lengths inside each) and the same
    lengths on the device (int64 [B])."""

    lengths: torch.Tensor
    max_len: int
    caches: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])


@dataclass
class Pending:
    B: int
    n: int
    depth: torch.Tensor       # [B, n]
    plans: dict               # kind -> VerifyPlan
    scratch: dict             # layer -> VerifyScratch


class HostPlans:
    """Index lists built on the host (kernels.v4 ``plan_verify`` / ``plan_commit``), one per
    layer kind per round, shared by that kind's layers (their caches have the same pages).
    ``blocked_s`` adds up the time spent waiting for the device in the two host copies."""

    def __init__(self):
        self.blocked_s = 0.0

    def _host(self, t: torch.Tensor):
        t0 = time.perf_counter()
        out = t.cpu().numpy()
        self.blocked_s += time.perf_counter() - t0
        return out

    def verify(self, model: "V4Rank", st: V4State, parents: torch.Tensor) -> dict:
        par = self._host(parents)                                     # the round's tree, on the host
        batch = TreeBatch(tuple(DraftTree(row) for row in par))
        return {kind: plan_verify(st.caches[i], batch, model.layer_weights[i], device=model.device)
                for kind, i in model.first_of_kind.items()}

    def commit(self, model: "V4Rank", st: V4State, plans: dict, accepted: torch.Tensor) -> dict:
        acc = self._host(accepted)
        batch = next(iter(plans.values())).batch
        paths = [batch.trees[b].path_to(int(a)).tolist() for b, a in enumerate(acc)]
        return {kind: plan_commit(st.caches[i], model.layer_weights[i], plans[kind], paths, device=model.device)
                for kind, i in model.first_of_kind.items()}


class V4Rank:
    family = "v4"
    capturable = False
    eager_reason = ("eager stages: the round's index lists are built on the host (kernels.v4 plan_verify / "
                    "plan_commit, round-dependent shapes), two host syncs per round")

    def __init__(self, shape: ModelShape, device="cuda", dtype=torch.bfloat16, seed: int = 0,
                 ep_ranks: int | None = None, plans=None):
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        self.ep_ranks = ep_ranks or default_ep_ranks(shape)
        self.d = _dims(shape, self.ep_ranks)
        self.deployment = DEPLOYMENT.format(ep=self.ep_ranks)
        self.w = make_weights(param_specs(shape, self.ep_ranks, dtype), self.device, dtype, seed)
        self.kinds = shape.layer_kinds
        d = self.d
        self.cfg = V4AttnConfig(num_heads=d["H"], head_dim=d["D"], rope_dim=d["rope"], window=d["window"],
                                csa_ratio=d["csa"], hca_ratio=d["hca"], topk=d["topk"], indexer_heads=d["Hi"],
                                indexer_dim=d["Di"], hidden=d["h"], rope_theta=ROPE_THETA,
                                page_size=256 if d["h"] >= 1024 else 16)
        self.layer_weights = [self._layer_weights(i, kind) for i, kind in enumerate(self.kinds)]
        self.first_of_kind = {}
        for i, kind in enumerate(self.kinds):
            self.first_of_kind.setdefault(kind, i)
        self.plans = plans or HostPlans()
        on_gpu = self.device.type == "cuda" and dtype != torch.float64
        self.attention_impl, self.commit_impl = ("triton", "triton") if on_gpu else ("torch", "torch")

    @property
    def hidden(self) -> int:
        return self.d["h"]

    @property
    def vocab(self) -> int:
        return self.d["V"]

    def _compressor(self, p: str, dim: int, ratio: int) -> CompressorParams:
        w = self.w
        return CompressorParams(w[p + "wkv"], w[p + "wgate"], w[p + "ape"], w[p + "norm"], ratio, dim,
                                self.d["rope"], ratio == 4, theta=ROPE_THETA)

    def _layer_weights(self, i: int, kind: str) -> V4LayerWeights:
        p, d = f"layers.{i}.", self.d
        comp = idx = None
        if kind in ("csa", "hca"):
            comp = self._compressor(p + "comp.", d["D"], d["csa"] if kind == "csa" else d["hca"])
        if kind == "csa":
            idx = self._compressor(p + "idx.", d["Di"], d["csa"])
        return V4LayerWeights(kind, comp, idx, self.w[p + "sink"])

    # ---- state -----------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int) -> V4State:
        st = V4State(torch.zeros(batch, dtype=torch.int64, device=self.device), max_len)
        sdt = torch.float64 if self.dtype == torch.float64 else torch.float32
        for i, lw in enumerate(self.layer_weights):
            st.caches[i] = V4Cache(self.cfg, lw, batch, max_len, dtype=self.dtype, state_dtype=sdt,
                                   device=self.device, seed=0)
        return st

    def new_draft_state(self, st: V4State, scratch_rows: int) -> DraftState:
        B, D = st.batch_size, self.d["D"]
        k = torch.zeros(B, st.max_len + 1, 1, D, dtype=self.dtype, device=self.device)
        sk = torch.zeros(B, scratch_rows, 1, D, dtype=self.dtype, device=self.device)
        return DraftState(st.lengths.clone(), st.max_len, k, k, sk, sk)      # one latent: K == V

    @torch.no_grad()
    def reset(self, st: V4State, ds: DraftState | None = None) -> None:
        """Empty every sequence: lengths 0, compressor buffers back to kv 0, score -inf."""
        st.lengths.zero_()
        for cache in st.caches.values():
            cache.lens[:] = 0
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
            cache.lens[:] = context_len
        if ds is not None:
            ds.k.normal_(generator=gen)
        st.lengths.fill_(context_len)

    # ---- pieces ----------------------------------------------------------------------------
    def _latent(self, p: str, h: torch.Tensor, pos: torch.Tensor):
        """h [..., hidden] -> q [..., H, D], kv [..., D] (RoPE'd), q latent [..., q_lora]."""
        d, w = self.d, self.w
        qr = rms_norm(F.linear(h, w[p + "wq_a"]), w[p + "q_norm"])
        q = rope(F.linear(qr, w[p + "wq_b"]).unflatten(-1, (d["H"], d["D"])), pos, d["rope"], ROPE_THETA, last=True)
        kv = rms_norm(F.linear(h, w[p + "wkv"]), w[p + "kv_norm"])
        kv = rope(kv.unsqueeze(-2), pos, d["rope"], ROPE_THETA, last=True).squeeze(-2)
        return q.contiguous(), kv.contiguous(), qr

    def _attn_out(self, p: str, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """o [..., H, D] -> [..., hidden]: RoPE removed (values carry it), grouped W_oa, W_ob."""
        d = self.d
        o = rope(o, -pos, d["rope"], ROPE_THETA, last=True)
        lead = o.shape[:-2]
        og = o.reshape(-1, d["G"], d["H"] // d["G"] * d["D"]).transpose(0, 1)           # [G, T, H/G*D]
        og = torch.bmm(og, self.w[p + "wo_a"].transpose(1, 2)).transpose(0, 1)         # [T, G, o_rank]
        return F.linear(og.reshape(*lead, -1), self.w[p + "wo_b"])

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        h = rms_norm(x, w[p + "ln2"])
        flat = h.reshape(-1, h.shape[-1])
        ids, wts = route_topk(flat, w[p + "router"], self.d["topk_e"])
        y = routed_experts(flat, ids, wts, w[p + "experts_gu"], w[p + "experts_down"])
        if self.d["Is"]:
            y = y + swiglu(flat, w[p + "shared_gu"], w[p + "shared_down"])
        return x + y.view(x.shape)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(hidden, self.w["norm"]), self.w["lm_head"])

    @functools.lru_cache(maxsize=16)
    def _cu(self, B: int, n: int) -> torch.Tensor:
        return torch.arange(0, B * n + 1, n, dtype=torch.int64, device=self.device)

    # ---- target: verify / commit / decode ----------------------------------------------------
    @torch.no_grad()
    def verify(self, st: V4State, tokens: torch.Tensor, parents: torch.Tensor):
        """As QwenModel.verify: (hidden [B*n, h], Pending); the caches are not written."""
        B, n = tokens.shape
        plans = self.plans.verify(self, st, parents)
        depth = tree_meta(parents.reshape(-1), self._cu(B, n), max_nodes=n, validate=False).depth.view(B, n)
        pos = (st.lengths[:, None] + depth).reshape(-1)
        x = self.w["embed"][tokens.reshape(-1)]
        scratch = {}
        for i, kind in enumerate(self.kinds):
            p = f"layers.{i}."
            h = rms_norm(x, self.w[p + "ln1"])
            q, kv, qr = self._latent(p, h, pos)
            iq = iw = None
            if kind == "csa":
                d = self.d
                iq = rope(F.linear(qr, self.w[p + "wq_idx"]).unflatten(-1, (d["Hi"], d["Di"])), pos, d["rope"],
                          ROPE_THETA, last=True).contiguous()
                iw_dt = torch.float64 if self.dtype == torch.float64 else torch.float32
                iw = F.linear(h, self.w[p + "w_idx"]).to(iw_dt) * d["Hi"] ** -0.5
            o, scratch[i] = tree_verify(st.caches[i], self.layer_weights[i], V4Inputs(q, kv, h, iq, iw), plans[kind],
                                        attention=self.attention_impl)
            x = x + self._attn_out(p, o, pos)
            x = self._moe(p, x)
        return x, Pending(B, n, depth, plans, scratch)

    @torch.no_grad()
    def commit(self, st: V4State, pend: Pending, accepted: torch.Tensor) -> None:
        cplans = self.plans.commit(self, st, pend.plans, accepted)
        for i, kind in enumerate(self.kinds):
            apply_commit(st.caches[i], pend.scratch[i], cplans[kind], impl=self.commit_impl)
        new_lens = next(iter(cplans.values())).new_lens
        for cache in st.caches.values():
            cache.lens[:] = new_lens
        st.lengths += pend.depth.gather(1, accepted[:, None])[:, 0] + 1

    @torch.no_grad()
    def decode(self, st: V4State, tokens: torch.Tensor) -> torch.Tensor:
        """One plain step through the same tree kernels (one-node trees): -> hidden [B, h]."""
        B = tokens.shape[0]
        minus = torch.full((B, 1), -1, dtype=torch.int64, device=self.device)
        hidden, pend = self.verify(st, tokens[:, None], minus)
        self.commit(st, pend, torch.zeros(B, dtype=torch.int64, device=self.device))
        return hidden

    # ---- MTP draft layer ---------------------------------------------------------------------
    @torch.no_grad()
    def draft_forward(self, ds: DraftState, tokens, prev_hidden, pos, rows, bits) -> torch.Tensor:
        """As QwenModel.draft_forward; SWA (window, sink) over the MTP's own latent cache."""
        w = self.w
        B, Q = tokens.shape
        e = rms_norm(w["embed"][tokens], w["mtp.enorm"])
        x = F.linear(torch.cat([e, rms_norm(prev_hidden, w["mtp.hnorm"])], -1), w["mtp.fc"])
        q, kv, _ = self._latent("mtp.", rms_norm(x, w["mtp.ln1"]), pos)
        ds.scratch_k.index_put_((batch_rows(B, Q, self.device), rows), kv[:, :, None])
        cache = ds.k[:, :ds.max_len]
        o = tree_attention(q, cache, cache, ds.lengths, pos, ds.scratch_k, ds.scratch_k, bits,
                           scale=self.d["D"] ** -0.5, window=self.d["window"], sink=w["mtp.sink"])
        x = x + self._attn_out("mtp.", o, pos)
        return self._moe("mtp.", x)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(hidden, self.w["mtp.norm"]), self.w["lm_head"])

