"""Accepted-path refresh of the persistent V4 state after a tree verify.

Convention: the accepted path of tree b is a root-first list of its local node ids,
``[0, c1, c2, ...]`` — the root (the token sampled last round, verified in this round) is
always its first element, so committing ``[0]`` appends exactly the root token.  An empty
list (or not calling commit at all) is a fully rejected round for that sequence: its
persistent state stays bit-identical.  A committed state equals the state after sequentially
decoding the accepted tokens (reference.decode_tokens):

  window   latents of the accepted tokens -> ring rows position % window (last ``window`` only)
  comp/idx entries completed at accepted nodes: copied from the round's scratch
  buffers  current slot s <- the last accepted token with position % r == s; for C4 the
           previous-window rows <- the window that completed last on the path (closed form of
           the online buffer updates, so one gather per buffer instead of a token loop)

Host side: :func:`plan_commit`; device side (graph-capturable): :func:`apply_commit`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from simtree.errors import SimtreeError

from .cache import V4Cache
from .commit_kernel import fused_commit
from .reference import V4LayerWeights
from .tree_verify import VerifyPlan, VerifyScratch

__all__ = ["CommitPlan", "plan_commit", "apply_commit", "commit"]


@dataclass
class CommitPlan:
    """win_dst/win_src [A]: window pool rows <- node rows; entry_dst_comp/entry_dst_idx/
    entry_src [E]: pool rows <- scratch entries; buffer rows of the flat [2 * B * S, C] view
    of comp_buf/idx_buf (kv rows, then score rows): buf_old_dst <- buf_old_src (the C4
    previous half taken from current-window rows written before this round), then
    buf_new_dst <- rows buf_new_src of the stacked node projections [2 * N, C];
    new_lens host [B]; the same buffer moves as one map for the fused kernel: buf_map [G, S]
    (row s of sequence buf_seq[g]'s buffer <- row of [buffers B*S | node projections N],
    -1 keeps it; old copies first, node copies win)."""

    win_dst: torch.Tensor
    win_src: torch.Tensor
    entry_dst_comp: torch.Tensor | None
    entry_dst_idx: torch.Tensor | None
    entry_src: torch.Tensor | None
    buf_old_dst: torch.Tensor | None
    buf_old_src: torch.Tensor | None
    buf_new_dst: torch.Tensor | None
    buf_new_src: torch.Tensor | None
    new_lens: np.ndarray
    buf_map: torch.Tensor | None = None
    buf_seq: torch.Tensor | None = None


def _check_path(tree, acc: np.ndarray, b: int) -> None:
    if acc.size == 0:
        return
    if acc[0] != 0:
        raise SimtreeError(f"accepted path of sequence {b} must start at the root (node 0), got {acc[0]}")
    if np.any(acc >= tree.num_nodes) or np.any(acc < 0):
        raise SimtreeError(f"accepted path of sequence {b} names a node outside its tree of {tree.num_nodes}")
    if np.any(tree.parents[acc[1:]] != acc[:-1]):
        raise SimtreeError(f"accepted nodes of sequence {b} are not a root path: {acc.tolist()}")


def plan_commit(cache: V4Cache, w: V4LayerWeights, plan: VerifyPlan,
                accepted: Sequence[Sequence[int]], device=None) -> CommitPlan:
    """Host-side index lists of the refresh; ``accepted[b]`` as in the module docstring."""
    batch = plan.batch
    if len(accepted) != batch.batch_size:
        raise SimtreeError(f"{len(accepted)} accepted paths for a batch of {batch.batch_size} trees")
    if not np.array_equal(plan.lens, cache.lens):
        raise SimtreeError("cache lengths changed since the verify plan was built (commit twice?)")
    W, r = cache.cfg.window, cache.ratio
    win_dst, win_src, e_comp, e_idx, e_src = [], [], [], [], []
    S = w.comp.num_slots if r else 0
    old_dst, old_src = [], []  # buffer row <- old buffer row
    new_dst, new_src = [], []  # buffer row <- flat node's projection
    slots = np.arange(r) if r else None
    m_of_node = {} if not r else {int(n): m for m, n in enumerate(plan.comp_nodes_host)}
    new_lens = cache.lens.copy()
    for b, (tree, start) in enumerate(zip(batch.trees, batch.cu_nodes[:-1])):
        acc = np.asarray(accepted[b], np.int64).reshape(-1)
        _check_path(tree, acc, b)
        A, L = acc.size, int(cache.lens[b])
        new_lens[b] = L + A
        if A == 0:
            continue
        pos = L + np.arange(A)
        keep = pos >= L + A - W
        win_dst.append(cache.window.flat_rows(b, pos[keep] % W))
        win_src.append(start + acc[keep])
        if not r:
            continue
        done = [(m_of_node[int(start + a)], int(p)) for a, p in zip(acc, pos) if int(start + a) in m_of_node]
        for m, p in done:
            e = (p + 1) // r - 1
            e_src.append(m)
            e_comp.append(int(cache.comp.flat_rows(b, e)))
            if cache.idx is not None:
                e_idx.append(int(cache.idx.flat_rows(b, e)))
        off = w.comp.cur_offset
        # current window slots: slot s <- the last accepted token with position % r == s
        t = A - 1 - ((L + A - 1 - slots) % r)
        has = t >= 0
        new_dst.append(b * S + off + slots[has])
        new_src.append(start + acc[t[has]])
        pc = (L + A) // r * r - 1  # last completion on the path
        if w.comp.overlap and pc >= L:  # previous half <- the window completed last
            q = pc - r + 1 + slots
            on_path = q >= L
            new_dst.append(b * S + slots[on_path])
            new_src.append(start + acc[q[on_path] - L])
            old_dst.append(b * S + slots[~on_path])
            old_src.append(b * S + off + slots[~on_path])
    t = lambda a, dt=np.int64: torch.as_tensor(np.ascontiguousarray(np.asarray(a, dt)), device=device)  # noqa: E731
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    cp = CommitPlan(t(cat(win_dst)), t(cat(win_src)), None, None, None, None, None, None, None, new_lens)
    if r:
        BS, N = cache.batch * S, batch.total_nodes
        od, os_ = cat(old_dst), cat(old_src)
        nd, ns = cat(new_dst), cat(new_src)
        cp.entry_dst_comp, cp.entry_src = t(e_comp), t(e_src)
        cp.entry_dst_idx = t(e_idx) if cache.idx is not None else None
        cp.buf_old_dst, cp.buf_old_src = t(np.concatenate([od, od + BS])), t(np.concatenate([os_, os_ + BS]))
        cp.buf_new_dst, cp.buf_new_src = t(np.concatenate([nd, nd + BS])), t(np.concatenate([ns, ns + N]))
        bmap = np.full((cache.batch, S), -1, np.int64)
        bmap.reshape(-1)[od] = os_
        bmap.reshape(-1)[nd] = BS + ns
        touched = np.flatnonzero((bmap >= 0).any(1))
        cp.buf_map, cp.buf_seq = t(bmap[touched]), t(touched)
    return cp


def _refresh_buffers(buf: torch.Tensor, proj, cp: CommitPlan) -> None:
    """Only the changed rows move; old-row copies go first (they read rows the node copies
    overwrite)."""
    flat = buf.view(-1, buf.shape[-1])
    if cp.buf_old_dst.numel():
        flat.index_copy_(0, cp.buf_old_dst, flat[cp.buf_old_src])
    if cp.buf_new_dst.numel():
        nodes = torch.stack(proj).view(-1, buf.shape[-1])
        flat.index_copy_(0, cp.buf_new_dst, nodes[cp.buf_new_src].to(flat.dtype))


def apply_commit(cache: V4Cache, scratch: VerifyScratch, cp: CommitPlan, impl: str = "triton",
                 sync_mirror: bool = True) -> None:
    """Device part of the refresh (no host sync; lengths are not touched).  impl "triton": one
    fused launch (commit_kernel); "torch": a handful of index_copy_ ops.  sync_mirror: also
    write the rows into FlashMLA's FP8 mirrors when the cache has them (cache.flashmla_mirror);
    False only for timing a Triton-only engine on a cache that a FlashMLA run also used."""
    if impl == "triton":
        fused_commit(cache, scratch, cp)
    else:
        _apply_commit_torch(cache, scratch, cp)
    fm = getattr(cache, "fm", None)
    if fm is not None and sync_mirror:  # keep FlashMLA's FP8 mirrors in step with the pools
        fm["window"].write(cp.win_dst, scratch.node_kv[cp.win_src])
        if cp.entry_src is not None:
            fm["comp"].write(cp.entry_dst_comp, scratch.comp_entries[cp.entry_src])


def _apply_commit_torch(cache: V4Cache, scratch: VerifyScratch, cp: CommitPlan) -> None:
    win = cache.window.pool
    win.index_copy_(0, cp.win_dst, scratch.node_kv[cp.win_src].to(win.dtype))
    if cp.entry_src is None:
        return
    cache.comp.pool.index_copy_(0, cp.entry_dst_comp, scratch.comp_entries[cp.entry_src].to(cache.comp.pool.dtype))
    _refresh_buffers(cache.comp_buf, scratch.comp_proj, cp)
    if cp.entry_dst_idx is not None:
        cache.idx.pool.index_copy_(0, cp.entry_dst_idx, scratch.idx_entries[cp.entry_src].to(cache.idx.pool.dtype))
        _refresh_buffers(cache.idx_buf, scratch.idx_proj, cp)


def commit(cache: V4Cache, w: V4LayerWeights, plan: VerifyPlan, scratch: VerifyScratch,
           accepted: Sequence[Sequence[int]]) -> None:
    """Write the accepted paths into the persistent state and drop the round's scratch."""
    cp = plan_commit(cache, w, plan, accepted, device=cache.window.pool.device)
    apply_commit(cache, scratch, cp)
    cache.lens[:] = cp.new_lens
