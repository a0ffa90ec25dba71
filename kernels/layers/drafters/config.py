"""The block-drafter families' shapes and weights, for either target family.

    cfg = drafter_config(get_model("qwen3.6-27b"), "dspark")      # sizes of the public drafters
    specs = drafter_specs(cfg)                                       # weights (kernels.layers.weights)

Three families share one backbone (:mod:`.backbone`): ``block`` (DFlash: one forward proposes
``block_len`` positions as independent marginals), ``tfm`` (the block backbone plus a light
autoregressive adapter over each position's top-``cand_k`` candidates) and ``dspark`` (the
backbone plus a sequential low-rank Markov head and a confidence head).

Sizes (DeepSpec's configs ``config/dflash/*``, ``config/dspark/*`` for Qwen3 4B/8B/14B and
Gemma-4 12B, all alike): block_size 7, 5 draft layers, the hidden states of 5 target layers
concatenated and projected (fc [h, 5h]) as the drafter's context, Markov rank 256 ("vanilla":
an embedding W1 [V, r] of the previous token and W2 [r -> V] added to the position's logits),
a confidence head Linear(h + r -> 1) over the position's hidden state and the previous token's
Markov embedding.  The draft layers are Qwen3-style attention blocks (no output gate, q/k
RMSNorm, RoPE) with the target's hidden size, heads and MLP width; the drafter shares the
target's embedding and LM head.

ASSUMPTIONS, labelled: (1) DeepSeek-V4's DSpark stages are V4 decoder layers (latent MQA, MoE;
sglang ``models/deepseek_v4_dspark.py``); here they are dense layers of matching width: one KV
head of the 512-wide latent, 16 query heads (the attention's weight count of a V4 layer, about
71 M), an MLP as wide as the active experts plus the shared one (6 x 2048 + 2048).  Their cost
at large batch, where the real layer reads more experts, is then low.  (2) The TfM adapter's
sizes (width 256, top-512 candidates per position) are not in public code: cand_k 512 is the
number the DFlash-TfM description gives, the width a light choice.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from simtree.drafters import DRAFTER_FAMILIES, PUBLIC, TFM
from simtree.errors import SimtreeError
from simtree.models import ModelShape

from ..qwen import QwenDims, layer_specs
from ..weights import Spec, linear, residual_gain

__all__ = ["DRAFTER_FAMILIES", "DrafterConfig", "drafter_config", "drafter_specs", "drafter_dims", "MAX_BLOCK_LEN"]

MAX_BLOCK_LEN = 64          # rows of one forward the runtime supports (well past the public 7)


@dataclass(frozen=True)
class DrafterConfig:
    """One drafter: ``family``; ``block_len`` rows per forward (row 0 the anchor - the last
    accepted token - rows 1.. a mask token; row j predicts the token at depth j + 1);
    ``layers`` draft layers over ``target_layers`` target hidden states; ``markov_rank`` (dspark);
    ``cand_k`` and ``adapter_dim`` (tfm); ``dims`` the draft layers' shape."""

    family: str
    model: str
    dims: QwenDims
    block_len: int = PUBLIC["block_len"]
    layers: int = PUBLIC["layers"]
    target_layers: int = PUBLIC["target_layers"]
    markov_rank: int = 0
    cand_k: int = 0
    adapter_dim: int = 0
    mask_token: int = 0

    @property
    def h(self) -> int:
        return self.dims.h

    @property
    def vocab(self) -> int:
        return self.dims.vocab

    def with_block_len(self, block_len: int) -> "DrafterConfig":
        return replace(self, block_len=int(block_len))


def drafter_dims(shape: ModelShape) -> QwenDims:
    """The draft layers' shape for a target (module docstring; V4: ASSUMPTION 1)."""
    if shape.family == "v4":
        v4, m = shape.v4, shape.mlp
        width = int(m["experts_per_token"]) * int(m["expert_intermediate"]) + \
            int(m.get("n_shared", 0)) * int(m.get("shared_intermediate", 0))
        D = int(v4["head_dim"])
        return QwenDims(shape.hidden, shape.vocab, width, 16, 1, D, False, int(v4.get("rope_dim", 64)))
    d = QwenDims.of(shape)
    return QwenDims(d.h, d.vocab, d.I, d.Hq, d.Hkv, d.D, False, d.rope)


def drafter_config(shape: ModelShape, family: str, **overrides) -> DrafterConfig:
    """The public sizes of ``family`` for target ``shape``; ``overrides``: any field (tests use
    tiny ones).  A block length beyond :data:`MAX_BLOCK_LEN` or below 1 is refused."""
    if family not in DRAFTER_FAMILIES:
        raise SimtreeError(f"unknown drafter family {family!r} (known: {', '.join(DRAFTER_FAMILIES)})")
    extra = {"dspark": dict(markov_rank=PUBLIC["markov_rank"]), "tfm": dict(TFM), "block": {}}[family]
    fields = dict(block_len=PUBLIC["block_len"], layers=PUBLIC["layers"], target_layers=PUBLIC["target_layers"],
                  **extra, mask_token=shape.vocab - 1)
    dims = overrides.pop("dims", None) or drafter_dims(shape)
    unknown = set(overrides) - set(fields)
    if unknown:
        raise SimtreeError(f"drafter {family}: unknown field(s) {', '.join(sorted(unknown))}")
    fields.update(overrides)
    cfg = DrafterConfig(family, shape.name, dims, **{k: int(v) for k, v in fields.items()})
    if not 1 <= cfg.block_len <= MAX_BLOCK_LEN:
        raise SimtreeError(f"drafter {family}: block_len {cfg.block_len} outside 1..{MAX_BLOCK_LEN}")
    if cfg.layers < 1 or cfg.target_layers < 1:
        raise SimtreeError(f"drafter {family}: layers and target_layers must be >= 1")
    if family == "dspark" and cfg.markov_rank < 1:
        raise SimtreeError("drafter dspark: markov_rank must be >= 1")
    if family == "tfm" and not (1 <= cfg.cand_k <= cfg.vocab and cfg.adapter_dim >= 1):
        raise SimtreeError(f"drafter tfm: cand_k must be 1..{cfg.vocab} and adapter_dim >= 1")
    return cfg


def drafter_specs(cfg: DrafterConfig, with_ends: bool = True) -> list[Spec]:
    """Every weight of the drafter; ``with_ends``: its own embedding and LM head (else the
    caller passes the target's, which the drafter shares)."""
    d, h = cfg.dims, cfg.h
    gain = residual_gain(cfg.layers)
    specs = [linear("fc", h, cfg.target_layers * h), Spec("hidden_norm", (h,), "const", 1.0),
             Spec("norm", (h,), "const", 1.0)]
    for i in range(cfg.layers):
        specs += layer_specs(f"layers.{i}.", "attn", d, gain)
    if with_ends:
        specs += [Spec("embed", (cfg.vocab, h)), linear("lm_head", cfg.vocab, h)]
    if cfg.family == "dspark":
        r = cfg.markov_rank
        specs += [Spec("markov.w1", (cfg.vocab, r), "normal", 0.02), linear("markov.w2", cfg.vocab, r, 0.1),
                  linear("conf.w", 1, h + r), Spec("conf.b", (1,), "const", 0.0)]
    if cfg.family == "tfm":
        a = cfg.adapter_dim
        specs += [linear("tfm.in", a, h), Spec("tfm.emb", (cfg.vocab, a), "normal", a ** -0.5),
                  linear("tfm.cell", a, 2 * a)]
    return specs
