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
from itertools import chain
from typing import Sequence

import numpy as np
import torch

from simtree.errors import SimtreeError

from .cache import V4Cache
from ._commit_kernel import fused_commit
from .reference import V4LayerWeights
from .verify import VerifyPlan, VerifyScratch, upload

__all__ = ["CommitPlan", "plan_commit", "apply_commit", "commit"]


@dataclass
class CommitPlan:
    """win_dst/win_src [A]: window pool rows <- node rows; entry_dst_comp/entry_dst_idx/
    entry_src [E]: pool rows <- scratch entries; new_lens host [B]; the compressor-buffer moves
    as one map: buf_map [G, S] — row s of sequence buf_seq[g]'s buffer (comp_buf and idx_buf,
    kv and score planes alike) <- row buf_map[g, s] of [buffers B*S | node projections N],
    -1 keeps it.  Every source is read before any row is written (a C4 "previous half <-
    current half" copy reads the pre-commit rows); the fused kernel and the torch form
    (:func:`_refresh_buffers`) both follow that order.

    ``padded`` (device_plan.plan_commit_device): the lists have static sizes, -1 rows are
    skipped (win_dst / entry_dst_* < 0), every sequence has a buf_map row (all -1: kept) and
    new_lens is a device tensor."""

    win_dst: torch.Tensor
    win_src: torch.Tensor
    entry_dst_comp: torch.Tensor | None
    entry_dst_idx: torch.Tensor | None
    entry_src: torch.Tensor | None
    new_lens: np.ndarray | torch.Tensor
    buf_map: torch.Tensor | None = None
    buf_seq: torch.Tensor | None = None
    padded: bool = False


def _check_path(tree, acc: np.ndarray, b: int) -> None:
    if acc.size == 0:
        return
    if acc[0] != 0:
        raise SimtreeError(f"accepted path of sequence {b} must start at the root (node 0), got {acc[0]}")
    if np.any(acc >= tree.num_nodes) or np.any(acc < 0):
        raise SimtreeError(f"accepted path of sequence {b} names a node outside its tree of {tree.num_nodes}")
    if np.any(tree.parents[acc[1:]] != acc[:-1]):
        raise SimtreeError(f"accepted nodes of sequence {b} are not a root path: {acc.tolist()}")


def _as_path(a) -> np.ndarray:
    return np.asarray(a, np.int64).reshape(-1)


def _flat_paths(accepted: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """(flat int64 [sum A_b], A_b [B]): every path as np.asarray(path, int64).reshape(-1) would
    give it, concatenated.  Lists / tuples of numbers convert in one call; anything else (arrays,
    nested lists) path by path."""
    if all(type(a) in (list, tuple) for a in accepted):
        try:
            flat = np.asarray(list(chain.from_iterable(accepted)), np.int64)
        except (TypeError, ValueError):
            flat = None
        if flat is not None and flat.ndim == 1:
            cnt = np.fromiter(map(len, accepted), np.int64, len(accepted))
            if int(cnt.sum()) == flat.size:
                return flat, cnt
    accs = [_as_path(a) for a in accepted]
    return np.concatenate(accs), np.array([a.size for a in accs], np.int64)


def _check_paths(batch, accepted: Sequence, flat: np.ndarray, sb: np.ndarray, i: np.ndarray) -> None:
    """_check_path for every sequence at once; the first failing sequence raises through
    _check_path, so the error is the one a per-sequence loop gives."""
    if not flat.size:
        return
    out = (flat < 0) | (flat >= np.diff(batch.cu_nodes)[sb])
    parent = batch.parents[batch.cu_nodes[:-1][sb] + np.where(out, 0, flat)]
    prev = np.concatenate([[-1], flat[:-1]])
    wrong = out | np.where(i == 0, flat != 0, parent != prev)
    if wrong.any():
        b = int(sb[np.argmax(wrong)])
        _check_path(batch.trees[b], _as_path(accepted[b]), b)
        raise SimtreeError(f"accepted path of sequence {b} is invalid: {_as_path(accepted[b]).tolist()}")  # unreached


def plan_commit(cache: V4Cache, w: V4LayerWeights, plan: VerifyPlan,
                accepted: Sequence[Sequence[int]], device=None) -> CommitPlan:
    """Host-side index lists of the refresh; ``accepted[b]`` as in the module docstring.  numpy
    over every accepted token of the batch at once (no per-sequence or per-slot Python loop)."""
    batch = plan.batch
    if batch is None:
        raise SimtreeError("a plan built on the device commits through plan_commit_device")
    if len(accepted) != batch.batch_size:
        raise SimtreeError(f"{len(accepted)} accepted paths for a batch of {batch.batch_size} trees")
    if not np.array_equal(plan.lens, cache.lens):
        raise SimtreeError("cache lengths changed since the verify plan was built (commit twice?)")
    W, r, B = cache.cfg.window, cache.ratio, batch.batch_size
    flat, cnt = _flat_paths(accepted)                           # accepted local ids, sequence by sequence; A_b
    first = np.cumsum(cnt) - cnt                                # where sequence b's path starts in flat
    sb = np.repeat(np.arange(B, dtype=np.int64), cnt)           # sequence of each accepted token
    i = np.arange(flat.size, dtype=np.int64) - first[sb]        # its index on the path
    _check_paths(batch, accepted, flat, sb, i)
    L = cache.lens.astype(np.int64)
    new_lens = cache.lens.copy()
    new_lens += cnt
    node = batch.cu_nodes[:-1][sb] + flat                       # flat node ids
    pos = L[sb] + i
    keep = i >= cnt[sb] - W                                     # the last W accepted tokens
    cp = CommitPlan(None, None, None, None, None, new_lens)
    host = {"win_dst": cache.window.flat_rows(sb[keep], pos[keep] % W), "win_src": node[keep]}
    if not r:
        return _finish(cp, host, device)
    # entries completed at accepted nodes: pool rows <- the round's scratch entries
    m_of = np.full(batch.total_nodes, -1, np.int64)
    m_of[plan.comp_nodes_host] = np.arange(len(plan.comp_nodes_host))
    m = m_of[node]
    done = m >= 0
    e = (pos[done] + 1) // r - 1
    host["entry_src"] = m[done]
    host["entry_dst_comp"] = cache.comp.flat_rows(sb[done], e)
    if cache.idx is not None:
        host["entry_dst_idx"] = cache.idx.flat_rows(sb[done], e)
    # buffers [B, S]: current-window slot s <- the last accepted token with position % r == s;
    # C4 previous half <- the window completed last on the path: its on-path slots from node
    # projections, the others from the current-window rows written before this round
    S, off = w.comp.num_slots, w.comp.cur_offset
    BS = B * S
    slots = np.arange(r)[None, :]
    A_, L_, f_ = cnt[:, None], L[:, None], first[:, None]
    bmap = np.full((B, S), -1, np.int64)
    tk = A_ - 1 - ((L_ + A_ - 1 - slots) % r)                   # path index of slot s's last token
    has = tk >= 0                                               # all False where A_b == 0
    cur = bmap[:, off:off + r]
    cur[has] = BS + node[(f_ + tk)[has]]
    if w.comp.overlap:
        pc = (L + cnt) // r * r - 1                             # last completion on the path
        q = pc[:, None] - r + 1 + slots
        prev = ((pc >= L) & (cnt > 0))[:, None]
        half = bmap[:, :r]
        on_path = prev & (q >= L_)
        half[on_path] = BS + node[(f_ + q - L_)[on_path]]
        old = prev & (q < L_)
        half[old] = np.broadcast_to(np.arange(B)[:, None] * S + off + slots, old.shape)[old]
    touched = np.flatnonzero((bmap >= 0).any(1))
    host["buf_map"], host["buf_seq"] = bmap[touched], touched
    return _finish(cp, host, device)


def _finish(cp: CommitPlan, host: dict, device) -> CommitPlan:
    for k, v in upload({k: np.asarray(a, np.int64) for k, a in host.items()}, device).items():
        setattr(cp, k, v)
    return cp


def _refresh_buffers(buf: torch.Tensor, proj, cp: CommitPlan) -> None:
    """The buffer map in plain torch ops (no host sync, graph-capturable): every touched
    sequence's S rows are gathered from their sources (pre-commit buffer rows or node
    projections; -1 keeps the row) before one index_copy_ writes them back."""
    G, S = cp.buf_map.shape
    if G == 0:
        return
    B, C = buf.shape[1], buf.shape[-1]
    BS = B * S
    planes = buf.view(2, BS, C)                                 # [kv | score] planes
    nodes = torch.stack(proj).view(2, -1, C)                    # [2, N, C]
    src = cp.buf_map.reshape(-1)
    rows = (cp.buf_seq.unsqueeze(1) * S + torch.arange(S, device=src.device)).reshape(-1)
    from_buf = planes[:, src.clamp(0, BS - 1)]
    from_node = nodes[:, (src - BS).clamp(0, nodes.shape[1] - 1)].to(planes.dtype)
    sel = src.view(1, -1, 1)
    new = torch.where(sel >= BS, from_node, torch.where(sel >= 0, from_buf, planes[:, rows]))
    planes.index_copy_(1, rows, new)


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
        fm["window"].write(*_mirror_rows(cp.win_dst, cp.win_src, scratch.node_kv, fm["window_base"], cp.padded))
        if cp.entry_src is not None:
            fm["comp"].write(*_mirror_rows(cp.entry_dst_comp, cp.entry_src, scratch.comp_entries, fm["comp_base"],
                                           cp.padded))


def _mirror_rows(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, spare: int, padded: bool):
    """(mirror row ids, rows) of a commit list; a padded list's -1 rows go to the mirror's first
    spare row, which only holds the round's scratch (rewritten by every verify before it is
    read)."""
    if not padded:
        return dst, rows[src]
    return torch.where(dst >= 0, dst, spare), rows[src.clamp(min=0)]


def _copy_rows(pool: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[dst] <- rows where dst >= 0, without a host sync (a padded plan's lists): the
    skipped rows repeat the first kept (dst, row) pair, or rewrite row 0 with itself when none
    is kept, so that every row written more than once gets the same value each time."""
    if dst.numel() == 0:
        return
    keep = dst >= 0
    first = torch.argmax(keep.to(torch.int32))
    any_kept = keep.any()
    first = first.reshape(1)          # a 1-element index: a 0-d one is read on the host
    fill_dst = torch.where(any_kept, dst.index_select(0, first)[0], 0)
    fill_row = torch.where(any_kept, rows.index_select(0, first)[0], pool[0])
    pool.index_copy_(0, torch.where(keep, dst, fill_dst), torch.where(keep.unsqueeze(1), rows, fill_row))


def _apply_commit_torch(cache: V4Cache, scratch: VerifyScratch, cp: CommitPlan) -> None:
    def copy(pool: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
        if cp.padded:
            _copy_rows(pool, dst, rows[src.clamp(min=0)].to(pool.dtype))
        else:
            pool.index_copy_(0, dst, rows[src].to(pool.dtype))

    copy(cache.window.pool, cp.win_dst, cp.win_src, scratch.node_kv)
    if cp.entry_src is None:
        return
    copy(cache.comp.pool, cp.entry_dst_comp, cp.entry_src, scratch.comp_entries)
    _refresh_buffers(cache.comp_buf, scratch.comp_proj, cp)
    if cp.entry_dst_idx is not None:
        copy(cache.idx.pool, cp.entry_dst_idx, cp.entry_src, scratch.idx_entries)
        _refresh_buffers(cache.idx_buf, scratch.idx_proj, cp)


def commit(cache: V4Cache, w: V4LayerWeights, plan: VerifyPlan, scratch: VerifyScratch,
           accepted: Sequence[Sequence[int]]) -> None:
    """Write the accepted paths into the persistent state and drop the round's scratch."""
    cp = plan_commit(cache, w, plan, accepted, device=cache.window.pool.device)
    apply_commit(cache, scratch, cp)
    cache.lens[:] = cp.new_lens
