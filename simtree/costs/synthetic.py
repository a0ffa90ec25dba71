"""SYNTHETIC analytic cost models (NOT measured): a roofline of a dense 27B GDN-hybrid on an
H200-class GPU, for tests and as the planner's default until measured cost bundles ship in
``simtree/data/costs/*.json``.  Everything that uses it says "SYNTHETIC" in its output.

Satisfies the cost protocols of :mod:`simtree.costs.model` (``Costs``, ``VerifyCost``,
``DraftCost``): ``verify.predict(nodes_per_seq, context_len, batch_size)`` and
``draft.predict(num_steps, topk, batch_size)`` in microseconds for the whole batch, numpy
broadcasting; no measured range and no fit error (analytic).

Verify, with T = b * n tokens (convex and non-decreasing in n, non-decreasing in l)::

    C_v = launch + max(weights, per_token * T)          # weight traffic vs matmul compute
          + per_seq * b                                  # recurrent state read + write
          + kv_per_ctx * b * l + attn_per_pair * b * n * l   # KV read, tree-query attention

Default numbers come from the public Qwen3.6-27B shapes (simtree/data/models/qwen3.6-27b/config.json):
54 GB of bf16 weights over ~4.2 TB/s -> 13 ms; 2 * 27e9 FLOP per token at ~700 TFLOP/s -> 78 us; 48 GDN
layers x 3 MiB state read + written -> ~70 us per sequence; 16 attention layers x 4 KV heads x
256 dims x 2 (K, V) x 2 B = 64 KiB per context token.  Draft (one MTP-like layer + LM head
per sequential step): C_d = s * (launch + max(weights_d, per_token_d * b * k)).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import MappingProxyType

import numpy as np

__all__ = ["RooflineVerifyCost", "RooflineDraftCost", "SyntheticCostBundle", "synthetic_costs",
           "SYNTHETIC_LABEL"]

SYNTHETIC_LABEL = "SYNTHETIC (analytic roofline, not measured)"


@dataclass(frozen=True)
class RooflineVerifyCost:
    launch_us: float = 400.0
    weights_us: float = 13000.0
    per_token_us: float = 78.0
    per_seq_us: float = 70.0
    kv_per_ctx_us: float = 0.0154
    attn_per_pair_us: float = 5.6e-4

    convex_in_n = True            # a max of linear terms plus linear terms in n
    valid_range = MappingProxyType({})   # analytic: no measured range, nothing extrapolated
    heldout_median_error = None   # not fitted

    def predict(self, nodes_per_seq, context_len, batch_size):
        l, b = context_len, batch_size
        if not (isinstance(l, (int, float)) and isinstance(b, (int, float))):
            l, b = np.asarray(l, np.float64), np.asarray(b, np.float64)
        n = np.asarray(nodes_per_seq, np.float64)
        # scalar l, b (the per-round case): the n-independent terms are computed once
        base = self.launch_us + self.per_seq_us * b + self.kv_per_ctx_us * b * l
        out = base + np.maximum(self.weights_us, (self.per_token_us * b) * n) + (self.attn_per_pair_us * b * l) * n
        return float(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True)
class RooflineDraftCost:
    launch_us: float = 60.0
    weights_us: float = 800.0
    per_token_us: float = 4.8

    valid_range = MappingProxyType({})

    def predict(self, num_steps, topk, batch_size):
        s, k, b = (np.asarray(v, np.float64) for v in (num_steps, topk, batch_size))
        out = s * (self.launch_us + np.maximum(self.weights_us, self.per_token_us * b * k))
        return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class SyntheticCostBundle:
    """A :class:`~simtree.costs.model.Costs` of roofline models (meta: synthetic True)."""

    verify: RooflineVerifyCost
    draft: RooflineDraftCost
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"verify": asdict(self.verify), "draft": asdict(self.draft), "meta": self.meta}


def synthetic_costs(**verify_overrides) -> SyntheticCostBundle:
    """The default SYNTHETIC bundle; keyword overrides go to :class:`RooflineVerifyCost`."""
    meta = {"model": "SYNTHETIC-dense-27b-gdn-hybrid", "device": "SYNTHETIC-h200-roofline",
            "source": SYNTHETIC_LABEL, "synthetic": True}
    return SyntheticCostBundle(RooflineVerifyCost(**verify_overrides), RooflineDraftCost(), meta)
