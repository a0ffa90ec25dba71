"""Per-round tree metadata shared by every GDN layer (built once per verify round).

SGLang builds its tree metadata once per round and every layer reads it; so do we: the
ancestor bitmask, depth and near ancestors are computed here by pointer doubling
(ceil(log2 n) gather rounds, no host sync when ``max_nodes`` is given) and the kernels read
them.  Layouts:

    bits     int64 [N, W]  W = ceil(max_nodes / 64); bit (m % 64) of word m // 64 of row j is
                           set iff local node m is an ancestor-or-self of j (TreeBatch layout)
    depth    int64 [N]     root depth 0
    anc      int64 [N, 3]  flat row of the 1st/2nd/3rd nearest ancestor, -1 past the root
    seq_ids  int64 [N]
    pairs    int32 [B, C, C] / counts int32 [B, C]  (``subchunk_pairs``, C = ceil(max_nodes / bt)):
             pairs[b, c, :counts[b, c]] lists, ascending, the sub-chunks c2 < c of tree b that
             hold an ancestor of some node of sub-chunk c; the tree kernel visits only those
    heavy_first  (order int32 [N], TreeMeta of the renumbered trees): the depth-first,
             larger-subtree-first node order the tree kernel walks large trees in
             (``order[bos + p]`` = flat row of the p-th node visited)
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from simtree.errors import SimtreeError, TreeError

__all__ = ["TreeMeta", "tree_meta", "tree_meta_host", "HEAVY_FIRST_MAX_NODES"]

# the heavy-first order is built from dense [nodes, max_nodes] tables, which grow with the
# square of the tree size: the kernel's depth-first walk and tree_meta's check stop here
HEAVY_FIRST_MAX_NODES = 256


@dataclass(frozen=True)
class TreeMeta:
    bits: torch.Tensor
    depth: torch.Tensor
    anc: torch.Tensor
    seq_ids: torch.Tensor
    max_nodes: int
    # every tree is stored in its heavy-first depth-first order already (``tree_meta``'s
    # depth_first): the kernel then walks the stored order, no renumbering, no indirection
    depth_first: bool = False
    # built on first use: ("heavy_first",) and ("pairs", block_t)
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def words(self) -> int:
        return int(self.bits.shape[1])

    def heavy_first(self, cu_nodes: torch.Tensor) -> tuple[torch.Tensor, "TreeMeta"]:
        """(order int32 [N], meta of the renumbered trees), cached: the tree kernel's node order.

        order[bos + p] is the flat row of the node visited p-th by a depth-first walk of its
        tree that takes the child with the larger subtree first (ties: lower index); the
        returned TreeMeta describes the same trees renumbered that way.  Depth-first
        numbering keeps each branch in few node sub-chunks, so fewer sub-chunk pairs hold
        ancestors (the benchmark's EAGLE-like trees of 128 nodes, 16-node sub-chunks: 12.8-14 of
        28 instead of all 28; reports/h200/gdn/tuning/pairs.md).
        Sync-free torch ops, built once per round."""
        key = ("heavy_first",)
        if key not in self._derived:
            self._derived[key] = _heavy_first(self, cu_nodes)
        return self._derived[key]

    def subchunk_pairs(self, cu_nodes: torch.Tensor, bt: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(pairs [B, C, C], counts [B, C], C) for node sub-chunks of ``bt`` (divides 64).

        Sync-free torch ops, cached per bt: built once per round, shared by every layer."""
        key = ("pairs", bt)
        if key not in self._derived:
            self._derived[key] = _subchunk_pairs(self.bits, self.seq_ids, cu_nodes, self.max_nodes, bt)
        return self._derived[key]


def _subchunk_pairs(bits, seq_ids, cu_nodes, max_nodes: int, bt: int):
    N, W = bits.shape
    B, C = cu_nodes.numel() - 1, (max_nodes + bt - 1) // bt
    dev = bits.device
    cu_nodes = cu_nodes.to(device=dev, dtype=torch.int64)
    # per row: does its ancestor set meet sub-chunk c2 (bits [c2 bt, (c2 + 1) bt) of the row)?
    if bt == 64:
        meets = bits != 0                                              # [N, W]
    else:
        shift = torch.arange(0, 64, bt, device=dev, dtype=torch.int64)
        meets = ((bits[:, :, None] >> shift) & ((1 << bt) - 1)) != 0   # arithmetic >>: masked
    meets = meets.reshape(N, -1)[:, :C].to(torch.int32)
    chunk = (torch.arange(N, device=dev) - cu_nodes[seq_ids]) // bt
    need = torch.zeros((B * C, C), dtype=torch.int32, device=dev)
    need.index_add_(0, seq_ids * C + chunk, meets)
    lower = torch.ones((C, C), dtype=torch.bool, device=dev).tril(-1)  # c2 < c only
    need = (need.reshape(B, C, C) > 0) & lower
    # stable sort of "not needed" moves the needed c2 to the front, in ascending order
    order = torch.sort((~need).to(torch.int8), dim=-1, stable=True).indices
    return order.to(torch.int32).contiguous(), need.sum(-1, dtype=torch.int32), C


def _heavy_first(meta: TreeMeta, cu_nodes: torch.Tensor) -> tuple[torch.Tensor, TreeMeta]:
    """Pre-order position of node v = sum over its ancestors-or-self a (root excluded) of
    1 + the subtree sizes of the siblings visited before a; dense [N, max_nodes] tables.  The
    renumbered metadata is the same tables permuted (no second pointer-doubling pass: this
    runs once per round, and each of its small ops is a launch)."""
    bits, seq, M = meta.bits, meta.seq_ids, meta.max_nodes
    dev = bits.device
    (N, W), B = bits.shape, cu_nodes.numel() - 1
    cu = cu_nodes.to(device=dev, dtype=torch.int64)
    bos = cu[seq]
    local = torch.arange(N, device=dev) - bos
    cols = torch.arange(64 * W, device=dev)
    anc = ((bits[:, cols // 64] >> (cols % 64)) & 1)                        # [N, 64 W] anc-or-self
    size = torch.zeros((B, 64 * W), dtype=torch.int64, device=dev).index_add_(0, seq, anc)
    par = torch.where(meta.anc[:, 0] >= 0, meta.anc[:, 0] - bos, -1)        # local parent
    par_tab = torch.full((B, 64 * W), -2, dtype=torch.int64, device=dev)
    par_tab[seq, local] = par
    sib_par, sib_size = par_tab[seq], size[seq]                              # [N, 64 W]
    own = sib_size.gather(1, local[:, None])
    before = (sib_par == par[:, None]) & ((sib_size > own) | ((sib_size == own) & (cols < local[:, None])))
    offset = torch.where(par >= 0, 1 + (before * sib_size).sum(1), 0)       # [N]
    tab = cols.expand(B, -1).clone()     # per tree: local node -> offset, then -> position
    tab[seq, local] = offset
    pos = (anc * tab[seq]).sum(1)                                            # local pre-order
    tab[seq, local] = pos                # columns past a tree's size keep their own index
    new = bos + pos                      # flat row of each node in the new numbering
    order = torch.empty(N, dtype=torch.int64, device=dev)
    order[new] = torch.arange(N, device=dev)
    # the same ancestor sets, columns and rows renumbered, packed back into 64-bit words
    anc_new = torch.zeros_like(anc).scatter_(1, tab[seq], anc)
    words = (anc_new.view(N, W, 64) << torch.arange(64, device=dev)).sum(-1)   # disjoint bits
    bits_new, depth_new, near_new = torch.empty_like(bits), torch.empty_like(meta.depth), \
        torch.empty_like(meta.anc)
    bits_new[new], depth_new[new] = words, meta.depth
    near_new[new] = torch.where(meta.anc >= 0, new[meta.anc.clamp_min(0)], -1)
    return order.to(torch.int32), TreeMeta(bits=bits_new, depth=depth_new, anc=near_new,
                                           seq_ids=seq, max_nodes=M, depth_first=True)


def _validate(parents: torch.Tensor, cu_nodes: torch.Tensor) -> None:
    if parents.dim() != 1 or cu_nodes.dim() != 1 or cu_nodes.numel() < 2:
        raise SimtreeError(f"parents must be [N] and cu_nodes [B+1] with B >= 1, got "
                           f"{tuple(parents.shape)} and {tuple(cu_nodes.shape)}")
    cu = cu_nodes.cpu()
    if int(cu[0]) != 0 or int(cu[-1]) != parents.numel():
        raise SimtreeError(f"cu_nodes must start at 0 and end at N={parents.numel()}, got "
                           f"{int(cu[0])}..{int(cu[-1])}")
    counts = cu[1:] - cu[:-1]
    if bool((counts < 1).any()):
        b = int(torch.nonzero(counts < 1)[0])
        raise TreeError(f"invalid cu_nodes: tree {b} has {int(counts[b])} nodes (needs the root)")


def tree_meta(parents: torch.Tensor, cu_nodes: torch.Tensor, max_nodes: int | None = None,
              validate: bool = True, depth_first: bool | None = None) -> TreeMeta:
    """Metadata for a flat batch of trees (parents LOCAL, -1 for roots; cu_nodes [B+1]).

    ``validate`` (one host sync) checks cu_nodes and that every parent precedes its child.
    Pass ``max_nodes`` and ``validate=False`` to stay sync-free (CUDA-graph capture).
    ``depth_first``: the trees are stored in their heavy-first depth-first order
    (``TreeBatch.is_depth_first`` says so on the host; ``TreeBatch.depth_first()`` renumbers),
    which the tree kernel walks without a node-order table.  None: found out here when
    validating (the sync is paid anyway) trees of 33-256 nodes (below, every order walks
    alike; above, the check's dense tables grow with the square of the size), else False.  A
    True claim is checked when validating in that range.
    """
    parents = parents.to(torch.int64)
    cu_nodes = cu_nodes.to(device=parents.device, dtype=torch.int64)
    N, B = parents.numel(), cu_nodes.numel() - 1
    if validate:
        _validate(parents, cu_nodes)
    dev = parents.device
    counts = cu_nodes[1:] - cu_nodes[:-1]
    seq_ids = torch.repeat_interleave(torch.arange(B, device=dev), counts, output_size=N)
    local = torch.arange(N, device=dev) - cu_nodes[seq_ids]
    if validate:
        bad = ((local == 0) & (parents != -1)) | ((local > 0) & ((parents < 0) | (parents >= local)))
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0])
            b, i = int(seq_ids[j]), int(local[j])
            raise TreeError(f"invalid parents: tree {b} node {i} has parent {int(parents[j])} "
                            f"(root needs -1, others a parent in [0, {i - 1}])")
    if max_nodes is None:
        max_nodes = int(counts.max())
    W = (max_nodes + 63) // 64
    one = torch.ones(N, dtype=torch.int64, device=dev)
    bits = torch.zeros((N, W), dtype=torch.int64, device=dev)
    bits.scatter_(1, (local // 64)[:, None], torch.bitwise_left_shift(one, local % 64)[:, None])
    pg = torch.where(parents >= 0, parents + cu_nodes[seq_ids], -1)
    jump, depth = pg.clone(), (pg >= 0).to(torch.int64)
    # pointer doubling: after round r, bits covers ancestors at distance < 2^r and jump is
    # the ancestor at distance 2^r (list ranking gives the depth the same way)
    for _ in range(max(0, math.ceil(math.log2(max(max_nodes, 1))))):
        has = jump >= 0
        j = jump.clamp_min(0)
        bits = torch.where(has[:, None], bits | bits[j], bits)
        depth = torch.where(has, depth + depth[j], depth)
        jump = torch.where(has, jump[j], jump)
    a1 = pg
    a2 = torch.where(a1 >= 0, pg[a1.clamp_min(0)], -1)
    a3 = torch.where(a2 >= 0, pg[a2.clamp_min(0)], -1)
    meta = TreeMeta(bits=bits, depth=depth, anc=torch.stack([a1, a2, a3], 1), seq_ids=seq_ids,
                    max_nodes=int(max_nodes), depth_first=bool(depth_first))
    if validate and depth_first is not False and 32 < max_nodes <= HEAVY_FIRST_MAX_NODES:
        order, _ = meta.heavy_first(cu_nodes)
        is_dfs = bool((order.to(torch.int64) == torch.arange(N, device=dev)).all())
        if depth_first and not is_dfs:
            raise TreeError("depth_first=True, but the trees are not stored in their heavy-first "
                            "depth-first order (TreeBatch.depth_first() renumbers them)")
        meta = replace(meta, depth_first=is_dfs)   # keeps the cached heavy-first tables
    return meta


def tree_meta_host(parents: np.ndarray, cu_nodes: np.ndarray, max_nodes: int | None = None,
                   device: torch.device | str = "cpu", depth_first: bool = False,
                   pair_blocks: tuple[int, ...] = ()) -> TreeMeta:
    """``tree_meta`` built on the host (numpy, same pointer doubling, the same tables bit for
    bit) from trees a caller holds there already (a runtime's drafted ``TreeBatch``), with the
    sub-chunk pairs of each ``pair_blocks`` size cached, and moved to ``device`` in one copy.

    For a runtime that issues the round's metadata eagerly: a few dozen numpy operations and
    one host-to-device copy instead of a few dozen kernel launches (``tree_meta`` and
    ``subchunk_pairs`` as torch ops).  No validation: the trees were validated as
    DraftTrees.  The heavy-first walk, where a launch wants it, is still built on the device
    on first use (``TreeMeta.heavy_first``)."""
    parents = np.asarray(parents, np.int64)
    cu = np.asarray(cu_nodes, np.int64)
    N, B = parents.shape[0], cu.shape[0] - 1
    counts = np.diff(cu)
    max_nodes = int(counts.max()) if max_nodes is None else int(max_nodes)
    W = (max_nodes + 63) // 64
    seq = np.repeat(np.arange(B, dtype=np.int64), counts)
    local = np.arange(N, dtype=np.int64) - cu[seq]
    # one sentinel row past the end (no bits, depth 0, no ancestor): a jump of -1 reads it
    # (np.take counts -1 from the end), so the doubling needs no masking
    bits = np.zeros((N + 1, W), np.uint64)
    bits[np.arange(N), local // 64] = np.left_shift(np.uint64(1), (local % 64).astype(np.uint64))
    pg = np.where(parents >= 0, parents + cu[seq], -1)
    pg1 = np.append(pg, -1)                      # parent rows, the sentinel's included
    jump = pg1
    depth = np.append((pg >= 0).astype(np.int64), 0)
    for _ in range(max(0, math.ceil(math.log2(max(max_nodes, 1))))):
        # np.take: a row gather several times faster than fancy indexing
        bits |= np.take(bits, jump, axis=0)
        depth += np.take(depth, jump)
        jump = np.take(jump, jump)
    bits, depth = bits[:N], depth[:N]
    a2 = np.take(pg1, pg)
    a3 = np.take(pg1, a2)
    parts = [bits.view(np.int64).reshape(-1), depth, np.stack([pg, a2, a3], 1).reshape(-1), seq]
    pairs = {}
    for bt in pair_blocks:
        order, cnt, C = _subchunk_pairs_np(bits, seq, local, B, max_nodes, bt)
        pairs[bt] = C
        parts += [_as_int64_words(order), _as_int64_words(cnt)]
    buf = torch.from_numpy(np.concatenate(parts)).to(device)     # the one host-to-device copy
    off = 0

    def take(size: int) -> torch.Tensor:
        nonlocal off
        off += size
        return buf[off - size:off]

    meta = TreeMeta(bits=take(N * W).view(N, W), depth=take(N), anc=take(3 * N).view(N, 3),
                    seq_ids=take(N), max_nodes=max_nodes, depth_first=bool(depth_first))
    for bt, C in pairs.items():
        order = take((B * C * C + 1) // 2).view(torch.int32)[:B * C * C].view(B, C, C)
        cnt = take((B * C + 1) // 2).view(torch.int32)[:B * C].view(B, C)
        meta._derived[("pairs", bt)] = (order, cnt, C)
    return meta


def _as_int64_words(a: np.ndarray) -> np.ndarray:
    """An int32 array's bytes as int64 words (padded to an even count), for one packed copy."""
    flat = np.ascontiguousarray(a, np.int32).reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int32)])
    return flat.view(np.int64)


_UINT = {16: np.uint16, 32: np.uint32, 64: np.uint64}   # a sub-chunk's bits, by its size


def _subchunk_pairs_np(bits: np.ndarray, seq: np.ndarray, local: np.ndarray, B: int,
                       max_nodes: int, bt: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``_subchunk_pairs`` in numpy (bits uint64 [N, W]): the same (pairs, counts, C)."""
    N = bits.shape[0]
    C = (max_nodes + bt - 1) // bt
    if sys.byteorder == "little":   # sub-chunk c2 of a row = its c2-th bt-bit field
        meets = np.ascontiguousarray(bits).view(_UINT[bt]).reshape(N, -1) != 0
    else:
        shift = np.arange(0, 64, bt, dtype=np.uint64)
        meets = (((bits[:, :, None] >> shift) & np.uint64((1 << bt) - 1)) != 0).reshape(N, -1)
    meets = meets[:, :C]
    key = seq * C + local // bt                  # rows come sorted by (tree, sub-chunk)
    start = np.flatnonzero(np.diff(key, prepend=-1))
    need = np.zeros((B * C, C), bool)
    need[key[start]] = np.logical_or.reduceat(meets, start, axis=0)
    need = need.reshape(B, C, C) & np.tri(C, C, -1, dtype=bool)
    order = np.argsort(~need, axis=-1, kind="stable")
    return order.astype(np.int32), need.sum(-1).astype(np.int32), C
