"""The full runtime's own steps, ready for the profiler to time (the same graphs the engine replays).

    model = build_model("qwen3.6-27b", "cuda")
    step = verify_step(model, batch_size=16, nodes=8, context_len=4096)
    step.run()                 # once: the captured verify + commit (eager where not capturable)
    step.describe()            # {"stage": "model_verify_step", "batch_size": 16, ...}
    step.close()               # frees the engine's state and graphs

* :func:`verify_step` (b, n, l) is what C_v(n, l, b) predicts: the engine's ``verify`` stage
  (the target over b trees of n nodes, the round's GDN metadata built on the device, argmax,
  acceptance, the outputs' book-keeping) and its ``commit`` stage (the accepted path's state).
  The trees are the model's own MTP drafts - an EAGLE top-2 tree of n nodes, or a chain of n
  with ``tree="linear"`` - drafted once (shaped by ``tree_model``'s scores where given, as the
  replayed runs shape theirs); every repetition commits a path of depth min(2, the tree's depth).
  n = 1 is the plain decode step (the engine's only stage there): also what a plain round of an
  engine with several round shapes (the controller's tiers) costs, the target's decode step plus
  two row copies, since its MTP layer falls behind during plain rounds and catches up in one
  batch when drafting resumes (``FullEngine.catch_up``, a one-off per switch that C_v(1) does
  not price: docs/controller.md).
* :func:`draft_step` (b, s, k, l) is what C_d(s, k, b) predicts: the engine's ``draft`` stage
  (s - 1 MTP forwards of k rows per sequence, the top-k expansion and the tree build, budget
  1 + s k capped at the nodes drafted) and its ``catchup`` stage (the MTP layer over the
  accepted path's s + 1 rows, masked past the accepted depth: its cost does not depend on it).

Before each repetition the lengths go back to the context (a device copy outside the graphs),
so every repetition runs at context l.  Caches
hold random content (``FullEngine.fill_context``), as the replayed runs do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from simtree.errors import SimtreeError

from .acceptance import DraftScores, TraceReplay
from .drafting import RoundShape
from .engine import FullEngine, release_memory

__all__ = ["Step", "verify_step", "draft_step", "tree_round_shape"]


def tree_round_shape(nodes: int, tree: str = "eagle") -> RoundShape:
    """The drafting shape whose trees have ``nodes`` nodes: a chain (``linear``) or EAGLE top-2
    with the fewest steps that draft enough candidates."""
    if nodes == 1:
        return RoundShape(0, 0, 1, 1)
    if tree == "linear":
        return RoundShape(nodes - 1, 1, nodes, nodes)
    if tree != "eagle":
        raise SimtreeError(f"unknown tree {tree!r}: eagle or linear")
    steps = 1 + max(0, math.ceil((nodes - 1 - 2) / 4))
    return RoundShape(steps, 2, nodes, nodes)


@dataclass
class Step:
    """One profiled step: ``run()`` puts the lengths back to the context and replays ``stages``."""

    stage: str
    engine: FullEngine
    stages: tuple[str, ...]
    context_len: int
    params: dict

    def __post_init__(self):
        e = self.engine
        named = [(n, g.replay) for n, g in e.graphs] if e.graphs else e._stages()
        self._fns = [fn for name, fn in named if name in self.stages]
        self._lengths = e.st.lengths.clone()

    def prime(self) -> "Step":
        """One whole round, then the lengths back: every buffer the stages read (this round's
        trees, the verify's outputs the catch-up reads) holds real values, not a captured
        graph's untouched memory."""
        e = self.engine
        for _, fn in ([(n, g.replay) for n, g in e.graphs] if e.graphs else e._stages()):
            fn()
        self._restore()
        return self

    def _restore(self) -> None:
        e = self.engine
        e.st.lengths.copy_(self._lengths)
        if e.ds is not None:
            e.ds.lengths.copy_(self._lengths)

    def run(self) -> None:
        self._restore()
        for fn in self._fns:
            fn()

    def describe(self) -> dict:
        return {"stage": self.stage, "model": self.engine.model.shape.name, "batch_size": self.engine.B,
                "context_len": self.context_len, "graphs": self.engine.graphs is not None,
                "stages": list(self.stages), **self.params}

    def close(self) -> None:
        self.engine = self._fns = None
        release_memory()


def _engine(model, rs: RoundShape, batch_size: int, context_len: int, depth: int, seed: int,
            tree_model=None) -> FullEngine:
    source = TraceReplay.fixed(depth, batch_size, model.device)
    if tree_model is not None:
        source.scores = DraftScores(tree_model, rs, model.device)
    engine = FullEngine(model, rs, batch_size, context_len + 4 * rs.path_rows + 8, source)
    engine.capture(shared_pool=False)
    engine.fill_context(context_len, seed)
    return engine


@torch.no_grad()
def verify_step(model, batch_size: int, nodes: int, context_len: int, tree: str = "eagle", seed: int = 0,
                tree_model=None) -> Step:
    """The engine's verify + commit at (b, n, l); plain decoding at n = 1 (module docstring).
    ``tree_model``: an AcceptanceModel whose scores shape the trees, as replayed runs shape them."""
    rs = tree_round_shape(nodes, tree)
    engine = _engine(model, rs, batch_size, context_len, min(2, rs.max_depth), seed, tree_model)
    if rs.plain:
        return Step("model_verify_step", engine, ("verify",), context_len, {"nodes_per_seq": 1, "tree": "plain"}).prime()
    return Step("model_verify_step", engine, ("verify", "commit"), context_len,
                {"nodes_per_seq": nodes, "tree": tree, "accepted_depth": min(2, rs.max_depth)}).prime()


@torch.no_grad()
def draft_step(model, batch_size: int, num_steps: int, topk: int, context_len: int, seed: int = 0,
               tree_model=None) -> Step:
    """The engine's draft + catchup stages at (b, s, k, l) (module docstring)."""
    if num_steps < 1 or topk < 1:
        raise SimtreeError(f"draft step needs num_steps >= 1 and topk >= 1, got {num_steps}, {topk}")
    candidates = topk + (num_steps - 1) * topk ** 2
    budget = min(1 + num_steps * topk, 1 + candidates)
    rs = RoundShape(num_steps, topk, budget, budget)
    engine = _engine(model, rs, batch_size, context_len, min(2, num_steps), seed, tree_model)
    return Step("draft_step", engine, ("draft", "catchup"), context_len,
                {"num_steps": num_steps, "topk": topk, "budget": budget}).prime()
