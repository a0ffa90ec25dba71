"""Shapes of one DeepSeek-V4 compressed-attention layer (the attention path only).

A layer is one of three kinds (``compress_ratios`` in the public config):

    swa  ratio 0    sliding window of ``window`` latent tokens only
    csa  ratio 4    window + top-``topk`` of the C4 entries picked by the lightning indexer
    hca  ratio r    window + every completed C``r`` entry (r = 128 at V4-Flash size)

K and V are the same latent vector (MQA over one 512-wide latent, the last ``rope_dim``
channels carry RoPE).  A query at position t sees compressed entry i iff i < (t+1)//ratio.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from simtree.errors import SimtreeError

__all__ = ["V4AttnConfig", "LAYER_KINDS"]

LAYER_KINDS = ("swa", "csa", "hca")


@dataclass(frozen=True)
class V4AttnConfig:
    num_heads: int = 64          # query heads (one shared latent KV head)
    head_dim: int = 512          # latent width D = nope 448 + rope 64; K == V
    rope_dim: int = 64
    window: int = 128            # sliding-window tokens every layer attends to
    csa_ratio: int = 4           # C4: overlapping windows of 2 * 4 slots
    hca_ratio: int = 128         # C128: windows of 128 slots
    topk: int = 512              # CSA entries kept by the indexer per query
    indexer_heads: int = 64
    indexer_dim: int = 128
    hidden: int = 4096           # compressor input width (the layer's hidden state)
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    page_size: int = 256         # tokens (or compressed entries) per cache page

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "window", "csa_ratio", "hca_ratio", "topk",
                     "indexer_heads", "indexer_dim", "hidden", "page_size"):
            if int(getattr(self, name)) < 1:
                raise SimtreeError(f"V4AttnConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.rope_dim <= min(self.head_dim, self.indexer_dim) or self.rope_dim % 2:
            raise SimtreeError(f"V4AttnConfig.rope_dim must be even and <= head_dim/indexer_dim, got {self.rope_dim}")

    @classmethod
    def flash(cls, **overrides) -> "V4AttnConfig":
        """DeepSeek-V4-Flash attention shapes (public config)."""
        return replace(cls(), **overrides)

    @classmethod
    def tiny(cls, **overrides) -> "V4AttnConfig":
        """A CPU test size where windows, C4 and C128 (here C8) boundaries fall inside a tree."""
        base = cls(num_heads=4, head_dim=32, rope_dim=8, window=8, csa_ratio=4, hca_ratio=8,
                   topk=3, indexer_heads=8, indexer_dim=16, hidden=24, page_size=4)
        return replace(base, **overrides)

    def ratio(self, kind: str) -> int:
        """Compression ratio of a layer kind (0 for SWA-only layers)."""
        if kind not in LAYER_KINDS:
            raise SimtreeError(f"unknown V4 layer kind {kind!r}; expected one of {', '.join(LAYER_KINDS)}")
        return {"swa": 0, "csa": self.csa_ratio, "hca": self.hca_ratio}[kind]

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5
