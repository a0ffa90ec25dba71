"""A block drafter's weights and state in static buffers: the runtime's interface to
``simtree.kernels.layers.drafters``.

    d = DrafterRound(get_model("qwen3.6-27b"), "dspark", batch=8, max_len=4096, device="cuda",
                     dtype=torch.bfloat16, ends=target_weights)      # shares the target's embed / LM head
    d.feats.copy_(feats); d.n_new.copy_(n_new)
    hid = d.hidden(anchor)           # the backbone's block rows [B, L, h]; the context committed
    out = draft_round(d.cfg.family, d.w, d.cfg, hid, anchor, tree, shape, keep=...)

``feats`` [B, A, F*h]: the target's hidden states (``target_layers`` of them concatenated) of the
A = block_len + 1 rows a round can accept, the first ``n_new`` [B] real; ``anchor`` [B]: the
target's next token, the caller's own buffer (the block engine's roots).
:meth:`DrafterRound.hidden` commits the real context rows to the drafter's caches and advances
its lengths.  The draft part after the backbone is
``kernels.layers.drafters.draft_round``, which the block engine (``runtime/full/block_engine.py``)
runs inside its own round, into its own tree, with its prefix rule and replay rescoring, and
the profiler's drafter stages time; so this class holds no tree and no CUDA graph of its own.
``weights``: trained weights {name: tensor} (the runtime's names; else random, drawn from ``seed``).
"""
from __future__ import annotations

import torch

from simtree.drafters import DRAFTER_ROPE_THETA
from simtree.errors import SimtreeError
from simtree.kernels.layers.drafters import BackboneState, backbone_forward, drafter_config, drafter_specs, prepare
from simtree.kernels.layers.rope import RopeTable
from simtree.kernels.layers.weights import make_weights, weights_from

__all__ = ["DrafterRound"]


class DrafterRound:
    """A block drafter's weights, caches, RoPE table and round inputs (module docstring)."""

    def __init__(self, shape, family: str, *, batch: int, max_len: int, device, dtype, seed: int = 0,
                 ends: dict | None = None, weights: dict | None = None, **sizes):
        """``sizes``: :func:`drafter_config`'s (block_len, layers, target_layers, ...)."""
        self.cfg = cfg = drafter_config(shape, family, **sizes)
        dev = torch.device(device)
        specs = drafter_specs(cfg, with_ends=ends is None)
        if weights is None:
            w = make_weights(specs, dev, dtype, seed)
        else:       # trained weights (runtime/drafter_model.py read_drafter): every one the drafter needs
            w = weights_from(specs, weights, dev, dtype)
            missing = [s.name for s in specs if s.name not in w]
            if missing:
                raise SimtreeError(f"{family} drafter weights lack {len(missing)} tensor(s), e.g. {missing[0]!r}")
        if ends is not None:
            w.update(embed=ends["embed"], lm_head=ends["lm_head"])
        self.w = prepare(w, cfg)
        A = cfg.block_len + 1
        self.state = BackboneState.new(cfg, batch, max_len, A, dtype, dev)
        self.rope = RopeTable(cfg.dims.rope, DRAFTER_ROPE_THETA, dev, max_len + A + cfg.block_len + 1,
                              dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        self.feats = torch.zeros(batch, A, cfg.target_layers * cfg.h, dtype=dtype, device=dev)
        self.n_new = torch.zeros(batch, dtype=torch.int64, device=dev)

    def hidden(self, anchor: torch.Tensor) -> torch.Tensor:
        """The backbone's block rows [B, L, h] from the static buffers (feats, n_new) and
        ``anchor`` [B], eagerly (inside a caller's CUDA graph, e.g. the engine's draft stage);
        commits the context rows and advances the lengths."""
        return backbone_forward(self.w, self.cfg, self.state, self.rope, self.feats, self.n_new, anchor)
