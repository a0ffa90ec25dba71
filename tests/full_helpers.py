"""Shared builders for the full-runtime tests: tiny float64 models from the registry whose
MTP layer agrees with the target often (``make_predictable``), so rounds accept and reject."""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from simtree.costs.model import CostBundle, DrafterCostModel
from simtree.costs.synthetic import synthetic_costs

from simtree.models import get_model
from simtree.runtime.full.lossless import make_predictable
from simtree.runtime.full.qwen import QwenModel
from simtree.runtime.full.v4_rank import V4Rank

torch.set_num_threads(1)  # tiny shapes: extra threads only spin on the shared CI cores

FAMILIES = ("tiny-gdn", "tiny-v4")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11],
           [5, 5, 5]]


@functools.lru_cache(maxsize=8)
def tiny_model(name: str, seed: int = 1, dtype=torch.float64):
    """A float64 tiny model on the CPU (cached: tests must not change its weights)."""
    shape = get_model(name)
    cls = QwenModel if shape.family == "gdn_hybrid" else V4Rank
    model = cls(shape, device="cpu", dtype=dtype, seed=seed)
    make_predictable(model, 0.3)
    return model


@dataclass
class _DrafterSurface:
    per_unit_us: float

    def predict(self, x, y, b):
        return 100.0 + self.per_unit_us * (x + y) * b


def drafter_costs(per_token_us: float = 10.0, families=("block", "tfm", "dspark"), drafter_us: float = 0.5):
    """Synthetic verify / draft costs (nodes cost verify time) with a C_d for each of ``families``
    (its own block of 7 positions)."""
    base = synthetic_costs(weights_us=0.0, per_token_us=per_token_us)
    return CostBundle(base.verify, base.draft, {"model": "tiny", "device": "cpu"},
                      {f: DrafterCostModel(_DrafterSurface(drafter_us), {"block_len": 7}, f) for f in families})


class TierRuns:
    """A controller (``simtree.control.Controller``'s interface) that runs its tiers in runs of
    given lengths, in turn: ``plan`` [(PolicySpec, rounds)]."""

    def __init__(self, plan):
        from types import SimpleNamespace
        self.tiers = [SimpleNamespace(name=s.name, spec=s) for s, _ in plan]
        self._order = [t for t, (_, n) in zip(self.tiers, plan) for _ in range(n)]
        self.chosen = []

    def choose(self, batch_size, context_lens, rounds_done=None):
        tier = self._order[len(self.chosen) % len(self._order)]
        self.chosen.append(tier.name)
        return tier

    def observe(self, tier, accepted):
        pass


class PeakBytes(TorchDispatchMode):
    """The peak of the bytes held by the tensors the ops inside allocate (views and in-place
    results of their inputs not counted; a tensor's bytes freed when it dies), with the copy
    ATen's logsumexp makes of its input inside the op ((x - max).exp_(), ReduceOps.cpp), which
    no op returns."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _hold(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if func is torch.ops.aten.logsumexp.default:
            self._hold(inputs[0].nbytes)
            self.now -= inputs[0].nbytes
        out = func(*args, **(kwargs or {}))
        seen = {a.untyped_storage().data_ptr() for a in inputs}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if key in seen or key in self.live or n == 0:
                continue
            self.live[key] = n
            self._hold(n)
            weakref.finalize(t, self._free, key)
        return out

    def _free(self, key) -> None:
        self.now -= self.live.pop(key, 0)


def reachable(obj, out: dict) -> dict:
    """{storage pointer: bytes} of every tensor reachable from ``obj`` through dicts, lists,
    tuples and simtree objects' attributes."""
    if isinstance(obj, torch.Tensor):
        out[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, dict):
        for v in obj.values():
            reachable(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            reachable(v, out)
    elif type(obj).__module__.startswith("simtree") and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            reachable(v, out)
    return out
