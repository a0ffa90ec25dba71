"""The memory floor of one DeepSeek-V4 layer's verify: the bytes it must move at least, over the
GPU's bandwidth (docs/math/v4_compression.md, "The verify's memory floor").

A round verifies ``nodes`` tree nodes in each of ``batch`` sequences of ``context`` cached
tokens.  Whatever the kernels, the step reads every weight it multiplies once (at the dtype it
is stored in: the layer's specs, :func:`simtree.kernels.layers.v4.layer_specs`), each sequence's
cache rows its nodes attend to or score once (the nodes of one tree share them), and the
layer's input and output streams once:

    weights       attention block: hc_attn, ln1, wqkv_a, q_norm, wq_b, kv_norm, wo_a, wo_b, sink,
                  the compressors (their projections at the dtype the form v4_comp builds: fp32 by default, the
                  checkpoint's bf16 under "model"; the benchmarks take the latter) and the CSA indexer's wq_idx + its compressor;
                  MoE block: ln2, router, hc_ffn, the shared expert and the routed experts a
                  round touches, E (1 - (1 - k/E)^T) of them in expectation (T tokens, uniform)
    window        the persistent rows of the sliding window: min(window - 1, context) per
                  sequence (the root's own row is a node, not cache)
    compressed    CSA: min(topk, E) rows per sequence (E = context // 4; a lower bound: the
                  tree's nodes may pick different rows); HCA: all E = context // 128
    indexer_keys  CSA: all E indexer keys per sequence (the scan scores every one)
    compressor_state  the compressors' partial windows (kv and score) per sequence
    activations   the streams in and out: T x hc x hidden, twice (scope "core": q, kv, x and
                  the indexer's q and weights in, o out)

Node latents, scratch entries, scores and index lists are intermediates: a fully fused
verify keeps them on chip, so the floor counts none of them.

    f = verify_floor(V4Dims.of(shape), "csa", batch=1, nodes=4, context=4096)
    f.total_bytes, f.us(4250.0)       # bytes, and microseconds at 4250 GB/s
    f.flops, f.compute_us(989.0)      # the matrix products, and their microseconds at 989 TFLOPs

The compute floor (``flops``) counts the matrix products: 2 T x every multiplied weight (a
token's k routed experts), the indexer's scan 2 T Hi Di E, attention 4 T H D rows.  Past a few
dozen tokens the attention block is bound by it, not by the bytes.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch

from simtree.costs.moe_forms import touched_experts
from simtree.errors import SimtreeError

from simtree.kernels.layers.v4 import V4Dims, layer_specs
from simtree.kernels.layers.weights import dtype_bytes
from simtree.quant import V4_ATTN_LINEARS

__all__ = ["V4Floor", "verify_floor", "SCOPES", "MOE_WEIGHTS", "CORE_WEIGHTS", "PROJECTIONS", "H200_COPY_GBPS",
           "H200_BF16_TFLOPS"]

SCOPES = ("core", "attention", "moe", "layer")
CORE_WEIGHTS = ("comp.", "idx.", "sink")      # what the kernels' tree_verify reads of the weights
H200_COPY_GBPS = 4250.0            # copy bandwidth measured on the H200 (reports/h200/v4)
H200_BF16_TFLOPS = 989.0           # dense bf16 tensor-core peak of the H200 (NVIDIA's data sheet)
MOE_WEIGHTS = ("ln2", "router", "router_bias", "tid2eid", "experts_gu", "experts_down", "shared_gu", "shared_down",
               "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale")
_ROUTED = ("experts_gu", "experts_down")


def _base(name: str) -> str:
    return name[:-len("_scale_inv")] if name.endswith("_scale_inv") else name


@dataclass(frozen=True)
class V4Floor:
    """Bytes of one layer's verify by part: ``weights`` {weight name: bytes}, ``cache`` {window,
    compressed, indexer_keys, compressor_state: bytes}, ``activations`` bytes."""

    kind: str
    scope: str
    weights: dict
    cache: dict
    activations: int
    flops: float = 0.0      # the matrix products' floating-point operations (the compute floor's)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def cache_bytes(self) -> int:
        return sum(self.cache.values())

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.activations

    def us(self, bandwidth_gbs: float = H200_COPY_GBPS) -> float:
        """The floor in microseconds at ``bandwidth_gbs`` GB/s."""
        return self.total_bytes / (bandwidth_gbs * 1e3)

    def compute_us(self, tflops: float = H200_BF16_TFLOPS) -> float:
        """The matrix products at ``tflops`` (every one at the bf16 tensor-core peak: a lower
        bound)."""
        return self.flops / (tflops * 1e6)


PROJECTIONS = V4_ATTN_LINEARS   # the attention's linears (FP8 in the checkpoint)


def _weight_bytes(d: V4Dims, kind: str, scope: str, tokens: int, dtype: torch.dtype) -> dict:
    specs = layer_specs("", kind, d, 1.0, torch.float32)
    out = {}
    for s in specs:
        moe = _base(s.name) in MOE_WEIGHTS
        core = s.name.startswith(CORE_WEIGHTS)
        if (scope == "attention" and moe) or (scope == "moe" and not moe) or (scope == "core" and not core) \
                or s.name == "tid2eid":
            continue                    # tid2eid: one row per token, not the table
        b = s.numel * dtype_bytes(s.dtype or dtype)
        if _base(s.name) in _ROUTED:
            b = round(b * touched_experts(tokens, d.E, d.topk_e) / d.E)    # uniform routing
        out[s.name] = b
    return out


def _flops(d: V4Dims, kind: str, scope: str, tokens: int, context: int) -> float:
    """2 x T x the multiplied weights (each token's k routed experts of the E), the indexer's
    scan (2 T Hi Di E: every node scores its sequence's entries) and attention (4 T H D rows:
    scores and the weighted sum over window + compressed rows)."""
    total = 0.0
    for s in layer_specs("", kind, d, 1.0, torch.float32):
        moe = _base(s.name) in MOE_WEIGHTS
        if len(s.shape) < 2 or s.name.endswith(("_scale_inv", "ape", "tid2eid")) or (scope == "attention" and moe) \
                or (scope == "moe" and not moe) or (scope == "core" and not s.name.startswith(CORE_WEIGHTS)):
            continue
        total += 2.0 * tokens * s.numel * (d.topk_e / d.E if _base(s.name) in _ROUTED else 1.0)
    if scope == "moe":
        return total
    r = d.ratio(kind)
    entries = context // r if r else 0
    rows = min(d.window, context + 1) + (min(d.topk, entries) if kind == "csa" else entries)
    total += 4.0 * tokens * d.H * d.D * rows
    if kind == "csa":
        total += 2.0 * tokens * d.Hi * d.Di * entries
    return total


def _cache_bytes(d: V4Dims, kind: str, batch: int, context: int, cache_dtype: torch.dtype,
                 state_dtype: torch.dtype) -> dict:
    el, sl = dtype_bytes(cache_dtype), dtype_bytes(state_dtype)
    out = {"window": batch * min(d.window - 1, context) * d.D * el}
    r = d.ratio(kind)
    if not r:
        return out
    entries = context // r
    slots = (2 if r == 4 else 1) * r
    out["compressed"] = batch * (min(d.topk, entries) if kind == "csa" else entries) * d.D * el
    # partial windows: kv and score, slots x (2 x dim with C4's overlap)
    width = (2 if r == 4 else 1) * d.D
    state = 2 * slots * width
    if kind == "csa":
        out["indexer_keys"] = batch * entries * d.Di * el
        state += 2 * slots * 2 * d.Di
    out["compressor_state"] = batch * state * sl
    return out


def verify_floor(d: V4Dims, kind: str, batch: int, nodes: int, context: int, scope: str = "attention",
                 dtype: torch.dtype = torch.bfloat16, cache_dtype: torch.dtype | None = None,
                 state_dtype: torch.dtype = torch.float32, fp8_projections: bool | None = None) -> V4Floor:
    """The floor of one ``kind`` (swa / csa / hca) layer's verify of ``nodes`` nodes in each of
    ``batch`` sequences at ``context`` cached tokens; ``scope`` "attention" (the attention block
    with its hyper-connection), "moe" (the MoE block with its), "layer" (both) or "core" (the
    kernels' tree_verify alone: from q, kv, x to o; the compressors' weights, the cache).  ``dtype``:
    the model's dtype (weights without one of their own, activations); ``cache_dtype``: the KV
    pools' (default ``dtype``); ``state_dtype``: the compressors' partial windows;
    ``fp8_projections``: the attention's linears (PROJECTIONS) at 1 byte with their block scales
    (True: as DeepSeek's checkpoint stores them) or at ``dtype`` (False); None: as the dims'
    ``proj`` says (V4-Flash: FP8, from its config)."""
    if fp8_projections is not None:
        d = dataclasses.replace(d, proj="fp8" if fp8_projections else "bf16")
    if kind not in ("swa", "csa", "hca"):
        raise SimtreeError(f"a V4 layer is swa, csa or hca, not {kind!r}")
    if scope not in SCOPES:
        raise SimtreeError(f"floor scope {scope!r}: use " + ", ".join(SCOPES))
    if min(batch, nodes) < 1 or context < 0:
        raise SimtreeError(f"floor of batch {batch}, nodes {nodes}, context {context}: batch and nodes must be "
                           ">= 1, context >= 0")
    tokens = batch * nodes
    weights = _weight_bytes(d, kind, scope, tokens, dtype)
    cache = ({} if scope == "moe" else
             _cache_bytes(d, kind, batch, context, cache_dtype or dtype, state_dtype))
    if scope == "core":     # q, kv, x (and the indexer's q, fp32 weights) in; o out
        width = 2 * d.H * d.D + d.D + d.h + (d.Hi * d.Di + 2 * d.Hi if kind == "csa" else 0)
        act = tokens * width * dtype_bytes(dtype)
    else:
        act = 2 * tokens * d.hc * d.h * dtype_bytes(dtype) * (2 if scope == "layer" else 1)
    return V4Floor(kind, scope, weights, cache, act, _flops(d, kind, scope, tokens, context))
