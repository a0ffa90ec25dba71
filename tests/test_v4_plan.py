"""Host planning of the V4 tree verify (plan_verify, plan_commit, PagedPool.all_rows,
steps.deepest_paths): the vectorised forms equal the straightforward per-sequence / per-slot
loop versions they replaced (kept below as references) exactly — same arrays, dtypes, shapes
and errors — on seeded random trees, lengths and batch sizes for csa, hca and swa, plus edge
cases: trees of one node, sequences at position 0, lengths around the window and the
compression-ratio boundaries, trees deeper than the window, empty / root-only accepted paths.
"""
import importlib

import numpy as np
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.v4 import V4AttnConfig, V4Cache, plan_verify, random_layer_weights, random_tree
from simtree.kernels.v4.commit import _refresh_buffers, plan_commit
from simtree.kernels.v4.steps import deepest_paths
from simtree.kernels.v4.verify import VerifyPlan
from simtree.trees.tree import DraftTree, TreeBatch

KINDS = ("csa", "hca", "swa")


# ---- references: the loop versions the vectorised planning replaced ---------------------------

def _all_rows_ref(pool) -> np.ndarray:
    i = np.arange(pool.capacity)
    return pool.block_table_host[:, i // pool.page_size] * pool.page_size + i % pool.page_size


def _path_matrix_ref(batch: TreeBatch, depth: np.ndarray) -> np.ndarray:
    parents = np.concatenate([np.where(t.parents >= 0, t.parents + s, -1)
                              for t, s in zip(batch.trees, batch.cu_nodes[:-1])])
    A = np.full((batch.total_nodes, int(depth.max()) + 1), -1, np.int64)
    for d in range(A.shape[1]):
        nodes = np.flatnonzero(depth == d)
        if d:
            A[nodes] = A[parents[nodes]]
        A[nodes, d] = nodes
    return A


def _slot_sources_ref(lens, entry, seq, nodes, A, ratio, cur_offset, num_slots, node_offset) -> np.ndarray:
    """Slot by slot: a window of S slots completing at entry e covers the S positions ending at
    (e + 1) * ratio - 1; a position before the round sits in the sequence's buffer (the
    window being filled at lens: rows cur_offset + q % ratio; the one before it: q % ratio),
    a position in the round is the completing node's path node at depth q - lens."""
    out = np.full((len(entry), num_slots), -1, np.int64)
    for m in range(len(entry)):
        b, L = int(seq[m]), int(lens[seq[m]])
        for s in range(num_slots):
            q = (int(entry[m]) + 1) * ratio - num_slots + s
            if q < 0:
                continue
            if q >= L:
                out[m, s] = node_offset + A[nodes[m], q - L]
            elif q // ratio == L // ratio:
                out[m, s] = b * num_slots + cur_offset + q % ratio
            else:
                assert q // ratio == L // ratio - 1 and cur_offset, "only C4 keeps a previous window"
                out[m, s] = b * num_slots + q % ratio
    return out


def _entry_rows_ref(pool, lens: np.ndarray, ratio: int) -> np.ndarray:
    n = lens // ratio
    emax = int(n.max()) if n.size else 0
    return np.where(np.arange(emax)[None, :] < n[:, None], _all_rows_ref(pool)[:, :emax], -1)


def plan_verify_ref(cache: V4Cache, batch: TreeBatch, w) -> dict:
    """plan_verify before vectorisation (per-tree concatenations, per-level path matrix,
    [N, W] window arithmetic through flat_rows), as host arrays."""
    W, r = cache.cfg.window, cache.ratio
    lens = cache.lens.copy()
    N, Pw = batch.total_nodes, cache.window.num_rows
    if np.any(lens + np.array([t.max_depth for t in batch.trees]) >= cache.max_len):
        raise SimtreeError(f"tree runs past the cache capacity of {cache.max_len} tokens")
    pos = np.asarray(batch.positions(lens), np.int64)
    seq = np.asarray(batch.seq_ids, np.int64)
    depth = np.concatenate([t.depth for t in batch.trees]).astype(np.int64)
    A = _path_matrix_ref(batch, depth)
    L = lens[seq][:, None]
    qpos = pos[:, None] - W + 1 + np.arange(W)[None, :]
    pers = cache.window.flat_rows(seq[:, None], np.maximum(qpos, 0) % W)
    path = A[np.arange(N)[:, None], np.clip(qpos - L, 0, A.shape[1] - 1)] + Pw
    win = np.where(qpos >= L, path, np.where(qpos >= 0, pers, -1))
    # the plan's host ancestor table: column k = k-th ancestor (A read from the node upwards)
    k = depth[:, None] - np.arange(A.shape[1])[None, :]
    anc = np.where(k >= 0, A[np.arange(N)[:, None], np.maximum(k, 0)], -1)
    out = {"lens": lens, "node_seq": np.asarray(batch.seq_ids), "win_idx": win,
           "ancestors_host": anc, "depth_host": depth}
    if not r:
        out["attn_idx"] = win.astype(np.int32)
        return out
    comp_nodes = np.flatnonzero((pos + 1) % r == 0)
    comp_entry = (pos[comp_nodes] + 1) // r - 1
    comp_seq = seq[comp_nodes]
    out["pos_mod"] = pos % r
    M, S = len(comp_nodes), w.comp.num_slots
    out.update(comp_nodes_host=comp_nodes, comp_entry=comp_entry)
    out["comp_src"] = _slot_sources_ref(lens, comp_entry, comp_seq, comp_nodes, A, r, w.comp.cur_offset, S,
                                        cache.batch * S).reshape(M, S)
    half = w.comp.rope_dim // 2
    freqs = w.comp.theta ** (-np.arange(half, dtype=np.float64) * 2.0 / w.comp.rope_dim)
    ang = (comp_entry.astype(np.float64) * r)[:, None] * freqs
    out["comp_cos"], out["comp_sin"] = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    m_of = np.full(N, -1, np.int64)
    m_of[comp_nodes] = np.arange(M)
    V = np.where(A >= 0, m_of[np.maximum(A, 0)], -1)
    V = np.take_along_axis(V, np.argsort(V < 0, axis=1, kind="stable"), axis=1)
    vis = V[:, :max(1, int((V >= 0).sum(1).max()))]
    out["scratch_vis"] = vis
    persist = _entry_rows_ref(cache.comp, lens, r)
    if w.indexer is None:
        Pc = cache.comp.num_rows
        comp_idx = np.concatenate([persist[seq], np.where(vis >= 0, vis + Pc, -1)], axis=1)
        out["attn_idx"] = np.concatenate([win, np.where(comp_idx >= 0, comp_idx + Pw + N, -1)], 1).astype(np.int32)
    else:
        nmax = batch.max_nodes
        local = np.arange(N) - np.asarray(batch.cu_nodes[:-1], np.int64)[seq]
        pad = np.full((cache.batch, nmax), -1, np.int64)
        pad[seq, local] = np.arange(N)
        out.update(persist_comp_rows=persist, persist_idx_rows=_entry_rows_ref(cache.idx, lens, r), pad_nodes=pad)
    return out


def _check_path_ref(tree, acc: np.ndarray, b: int) -> None:
    """Node by node (the error texts are plan_commit's contract): starts at the root, every
    node inside the tree, and the path is the tree's own root path to its last node."""
    path = [int(a) for a in acc]
    if not path:
        return
    if path[0] != 0:
        raise SimtreeError(f"accepted path of sequence {b} must start at the root (node 0), got {path[0]}")
    if not all(0 <= a < tree.num_nodes for a in path):
        raise SimtreeError(f"accepted path of sequence {b} names a node outside its tree of {tree.num_nodes}")
    if tree.path_to(path[-1]).tolist() != path:
        raise SimtreeError(f"accepted nodes of sequence {b} are not a root path: {path}")


def plan_commit_ref(cache: V4Cache, w, plan, accepted) -> dict:
    """plan_commit before vectorisation: one Python iteration per sequence (and per completed
    entry); the buffer moves both as the two-step lists (old copies, then node copies) and as
    the map the fused kernel reads."""
    batch = plan.batch
    if len(accepted) != batch.batch_size:
        raise SimtreeError(f"{len(accepted)} accepted paths for a batch of {batch.batch_size} trees")
    if not np.array_equal(plan.lens, cache.lens):
        raise SimtreeError("cache lengths changed since the verify plan was built (commit twice?)")
    W, r = cache.cfg.window, cache.ratio
    win_dst, win_src, e_comp, e_idx, e_src = [], [], [], [], []
    S = w.comp.num_slots if r else 0
    old_dst, old_src, new_dst, new_src = [], [], [], []
    slots = np.arange(r) if r else None
    m_of_node = {} if not r else {int(n): m for m, n in enumerate(plan.comp_nodes_host)}
    new_lens = cache.lens.copy()
    for b, (tree, start) in enumerate(zip(batch.trees, batch.cu_nodes[:-1])):
        acc = np.asarray(accepted[b], np.int64).reshape(-1)
        _check_path_ref(tree, acc, b)
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
        t = A - 1 - ((L + A - 1 - slots) % r)
        has = t >= 0
        new_dst.append(b * S + off + slots[has])
        new_src.append(start + acc[t[has]])
        pc = (L + A) // r * r - 1
        if w.comp.overlap and pc >= L:
            q = pc - r + 1 + slots
            on_path = q >= L
            new_dst.append(b * S + slots[on_path])
            new_src.append(start + acc[q[on_path] - L])
            old_dst.append(b * S + slots[~on_path])
            old_src.append(b * S + off + slots[~on_path])
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    out = {"win_dst": cat(win_dst), "win_src": cat(win_src), "new_lens": new_lens}
    if r:
        BS, N = cache.batch * S, batch.total_nodes
        od, os_, nd, ns = cat(old_dst), cat(old_src), cat(new_dst), cat(new_src)
        out["entry_dst_comp"], out["entry_src"] = np.asarray(e_comp, np.int64), np.asarray(e_src, np.int64)
        out["entry_dst_idx"] = np.asarray(e_idx, np.int64) if cache.idx is not None else None
        out["buf_old_dst"], out["buf_old_src"] = np.concatenate([od, od + BS]), np.concatenate([os_, os_ + BS])
        out["buf_new_dst"], out["buf_new_src"] = np.concatenate([nd, nd + BS]), np.concatenate([ns, ns + N])
        bmap = np.full((cache.batch, S), -1, np.int64)
        bmap.reshape(-1)[od] = os_
        bmap.reshape(-1)[nd] = BS + ns
        touched = np.flatnonzero((bmap >= 0).any(1))
        out["buf_map"], out["buf_seq"] = bmap[touched], touched
    return out


def _refresh_buffers_ref(buf: torch.Tensor, proj, ref: dict) -> None:
    """The two-step torch form the lists fed: old-row copies first, then node copies."""
    flat = buf.view(-1, buf.shape[-1])
    od, os_ = torch.as_tensor(ref["buf_old_dst"]), torch.as_tensor(ref["buf_old_src"])
    nd, ns = torch.as_tensor(ref["buf_new_dst"]), torch.as_tensor(ref["buf_new_src"])
    if od.numel():
        flat.index_copy_(0, od, flat[os_])
    if nd.numel():
        nodes = torch.stack(proj).view(-1, buf.shape[-1])
        flat.index_copy_(0, nd, nodes[ns].to(flat.dtype))


def deepest_paths_ref(batch: TreeBatch) -> list:
    return [t.path_to(int(t.leaves[np.argmax(t.depth[t.leaves])])).tolist() for t in batch.trees]


# ---- comparison helpers ----------------------------------------------------------------------

def _host(x):
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else x


def _same(got, want, name):
    got = _host(got)
    if want is None:
        assert got is None, name
        return
    assert got is not None, name
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.array_equal(got, want), f"{name} differs"


PLAN_FIELDS = ("node_seq", "win_idx", "comp_entry", "comp_src", "comp_nodes_host", "scratch_vis",
               "persist_comp_rows", "persist_idx_rows", "pad_nodes", "pos_mod", "attn_idx", "comp_cos", "comp_sin",
               "ancestors_host", "depth_host")


def _compare_plan(plan: VerifyPlan, ref: dict) -> None:
    _same(plan.lens, ref["lens"], "lens")
    for name in PLAN_FIELDS:
        _same(getattr(plan, name), ref.get(name), name)


def _compare_commit(cache, w, plan, accepted, seed) -> None:
    cp = plan_commit(cache, w, plan, accepted)
    ref = plan_commit_ref(cache, w, plan, accepted)
    for name in ("win_dst", "win_src", "entry_dst_comp", "entry_dst_idx", "entry_src", "buf_map", "buf_seq"):
        _same(getattr(cp, name), ref.get(name), name)
    _same(cp.new_lens, ref["new_lens"], "new_lens")
    if cache.ratio:  # the one map the plan keeps moves exactly what the two-step lists moved
        g = torch.Generator().manual_seed(seed)
        B, N, S, C = cache.batch, plan.batch.total_nodes, w.comp.num_slots, 3
        buf = torch.randn(2, B, S, C, generator=g, dtype=torch.float64)
        proj = tuple(torch.randn(N, C, generator=g, dtype=torch.float64) for _ in range(2))
        a, b = buf.clone(), buf.clone()
        _refresh_buffers(a, proj, cp)
        _refresh_buffers_ref(b, proj, ref)
        assert torch.equal(a, b)


def _cfg(variant: int) -> V4AttnConfig:
    if variant == 0:
        return V4AttnConfig.tiny()                                   # window 8, C4, C8, pages of 4
    if variant == 1:
        return V4AttnConfig.tiny(window=5, hca_ratio=3, page_size=3)  # odd sizes, window < 2 * C4
    return V4AttnConfig.tiny(window=16, hca_ratio=16, page_size=8)


def _tree(rng: np.random.Generator, n: int) -> DraftTree:
    shape = rng.integers(4)
    if shape == 0:
        return random_tree(n, rng)
    if shape == 1:
        return DraftTree.chain(n)
    if shape == 2:
        return DraftTree(np.array([-1] + [0] * (n - 1)))             # star: all depth 1
    return DraftTree(np.array([-1] + [int(rng.integers(i)) for i in range(1, n)]))  # any parent


def _boundary_lens(rng: np.random.Generator, cfg: V4AttnConfig) -> int:
    """A length at or around 0, the window, the compression ratios or their multiples."""
    marks = [0, cfg.window, cfg.csa_ratio, cfg.hca_ratio, 2 * cfg.csa_ratio, 2 * cfg.hca_ratio,
             3 * cfg.hca_ratio, cfg.window + cfg.hca_ratio]
    if rng.random() < 0.3:
        return int(rng.integers(0, 80))
    return max(0, int(rng.choice(marks)) + int(rng.integers(-2, 3)))


def _accepted(rng: np.random.Generator, tree: DraftTree) -> list:
    """[] (rejected), [0] (root only), or the root path to a random node (often the deepest)."""
    u = rng.random()
    if u < 0.1:
        return []
    if u < 0.2:
        return [0]
    node = int(np.argmax(tree.depth)) if u < 0.5 else int(rng.integers(tree.num_nodes))
    return tree.path_to(node).tolist()


def _case(kind, seed, cfg, batch=None, max_nodes=16):
    rng = np.random.default_rng(seed)
    w = random_layer_weights(cfg, kind, seed % 3)
    B = batch or int(rng.integers(1, 7))
    trees = TreeBatch(tuple(_tree(rng, int(rng.integers(1, max_nodes + 1))) for _ in range(B)))
    lens = np.array([_boundary_lens(rng, cfg) for _ in range(B)], np.int64)
    cache = V4Cache(cfg, w, B, int(lens.max()) + max_nodes + 3, dtype=torch.float32, seed=seed)
    cache.lens[:] = lens
    return w, cache, trees, rng


# ---- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", [0, 1, 2])
def test_plans_equal_loop_reference_random(kind, variant):
    cfg = _cfg(variant)
    for seed in range(25):
        w, cache, trees, rng = _case(kind, 1000 * variant + seed, cfg)
        plan = plan_verify(cache, trees, w)
        _compare_plan(plan, plan_verify_ref(cache, trees, w))
        _compare_commit(cache, w, plan, [_accepted(rng, t) for t in trees.trees], seed)
        assert deepest_paths(plan) == deepest_paths_ref(trees)


@pytest.mark.parametrize("kind", KINDS)
def test_edge_cases(kind):
    """Trees of one node, every sequence at position 0, a chain deeper than the window,
    lengths right at and around the window / ratio boundaries, nothing accepted anywhere."""
    cfg = V4AttnConfig.tiny()
    W, r4, r8 = cfg.window, cfg.csa_ratio, cfg.hca_ratio
    cases = [
        ([DraftTree.chain(1)], [0]),
        ([DraftTree.chain(1)] * 3, [0, r4 - 1, r8]),
        ([DraftTree.chain(5), DraftTree.chain(1)], [0, 0]),
        ([DraftTree.chain(W + 6), DraftTree.chain(2)], [0, W - 1]),      # deeper than the window
        ([DraftTree.chain(W + 6)], [r8 - 1]),
        ([random_tree(9, np.random.default_rng(s)) for s in range(5)], [W - 1, W, W + 1, r4 * 5 - 1, r8 * 3]),
        ([DraftTree(np.array([-1, 0, 0, 0, 1]))] * 2, [r4, 2 * r8 - 1]),
    ]
    w = random_layer_weights(cfg, kind, 0)
    for c, (trees, lens) in enumerate(cases):
        tb = TreeBatch(tuple(trees))
        cache = V4Cache(cfg, w, len(lens), max(lens) + W + 12, dtype=torch.float32, seed=c)
        cache.lens[:] = lens
        plan = plan_verify(cache, tb, w)
        _compare_plan(plan, plan_verify_ref(cache, tb, w))
        deepest = [t.path_to(int(np.argmax(t.depth))).tolist() for t in tb.trees]
        for acc in (deepest, [[] for _ in trees], [[0] for _ in trees],
                    [d if b % 2 else [] for b, d in enumerate(deepest)]):
            _compare_commit(cache, w, plan, acc, c)
    # a DraftTree instead of a batch
    cache = V4Cache(cfg, w, 1, 40, dtype=torch.float32)
    cache.lens[:] = 17
    tree = random_tree(7, np.random.default_rng(3))
    _compare_plan(plan_verify(cache, tree, w), plan_verify_ref(cache, TreeBatch((tree,)), w))


@pytest.mark.parametrize("kind", KINDS)
def test_flash_config_batch_64(kind):
    """V4-Flash shapes (window 128, C4 / C128, pages of 256) at the bench's batch 64, mixed
    lengths around 4K (page and C128 boundaries) and 8-16 node trees."""
    cfg = V4AttnConfig.flash(head_dim=64, rope_dim=64, indexer_dim=64, hidden=32)  # planning ignores widths
    rng = np.random.default_rng(7)
    w = random_layer_weights(cfg, kind, 0)
    trees = TreeBatch(tuple(random_tree(int(rng.integers(8, 17)), rng) for _ in range(64)))
    lens = 4096 + rng.integers(-300, 300, 64)
    lens[:4] = [127, 128, 4095, 4096]
    cache = V4Cache(cfg, w, 64, int(lens.max()) + 64, dtype=torch.float32, seed=1)
    cache.lens[:] = lens
    plan = plan_verify(cache, trees, w)
    _compare_plan(plan, plan_verify_ref(cache, trees, w))
    _compare_commit(cache, w, plan, [_accepted(rng, t) for t in trees.trees], 7)
    assert deepest_paths(plan) == deepest_paths_ref(trees)


def test_all_rows_equals_block_table_formula():
    for cap, ps in ((1, 4), (8, 4), (9, 4), (33, 8), (100, 7)):
        cache_rows = V4Cache(V4AttnConfig.tiny(page_size=ps), random_layer_weights(V4AttnConfig.tiny(), "hca", 0),
                             3, cap * 8, dtype=torch.float32, seed=cap)
        for pool in (cache_rows.window, cache_rows.comp):
            got = pool.all_rows()
            assert got.shape == (3, pool.capacity) and got.dtype == np.int64
            assert np.array_equal(got, _all_rows_ref(pool))
            assert np.array_equal(got, pool.flat_rows(np.arange(3)[:, None], np.arange(pool.capacity)[None, :]))
            with pytest.raises(ValueError):
                got[0, 0] = 5  # read-only: a caller cannot corrupt later rounds


@pytest.mark.parametrize("bad", [
    [[1], [0]], [[0, 5, 1], [0]], [[0], [0, 99]], [[0], [-1]], [[0, 1], [0, 2, 1]], [[0, 1, 2], [5]],
    [[], [0, 3]], [[0, 0], [0]],
])
def test_invalid_accepted_paths_raise_like_the_reference(bad):
    cfg = V4AttnConfig.tiny()
    w = random_layer_weights(cfg, "csa", 0)
    tb = TreeBatch((DraftTree.chain(4), DraftTree(np.array([-1, 0, 0, 1]))))
    cache = V4Cache(cfg, w, 2, 64, dtype=torch.float32)
    cache.lens[:] = [9, 13]
    plan = plan_verify(cache, tb, w)
    with pytest.raises(SimtreeError) as want:
        plan_commit_ref(cache, w, plan, bad)
    with pytest.raises(SimtreeError) as got:
        plan_commit(cache, w, plan, bad)
    assert str(got.value) == str(want.value)


def test_capacity_error_unchanged():
    cfg = V4AttnConfig.tiny()
    w = random_layer_weights(cfg, "hca", 0)
    cache = V4Cache(cfg, w, 2, 19, dtype=torch.float32)
    cache.lens[:] = [3, 15]
    tb = TreeBatch((DraftTree.chain(2), DraftTree.chain(5)))
    with pytest.raises(SimtreeError, match="capacity"):
        plan_verify_ref(cache, tb, w)
    with pytest.raises(SimtreeError, match="capacity"):
        plan_verify(cache, tb, w)


def test_accelerator_persist_rows_equal_host_rows():
    """The CSA persistent rows an accelerator builds from its copy of the block rows (run here
    on CPU tensors) equal the host form, for equal and mixed lengths and Emax 0."""
    from simtree.kernels.v4.verify import _entry_rows, _entry_rows_torch
    cfg = V4AttnConfig.tiny(page_size=3)
    w = random_layer_weights(cfg, "csa", 0)
    cache = V4Cache(cfg, w, 5, 90, dtype=torch.float32, seed=2)
    for lens in ([0, 0, 0, 0, 0], [3, 1, 2, 0, 3], [40, 40, 40, 40, 40], [41, 7, 89, 0, 64]):
        lens = np.array(lens, np.int64)
        for pool in (cache.comp, cache.idx):
            want = _entry_rows_ref(pool, lens, cfg.csa_ratio)
            _same(_entry_rows(pool, lens, cfg.csa_ratio), want, "host rows")
            _same(_entry_rows_torch(pool.all_rows_on("cpu"), lens // cfg.csa_ratio), want, "device rows")
    assert cache.comp.all_rows_on("cpu") is cache.comp.all_rows_on(torch.device("cpu"))  # uploaded once


@pytest.mark.parametrize("form", ["list", "tuple", "array", "column", "nested", "mixed"])
def test_accepted_path_forms(form):
    """plan_commit reads a path as np.asarray(path, int64).reshape(-1), whatever its form."""
    cfg = V4AttnConfig.tiny()
    w = random_layer_weights(cfg, "csa", 0)
    tb = TreeBatch((DraftTree.chain(6), DraftTree(np.array([-1, 0, 0, 1])), DraftTree.chain(3)))
    cache = V4Cache(cfg, w, 3, 64, dtype=torch.float32)
    cache.lens[:] = [9, 13, 2]
    plan = plan_verify(cache, tb, w)
    paths = [[0, 1, 2, 3], [0, 1, 3], []]
    conv = {"list": lambda p: list(p), "tuple": tuple, "array": np.array,
            "column": lambda p: np.array(p, np.int64).reshape(-1, 1), "nested": lambda p: [list(p)],
            "mixed": lambda p: [float(x) for x in p]}[form]
    acc = [conv(p) for p in paths]
    if form == "mixed":
        acc[1] = np.array(paths[1], np.int32)
    cp, ref = plan_commit(cache, w, plan, acc), plan_commit_ref(cache, w, plan, acc)
    for name in ("win_dst", "win_src", "entry_dst_comp", "entry_dst_idx", "entry_src", "buf_map", "buf_seq"):
        _same(getattr(cp, name), ref[name], name)
    _same(cp.new_lens, ref["new_lens"], "new_lens")
    bad = [conv(p) for p in ([0, 1, 2, 3], [0, 2, 3], [])]
    with pytest.raises(SimtreeError) as want:
        plan_commit_ref(cache, w, plan, bad)
    with pytest.raises(SimtreeError) as got:
        plan_commit(cache, w, plan, bad)
    assert str(got.value) == str(want.value)


def test_persist_rows_built_on_the_device_only_when_large(monkeypatch):
    """Accelerators build the CSA persistent rows themselves from DEVICE_PERSIST_MIN_ENTRIES
    [B, Emax] entries on (measured faster there, slower below); the CPU always uses numpy."""
    tv = importlib.import_module("simtree.kernels.v4.verify")  # the module, not the function
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    limit = tv.DEVICE_PERSIST_MIN_ENTRIES
    assert tv._persist_on_device(gpu, 64, -(-limit // 64))
    assert not tv._persist_on_device(gpu, 64, limit // 64 - 1)
    assert not tv._persist_on_device(cpu, 64, 10 * limit)
    monkeypatch.setattr(tv, "DEVICE_PERSIST_MIN_ENTRIES", 0)
    assert tv._persist_on_device(gpu, 1, 0) and not tv._persist_on_device(cpu, 1, 0)


def _fields(plan):
    return {k: v for k, v in vars(plan).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("kind", KINDS)
def test_packed_upload_same_tensors(kind, monkeypatch):
    """The accelerator upload (small arrays of a dtype staged into one buffer, one copy per
    dtype), run on CPU tensors: every plan tensor equals the per-array upload, is contiguous,
    starts at a 128-byte offset of its buffer, and the tensors of a dtype share one buffer."""
    tv = importlib.import_module("simtree.kernels.v4.verify")  # the module, not the function
    for seed in range(6):
        w, cache, trees, rng = _case(kind, 50 + seed, V4AttnConfig.tiny())
        acc = [_accepted(rng, t) for t in trees.trees]
        monkeypatch.setattr(tv, "PACK_UPLOADS", False)
        plain = plan_verify(cache, trees, w)
        plain_c = plan_commit(cache, w, plain, acc)
        monkeypatch.setattr(tv, "PACK_UPLOADS", True)
        packed = plan_verify(cache, trees, w)
        packed_c = plan_commit(cache, w, packed, acc)
        for a, b in ((plain, packed), (plain_c, packed_c)):
            fa, fb = _fields(a), _fields(b)
            assert fa.keys() == fb.keys()
            storages = {}
            for k in fa:
                _same(fb[k], _host(fa[k]), k)
                if k.startswith("persist_") or not fb[k].numel():  # built apart (on the device) / no data
                    continue
                base = fb[k].untyped_storage().data_ptr()
                assert fb[k].is_contiguous() and (fb[k].data_ptr() - base) % 128 == 0, k
                storages.setdefault(fb[k].dtype, set()).add(base)
            assert all(len(v) == 1 for v in storages.values()), storages


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_packed_upload_end_to_end(kind, attention, monkeypatch):
    """Verify and commit on packed plan tensors (views into shared buffers) still equal
    float64 sequential decoding."""
    tv = importlib.import_module("simtree.kernels.v4.verify")  # the module, not the function
    from simtree.kernels.v4.check import check_against_reference
    monkeypatch.setattr(tv, "PACK_UPLOADS", True)
    cfg = V4AttnConfig.tiny()
    dtype = torch.float64 if attention == "torch" else torch.float32
    r = check_against_reference(cfg, kind, [14, 22, 5], nodes=10, seed=3, dtype=dtype, attention=attention)
    tol = 1e-12 if attention == "torch" else 2e-4
    assert r["verify_err"] < tol and r["commit_err"] < tol and not r["verify_wrote_cache"]
