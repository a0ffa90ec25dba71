"""A block drafter's round in static buffers, replayed from a CUDA graph on CUDA (eager on the
CPU): the runtime's interface to ``simtree.kernels.layers.drafters``.

    d = DrafterRound(get_model("qwen3.6-27b"), "dspark", batch=8, max_len=4096, device="cuda",
                     dtype=torch.bfloat16, ends=target_weights)      # shares the target's embed / LM head
    out = d.run(feats, n_new, anchor)
    #   block:  out.tree (DeviceTree [B, budget], best-first from the marginals), out.lp, out.ids [B, L, topk]
    #   tfm:    out.tree (the adapter's best-first tree, ``width`` expansions a step)
    #   dspark: out.lp, out.ids [B, L, topk], out.confidence [B, L]

``feats`` [B, A, F*h]: the target's hidden states (``target_layers`` of them concatenated) of the
A = block_len + 1 rows a round can accept, the first ``n_new`` [B] real; ``anchor`` [B]: the
target's next token.  The round commits the real context rows to the drafter's caches and
advances its lengths; the outputs are views of static buffers, overwritten by the next round.
``weights``: trained weights {name: tensor} (the runtime's names; else random, drawn from ``seed``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from simtree.errors import SimtreeError
from simtree.kernels.layers.drafters import (BackboneState, DeviceTree, backbone_forward, block_marginals,
                                             drafter_config, drafter_specs, dspark_draft, prepare, tfm_tree,
                                             tree_from_marginals)
from simtree.kernels.layers.rope import RopeTable
from simtree.kernels.layers.weights import make_weights, weights_from

__all__ = ["DrafterRound", "DrafterOutput"]

ROPE_THETA = 1e6   # the drafter's own RoPE (DeepSpec's drafters take the target's config; angles only)


@dataclass
class DrafterOutput:
    tree: DeviceTree | None = None
    lp: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    confidence: torch.Tensor | None = None


class DrafterRound:
    def __init__(self, shape, family: str, *, batch: int, max_len: int, device, dtype, budget: int = 8,
                 topk: int = 4, width: int = 4, seed: int = 0, ends: dict | None = None, graph: bool | None = None,
                 weights: dict | None = None, **sizes):
        self.cfg = cfg = drafter_config(shape, family, **sizes)
        if budget < 1 or topk < 1 or width < 1:
            raise SimtreeError(f"drafter round: budget, topk and width must be >= 1, got {budget}, {topk}, {width}")
        self.family, self.budget, self.topk, self.width = family, int(budget), int(topk), int(width)
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
        self.rope = RopeTable(cfg.dims.rope, ROPE_THETA, dev, max_len + A + cfg.block_len + 1,
                              dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        self.feats = torch.zeros(batch, A, cfg.target_layers * cfg.h, dtype=dtype, device=dev)
        self.n_new = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.anchor = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.use_graph = dev.type == "cuda" if graph is None else bool(graph)
        self._graph, self._out = None, None

    def hidden(self) -> torch.Tensor:
        """The backbone's block rows [B, L, h] from the static buffers (feats, n_new, anchor),
        eagerly (inside a caller's CUDA graph, e.g. the engine's draft stage); commits the
        context rows and advances the lengths."""
        return backbone_forward(self.w, self.cfg, self.state, self.rope, self.feats, self.n_new, self.anchor)

    def _round(self) -> DrafterOutput:
        hid = self.hidden()
        if self.family == "block":
            lp, ids = block_marginals(self.w, hid, self.topk)
            return DrafterOutput(tree_from_marginals(lp, ids, self.anchor, self.budget), lp, ids)
        if self.family == "tfm":
            return DrafterOutput(tfm_tree(self.w, hid, self.anchor, self.cfg.cand_k, self.budget, self.width))
        lp, ids, conf = dspark_draft(self.w, hid, self.anchor, self.topk)
        return DrafterOutput(None, lp, ids, conf)

    def _capture(self) -> None:
        saved = self.state.lengths.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._round()                       # warm-up: Triton compiles, allocator settles
        torch.cuda.current_stream().wait_stream(s)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._out = self._round()
        self.state.lengths.copy_(saved)         # the warm-up's commit is undone (its rows are overwritten)

    def run(self, feats: torch.Tensor, n_new: torch.Tensor, anchor: torch.Tensor) -> DrafterOutput:
        """One round (module docstring); no host sync."""
        self.feats.copy_(feats)
        self.n_new.copy_(n_new)
        self.anchor.copy_(anchor)
        if not self.use_graph:
            return self._round()
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._out
