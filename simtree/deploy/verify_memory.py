"""What the target's verify round holds on the device beside its weights and caches (:mod:`.memory`'s
check), from the full runtime's code (``runtime/full``: ``engine.FullEngine._verify``, the models'
``verify`` and ``greedy``).

    r = verify_round(get_model("qwen3.6-27b"), rows=64 * 16)     # batch x verified nodes per sequence
    r.kept_bytes, r.hidden_bytes, r.peak_bytes, r.total_bytes

A round verifies T = batch x nodes rows at once.  At its peak (the LM head, after the last layer)
the device holds, at the model's dtype unless said:

    kept     what each layer's verify hands the commit, held until the commit: Qwen's GDN layer
             the input projection's rows [T, C + HV V + 2 HV] (the commit's conv rows are a view
             of it), the convolved q | k | v [T, C] (the commit reads k from it), the u cache
             [T, HV, V] (the launch rule's u_cache_bf16 for a bf16 model, else the model's dtype)
             and the decay G [T, HV] float32, C = 2 H K + HV V; an attention layer its K | V rows
             [T, 2, Hkv, D]; V4 (``kernels/v4/verify.py`` VerifyScratch) every layer's node
             latents [T, D], a compressed layer's two stacked compressor projections [2, T, C]
             in float32 (C: 2 D for CSA's overlapping windows, D for HCA; CSA's indexer 2 Di) and
             its round's entries, counted at one per row (at most; [E, D] and [E, Di])
    hidden   the verified rows' hidden states the engine keeps ([T, h]; V4: its hc streams
             [T, hc h])
    peak     the largest transient on top of those: the LM head's float32 logits over the rank's
             vocabulary [T, V] with their argmax (V4: the streams' collapse and norm [T, h] before
             it), or a layer's MLP (Qwen: gate | up, activation and output rows) or MoE
             dispatch (V4: the T k (token, expert) pairs' rows sorted by expert, their gate | up,
             activation, output, the rows put back and weighted: ``kernels/layers/moe.py``;
             FP8 experts also quantise their inputs), whichever is larger

Not counted: the round's metadata (positions, parents, ancestor bits: integers, tens of bytes a
row; a test measures it on the tiny models), the kernels' own scratch inside a layer (freed
before the next), and a round's draft, whose logits are over batch x frontier rows, not T.  With
CUDA graphs (the runtime's rounds) the pending a verify hands its commit is the same memory every
round; an eager round that keeps the last one until the next verify returns holds it twice.
"""
from __future__ import annotations

from dataclasses import dataclass

from simtree.models import DTYPE_BYTES, ModelShape

__all__ = ["VerifyRound", "verify_round", "kept_row_bytes"]

_F32, _I64 = 4, 8


@dataclass(frozen=True)
class VerifyRound:
    """Bytes one verify round of ``rows`` (batch x nodes) holds at its peak (module docstring)."""

    rows: int
    kept_bytes: int = 0
    hidden_bytes: int = 0
    peak_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.kept_bytes + self.hidden_bytes + self.peak_bytes


def kept_row_bytes(shape: ModelShape) -> list[int]:
    """Per layer of ``shape`` (one rank's), the bytes a verified row's pending holds until the
    commit (module docstring's ``kept``)."""
    dt = DTYPE_BYTES.get(shape.dtype, 2)
    out = []
    for kind in shape.layer_kinds:
        if kind == "gdn":
            g = shape.gdn
            H, HV, K, V = (int(g[k]) for k in ("key_heads", "value_heads", "key_dim", "value_dim"))
            C = 2 * H * K + HV * V
            out.append((C + HV * V + 2 * HV) * dt + C * dt + HV * V * dt + HV * _F32)
        elif kind == "attn":
            a = shape.attn
            out.append(2 * int(a["kv_heads"]) * int(a["head_dim"]) * dt)
        else:      # V4: swa, csa, hca
            v = shape.v4
            D, Di = int(v["head_dim"]), int(v["index_head_dim"])
            n = D * dt
            if kind in ("csa", "hca"):
                n += 2 * (2 * D if kind == "csa" else D) * _F32 + D * dt
            if kind == "csa":
                n += 2 * 2 * Di * _F32 + Di * dt
            out.append(n)
    return out


def _layer_peak(shape: ModelShape, T: int, dt: int) -> int:
    """The largest transient inside a layer: Qwen's MLP rows, V4's MoE dispatch."""
    h, m = shape.hidden, shape.mlp
    if m.get("kind") == "moe":
        k, I, E = int(m["experts_per_token"]), int(m["expert_intermediate"]), int(m["n_experts"])
        quant = T * k * (h + I) if m.get("expert_dtype") in ("fp8", "fp4") else 0
        # the normed input and the weighted sum [T, h]; per pair its row, gate | up, activation,
        # output, the output put back and weighted; the route's ids, weights, sorted ids and order
        return 2 * T * h * dt + T * k * (4 * h + 3 * I) * dt + quant + T * k * (3 * _I64 + _F32) + E * _F32
    I = int(m["intermediate"])
    return T * (h + 3 * I) * dt      # gate | up, the activation, the output (the norm's rows freed)


def verify_round(shape: ModelShape, rows: int, plain: bool = False) -> VerifyRound:
    """The bytes a verify round of ``rows`` (batch x nodes) rows holds on one rank of ``shape``
    (that rank's shape, as :func:`simtree.deploy.memory.rank_memory` prices it); ``plain``: a
    plain decoding step (one row a sequence), which commits as it goes and keeps nothing for a
    commit (Qwen's ``decode``; V4's decode is a one-node verify and commit, counted as one)."""
    T, dt = int(rows), DTYPE_BYTES.get(shape.dtype, 2)
    h, V = shape.hidden, shape.vocab
    v4 = shape.family == "v4"
    hidden = T * h * dt * (int(shape.v4.get("hc_mult", 4)) if v4 else 1)
    head = T * V * _F32 + T * _I64 + (2 * T * h * dt if v4 else 0)
    kept = 0 if plain and not v4 else T * sum(kept_row_bytes(shape))
    return VerifyRound(T, kept, hidden, max(head, _layer_peak(shape, T, dt)))
