"""A cost bundle tabulated per batch size for step-by-step simulation.

A fitted surface costs ~0.7 ms per call; a served trace asks it at every step.  Per batch size
the grid evaluates C_v once on nodes per sequence in steps of 1/8 and contexts in buckets of
``CTX_BUCKET`` tokens, and C_d on whole (steps, top-k); lookups take the nearest node step and
interpolate linearly in context.  The same ``verify.predict`` / ``draft.predict`` signatures
as a bundle, so the controller takes either.  The grid itself spans more than the measured
range; a lookup outside it warns once per axis, as the bundle does.
"""
from __future__ import annotations

import warnings

import numpy as np

__all__ = ["CostGrid", "CTX_BUCKET", "NODE_STEP"]

CTX_BUCKET = 64
NODE_STEP = 0.125


class _Verify:
    def __init__(self, grid: "CostGrid"):
        self._g = grid

    def predict(self, nodes_per_seq, context_len, batch_size):
        return self._g.verify_us(nodes_per_seq, context_len, int(batch_size))


class _Draft:
    def __init__(self, grid: "CostGrid"):
        self._g = grid

    def predict(self, num_steps, topk, batch_size):
        return self._g.draft_us(num_steps, topk, int(batch_size))


class CostGrid:
    def __init__(self, costs, max_nodes: float = 17.0, max_context: int = 16384, max_steps: int = 16,
                 max_topk: int = 4):
        self.costs, self.meta = costs, getattr(costs, "meta", {})
        self._n = np.arange(1.0, max_nodes + NODE_STEP / 2, NODE_STEP)
        self._l = np.arange(0, max_context + CTX_BUCKET, CTX_BUCKET, dtype=np.float64)
        self._l[0] = 1.0
        self._s, self._k = np.arange(1, max_steps + 1), np.arange(1, max_topk + 1)
        self._v: dict[int, np.ndarray] = {}
        self._d: dict[int, np.ndarray] = {}
        self.verify, self.draft = _Verify(self), _Draft(self)
        self._warned: set = set()

    def _check(self, model: str, axis: str, value) -> None:
        if (model, axis) in self._warned:
            return
        lo, hi = (getattr(self.costs, model).valid_range or {}).get(axis, (None, None))
        if lo is None:
            return
        if np.isscalar(value):
            small = big = float(value)
        else:
            v = np.asarray(value, np.float64)
            small, big = float(v.min()), float(v.max())
        if small >= lo - 1e-9 * max(1.0, abs(lo)) and big <= hi + 1e-9 * max(1.0, abs(hi)):   # float rounding is in range
            return
        self._warned.add((model, axis))
        warnings.warn(f"{self.meta.get('model', '?')} {model} cost model queried outside its measured range "
                      f"({axis} in [{lo:g}, {hi:g}], asked {big if big > hi else small:g}); "
                      "extrapolating conservatively (non-decreasing)", RuntimeWarning, stacklevel=3)

    def _vgrid(self, b: int) -> np.ndarray:
        if b not in self._v:
            N, L = np.meshgrid(self._n, self._l, indexing="ij")
            with warnings.catch_warnings():   # the grid spans more than is queried: lookups warn
                warnings.simplefilter("ignore")
                self._v[b] = np.asarray(self.costs.verify.predict(N, L, b), np.float64)
            self._check("verify", "batch_size", b)
        return self._v[b]

    def verify_us(self, nodes, context_len, b: int):
        g = self._vgrid(b)
        self._check("verify", "nodes_per_seq", nodes)
        self._check("verify", "context_len", context_len)
        if np.isscalar(nodes) and np.isscalar(context_len):   # the per-step call: no array overhead
            i = min(max(int(round((float(nodes) - 1.0) / NODE_STEP)), 0), g.shape[0] - 1)
            x = min(max(float(context_len) / CTX_BUCKET, 0.0), g.shape[1] - 1.000001)
            j = int(x)
            return float(g[i, j] * (j + 1 - x) + g[i, j + 1] * (x - j))
        i = np.clip(np.rint((np.asarray(nodes, np.float64) - 1.0) / NODE_STEP).astype(np.int64), 0, g.shape[0] - 1)
        x = np.clip(np.asarray(context_len, np.float64) / CTX_BUCKET, 0, g.shape[1] - 1.000001)
        j = np.floor(x).astype(np.int64)
        f = x - j
        return g[i, j] * (1 - f) + g[i, j + 1] * f

    def draft_us(self, num_steps, topk, b: int):
        if b not in self._d:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._d[b] = np.asarray(self.costs.draft.predict(self._s[:, None], self._k[None, :], b), np.float64)
        self._check("draft", "num_steps", num_steps)
        g = self._d[b]
        if np.isscalar(num_steps) and np.isscalar(topk):
            if num_steps <= 0:
                return 0.0
            return float(g[min(int(num_steps), g.shape[0]) - 1, min(max(int(topk), 1), g.shape[1]) - 1])
        s = np.asarray(num_steps, np.int64)
        k = np.clip(np.asarray(topk, np.int64), 1, g.shape[1])
        return np.where(s <= 0, 0.0, g[np.clip(s, 1, g.shape[0]) - 1, k - 1])
