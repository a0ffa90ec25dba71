"""A profiled step: the grid point a profile table row measures, and the contract between the
profiler, which times steps, and whoever builds them (the profiler's own stages; the
runtime's models, :mod:`simtree.runtime.profile_steps`, handed to the sweep by the CLI).

    wl = builder.workload(ctx, point)    # raises Unavailable if the variant cannot run here
    step, instance_bytes = wl.make()     # one copy on its own random inputs
    step()                               # what is timed

``point.tree_shape`` names the trees a point verifies; :func:`random_tree` draws them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from simtree.errors import SimtreeError
from simtree.trees.tree import DraftTree

__all__ = ["Point", "Workload", "Unavailable", "StepContext", "StepBuilder", "TREE_SHAPES", "random_tree"]

TREE_SHAPES = ("eagle", "linear", "chain", "random", "any")


class Unavailable(Exception):
    """This (stage, variant) cannot run on this machine (missing kernel / package / device)."""


@dataclass(frozen=True)
class Point:
    """One grid point of a sweep: the key of a profile table row (its columns, same names)."""

    stage: str
    variant: str
    model: str
    batch_size: int
    nodes_per_seq: int
    context_len: int = 0
    tree_shape: str = "any"
    num_steps: int = 0
    topk: int = 0

    @property
    def tokens(self) -> int:
        return self.batch_size * self.nodes_per_seq


@dataclass
class Workload:
    """Builds the timed step of a point: ``make() -> (step, instance_bytes)``; ``shared_bytes``
    are read by every copy (weights); ``eager``: the step does host work (syncs, Python) and
    is never captured in a CUDA graph."""

    make: Callable[[], tuple[Callable[[], object], int]]
    shared_bytes: int = 0
    eager: bool = False


class StepContext(Protocol):
    """What a step builder may read of the sweep's context for one model."""

    model: object           # the ModelShape timed: one rank's (ModelShape.shard of the sweep's deployment)
    device: object          # torch.device the steps run on
    seed: int               # the sweep's seed: inputs derive from it
    notes: dict             # per-model scratch shared by the points of a sweep (loaded models, caches)


class StepBuilder(Protocol):
    """The steps of one variant that the profiler does not build itself (e.g. the runtime's
    ``runtime_tiny``); ``run_sweep(..., builders={variant: builder})`` times them."""

    def workload(self, ctx: StepContext, point: Point) -> Workload:
        """The point's workload; Unavailable for a stage this variant does not time."""
        ...

    def check(self, ctx: StepContext, stage: str) -> str:
        """A one-line verdict of a correctness check at a small shape ("ok ..." or "no
        reference"), run once per (model, stage) before timing; AssertionError on a mismatch."""
        ...


def random_tree(n: int, shape: str, rng: np.random.Generator, width: int = 4) -> DraftTree:
    """A tree of ``n`` nodes: "linear" = chain; "eagle" = EAGLE-like (each node has at most
    ``width`` children, parents drawn with weight 2^depth so the tree is deep and bushy near
    the root like a pruned top-k expansion); "random" (or "any") = uniform random parents."""
    if shape not in TREE_SHAPES:
        raise SimtreeError(f"unknown tree_shape {shape!r} (known: {', '.join(TREE_SHAPES)})")
    if shape in ("linear", "chain") or n <= 2:
        return DraftTree.chain(n)
    parents = [-1]
    depth = [0]
    children = [0]
    for i in range(1, n):
        cand = [j for j in range(i) if children[j] < width] if shape == "eagle" else list(range(i))
        w = np.array([2.0 ** depth[j] for j in cand]) if shape == "eagle" else np.ones(len(cand))
        p = int(rng.choice(cand, p=w / w.sum()))
        parents.append(p)
        depth.append(depth[p] + 1)
        children[p] += 1
        children.append(0)
    return DraftTree(np.asarray(parents))
