"""A block drafter's round in static buffers, replayed from a CUDA graph on CUDA (eager on the
CPU): the runtime's interface to ``simtree.kernels.layers.drafters``.

    d = DrafterRound(get_model("qwen3.6-27b"), "dspark", batch=8, max_len=4096, device="cuda",
                     dtype=torch.bfloat16, ends=target_weights)      # shares the target's embed / LM head
    out = d.run(feats, n_new, anchor)
    #   block:  out.tree (TreeBuffers [B, budget], best-first from the marginals), out.lp, out.ids [B, L, topk]
    #   tfm:    out.tree (the adapter's best-first tree, ``width`` expansions a step)
    #   dspark: out.tree (the chain, valid up to out.verified_len [B]: the prefix whose survival
    #           clears ``keep``), out.lp, out.ids [B, L, topk], out.confidence [B, L]

``feats`` [B, A, F*h]: the target's hidden states (``target_layers`` of them concatenated) of the
A = block_len + 1 rows a round can accept, the first ``n_new`` [B] real; ``anchor`` [B]: the
target's next token.  The round commits the real context rows to the drafter's caches and
advances its lengths; the outputs are views of static buffers, overwritten by the next round.
After the backbone a round is ``kernels.layers.drafters.draft_round``, the draft code the block
engine (``runtime/full/block_engine.py``, which runs :meth:`DrafterRound.hidden` inside its own
round) and the profiler's drafter stages run.
``weights``: trained weights {name: tensor} (the runtime's names; else random, drawn from ``seed``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from simtree.drafters import DRAFTER_ROPE_THETA
from simtree.errors import SimtreeError
from simtree.kernels.layers.device_trees import TreeBuffers
from simtree.kernels.layers.drafters import (BackboneState, DraftShape, backbone_forward, draft_round, drafter_config,
                                             drafter_specs, prepare, threshold_keep)
from simtree.kernels.layers.rope import RopeTable
from simtree.kernels.layers.weights import make_weights, weights_from

__all__ = ["DrafterRound", "DrafterOutput"]



@dataclass
class DrafterOutput:
    """The round's tree [B, budget] and what ``draft_round`` returns besides (None where the
    family has none)."""
    tree: TreeBuffers
    lp: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    verified_len: torch.Tensor | None = None


class DrafterRound:
    def __init__(self, shape, family: str, *, batch: int, max_len: int, device, dtype, budget: int = 8,
                 topk: int = 4, width: int = 4, keep: float = 0.0, seed: int = 0, ends: dict | None = None,
                 graph: bool | None = None, weights: dict | None = None, **sizes):
        """``budget``: the tree's nodes (root included; dspark: the chain's bucket); ``keep``
        (dspark): the survival a chain's prefix must clear to be verified (0: the whole chain)."""
        self.cfg = cfg = drafter_config(shape, family, **sizes)
        if budget < 1 or topk < 1 or width < 1:
            raise SimtreeError(f"drafter round: budget, topk and width must be >= 1, got {budget}, {topk}, {width}")
        self.family, self.budget, self.topk, self.width = family, int(budget), int(topk), int(width)
        self.keep = threshold_keep(keep)
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
        self.anchor = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.tree = None      # laid on the first run(): the block engine drafts into its own round's tree
        self.use_graph = dev.type == "cuda" if graph is None else bool(graph)
        self._graph, self._out = None, None

    def hidden(self) -> torch.Tensor:
        """The backbone's block rows [B, L, h] from the static buffers (feats, n_new, anchor),
        eagerly (inside a caller's CUDA graph, e.g. the engine's draft stage); commits the
        context rows and advances the lengths."""
        return backbone_forward(self.w, self.cfg, self.state, self.rope, self.feats, self.n_new, self.anchor)

    def _round(self) -> DrafterOutput:
        if self.tree is None:
            self.tree = TreeBuffers.empty(self.anchor.shape[0], self.budget, self.anchor.device)
        out = draft_round(self.family, self.w, self.cfg, self.hidden(), self.anchor, self.tree,
                          DraftShape(self.budget, self.width, self.topk),
                          keep=self.keep if self.family == "dspark" else None)
        return DrafterOutput(self.tree, *out)

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
