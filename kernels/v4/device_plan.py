"""A round's V4 verify and commit metadata built on the device, in static shapes (CUDA graphs).

:func:`plan_verify_device` builds the :class:`~.verify.VerifyPlan` that
:func:`~.verify.plan_verify` builds on the host, and :func:`plan_commit_device` the
:class:`~.commit.CommitPlan` of :func:`~.commit.plan_commit`: same fields, same meaning, from
device tensors, with torch ops only (no host synchronisation, no upload), every shape fixed
by a bucket (:class:`PlanBounds`).  Plan, :func:`~.verify.tree_verify` and
:func:`~.commit.apply_commit` therefore replay in one CUDA graph with new trees, lengths and
accepted nodes copied into its static inputs.

Inputs (the flat tree form of simtree.trees.tree.TreeBatch and the GDN kernels):

    parents   int64 [N]    local parent ids, -1 at roots; N node rows, fixed per bucket
    cu_nodes  int64 [B+1]  tree b owns rows cu_nodes[b]:cu_nodes[b+1] (an empty tree is a
                           sequence that takes no part in the round); rows >= cu_nodes[B] pad
    lens      int64 [B]    tokens already cached per sequence (the host's cache.lens)
    accepted  int64 [B]    (commit) local id of each tree's last accepted node, -1: none

Sizes that depend on the data are padded to the bucket's bounds and the padding is -1:
completing windows M, scratch entries on a path, persistent entries per sequence (from the
context bound ``max_context``), rows a commit moves.  Padding node rows attend to nothing but,
in CSA layers, the top-k of the persistent entries of the sequence whose free ``pad_nodes``
slot they fill (node_seq): their outputs are defined, and meaningless.  The CSA indexer scans
``bounds.entries`` columns per sequence, so a bucket's context bound should follow its
contexts (the verify's cost grows with the bound, not with the real lengths).  The host's
cache.lens is neither read nor written here: the caller keeps it in step with the commit
plan's new_lens (reading the accepted lengths is the one host read a round needs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from simtree.errors import SimtreeError
from simtree.trees.tree import TreeBatch

from .cache import V4Cache
from .commit import CommitPlan
from .compressor import device_freqs
from .reference import V4LayerWeights
from .verify import VerifyPlan, _ancestors

__all__ = ["PlanBounds", "plan_verify_device", "plan_commit_device", "tree_tensors"]


@dataclass(frozen=True)
class PlanBounds:
    """Static sizes of a device plan: B sequences, N node rows, at most ``max_nodes`` nodes per
    tree and ``max_context`` cached tokens per sequence, compression ratio r (0: SWA)."""

    batch: int
    node_rows: int
    max_nodes: int
    max_context: int
    ratio: int
    window: int

    @property
    def completions(self) -> int:
        """M rows of comp_nodes / comp_src: a tree of n >= 2 nodes has a node at depth 1, and
        depths 0 and 1 cannot both complete a window of r >= 2 tokens, so at most n - 1 of its
        nodes complete one (n at r = 1)."""
        if not self.ratio:
            return 0
        per_tree = self.max_nodes if self.ratio == 1 else max(1, self.max_nodes - 1)
        return min(self.node_rows, self.batch * per_tree)

    @property
    def scratch_width(self) -> int:
        """Columns of scratch_vis: the windows completing on a path of max_nodes tokens."""
        return (self.max_nodes - 1) // self.ratio + 1 if self.ratio else 0

    @property
    def entries(self) -> int:
        """Columns of the persistent entry rows: completed entries of max_context tokens."""
        return self.max_context // self.ratio if self.ratio else 0

    @property
    def window_commits(self) -> int:
        """Window rows a commit writes per sequence: the last min(window, path) tokens."""
        return min(self.window, self.max_nodes)

    @property
    def entry_commits(self) -> int:
        """Entries a commit writes per sequence: windows completing on a path of max_nodes."""
        return -(-self.max_nodes // self.ratio) if self.ratio else 0


def tree_tensors(batch: TreeBatch, node_rows: int | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents [node_rows], cu_nodes [B+1]) of a host TreeBatch in the static input form
    (rows past its nodes are padding, parent -1); node_rows None: exactly its nodes."""
    N = batch.total_nodes if node_rows is None else node_rows
    if N < batch.total_nodes:
        raise SimtreeError(f"{batch.total_nodes} tree nodes do not fit {N} node rows")
    parents = np.full(N, -1, np.int64)
    parents[:batch.total_nodes] = batch.parents
    return (torch.as_tensor(parents, device=device),
            torch.as_tensor(np.asarray(batch.cu_nodes, np.int64), device=device))


def _check_shapes(cache: V4Cache, parents, cu_nodes, lens, max_nodes: int, max_context) -> PlanBounds:
    """The bucket's sizes from the tensors' shapes (no device read)."""
    B = cache.batch
    for name, t, n in (("cu_nodes", cu_nodes, B + 1), ("lens", lens, B)):
        if t.dim() != 1 or t.numel() != n or t.dtype != torch.int64:
            raise SimtreeError(f"{name} must be int64 [{n}] for a cache of {B} sequences, got "
                               f"{t.dtype} {list(t.shape)}")
    if parents.dim() != 1 or parents.dtype != torch.int64:
        raise SimtreeError(f"parents must be a flat int64 tensor, got {parents.dtype} {list(parents.shape)}")
    if len({parents.device, cu_nodes.device, lens.device}) > 1:
        raise SimtreeError("parents, cu_nodes and lens must be on one device")
    max_context = cache.max_len - 1 if max_context is None else int(max_context)
    if max_nodes < 1 or not 0 <= max_context < cache.max_len:
        raise SimtreeError(f"max_nodes must be >= 1 and max_context in [0, {cache.max_len - 1}], "
                           f"got {max_nodes} and {max_context}")
    if not 0 < parents.numel() <= B * max_nodes:
        raise SimtreeError(f"{parents.numel()} node rows: need 1 to {B} trees x {max_nodes} nodes")
    return PlanBounds(B, parents.numel(), int(max_nodes), max_context, cache.ratio, cache.cfg.window)


def _validate(cache: V4Cache, parents, cu_nodes, lens, bd: PlanBounds) -> None:
    """The checks plan_verify makes, on the host (one synchronisation; not for graphs)."""
    cu, par, L = (t.cpu().numpy() for t in (cu_nodes, parents, lens))
    counts = np.diff(cu)
    if cu[0] != 0 or np.any(counts < 0) or cu[-1] > bd.node_rows:
        raise SimtreeError(f"cu_nodes must rise from 0 to at most {bd.node_rows}, got {cu.tolist()}")
    if np.any(counts > bd.max_nodes):
        b = int(np.argmax(counts))
        raise SimtreeError(f"tree {b} has {counts[b]} nodes, more than max_nodes {bd.max_nodes}")
    seq = np.repeat(np.arange(bd.batch), counts)
    local = np.arange(cu[-1]) - cu[seq]
    p = par[:cu[-1]]
    bad = np.flatnonzero(np.where(local == 0, p != -1, (p < 0) | (p >= local)))
    if bad.size:
        j = int(bad[0])
        raise SimtreeError(f"tree {seq[j]} node {local[j]} has parent {p[j]} "
                           "(the root needs -1, others an earlier node)")
    if np.any(L < 0) or np.any(L > bd.max_context):
        raise SimtreeError(f"cache lengths must lie in [0, {bd.max_context}], got {L.min()}..{L.max()}")
    if cu[-1]:
        depth = _ancestors(np.where(p >= 0, p + cu[seq], -1))[1]
        if np.any(L[seq] + depth >= cache.max_len):
            raise SimtreeError(f"tree runs past the cache capacity of {cache.max_len} tokens")


def _ancestor_table(pg: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """[N, max_nodes]: column k = the k-th ancestor's flat row (k = 0 the node), -1 above the
    root, from flat parents pg [N]; pointer doubling, ceil(log2 max_nodes) rounds (row N of
    the working table stands for -1)."""
    N = pg.shape[0]
    anc = torch.full((N + 1, 1), -1, dtype=torch.int64, device=pg.device)
    anc[:N, 0] = torch.arange(N, device=pg.device)
    hop = torch.cat([pg, pg.new_full((1,), -1)])
    hop = torch.where(hop < 0, N, hop)                 # each row's m-th ancestor (m = 1)
    m = 1
    while m < max_nodes:
        anc = torch.cat([anc, anc[hop]], 1)             # columns m..2m-1: columns 0..m-1 of the m-th ancestor
        nxt = anc[hop, m]                               # the 2m-th ancestor
        hop = torch.where(nxt < 0, N, nxt)
        m *= 2
    return anc[:N, :max_nodes]


def _window_rows(ring_rows: torch.Tensor, seq, pos, anc, Pw: int, real) -> torch.Tensor:
    """[N, W] rows of [window pool | node latents] for positions p-W+1 .. p (as
    verify._window_rows): the ring row of q % W, the path node q - lens levels below
    the root (the k-th ancestor in column W-1-k) plus Pw, -1 before position 0 and on padding."""
    N, W = seq.shape[0], ring_rows.shape[1]
    q = pos[:, None] - (W - 1) + torch.arange(W, device=pos.device)[None, :]
    ring = ring_rows[seq[:, None], q % W]
    K = min(W, anc.shape[1])
    tree = torch.cat([anc.new_full((N, W - K), -1), anc[:, :K].flip(1)], 1)
    win = torch.where(tree >= 0, tree + Pw, torch.where(q >= 0, ring, -1))
    return torch.where(real[:, None], win, -1)


def _slot_sources(lens, entry, seq, nodes, anc, depth, live, p, batch: int) -> torch.Tensor:
    """[M, S] virtual rows of the completing windows into [buffers B*S | node projections N]
    (as verify._slot_sources); -1 where a slot precedes position 0 and on padding rows."""
    r, S = p.ratio, p.num_slots
    q = (entry[:, None] - int(p.overlap)) * r + torch.arange(S, device=entry.device)[None, :]
    L = lens[seq][:, None]
    buf_row = torch.where(q // r == L // r, p.cur_offset + q % r, q % r)
    up = (depth[nodes][:, None] - (q - L)).clamp(0, anc.shape[1] - 1)
    tree_rows = anc[nodes[:, None], up] + batch * S
    out = torch.where(q >= L, tree_rows, seq[:, None] * S + buf_row)
    return torch.where((q < 0) | ~live[:, None], -1, out)


def _entry_rope(entry: torch.Tensor, p) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [M, rope_dim / 2] (float32, computed in float64 as the host plan does) of the
    entries at positions entry * ratio (padding rows: position 0)."""
    freqs = device_freqs(p.inv_freq(), entry.device)
    ang = (entry.clamp(min=0).to(torch.float64) * p.ratio)[:, None] * freqs
    return ang.cos().to(torch.float32), ang.sin().to(torch.float32)


def _scratch_visible(L, depth, anc, m_of, r: int, width: int) -> torch.Tensor:
    """[N, width] scratch entries on each node's path, root first, -1 pad: the windows
    completing on a path sit at depths d0, d0 + r, ... with d0 = (r - 1 - lens) % r."""
    d = ((r - 1 - L) % r)[:, None] + r * torch.arange(width, device=L.device)[None, :]
    up = depth[:, None] - d
    node = anc.gather(1, up.clamp(0, anc.shape[1] - 1))
    return torch.where(up >= 0, m_of[node.clamp(min=0)], -1)


def _entry_rows(pool, lens: torch.Tensor, r: int, width: int) -> torch.Tensor:
    """[B, width] flat pool rows of each sequence's persistent entries, -1 past lens // r."""
    rows = pool.all_rows_on(lens.device)[:, :width]
    keep = torch.arange(width, device=lens.device)[None, :] < (lens // r)[:, None]
    return torch.where(keep, rows, -1)


def plan_verify_device(cache: V4Cache, w: V4LayerWeights, parents: torch.Tensor, cu_nodes: torch.Tensor,
                       lens: torch.Tensor, max_nodes: int, max_context: int | None = None,
                       validate: bool = False) -> VerifyPlan:
    """plan_verify on the device; inputs and padding in the module docstring.

    max_nodes: nodes of one tree at most (n); max_context: cached tokens of one sequence at
    most (None: cache.max_len - 1).  With N = parents.numel() <= B * n node rows, W the
    window, S the compressor's slots and bd = plan.bounds (M = bd.completions, E =
    bd.entries, Sv = bd.scratch_width) the plan holds:

        node_seq, pos_mod, depth [N]; ancestors [N, n]; win_idx [N, W]; lens_device [B];
        comp_nodes, comp_entry [M]; comp_src [M, S]; comp_cos, comp_sin [M, rope_dim / 2];
        scratch_vis [N, Sv]; attn_idx int32 [N, W] (swa) or [N, W + E + Sv] (hca);
        pad_nodes [B, n], persist_comp_rows, persist_idx_rows [B, E] (csa)

    About 165 torch calls for csa / hca (65 for swa; most of them one small kernel, some mere
    views) plus 5 per pointer-doubling round (ceil(log2 n) rounds), whatever B, N and the
    lengths: no Python loop over nodes, sequences or slots.  Work and memory O(N (n + W + Sv)
    + M S + B E), plus N E for HCA's list (as on the host).  validate: plan_verify's input
    checks, on the host (one synchronisation: tests and debugging only).
    """
    bd = _check_shapes(cache, parents, cu_nodes, lens, max_nodes, max_context)
    if validate:
        _validate(cache, parents, cu_nodes, lens, bd)
    dev = parents.device
    B, N, n, r = bd.batch, bd.node_rows, bd.max_nodes, bd.ratio
    Pw = cache.window.num_rows
    rows = torch.arange(N, device=dev)
    real = rows < cu_nodes[B]
    seq = (torch.searchsorted(cu_nodes, rows, right=True) - 1).clamp(max=B - 1)
    local = rows - cu_nodes[seq]
    # padding row k (past cu_nodes[B]) takes the k-th free slot of the [B, n] node table, so
    # that CSA's indexer, which scores every slot, leaves no score row unwritten
    free = (torch.arange(n, device=dev)[None, :] >= (cu_nodes[1:] - cu_nodes[:-1])[:, None]).reshape(-1)
    pad_slot = torch.searchsorted(torch.cumsum(free, 0), rows - cu_nodes[B] + 1)
    slot = torch.where(real, seq * n + local, pad_slot)
    node_seq = slot // n
    pg = torch.where(real & (parents >= 0), parents + cu_nodes[seq], -1)
    anc = torch.where(real[:, None], _ancestor_table(pg, n), -1)
    depth = (anc >= 0).sum(1) - 1
    L = lens[node_seq]
    pos = L + depth.clamp(min=0)
    win = _window_rows(cache.window.all_rows_on(dev), node_seq, pos, anc, Pw, real)
    plan = VerifyPlan(None, None, node_seq, win, lens_device=lens, cu_nodes=cu_nodes, depth=depth,
                      ancestors=anc, bounds=bd)
    if not r:
        plan.attn_idx = win.to(torch.int32)
        return plan
    # completing nodes in flat order (the host's flatnonzero): the m-th is where the running
    # count first reaches m + 1
    is_comp = real & ((pos + 1) % r == 0)
    count = torch.cumsum(is_comp, 0)
    found = torch.searchsorted(count, torch.arange(1, bd.completions + 1, device=dev))
    live = found < N
    comp_nodes = torch.where(live, found, -1)
    c = comp_nodes.clamp(min=0)
    plan.comp_nodes = comp_nodes
    plan.comp_entry = torch.where(live, (pos[c] + 1) // r - 1, -1)
    plan.pos_mod = pos % r
    plan.comp_src = _slot_sources(lens, plan.comp_entry, node_seq[c], c, anc, depth, live, w.comp, B)
    plan.comp_cos, plan.comp_sin = _entry_rope(plan.comp_entry, w.comp)
    m_of = torch.where(is_comp, count - 1, -1)
    plan.scratch_vis = _scratch_visible(L, depth, anc, m_of, r, bd.scratch_width)
    if w.indexer is None:  # HCA: every visible entry, a static list
        base = Pw + N
        persist = _entry_rows(cache.comp, lens, r, bd.entries)
        ext = torch.where(real[:, None], torch.where(persist >= 0, persist + base, -1)[node_seq], -1)
        vis = plan.scratch_vis
        scratch = torch.where(vis >= 0, vis + (cache.comp.num_rows + base), -1)
        plan.attn_idx = torch.cat([win, ext, scratch], 1).to(torch.int32)
    else:
        plan.pad_nodes = torch.full((B * n,), -1, dtype=torch.int64, device=dev).scatter_(0, slot, rows).view(B, n)
        plan.persist_comp_rows = _entry_rows(cache.comp, lens, r, bd.entries)
        plan.persist_idx_rows = _entry_rows(cache.idx, lens, r, bd.entries)
    return plan


def _buffer_map(w: V4LayerWeights, L, A, path, batch: int) -> torch.Tensor:
    """[B, S] buf_map of commit.plan_commit for every sequence (all -1: kept): current-window
    slot s <- the last accepted token with position % r == s; C4's previous half <- the window
    completed last on the path (on-path slots from node projections, the others from the
    current-window rows written before this round).  path[b, u]: the accepted node's u-th
    ancestor (flat row)."""
    p = w.comp
    r, S, n = p.ratio, p.num_slots, path.shape[1]
    BS = batch * S
    s = torch.arange(r, device=L.device)[None, :]
    Lc, Ac = L[:, None], A[:, None]
    u = (Lc + Ac - 1 - s) % r                      # levels above the accepted node
    cur = torch.where(u < Ac, BS + path.gather(1, u.clamp(max=n - 1)), -1)
    if not p.overlap:
        return cur
    pc = (L + A) // r * r - 1                      # the last completion on the path
    q = pc[:, None] - r + 1 + s
    prev = ((pc >= L) & (A > 0))[:, None]
    from_path = BS + path.gather(1, (Ac - 1 - (q - Lc)).clamp(0, n - 1))
    old = torch.arange(batch, device=L.device)[:, None] * S + p.cur_offset + s
    half = torch.where(prev & (q >= Lc), from_path, torch.where(prev, old, -1))
    return torch.cat([half, cur], 1)


def plan_commit_device(cache: V4Cache, w: V4LayerWeights, plan: VerifyPlan, accepted: torch.Tensor,
                       validate: bool = False) -> CommitPlan:
    """plan_commit on the device: accepted int64 [B], the local id of each tree's last
    accepted node (its root path is committed), -1 for a fully rejected sequence.

    Returns a padded CommitPlan (B = batch, Kw = bounds.window_commits, Kc =
    bounds.entry_commits): win_dst, win_src [B Kw]; entry_dst_comp, entry_dst_idx, entry_src
    [B Kc]; buf_map [B, S]; buf_seq [B]; new_lens [B] = lens + accepted tokens (device).
    About 100 torch calls for csa, 70 for hca, 30 for swa, whatever B; work O(B (n + W + S)).
    The cache must still be at plan.lens_device
    (not checked: that would read the device); validate: the accepted ids against the trees,
    on the host (one synchronisation)."""
    bd = plan.bounds
    if not isinstance(bd, PlanBounds):
        raise SimtreeError("plan_commit_device takes a plan built by plan_verify_device")
    B, N, n, W, r = bd.batch, bd.node_rows, bd.max_nodes, bd.window, bd.ratio
    if accepted.dim() != 1 or accepted.numel() != B or accepted.dtype != torch.int64:
        raise SimtreeError(f"accepted must be int64 [{B}], got {accepted.dtype} {list(accepted.shape)}")
    if validate:
        acc, counts = accepted.cpu().numpy(), np.diff(plan.cu_nodes.cpu().numpy())
        bad = np.flatnonzero((acc < -1) | (acc >= counts))
        if bad.size:
            b = int(bad[0])
            raise SimtreeError(f"accepted node {acc[b]} of sequence {b} is outside its tree of {counts[b]} nodes")
    dev, L = accepted.device, plan.lens_device
    bidx = torch.arange(B, device=dev)[:, None]
    last = (plan.cu_nodes[:-1] + accepted.clamp(min=0)).clamp(max=N - 1)
    A = torch.where(accepted >= 0, plan.depth[last] + 1, 0)         # accepted tokens
    path = plan.ancestors[last]                                      # column u: path token A - 1 - u
    u = torch.arange(bd.window_commits, device=dev)[None, :]
    kept = u < A[:, None]                                            # the last min(W, A) tokens
    row = cache.window.all_rows_on(dev)[bidx, ((L + A - 1)[:, None] - u) % W]
    cp = CommitPlan(torch.where(kept, row, -1).reshape(-1), torch.where(kept, path[:, :u.shape[1]], -1).reshape(-1),
                    None, None, None, L + A, padded=True)
    if not r:
        return cp
    # entries completed on the path, root first: path indices d0, d0 + r, ... below A
    i = ((r - 1 - L) % r)[:, None] + r * torch.arange(bd.entry_commits, device=dev)[None, :]
    done = i < A[:, None]
    node = path.gather(1, (A[:, None] - 1 - i).clamp(0, n - 1))
    m = torch.searchsorted(torch.where(plan.comp_nodes >= 0, plan.comp_nodes, N), node)
    e = ((L[:, None] + i + 1) // r - 1).clamp(0, cache.comp.capacity - 1)
    cp.entry_src = torch.where(done, m, -1).reshape(-1)
    cp.entry_dst_comp = torch.where(done, cache.comp.all_rows_on(dev)[bidx, e], -1).reshape(-1)
    if cache.idx is not None:
        cp.entry_dst_idx = torch.where(done, cache.idx.all_rows_on(dev)[bidx, e], -1).reshape(-1)
    cp.buf_map = _buffer_map(w, L, A, path, B)
    cp.buf_seq = torch.arange(B, device=dev)
    return cp
