"""Persistent, paged per-sequence state of one V4 attention layer.

Every growing buffer is a :class:`PagedPool`: rows live in pages of ``page_size`` rows of a
flat pool [num_pages * page_size, dim]; sequence b's logical row i is flat row
``block_table[b, i // page_size] * page_size + i % page_size``.  Pages are handed out in a
shuffled order so that nothing relies on contiguity.

    window   ring of the last ``window`` token latents, logical row = position % window
    comp     compressed entries (C4 for CSA, C128 for HCA), logical row = entry index
    idx      the indexer's C4 keys (CSA only)
    comp_buf, idx_buf [2, B, S, C]: the compressors' partial windows; views comp_kv = comp_buf[0],
             comp_score = comp_buf[1] (idx_kv, idx_score likewise) — one tensor so that the
             refresh moves kv and score rows with one index op
    lens     host int64 [B]: tokens already in the cache (the tree root sits at lens[b])

Scratch (tree nodes' latents, entries completed inside a tree) never lives here.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from simtree.errors import SimtreeError

from .compressor import init_state
from .config import V4AttnConfig
from .reference import SeqState, V4LayerWeights

__all__ = ["PagedPool", "V4Cache"]


class PagedPool:
    """B sequences x ``capacity`` logical rows of width ``dim`` in shuffled pages."""

    def __init__(self, batch: int, capacity: int, dim: int, page_size: int, dtype, device,
                 rng: np.random.Generator | None = None):
        self.page_size = page_size
        self.capacity = capacity
        pages = max(1, -(-capacity // page_size))
        order = np.arange(batch * pages)
        if rng is not None:
            rng.shuffle(order)
        self.block_table_host = order.reshape(batch, pages).astype(np.int64)
        self.block_table = torch.as_tensor(self.block_table_host, device=device)
        self.pool = torch.zeros(batch * pages * page_size, dim, dtype=dtype, device=device)

    @property
    def num_rows(self) -> int:
        return self.pool.shape[0]

    def all_rows(self) -> np.ndarray:
        """Host int64 [B, capacity]: the flat row of every (sequence, logical row); built once
        (the block table never changes), so planning a round slices instead of recomputing."""
        if getattr(self, "_all_rows", None) is None:
            # one broadcast add over [B, pages, page_size] (no gathered temporaries); read-only
            # so that no caller's in-place edit can leak into later rounds
            ps = self.page_size
            full = (self.block_table_host * ps)[:, :, None] + np.arange(ps, dtype=np.int64)
            rows = full.reshape(full.shape[0], -1)[:, :self.capacity]
            rows.setflags(write=False)
            self._all_rows = rows
        return self._all_rows

    def all_rows_on(self, device) -> torch.Tensor:
        """all_rows() as an int64 tensor on ``device``, uploaded once per device (the block
        table never changes)."""
        key = str(torch.device(device))
        cached = self.__dict__.setdefault("_all_rows_on", {})
        if key not in cached:
            # a copy: all_rows() is read-only, and on the CPU as_tensor would share its memory
            cached[key] = torch.tensor(self.all_rows(), device=device)
        return cached[key]

    def flat_rows(self, seq: np.ndarray, logical: np.ndarray) -> np.ndarray:
        """Host int64 flat rows of (seq, logical row) pairs (broadcasting)."""
        logical = np.asarray(logical, np.int64)
        if logical.size and (logical.min() < 0 or logical.max() >= self.capacity):
            raise SimtreeError(f"paged row {int(logical.max())} outside capacity {self.capacity}")
        page = self.block_table_host[np.asarray(seq, np.int64), logical // self.page_size]
        return page * self.page_size + logical % self.page_size


class V4Cache:
    """Paged persistent state of one layer (kind swa/csa/hca) for a batch of sequences."""

    def __init__(self, cfg: V4AttnConfig, w: V4LayerWeights, batch: int, max_len: int,
                 dtype=torch.bfloat16, state_dtype=torch.float32, device=None, seed: int = 0):
        self.cfg, self.kind, self.batch = cfg, w.kind, batch
        self.ratio = cfg.ratio(w.kind)
        self.lens = np.zeros(batch, np.int64)
        self.max_len = max_len
        rng = np.random.default_rng(seed)
        ps = cfg.page_size
        self.window = PagedPool(batch, cfg.window, cfg.head_dim, ps, dtype, device, rng)
        self.comp = self.idx = None
        self.comp_kv = self.comp_score = self.idx_kv = self.idx_score = None
        self.comp_buf = self.idx_buf = None
        if self.ratio:
            self.comp = PagedPool(batch, max_len // self.ratio + 1, cfg.head_dim, ps, dtype, device, rng)
            self.comp_buf = torch.stack(init_state(w.comp, batch, state_dtype, device))
            self.comp_kv, self.comp_score = self.comp_buf[0], self.comp_buf[1]
        if w.indexer is not None:
            self.idx = PagedPool(batch, max_len // cfg.csa_ratio + 1, cfg.indexer_dim, ps, dtype, device, rng)
            self.idx_buf = torch.stack(init_state(w.indexer, batch, state_dtype, device))
            self.idx_kv, self.idx_score = self.idx_buf[0], self.idx_buf[1]

    # ---- builders ------------------------------------------------------------------------
    @classmethod
    def from_states(cls, cfg, w, states: list[SeqState], max_len: int, dtype=torch.float64,
                    state_dtype=torch.float64, device=None, seed: int = 0) -> "V4Cache":
        """Pack unpaged reference states (see reference.SeqState) into a paged cache."""
        cache = cls(cfg, w, len(states), max_len, dtype, state_dtype, device, seed)
        for b, st in enumerate(states):
            if st.length > max_len:
                raise SimtreeError(f"sequence {b} has {st.length} tokens, more than max_len {max_len}")
            cache.lens[b] = st.length
            pos = np.arange(max(0, st.length - cfg.window), st.length)
            cache.window.pool[cache.window.flat_rows(b, pos % cfg.window)] = st.kv[pos].to(device=device, dtype=dtype)
            for name in ("comp", "idx"):
                pool, rows = getattr(cache, name), getattr(st, name)
                if pool is not None and rows.shape[0]:
                    pool.pool[pool.flat_rows(b, np.arange(rows.shape[0]))] = rows.to(device=device, dtype=dtype)
            for name in ("comp_kv", "comp_score", "idx_kv", "idx_score"):
                if getattr(cache, name) is not None:
                    getattr(cache, name)[b] = getattr(st, name).to(device=device, dtype=state_dtype)
        return cache

    @classmethod
    def random(cls, cfg, w, batch: int, context_len: int, max_len: int | None = None,
               dtype=torch.bfloat16, state_dtype=torch.float32, device=None, seed: int = 0) -> "V4Cache":
        """A cache at ``context_len`` tokens filled with random numbers (for timing only)."""
        cache = cls(cfg, w, batch, max_len or context_len + 256, dtype, state_dtype, device, seed)
        gen = torch.Generator(device=device or "cpu").manual_seed(seed)
        for pool in (cache.window, cache.comp, cache.idx):
            if pool is not None:
                pool.pool.normal_(generator=gen)
        for name in ("comp_kv", "comp_score", "idx_kv", "idx_score"):
            if getattr(cache, name) is not None:
                getattr(cache, name).normal_(generator=gen)
        cache.lens[:] = context_len
        return cache

    # ---- views ---------------------------------------------------------------------------
    def sequence_state(self, b: int) -> SeqState:
        """Sequence b as an unpaged SeqState; kv holds only the window ([min(L, window), D])."""
        L, W = int(self.lens[b]), self.cfg.window
        pos = np.arange(max(0, L - W), L)
        st = SeqState(L, self.window.pool[self.window.flat_rows(b, pos % W)])
        n_entries = L // self.ratio if self.ratio else 0
        for name in ("comp", "idx"):
            pool = getattr(self, name)
            if pool is not None:
                setattr(st, name, pool.pool[pool.flat_rows(b, np.arange(n_entries))])
        for name in ("comp_kv", "comp_score", "idx_kv", "idx_score"):
            if getattr(self, name) is not None:
                setattr(st, name, getattr(self, name)[b])
        return st

    def flashmla_mirror(self, node_rows: int, scratch_rows: int):
        """FP8 copies of the window and compressed pools in FlashMLA's V4 layout (flashmla.
        PackedRows), each followed by spare rows for the round's node latents / scratch
        entries.  Built once by packing every row (outside CUDA graphs), rebuilt if the spare
        rows are too few, kept in sync by commit.apply_commit.  Derived data: not part of the
        persistent state (checksum) — only the spare rows are written during a verify."""
        from .flashmla import PackedRows
        fm = getattr(self, "fm", None)
        if fm is not None and fm["node_rows"] >= node_rows and fm["scratch_rows"] >= scratch_rows:
            return fm
        dev = self.window.pool.device
        fm = {"node_rows": node_rows, "scratch_rows": scratch_rows}
        for name, pool, extra in (("window", self.window, node_rows), ("comp", self.comp, scratch_rows)):
            if pool is None:
                continue
            base = -(-pool.num_rows // 64) * 64
            packed = PackedRows(base + max(extra, 1), dev)
            for r0 in range(0, pool.num_rows, 1 << 16):  # bounded temporaries
                rows = torch.arange(r0, min(r0 + (1 << 16), pool.num_rows), device=dev)
                packed.write(rows, pool.pool[rows])
            fm[name], fm[name + "_base"] = packed, base
        self.fm = fm
        return fm

    def persistent_tensors(self) -> dict[str, torch.Tensor]:
        out = {"window": self.window.pool}
        for name in ("comp", "idx"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).pool
        for name in ("comp_kv", "comp_score", "idx_kv", "idx_score"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def checksum(self) -> str:
        """sha256 over every persistent byte and the lengths (bit-identity checks)."""
        h = hashlib.sha256(self.lens.tobytes())
        for name, t in self.persistent_tensors().items():
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
