"""Layers of a Qwen3.5/3.6-style GDN hybrid (dense MLP), built from the kernels: what the full
runtime's model composes and what the profiler times, layer kind by layer kind.

Every function takes a layer's weights (``w``: its names without the ``layers.<i>.`` prefix),
the model's :class:`QwenDims` and explicit state buffers; none keeps state.  A layer is

    x = mixer_post(x, core(mixer_pre(x)));  x = mlp(x)          (residual adds in the GEMMs)

GDN mixer (docs/math/gdn_tree_solve.md): one fused in_proj -> [qkv | z | b | a]; the short
causal conv of every node over its ancestors (one fused op, output q | k | v contiguous);
g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) (one fused op); the tree verify
(``kernels.gdn``); out = W_o (RMSNorm(o) * SiLU(z)) (one fused norm).  Gated attention: one
fused q(+gate) | k | v projection; per-head RMSNorm + partial RoPE of q and k in one op each,
k and v into one [N, 2, Hkv, D] tensor (the KV cache's row layout, written by one
``index_copy_`` per layer); attention over the cache plus the node's ancestors; output gate
sigmoid(g) * o.  MLP: RMSNorm, one gate|up GEMM, SiLU(gate) * up, down.

Norm weights are the scale each RMSNorm multiplies by: Qwen3.5's zero-centred norms
(``x * (1 + w)``: layer, q / k, final and MTP norms) hold their checkpoint's ``1 + w``
(simtree.checkpoints.qwen3_5); the GDN output norm its ``w``.  RoPE theta, the rotated dims and
the norm eps come from the shape (a checkpoint's config.json; defaults for YAML shapes).

Everything a round shares - positions, RoPE rows, the ancestor bits, the GDN kernels' tree
metadata, the conv taps, the commit's cache rows - is built once per round by
:func:`round_meta` / :func:`commit_meta`; a layer issues no index arithmetic of its own.

Caches: attention [B, S + 1, 2, Hkv, D] (row S: a trash row for writes that are not
committed), GDN state [B, HV, K, V] float32, conv state [B, W - 1, C] (oldest first).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from simtree.errors import SimtreeError
from simtree.kernels.gdn import (gdn_defer_commit, gdn_fold_pending, gdn_tree_commit, gdn_tree_verify, gdn_tree_verify_folding,
                                 tree_meta, verify_round_meta)
from simtree.kernels.gdn.ops import recurrent_step
from simtree.models import ModelShape

from . import ops
from .attention import tree_attention
from .head import embed
from .opcount import kernel_core
from .rope import RopeTable
from .weights import Spec, ends_specs, linear, mtp_specs, residual_gain

__all__ = ["QwenDims", "ROPE_FRACTION", "ROPE_THETA", "layer_specs", "model_specs", "prepare", "RoundTables",
           "QwenRound", "QwenCommit", "round_meta", "commit_meta", "advance", "gdn_pre", "gdn_core_verify",
           "gdn_core_decode",
           "gdn_post", "gdn_commit", "attn_pre", "attn_core", "attn_post", "attn_commit", "mlp", "gdn_layer",
           "attn_layer", "mtp_forward", "GdnPre", "new_cache"]

# Defaults for shapes without a config.json (the YAML shapes); a checkpoint's config sets its own.
ROPE_FRACTION = 0.25       # partial_rotary_factor of Qwen3.5 / 3.6: RoPE on 64 of 256 dims
ROPE_THETA = 10_000_000.0  # rope_theta of Qwen3.5 / 3.6 (config.json rope_parameters)
EPS = 1e-6                 # rms_norm_eps


@dataclass(frozen=True)
class QwenDims:
    """A (possibly sharded) shape's numbers: heads and MLP columns are whatever the shape says."""

    h: int
    vocab: int
    I: int
    Hq: int
    Hkv: int
    D: int
    gate: bool
    rope: int
    gH: int = 0
    gHV: int = 0
    gK: int = 0
    gV: int = 0
    W: int = 4
    theta: float = ROPE_THETA
    eps: float = EPS

    @classmethod
    def of(cls, shape: ModelShape) -> "QwenDims":
        a, g = shape.attn, shape.gdn
        D = int(a["head_dim"])
        rope = int(a.get("rope_dim", max(2, int(D * ROPE_FRACTION) // 2 * 2)))
        extra = {}
        if g:
            extra = dict(gH=int(g["key_heads"]), gHV=int(g["value_heads"]), gK=int(g["key_dim"]),
                         gV=int(g["value_dim"]), W=int(g.get("conv_kernel", 4)))
            if not 2 <= extra["W"] <= 4:
                raise SimtreeError(f"model {shape.name!r}: conv_kernel must be 2..4, got {extra['W']}")
        cfg = shape.config or {}
        return cls(shape.hidden, shape.vocab, int(shape.mlp["intermediate"]), int(a["q_heads"]), int(a["kv_heads"]),
                   D, bool(a.get("output_gate", False)), rope, **extra, theta=float(a.get("rope_theta", ROPE_THETA)),
                   eps=float(cfg.get("rms_norm_eps", EPS)))

    @property
    def conv(self) -> int:
        return 2 * self.gH * self.gK + self.gHV * self.gV

    @property
    def q_out(self) -> int:
        return self.Hq * self.D * (2 if self.gate else 1)


# ---- weights ----------------------------------------------------------------------------------
def layer_specs(p: str, kind: str, d: QwenDims, out_gain: float) -> list[Spec]:
    """One block: the mixer of ``kind`` (gdn / attn) and the dense MLP, names prefixed by ``p``."""
    if kind == "gdn":
        HV, V = d.gHV, d.gV
        mixer = [linear(p + "in_proj", d.conv + HV * V + 2 * HV, d.h),       # qkv | z | b | a
                 Spec(p + "conv", (d.conv, d.W), "normal", d.W ** -0.5),
                 Spec(p + "A_log", (HV,), "log_uniform", 16.0, torch.float32),
                 Spec(p + "dt_bias", (HV,), "const", 1.0, torch.float32),
                 Spec(p + "gnorm", (V,), "const", 1.0), linear(p + "out", d.h, HV * V, out_gain)]
    elif kind == "attn":
        mixer = [linear(p + "qkv", d.q_out + 2 * d.Hkv * d.D, d.h), Spec(p + "q_norm", (d.D,), "const", 1.0),
                 Spec(p + "k_norm", (d.D,), "const", 1.0), linear(p + "o", d.h, d.Hq * d.D, out_gain)]
    else:
        raise SimtreeError(f"a Qwen layer is gdn or attn, not {kind!r}")
    return [Spec(p + "ln1", (d.h,), "const", 1.0), *mixer, Spec(p + "ln2", (d.h,), "const", 1.0),
            linear(p + "gate_up", 2 * d.I, d.h), linear(p + "down", d.h, d.I, out_gain)]


def model_specs(shape: ModelShape) -> list[Spec]:
    """Every weight of the target and its MTP layer."""
    bad = sorted(set(shape.layer_kinds) - {"gdn", "attn"})
    if bad or shape.mlp.get("kind") != "dense":
        raise SimtreeError(f"model {shape.name!r} is not a dense GDN hybrid (layer kinds {bad}, mlp "
                           f"{shape.mlp.get('kind')!r}): the Qwen layers are gdn / attn with a dense MLP")
    if shape.draft.get("attention", "attn") != "attn":
        raise SimtreeError(f"model {shape.name!r}: the Qwen MTP layer is a full-attention block, "
                           f"draft.attention is {shape.draft.get('attention')!r}")
    d, gain = QwenDims.of(shape), residual_gain(shape.num_layers)
    specs = ends_specs(d.vocab, d.h)
    for i, kind in enumerate(shape.layer_kinds):
        specs += layer_specs(f"layers.{i}.", kind, d, gain)
    return specs + mtp_specs(d.h, layer_specs("mtp.", "attn", d, gain))


def prepare(w: dict, dtype: torch.dtype) -> dict:
    """A layer's weights plus what is derived from them once (not per call): -exp(A_log)."""
    out = dict(w)
    if "A_log" in w:
        gdt = torch.float64 if dtype == torch.float64 else torch.float32
        out["neg_A"] = -w["A_log"].to(gdt).exp()
        out["dt_bias"] = w["dt_bias"].to(gdt)
    return out


def new_cache(d: QwenDims, batch: int, max_len: int, dtype, device) -> torch.Tensor:
    """An attention layer's KV cache [B, max_len + 1, 2, Hkv, D] (row max_len: trash)."""
    return torch.zeros(batch, max_len + 1, 2, d.Hkv, d.D, dtype=dtype, device=device)


# ---- per-round metadata ---------------------------------------------------------------------
class RoundTables:
    """What rounds of one model reuse: the RoPE table and constant index tensors per batch shape."""

    def __init__(self, d: QwenDims, device, length: int = 0, dtype=torch.float32):
        self.d, self.device = d, torch.device(device)
        self.rope = RopeTable(d.rope, d.theta, device, length, dtype)

    @functools.lru_cache(maxsize=32)
    def cu(self, B: int, n: int) -> torch.Tensor:
        return torch.arange(0, B * n + 1, n, dtype=torch.int64, device=self.device)

    @functools.lru_cache(maxsize=32)
    def roots(self, B: int) -> torch.Tensor:
        return torch.full((B,), -1, dtype=torch.int64, device=self.device)

    @functools.lru_cache(maxsize=32)
    def arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64, device=self.device)

    @functools.lru_cache(maxsize=32)
    def ones_bits(self, B: int) -> torch.Tensor:
        return torch.ones(B, 1, 1, dtype=torch.int64, device=self.device)


@dataclass
class QwenCommit:
    """Where a round's accepted rows go: kv_rows [N] flat cache rows (b (S + 1) + position, or
    the trash row S), conv_idx [B, W - 1] the conv state's new sources, gained [B] tokens."""

    kv_rows: torch.Tensor
    conv_idx: torch.Tensor | None
    accepted: torch.Tensor
    gained: torch.Tensor


@dataclass
class QwenRound:
    """One round's shared metadata (B sequences x n nodes, N = B n; n = 1 and ``decode``: plain
    decoding).  parents [N] local, cu [B + 1]; pos [B, n]; cs [N, R] RoPE rows; bits [B, n, Wb];
    conv_idx [N, W] (sources of each conv tap, see reference.conv_sources); gdn: the GDN
    kernels' TreeMeta (tree rounds); commit: a decode round's commit rows."""

    B: int
    n: int
    lengths: torch.Tensor
    parents: torch.Tensor
    cu: torch.Tensor
    pos: torch.Tensor
    cs: torch.Tensor
    bits: torch.Tensor
    depth: torch.Tensor
    conv_idx: torch.Tensor | None = None
    gdn: object = None
    anc: torch.Tensor | None = None
    commit: QwenCommit | None = None
    decode: bool = False


def _conv_taps(d: QwenDims, t: RoundTables, rows, seq, depth, anc, taps: int) -> torch.Tensor:
    """[M, taps] conv sources at distances taps - 1 ... 0 behind each row (oldest first): the
    row itself (distance 0), its ancestors, then the committed conv state (slot W - 1 -
    (distance - depth), oldest first), encoded as in reference.conv_sources."""
    dist = t.arange(taps).flip(0)[None, :]
    x_src = torch.where(dist == 0, rows[:, None], anc.gather(1, (dist - 1).clamp(min=0).expand(rows.shape[0], -1)))
    slot = (d.W - 1 - dist + depth[:, None]).clamp(0, d.W - 2)
    state_row = seq[:, None] * (d.W - 1) + slot
    return torch.where(dist <= depth[:, None], x_src, -1 - state_row)


def round_meta(d: QwenDims, t: RoundTables, lengths: torch.Tensor, parents: torch.Tensor | None, S1: int,
               has_gdn: bool = True) -> QwenRound:
    """The round's metadata for trees ``parents`` [B, n] (local, -1 at the root, topological),
    or plain decoding (``parents`` None: one token per sequence at lengths[b]).  ``S1``: rows
    of a sequence's attention cache (max_len + 1)."""
    if parents is None:
        B = lengths.shape[0]
        rows = t.arange(B)
        zero = torch.zeros_like(rows)
        pos = lengths[:, None]
        rm = QwenRound(B, 1, lengths, t.roots(B), t.cu(B, 1), pos, t.rope.rows(pos), t.ones_bits(B),
                       zero.view(B, 1), decode=True)
        if has_gdn:
            anc = torch.full((B, d.W - 1), -1, dtype=torch.int64, device=t.device)
            rm.conv_idx = _conv_taps(d, t, rows, rows, zero, anc, d.W)
            rm.commit = QwenCommit(rows * S1 + lengths, rm.conv_idx[:, 1:].contiguous(), zero, torch.ones_like(rows))
        else:
            rm.commit = QwenCommit(rows * S1 + lengths, None, zero, torch.ones_like(rows))
        return rm
    B, n = parents.shape
    flat = parents.reshape(-1)
    cu = t.cu(B, n)
    meta = (verify_round_meta(flat, cu, n, d.gHV, d.gV) if has_gdn
            else tree_meta(flat, cu, max_nodes=n, validate=False))
    depth = meta.depth.view(B, n)
    pos = lengths[:, None] + depth
    rm = QwenRound(B, n, lengths, flat, cu, pos, t.rope.rows(pos), meta.bits.view(B, n, -1), depth,
                   gdn=meta if has_gdn else None, anc=meta.anc)
    if has_gdn:
        rm.conv_idx = _conv_taps(d, t, t.arange(B * n), meta.seq_ids, meta.depth, meta.anc, d.W)
    return rm


def commit_meta(d: QwenDims, t: RoundTables, rm: QwenRound, accepted: torch.Tensor, S1: int,
                has_gdn: bool = True) -> QwenCommit:
    """Commit rows for the accepted nodes (LOCAL index, int64 [B]) of a tree round: the root
    path's KV rows at their positions (the rest to the trash row), the conv state's sources."""
    B, n = rm.B, rm.n
    row = rm.cu[:-1] + accepted                                                 # flat accepted row
    j = t.arange(n)
    on_path = ((rm.bits.view(B * n, -1)[row][:, j // 64] >> (j % 64)) & 1).bool()   # [B, n]
    seq = t.arange(B)
    dest = torch.where(on_path, rm.pos, S1 - 1) + seq[:, None] * S1
    a_depth = rm.depth.gather(1, accepted[:, None])[:, 0]
    conv_idx = _conv_taps(d, t, row, seq, a_depth, rm.anc[row], d.W - 1) if has_gdn else None
    return QwenCommit(dest.reshape(-1), conv_idx, accepted, a_depth + 1)


def advance(lengths: torch.Tensor, cm: QwenCommit) -> None:
    """The sequences' lengths past the round's committed tokens."""
    lengths += cm.gained


# ---- GDN mixer ----------------------------------------------------------------------------------
@dataclass
class GdnPre:
    """The mixer's inputs to the core: x_conv [N, C] (the pre-conv rows, read again by the conv
    commit), q, k [N, H, K], v [N, HV, V] contiguous, g, beta [N, HV] float32, z [N, HV V]."""

    x_conv: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    z: torch.Tensor


def gdn_pre(w: dict, d: QwenDims, x: torch.Tensor, conv_state: torch.Tensor, rm: QwenRound) -> GdnPre:
    N, C, ZV, hk = x.shape[0], d.conv, d.gHV * d.gV, d.gH * d.gK
    proj = F.linear(ops.rms_norm(x, w["ln1"], d.eps), w["in_proj"])
    x_conv = proj[:, :C]
    qkv = ops.tree_conv(x_conv, conv_state, rm.conv_idx, w["conv"], [hk, 2 * hk], True)
    g, beta = ops.gdn_gates(proj[:, C + ZV:], w["neg_A"], w["dt_bias"])
    return GdnPre(x_conv, qkv[:N * hk].view(N, d.gH, d.gK), qkv[N * hk:2 * N * hk].view(N, d.gH, d.gK),
                  qkv[2 * N * hk:].view(N, d.gHV, d.gV), g, beta, proj[:, C:C + ZV])


def gdn_core_verify(d: QwenDims, pre: GdnPre, ssm: torch.Tensor, rm: QwenRound, path=None):
    """Every node's output along its root path -> (o [N, HV, V], cache).  The state is untouched
    unless ``path`` (a deferred commit's ``GDNPendingPath``) holds a waiting path: that is
    folded in first, in the same kernel."""
    with kernel_core("gdn_tree_verify"):
        if path is not None:
            return gdn_tree_verify_folding(pre.q, pre.k, pre.v, pre.g, pre.beta, ssm, path, rm.parents, rm.cu,
                                           meta=rm.gdn)
        return gdn_tree_verify(pre.q, pre.k, pre.v, pre.g, pre.beta, ssm, rm.parents, rm.cu, scale=d.gK ** -0.5,
                               meta=rm.gdn)


def gdn_core_decode(d: QwenDims, pre: GdnPre, ssm: torch.Tensor, conv_state: torch.Tensor, rm: QwenRound,
                    path=None):
    """One token per sequence: the state read, updated and written once; the conv state shifted
    (a waiting deferred path in ``path`` folded in first, standalone: with the deferred form a
    decode step has one more short launch per GDN layer, a no-op where nothing waits)."""
    if path is not None:
        with kernel_core("gdn_fold_pending"):
            gdn_fold_pending(ssm, path)
    with kernel_core("gdn_decode"):
        o = recurrent_step(pre.q, pre.k, pre.v, pre.g, pre.beta, ssm)
    ops.gather_rows(conv_state, pre.x_conv, rm.commit.conv_idx)
    return o


def gdn_post(w: dict, d: QwenDims, x: torch.Tensor, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return torch.addmm(x, ops.gated_rms_norm(o, z, w["gnorm"], d.eps), w["out"].t())


def gdn_commit(d: QwenDims, ssm, conv_state, pending, rm: QwenRound, cm: QwenCommit, path=None) -> None:
    """Fold the accepted path into the GDN state (kernels.gdn commit) and the conv state; with
    ``path`` (a ``GDNPendingPath``) the state's fold is deferred to the next verify (the path's
    rows kept there; ``gdn_defer_commit``)."""
    x_conv, k, cache = pending
    if path is not None:
        with kernel_core("gdn_defer_commit"):
            gdn_defer_commit(ssm, path, k, cache, rm.parents, rm.cu, cm.accepted, check=False)
    else:
        with kernel_core("gdn_tree_commit"):
            gdn_tree_commit(ssm, k, cache, rm.parents, rm.cu, cm.accepted, check=False)
    ops.gather_rows(conv_state, x_conv, cm.conv_idx)


# ---- gated attention ----------------------------------------------------------------------------
def attn_pre(w: dict, d: QwenDims, x: torch.Tensor, cs: torch.Tensor):
    """-> q [N, Hq, D], kv [N, 2, Hkv, D] (k normed and rotated, v), gate [N, Hq, D] or None."""
    N, D, kvd = x.shape[0], d.D, d.Hkv * d.D
    proj = F.linear(ops.rms_norm(x, w["ln1"], d.eps), w["qkv"])
    qg = proj[:, :d.q_out].view(N, d.Hq, -1)                                    # per head q (| gate)
    q = ops.norm_rope(qg[..., :D], w["q_norm"], cs, 0, False, d.eps, True)
    kv = torch.empty(N, 2, d.Hkv, D, dtype=x.dtype, device=x.device)
    ops.norm_rope_into(proj[:, d.q_out:d.q_out + kvd].view(N, d.Hkv, D), w["k_norm"], cs, 0, False, d.eps, True, kv[:, 0])
    kv[:, 1].copy_(proj[:, d.q_out + kvd:].view(N, d.Hkv, D))
    return q, kv, (qg[..., D:] if d.gate else None)


def attn_core(d: QwenDims, q, kv, cache, lengths, pos, bits) -> torch.Tensor:
    """Attention of q [B*Q, Hq, D] over the cache [B, S + 1, 2, Hkv, D] (rows < lengths) plus the
    round's rows kv [B*Q, 2, Hkv, D] visible in bits [B, Q, Wb] -> o [B*Q, Hq, D]."""
    B, Q = pos.shape
    S = cache.shape[1] - 1
    kvt = kv.view(B, -1, 2, d.Hkv, d.D)
    with kernel_core("tree_attention"):
        o = tree_attention(q.view(B, Q, d.Hq, d.D), cache[:, :S, 0], cache[:, :S, 1], lengths, pos, kvt[:, :, 0],
                           kvt[:, :, 1], bits)
    return o.view(B * Q, d.Hq, d.D)


def attn_post(w: dict, d: QwenDims, x: torch.Tensor, o: torch.Tensor, gate) -> torch.Tensor:
    y = ops.sigmoid_mul(o, gate) if gate is not None else o.reshape(o.shape[0], -1)
    return torch.addmm(x, y, w["o"].t())


def attn_commit(cache: torch.Tensor, kv: torch.Tensor, kv_rows: torch.Tensor) -> None:
    """The round's KV rows into the cache, one index_copy_ (rows off the path: the trash row)."""
    cache.view(-1, *cache.shape[2:]).index_copy_(0, kv_rows, kv)


def mlp(w: dict, d: QwenDims, x: torch.Tensor) -> torch.Tensor:
    h = F.linear(ops.rms_norm(x, w["ln2"], d.eps), w["gate_up"])
    return torch.addmm(x, ops.silu_mul(h), w["down"].t())


# ---- whole layers -------------------------------------------------------------------------------
def gdn_layer(w: dict, d: QwenDims, x, ssm, conv_state, rm: QwenRound, path=None):
    """One GDN block -> (x, pending for gdn_commit: (x_conv, k, cache); None after a decode).
    ``path``: the layer's deferred-commit ``GDNPendingPath`` (its waiting path folded first)."""
    pre = gdn_pre(w, d, x, conv_state, rm)
    if rm.decode:
        o, pending = gdn_core_decode(d, pre, ssm, conv_state, rm, path), None
    else:
        o, cache = gdn_core_verify(d, pre, ssm, rm, path)
        pending = (pre.x_conv, pre.k, cache)
    return mlp(w, d, gdn_post(w, d, x, o, pre.z)), pending


def attn_layer(w: dict, d: QwenDims, x, cache, rm: QwenRound):
    """One attention block -> (x, kv for attn_commit; written already after a decode)."""
    q, kv, gate = attn_pre(w, d, x, rm.cs)
    o = attn_core(d, q, kv, cache, rm.lengths, rm.pos, rm.bits)
    if rm.decode:
        attn_commit(cache, kv, rm.commit.kv_rows)
    return mlp(w, d, attn_post(w, d, x, o, gate)), kv


def mtp_forward(w: dict, d: QwenDims, embed_table, tokens, prev_hidden, cs, pos, rows, bits, cache, scratch,
                lengths) -> torch.Tensor:
    """The MTP layer over rows tokens [B, Q] at positions pos [B, Q], with the hidden states
    before them prev_hidden [B, Q, h]: x = W_fc [RMSNorm(embed); RMSNorm(hidden)], one gated
    attention block over its cache [B, S + 1, 2, Hkv, D] plus the scratch rows [B, R, 2, Hkv, D]
    visible in bits (the rows' own K/V written to scratch row ``rows`` [B, Q] first), the MLP
    -> hidden [B, Q, h] (before the final norm)."""
    B, Q = tokens.shape
    e = ops.rms_norm(embed(embed_table, tokens), w["enorm"], d.eps)
    hn = ops.rms_norm(prev_hidden.reshape(B * Q, -1), w["hnorm"], d.eps)
    x = F.linear(torch.cat([e, hn], -1), w["fc"])
    q, kv, gate = attn_pre(w, d, x, cs)
    R = scratch.shape[1]
    scratch.view(B * R, *scratch.shape[2:]).index_copy_(0, (rows + (torch.arange(B, device=rows.device) * R)[:, None])
                                                        .reshape(-1), kv)
    S = cache.shape[1] - 1
    with kernel_core("tree_attention"):
        o = tree_attention(q.view(B, Q, d.Hq, d.D), cache[:, :S, 0], cache[:, :S, 1], lengths, pos, scratch[:, :, 0],
                           scratch[:, :, 1], bits)
    x = attn_post(w, d, x, o.view(B * Q, d.Hq, d.D), gate)
    return mlp(w, d, x).view(B, Q, -1)
