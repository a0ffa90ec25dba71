"""The draft tree of one sequence and its batched, ragged form.

A tree is three flat arrays in topological order (parents precede children):

    parents   int64 [n]   parents[0] == -1 (node 0 is the root: the last accepted token,
                          not yet processed by the target); 0 <= parents[i] < i otherwise
    tokens    int64 [n]   draft token of each node (tokens[0] is the root's token)
    log_probs float64 [n] draft log-probability of the node given its parent (0 for the root)

Every derived view (depth, ancestor bitmask, chains, positions, SGLang-style next-token /
next-sibling arrays) is computed here and nowhere else.  Verify kernels read the flat
metadata of a :class:`TreeBatch` (``cu_nodes`` offsets, parents, depth).

Budget convention (as SGLang's ``--speculative-num-draft-tokens``): a tree of budget D has
D nodes including the root, so it verifies D tokens per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from simtree.errors import SimtreeError, TreeError, check_int

__all__ = ["DraftTree", "TreeBatch", "pack_bits"]


def pack_bits(mask: np.ndarray) -> np.ndarray:
    """Pack a bool matrix [n, m] into int64 words [n, ceil(m / 64)]; bit j%64 of word j//64."""
    n, m = mask.shape
    words = (m + 63) // 64
    padded = np.zeros((n, words * 64), dtype=bool)
    padded[:, :m] = mask
    # bit j%8 of byte j//8, bytes read as little-endian 64-bit words: bit j%64 of word j//64
    packed = np.packbits(padded, axis=1, bitorder="little")
    return np.ascontiguousarray(packed).view("<i8").astype(np.int64)


def _as_int_array(values, what: str) -> np.ndarray:
    """A fresh int64 copy of ``values`` (never a view of the caller's array: trees are immutable).

    Floats are accepted only when integral, so 0.5 or NaN never truncates silently to a node id.
    """
    try:
        arr = np.array(values, copy=True).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise TreeError(f"invalid {what} array: not a list of integers ({exc})") from None
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            i = int(bad[0])
            raise TreeError(f"invalid {what} array: entry {i} is {arr[i]}, not an integer")
    elif arr.dtype.kind not in "iub":
        raise TreeError(f"invalid {what} array: dtype {arr.dtype} is not an integer type")
    return arr.astype(np.int64)


def _check_parents(parents: np.ndarray) -> None:
    n = parents.shape[0]
    if n == 0:
        raise TreeError("draft tree is empty: it needs at least the root node")
    if parents[0] != -1:
        raise TreeError(f"invalid parent array: node 0 must be the root (parent -1), got parent {parents[0]}")
    roots = np.flatnonzero(parents == -1)
    if roots.size > 1:
        raise TreeError(f"invalid parent array: several roots {roots[:8].tolist()}; only node 0 may have parent -1")
    out_of_range = np.flatnonzero((parents < -1) | (parents >= n))
    if out_of_range.size:
        i = int(out_of_range[0])
        raise TreeError(f"invalid parent array: node {i} has parent {parents[i]} outside [0, {n - 1}]")
    bad = np.flatnonzero(parents[1:] >= np.arange(1, n)) + 1
    if bad.size:
        i = int(bad[0])
        seen, j = set(), i
        while j > 0 and j not in seen:
            seen.add(j)
            j = int(parents[j])
        if j in seen:
            raise TreeError(f"invalid parent array: cycle through node {j} (parents {sorted(seen)[:8]})")
        raise TreeError(f"invalid parent array: node {i} has parent {parents[i]} >= {i}; "
                        "nodes must be in topological order (parent before child)")


@dataclass(frozen=True, eq=False)
class DraftTree:
    """Draft tree of one sequence. See the module docstring for the array conventions."""

    parents: np.ndarray
    tokens: np.ndarray = field(default=None)  # type: ignore[assignment]
    log_probs: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        parents = _as_int_array(self.parents, "parent")
        _check_parents(parents)
        n = parents.shape[0]
        tokens = np.zeros(n, np.int64) if self.tokens is None else _as_int_array(self.tokens, "token")
        try:
            log_probs = (np.zeros(n, np.float64) if self.log_probs is None
                         else np.array(self.log_probs, np.float64, copy=True).reshape(-1))
        except (TypeError, ValueError) as exc:
            raise TreeError(f"invalid log-prob array: not a list of numbers ({exc})") from None
        if tokens.shape[0] != n:
            raise TreeError(f"token/parent length mismatch: {tokens.shape[0]} tokens for {n} nodes")
        if log_probs.shape[0] != n:
            raise TreeError(f"score/parent length mismatch: {log_probs.shape[0]} log-probs for {n} nodes")
        if not np.all(np.isfinite(log_probs[1:])) or np.any(log_probs[1:] > 1e-6):
            i = int(np.flatnonzero(~np.isfinite(log_probs[1:]) | (log_probs[1:] > 1e-6))[0]) + 1
            raise TreeError(f"invalid draft log-prob at node {i}: {log_probs[i]} (must be finite and <= 0)")
        log_probs = log_probs.copy()
        log_probs[0] = 0.0
        for name, value in (("parents", parents), ("tokens", tokens), ("log_probs", log_probs)):
            value.setflags(write=False)
            object.__setattr__(self, name, value)

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def chain(cls, length: int, tokens: Sequence[int] | None = None,
              log_probs: Sequence[float] | None = None) -> "DraftTree":
        """A linear chain of ``length`` nodes (root included)."""
        try:   # a TreeError, as every misuse of the tree type
            length = check_int(length, "chain length")
        except SimtreeError as exc:
            raise TreeError(str(exc)) from None
        return cls(np.arange(-1, length - 1), tokens, log_probs)

    # ---- sizes --------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    def __len__(self) -> int:
        return self.num_nodes

    # ---- derived views (computed once) --------------------------------------------------
    @cached_property
    def depth(self) -> np.ndarray:
        """int64 [n]: root depth 0."""
        # One pass in topological order over plain Python ints: the per-node cost of the old loop
        # was numpy scalar indexing, and at tree sizes of tens of nodes this beats pointer doubling
        # (~log2(n) numpy passes) too; see tests/test_tree.py for the reference it must equal.
        parents = self.parents.tolist()
        depth = [0] * len(parents)
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
        out = np.array(depth, np.int64)
        out.setflags(write=False)
        return out

    @cached_property
    def _ancestors(self) -> np.ndarray:
        """int64 [n, max_depth + 1]: column k is each node's k-th ancestor (column 0 the node
        itself), -1 above the root.  Filled by doubling: with columns 0..m-1 known and ``hop``
        the m-th ancestor, columns m..2m-1 are columns 0..m-1 of ``hop``'s row."""
        n, top = self.num_nodes, self.max_depth
        anc = np.full((n + 1, top + 1), -1, np.int64)  # row n (index -1): above the root
        anc[:n, 0] = np.arange(n)
        m = 1
        while m <= top:
            hop = self.parents if m == 1 else anc[anc[:n, m - 1], 1]
            k = min(m, top + 1 - m)
            anc[:n, m:m + k] = anc[hop, :k]
            m += k
        anc = anc[:n]
        anc.setflags(write=False)
        return anc

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @cached_property
    def path_log_prob(self) -> np.ndarray:
        """float64 [n]: cumulative draft log-prob from the root (the EAGLE draft score)."""
        # Root first over Python floats (IEEE doubles, the same additions in the same order as
        # score[i] = log_probs[i] + score[parent]): bit-identical, never above the parent's score.
        # A vectorised sum (pointer doubling, ancestor-mask matmul) would reassociate it.
        parents, log_probs = self.parents.tolist(), self.log_probs.tolist()
        score = [0.0] * len(parents)
        for i in range(1, len(parents)):
            score[i] = log_probs[i] + score[parents[i]]
        out = np.array(score, np.float64)
        out.setflags(write=False)
        return out

    @cached_property
    def num_children(self) -> np.ndarray:
        return np.bincount(self.parents[1:], minlength=self.num_nodes).astype(np.int64)

    @cached_property
    def leaves(self) -> np.ndarray:
        return np.flatnonzero(self.num_children == 0)

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """bool [n, n]: mask[i, j] is True iff j is an ancestor of i or i itself."""
        n = self.num_nodes
        mask = np.zeros((n, n + 1), dtype=bool)  # column n catches the -1 slots above the root
        mask[np.arange(n)[:, None], self._ancestors] = True
        mask = np.ascontiguousarray(mask[:, :n])
        mask.setflags(write=False)
        return mask

    @cached_property
    def ancestor_bits(self) -> np.ndarray:
        """int64 [n, ceil(n/64)]: :attr:`ancestor_mask` packed into 64-bit words."""
        return pack_bits(self.ancestor_mask)

    def path_to(self, node: int) -> np.ndarray:
        """Node indices from the root to ``node`` inclusive."""
        if not 0 <= node < self.num_nodes:
            raise TreeError(f"node {node} is not in a tree of {self.num_nodes} nodes")
        return self._ancestors[node, self.depth[node]::-1].copy()  # root first

    @cached_property
    def chains(self) -> tuple[np.ndarray, ...]:
        """Root-to-leaf paths, one per leaf, in leaf order."""
        return tuple(self.path_to(int(leaf)) for leaf in self.leaves)

    def positions(self, cache_len: int) -> np.ndarray:
        """Sequence positions of the nodes; the root is the first token not yet in the cache."""
        return cache_len + self.depth

    @cached_property
    def next_token(self) -> np.ndarray:
        """int64 [n]: first child of each node, -1 if none (SGLang ``retrive_next_token``)."""
        first = np.full(self.num_nodes, -1, np.int64)
        parent, index = np.unique(self.parents[1:], return_index=True)  # lowest index child wins
        first[parent] = index + 1
        return first

    @cached_property
    def next_sibling(self) -> np.ndarray:
        """int64 [n]: next child of the same parent, -1 if none (``retrive_next_sibling``)."""
        nxt = np.full(self.num_nodes, -1, np.int64)
        child = np.argsort(self.parents[1:], kind="stable") + 1  # grouped by parent, index order
        same = self.parents[child[1:]] == self.parents[child[:-1]]
        nxt[child[:-1][same]] = child[1:][same]
        return nxt

    def subtree(self, keep: np.ndarray | Sequence[int]) -> "DraftTree":
        """The tree restricted to ``keep`` (must contain the root and be ancestor-closed)."""
        keep = np.unique(_as_int_array(keep, "subtree node"))
        if keep.size == 0 or keep[0] != 0:
            raise TreeError("subtree must keep the root (node 0)")
        if keep[-1] >= self.num_nodes:
            raise TreeError(f"subtree node {keep[-1]} is not in a tree of {self.num_nodes} nodes")
        remap = np.full(self.num_nodes, -1, np.int64)
        remap[keep] = np.arange(keep.size)
        parents = self.parents[keep]
        new_parents = np.where(parents >= 0, remap[np.maximum(parents, 0)], -1)
        if np.any(new_parents[1:] < 0):
            raise TreeError("subtree is not ancestor-closed: a kept node's parent was dropped")
        return DraftTree(new_parents, self.tokens[keep], self.log_probs[keep])

    @cached_property
    def heavy_first_order(self) -> np.ndarray:
        """int64 [n]: order[p] = the node a depth-first walk visits p-th, taking the child with
        the larger subtree first (ties: lower index); a topological order.  Tree kernels that
        walk nodes in sub-chunks pay only for sub-chunk pairs holding ancestors, and in this
        order a branch stays in few sub-chunks (``kernels.gdn``: ``TreeMeta.heavy_first`` is
        the same order built on the device).  Plain Python over lists: at draft-tree sizes
        that is several times faster than dense numpy tables; the runtime pays it once per
        round and tree where it renumbers (reports/cpu_host/tree_renumber.csv)."""
        parents = self.parents.tolist()
        n = len(parents)
        size = [1] * n
        for i in range(n - 1, 0, -1):            # children follow their parents
            size[parents[i]] += size[i]
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[parents[i]].append(i)
        out, stack = [], [0]
        while stack:
            x = stack.pop()
            out.append(x)
            k = kids[x]
            if len(k) > 1:                       # popped largest subtree first, then lower index
                k.sort(key=lambda c: (size[c], -c))
            stack.extend(k)
        order = np.array(out, np.int64)
        order.setflags(write=False)
        return order

    @cached_property
    def is_heavy_first(self) -> bool:
        """Whether the nodes are stored in :attr:`heavy_first_order` already."""
        if self.max_depth == self.num_nodes - 1:   # a chain (parents in order)
            return True
        return bool(np.array_equal(self.heavy_first_order, np.arange(self.num_nodes)))

    def depth_first(self) -> "DraftTree":
        """The tree renumbered in :attr:`heavy_first_order` (itself when it already is)."""
        if self.is_heavy_first:
            return self
        out = self._permuted(self.heavy_first_order)
        out.__dict__["is_heavy_first"] = True     # known: skip recomputing it
        return out

    def renumbered(self, order: np.ndarray | Sequence[int]) -> "DraftTree":
        """The same tree with node p = old node ``order[p]`` (a permutation that keeps
        parents before children, e.g. :attr:`heavy_first_order`)."""
        order = _as_int_array(order, "order")
        n = self.num_nodes
        if order.shape[0] != n or not np.array_equal(np.sort(order), np.arange(n)):
            raise TreeError(f"renumbering is not a permutation of the tree's {n} nodes")
        out = self._permuted(order)
        _check_parents(out.parents)   # a permutation may still put a child before its parent
        return out

    def _permuted(self, order: np.ndarray) -> "DraftTree":
        """Node p = old node order[p], for an order known to be a topological permutation (no
        re-validation: the runtime renumbers every round's trees)."""
        pos = np.empty(self.num_nodes, np.int64)
        pos[order] = np.arange(self.num_nodes)
        par = self.parents[order]
        out = object.__new__(DraftTree)
        for name, value in (("parents", np.where(par >= 0, pos[np.maximum(par, 0)], -1)),
                            ("tokens", self.tokens[order]), ("log_probs", self.log_probs[order])):
            value.setflags(write=False)
            object.__setattr__(out, name, value)
        return out

    def __repr__(self) -> str:
        return f"DraftTree(n={self.num_nodes}, depth={self.max_depth}, leaves={self.leaves.size})"


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """B draft trees of different sizes, flattened with cu_seqlens-style offsets.

    cu_nodes  int64 [B+1]  tree b owns flat rows cu_nodes[b]:cu_nodes[b+1]
    parents   int64 [N]    parent as a *local* index within its tree (-1 for roots)
    parents_global int64 [N]  parent as a flat row (-1 for roots)
    depth, tokens, seq_ids int64 [N]
    """

    trees: tuple[DraftTree, ...]

    def __post_init__(self) -> None:
        trees = tuple(self.trees)
        if not trees:
            raise TreeError("tree batch is empty: it needs at least one tree")
        for b, t in enumerate(trees):
            if not isinstance(t, DraftTree):
                raise TreeError(f"tree batch entry {b} is a {type(t).__name__}, not a DraftTree")
        object.__setattr__(self, "trees", trees)

    @property
    def batch_size(self) -> int:
        return len(self.trees)

    @cached_property
    def cu_nodes(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([t.num_nodes for t in self.trees])]).astype(np.int64)

    @property
    def total_nodes(self) -> int:
        return int(self.cu_nodes[-1])

    @property
    def max_nodes(self) -> int:
        return int(np.diff(self.cu_nodes).max())

    @cached_property
    def parents(self) -> np.ndarray:
        return np.concatenate([t.parents for t in self.trees])

    @cached_property
    def parents_global(self) -> np.ndarray:
        offs = np.repeat(self.cu_nodes[:-1], np.diff(self.cu_nodes))
        return np.where(self.parents >= 0, self.parents + offs, -1)

    @cached_property
    def seq_ids(self) -> np.ndarray:
        return np.repeat(np.arange(self.batch_size, dtype=np.int64), np.diff(self.cu_nodes))

    @cached_property
    def depth(self) -> np.ndarray:
        return np.concatenate([t.depth for t in self.trees])

    @cached_property
    def tokens(self) -> np.ndarray:
        return np.concatenate([t.tokens for t in self.trees])

    def positions(self, cache_lens: Sequence[int] | np.ndarray) -> np.ndarray:
        cache_lens = np.asarray(cache_lens, np.int64).reshape(-1)
        if cache_lens.shape[0] != self.batch_size:
            raise TreeError(f"{cache_lens.shape[0]} cache lengths for a batch of {self.batch_size} trees")
        return cache_lens[self.seq_ids] + self.depth

    @cached_property
    def is_depth_first(self) -> bool:
        """Every tree stored in its heavy-first depth-first order (``DraftTree.is_heavy_first``):
        the order the GDN tree kernel walks fastest (``kernels.gdn``, ``tree_meta(depth_first=)``)."""
        return all(t.is_heavy_first for t in self.trees)

    @property
    def known_depth_first(self) -> bool:
        """:attr:`is_depth_first` where already known (``depth_first()`` sets it), else False:
        free, for callers that only pick a faster kernel launch with it."""
        return bool(self.__dict__.get("is_depth_first", False))

    def depth_first(self) -> "TreeBatch":
        """The batch with every tree renumbered depth-first, larger subtree first
        (``DraftTree.depth_first``); tokens and log-probs move with their nodes."""
        if "is_depth_first" in self.__dict__ and self.is_depth_first:
            return self
        out = TreeBatch(tuple(t.depth_first() for t in self.trees))
        out.__dict__["is_depth_first"] = True     # known: skip recomputing it
        return out

    @cached_property
    def deepest_nodes(self) -> np.ndarray:
        """int64 [B]: each tree's deepest node (the last in stored order among ties), the
        accepted node benchmarks take as the commit's most expensive case."""
        return np.array([t.num_nodes - 1 - int(np.argmax(t.depth[::-1])) for t in self.trees],
                        np.int64)

    @cached_property
    def ancestor_bits(self) -> np.ndarray:
        """int64 [N, ceil(max_nodes/64)]: each row's local ancestor-or-self bits."""
        words = (self.max_nodes + 63) // 64
        out = np.zeros((self.total_nodes, words), np.int64)
        for t, start in zip(self.trees, self.cu_nodes[:-1]):
            bits = t.ancestor_bits
            out[start:start + t.num_nodes, :bits.shape[1]] = bits
        return out

    TORCH_FIELDS = ("cu_nodes", "parents", "parents_global", "seq_ids", "depth", "tokens", "ancestor_bits")

    def to_torch(self, device="cpu", names: Sequence[str] = TORCH_FIELDS) -> dict:
        """The flat metadata verify kernels read, as int64 torch tensors (only ``names``: a
        caller that builds its own masks need not pay for ancestor_bits every round)."""
        import torch

        return {k: torch.as_tensor(np.ascontiguousarray(getattr(self, k)), device=device) for k in names}
