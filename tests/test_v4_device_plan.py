"""Round metadata built on the device (plan_verify_device, plan_commit_device) against the host
plans (plan_verify, plan_commit): the same lists once the padding is removed, the same verify
outputs and committed state, and end to end the float64 sequential reference, on fresh random
trees, padding rows and lengths at and around the window and the compression boundaries (C4
and C8 in the tiny config, C3 / C16 in its variants) for swa, csa and hca layers.
"""
import numpy as np
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.v4 import (V4AttnConfig, V4Cache, V4Inputs, apply_commit, plan_commit, plan_commit_device,
                                plan_verify, plan_verify_device, random_inputs, random_layer_weights, random_tree,
                                tree_tensors, tree_verify)
from simtree.kernels.v4.check import check_against_reference
from simtree.trees.tree import DraftTree, TreeBatch

from host_reads import TorchCalls

KINDS = ("swa", "csa", "hca")
CFGS = {"tiny": V4AttnConfig.tiny(),                                        # window 8, C4, C8
        "odd": V4AttnConfig.tiny(window=5, hca_ratio=3, page_size=3),
        "wide": V4AttnConfig.tiny(window=16, hca_ratio=16, page_size=8)}


def _tree(rng: np.random.Generator, n: int) -> DraftTree:
    shape = rng.integers(4)
    if shape == 0:
        return random_tree(n, rng)
    if shape == 1:
        return DraftTree.chain(n)
    if shape == 2:
        return DraftTree(np.array([-1] + [0] * (n - 1)))                    # star: all at depth 1
    return DraftTree(np.array([-1] + [int(rng.integers(i)) for i in range(1, n)]))


def _length(rng: np.random.Generator, cfg: V4AttnConfig) -> int:
    """0, or just below / at / just above a multiple of the window or a compression ratio."""
    if rng.random() < 0.1:
        return 0
    step = int(rng.choice([cfg.window, cfg.csa_ratio, cfg.hca_ratio]))
    return max(0, step * int(rng.integers(1, 5)) + int(rng.integers(-2, 3)))


def _case(kind: str, seed: int, cfg: V4AttnConfig, dtype=torch.float32):
    """Weights, a random cache, host trees, and the device plan's inputs (random padding rows,
    a random slack in max_nodes and in the context bound)."""
    rng = np.random.default_rng(seed)
    w = random_layer_weights(cfg, kind, seed % 5, dtype)
    B = int(rng.integers(1, 6))
    max_nodes = int(rng.integers(1, 12))
    trees = TreeBatch(tuple(_tree(rng, int(rng.integers(1, max_nodes + 1))) for _ in range(B)))
    lens = np.array([_length(rng, cfg) for _ in range(B)], np.int64)
    max_context = int(lens.max()) + int(rng.integers(0, 20))
    cache = V4Cache.random(cfg, w, B, 0, max_context + max_nodes + 1, dtype=dtype, state_dtype=dtype, seed=seed)
    cache.lens[:] = lens
    rows = int(rng.integers(trees.total_nodes, B * max_nodes + 1))
    parents, cu = tree_tensors(trees, rows)
    return w, cache, trees, (parents, cu, torch.as_tensor(lens), max_nodes, max_context), rng


def _eq(got, want, name):
    got, want = torch.as_tensor(got), torch.as_tensor(np.asarray(want))
    assert got.dtype == want.dtype and got.shape == want.shape, f"{name}: {got.dtype} {list(got.shape)} " \
                                                                f"!= {want.dtype} {list(want.shape)}"
    assert torch.equal(got, want), f"{name} differs"


def _pad(t, name):
    assert bool((t == -1).all()), f"{name}: padding is not -1"


def _compare_verify(hp, dp, cache, trees):
    """Field by field: the device plan's rows of real nodes (the first N, same flat ids) and
    columns up to the host's widths equal the host plan; everything past them is -1."""
    N, Nd = trees.total_nodes, dp.node_seq.shape[0]
    D = hp.ancestors_host.shape[1]
    _eq(dp.lens_device, hp.lens, "lens")
    _eq(dp.node_seq[:N], hp.node_seq, "node_seq")
    _eq(dp.win_idx[:N], hp.win_idx, "win_idx")
    _pad(dp.win_idx[N:], "win_idx")
    _eq(dp.depth[:N], hp.depth_host, "depth")
    _pad(dp.depth[N:], "depth")
    _eq(dp.ancestors[:N, :D], hp.ancestors_host, "ancestors")
    _pad(dp.ancestors[:, D:], "ancestors")
    _pad(dp.ancestors[N:], "ancestors")
    if not cache.ratio:
        _eq(dp.attn_idx[:N], hp.attn_idx, "attn_idx")
        _pad(dp.attn_idx[N:], "attn_idx")
        return
    M, Sv = len(hp.comp_nodes_host), hp.scratch_vis.shape[1]
    _eq(dp.comp_nodes[:M], hp.comp_nodes_host, "comp_nodes")
    for name in ("comp_nodes", "comp_entry", "comp_src"):
        _pad(getattr(dp, name)[M:], name)
    for name in ("comp_entry", "comp_src", "comp_cos", "comp_sin"):
        _eq(getattr(dp, name)[:M], getattr(hp, name), name)
    _eq(dp.pos_mod[:N], hp.pos_mod, "pos_mod")
    _eq(dp.scratch_vis[:N, :Sv], hp.scratch_vis, "scratch_vis")
    _pad(dp.scratch_vis[:, Sv:], "scratch_vis")
    _pad(dp.scratch_vis[N:], "scratch_vis")
    if hp.attn_idx is not None:  # HCA: the same list once -1 is dropped, compressed rows past N more nodes
        base = cache.window.num_rows + N
        for j in range(N):
            h = hp.attn_idx[j][hp.attn_idx[j] >= 0]
            _eq(dp.attn_idx[j][dp.attn_idx[j] >= 0], torch.where(h >= base, h + (Nd - N), h), f"attn_idx row {j}")
        _pad(dp.attn_idx[N:], "attn_idx")
        return
    E = hp.persist_comp_rows.shape[1]
    for name in ("persist_comp_rows", "persist_idx_rows"):
        _eq(getattr(dp, name)[:, :E], getattr(hp, name), name)
        _pad(getattr(dp, name)[:, E:], name)
    hn = hp.pad_nodes.shape[1]
    real = torch.arange(dp.pad_nodes.shape[1])[None, :] < torch.as_tensor(np.diff(trees.cu_nodes))[:, None]
    _eq(dp.pad_nodes[real], hp.pad_nodes[real[:, :hn]], "pad_nodes")
    # padding rows fill free slots once each, in their node_seq's row
    slots = torch.nonzero(dp.pad_nodes >= N)
    _eq(torch.sort(dp.pad_nodes[dp.pad_nodes >= N])[0], torch.arange(N, Nd), "padding slots")
    _eq(dp.node_seq[dp.pad_nodes[slots[:, 0], slots[:, 1]]], slots[:, 0], "padding node_seq")


def _paths(rng, trees):
    """Per tree: [] (rejected), [0], or the root path to a random node (often the deepest)."""
    out = []
    for t in trees.trees:
        u = rng.random()
        node = (-1 if u < 0.15 else 0 if u < 0.3 else int(np.argmax(t.depth)) if u < 0.6
                else int(rng.integers(t.num_nodes)))
        out.append([] if node < 0 else t.path_to(node).tolist())
    return out


def _last(paths):
    return torch.tensor([p[-1] if p else -1 for p in paths], dtype=torch.int64)


def _compare_commit(hc, dc, batch):
    """The same row moves: window pairs as a set, entries in order, buf_map row by row."""
    keep = dc.win_dst >= 0
    assert bool((dc.win_src[~keep] == -1).all())
    pairs = lambda d, s: sorted(zip(d.tolist(), s.tolist()))  # noqa: E731
    assert pairs(dc.win_dst[keep], dc.win_src[keep]) == pairs(hc.win_dst, hc.win_src)
    _eq(dc.new_lens, hc.new_lens, "new_lens")
    if hc.entry_src is None:
        assert dc.entry_src is None and dc.buf_map is None
        return
    done = dc.entry_dst_comp >= 0
    for name in ("entry_src", "entry_dst_comp", "entry_dst_idx"):
        if getattr(hc, name) is None:
            assert getattr(dc, name) is None, name
            continue
        _eq(getattr(dc, name)[done], getattr(hc, name), name)
        _pad(getattr(dc, name)[~done], name)
    _eq(dc.buf_seq, torch.arange(batch), "buf_seq")
    _eq(dc.buf_map[hc.buf_seq], hc.buf_map, "buf_map")
    untouched = torch.ones(batch, dtype=torch.bool)
    untouched[hc.buf_seq] = False
    _pad(dc.buf_map[untouched], "buf_map")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", sorted(CFGS))
def test_device_plans_equal_host_plans(kind, variant):
    for seed in range(20):
        w, cache, trees, args, rng = _case(kind, 100 * seed + len(variant), CFGS[variant])
        hp = plan_verify(cache, trees, w)
        dp = plan_verify_device(cache, w, *args, validate=True)
        _compare_verify(hp, dp, cache, trees)
        paths = _paths(rng, trees)
        _compare_commit(plan_commit(cache, w, hp, paths), plan_commit_device(cache, w, dp, _last(paths)),
                        trees.batch_size)


def _cache_diff(a: V4Cache, b: V4Cache) -> dict:
    return {k: float((t - b.persistent_tensors()[k]).abs().max()) for k, t in a.persistent_tensors().items()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attention,dtype,tol", [("torch", torch.float64, 1e-12), ("triton", torch.float32, 2e-6)])
def test_device_plan_verifies_and_commits_like_the_host_plan(kind, attention, dtype, tol):
    """Outputs of the real nodes and the committed caches (fused and torch commit); window rows
    are copies, so bit-identical; entries and buffers to fp tolerance (projections batch N vs
    the padded rows)."""
    for seed in range(3):
        w, cache, trees, args, rng = _case(kind, seed, CFGS["tiny"], dtype)
        twin = V4Cache.random(cache.cfg, w, cache.batch, 0, cache.max_len, dtype=dtype, state_dtype=dtype, seed=seed)
        twin.lens[:] = cache.lens
        N, rows = trees.total_nodes, args[0].numel()
        inp = random_inputs(cache.cfg, rows, torch.Generator().manual_seed(seed), dtype)
        hp, dp = plan_verify(cache, trees, w), plan_verify_device(twin, w, *args)
        out_h, sc_h = tree_verify(cache, w, inp.select(torch.arange(N)), hp, attention=attention)
        out_d, sc_d = tree_verify(twin, w, inp, dp, attention=attention)
        assert float((out_d[:N] - out_h).abs().max()) < tol
        assert bool(torch.isfinite(out_d).all())          # padding rows are defined
        paths = _paths(rng, trees)
        impl = "torch" if seed % 2 else "triton"
        apply_commit(cache, sc_h, plan_commit(cache, w, hp, paths), impl=impl)
        apply_commit(twin, sc_d, plan_commit_device(twin, w, dp, _last(paths)), impl=impl)
        diff = _cache_diff(cache, twin)
        assert diff.pop("window") == 0.0
        assert all(v < tol for v in diff.values()), diff


HISTORIES = ([3, 4, 5, 7, 8, 9], [0, 15, 16, 17, 31, 32])  # around C4 and C8 boundaries


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("history", HISTORIES)
def test_device_plan_round_equals_sequential_decoding(kind, history):
    """End to end: verify + commit through the device plans == float64 sequential decoding."""
    r = check_against_reference(CFGS["tiny"], kind, history, nodes=9, seed=sum(history), planner="device")
    assert r["verify_err"] < 1e-12 and r["commit_err"] < 1e-12
    assert not r["verify_wrote_cache"] and r["rejected_identical"]


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_device_plan_round_triton_and_rejected_sequences(kind):
    """Fused kernels (fp32) and the padded fused commit; [] and [0] accepted paths."""
    trees = [DraftTree.chain(13), random_tree(6, np.random.default_rng(4)), random_tree(5, np.random.default_rng(5))]
    acc = [trees[0].path_to(12).tolist(), [], [0]]
    r = check_against_reference(CFGS["tiny"], kind, [6, 15, 31], trees=trees, accepted=acc, seed=5,
                                dtype=torch.float32, attention="triton", planner="device")
    assert r["verify_err"] < 1e-4 and r["commit_err"] < 1e-5 and r["rejected_identical"]


@pytest.mark.parametrize("kind", KINDS)
def test_empty_tree_takes_no_part(kind):
    """A sequence with no nodes: the other trees verify and commit as with the host plan (where
    the empty tree is a lone root that is then rejected) and its own state stays bit-identical."""
    cfg, rng = CFGS["tiny"], np.random.default_rng(3)
    w = random_layer_weights(cfg, kind, 3)
    trees = [random_tree(7, rng), DraftTree.chain(1), DraftTree.chain(9)]
    lens = np.array([14, 21, 7])
    caches = [V4Cache.random(cfg, w, 3, 0, 40, dtype=torch.float64, state_dtype=torch.float64, seed=3)
              for _ in range(2)]
    for c in caches:
        c.lens[:] = lens
    host = TreeBatch(tuple(trees))
    parents = torch.as_tensor(np.concatenate([trees[0].parents, trees[2].parents, [-1, 5]]))
    cu = torch.tensor([0, 7, 7, 16])
    inp = random_inputs(cfg, 18, torch.Generator().manual_seed(3))
    dp = plan_verify_device(caches[1], w, parents, cu, torch.as_tensor(lens), 9, validate=True)
    out_d, sc_d = tree_verify(caches[1], w, inp, dp, attention="torch")
    # the host's lone root reads a padding row's inputs
    host_rows = torch.cat([torch.arange(7), torch.tensor([16]), torch.arange(7, 16)])
    hp = plan_verify(caches[0], host, w)
    out_h, sc_h = tree_verify(caches[0], w, inp.select(host_rows), hp, attention="torch")
    keep = torch.tensor([i for i in range(17) if i != 7])
    assert float((out_d[:16] - out_h[keep]).abs().max()) < 1e-12
    paths = [trees[0].path_to(6).tolist(), [], trees[2].path_to(8).tolist()]
    before = caches[1].sequence_state(1).clone()
    apply_commit(caches[0], sc_h, plan_commit(caches[0], w, hp, paths), impl="torch")
    cp = plan_commit_device(caches[1], w, dp, torch.tensor([6, -1, 8]), validate=True)
    apply_commit(caches[1], sc_d, cp, impl="triton")
    assert cp.new_lens.tolist() == [14 + int(trees[0].depth[6]) + 1, 21, 16]
    assert all(v < 1e-12 for v in _cache_diff(*caches).values())
    after = caches[1].sequence_state(1)
    assert all(torch.equal(getattr(before, k), getattr(after, k)) for k in STATE if getattr(before, k) is not None)


STATE = ("kv", "comp", "idx", "comp_kv", "comp_score", "idx_kv", "idx_score")


@pytest.mark.parametrize("kind", KINDS)
def test_rounds_chain_on_device_lengths(kind):
    """Five rounds in a row, the device plans reading the previous commit's new_lens (never the
    host's cache.lens): outputs and caches follow the host plans round after round."""
    cfg, rng, B, n = CFGS["tiny"], np.random.default_rng(11), 3, 7
    w = random_layer_weights(cfg, kind, 11)
    host, dev = (V4Cache.random(cfg, w, B, 0, 100, dtype=torch.float64, state_dtype=torch.float64, seed=11)
                 for _ in range(2))
    host.lens[:] = dev.lens[:] = [3, 14, 29]
    lens = torch.as_tensor(host.lens.copy())
    gen = torch.Generator().manual_seed(11)
    for _ in range(5):
        trees = TreeBatch(tuple(_tree(rng, int(rng.integers(1, n + 1))) for _ in range(B)))
        inp = random_inputs(cfg, B * n, gen)
        parents, cu = tree_tensors(trees, B * n)
        dp = plan_verify_device(dev, w, parents, cu, lens, n, 80)
        hp = plan_verify(host, trees, w)
        out_d, sc_d = tree_verify(dev, w, inp, dp, attention="torch")
        out_h, sc_h = tree_verify(host, w, inp.select(torch.arange(trees.total_nodes)), hp, attention="torch")
        assert float((out_d[:trees.total_nodes] - out_h).abs().max()) < 1e-12
        paths = _paths(rng, trees)
        cp = plan_commit(host, w, hp, paths)
        apply_commit(host, sc_h, cp, impl="torch")
        host.lens[:] = cp.new_lens
        dcp = plan_commit_device(dev, w, dp, _last(paths))
        apply_commit(dev, sc_d, dcp)
        lens = dcp.new_lens
        _eq(lens, host.lens, "lens")
        assert all(v < 1e-12 for v in _cache_diff(host, dev).values())


@pytest.mark.parametrize("kind", KINDS)
def test_device_builders_make_the_same_calls_at_any_batch_and_never_read_the_device(kind):
    """No Python loop over nodes or sequences: the torch calls of the builders do not depend on
    the batch, the trees or the lengths (same max_nodes), and none of them reads a value back."""
    cfg, counts = CFGS["tiny"], []
    for seed, B in ((0, 1), (1, 5)):
        rng = np.random.default_rng(seed)
        w = random_layer_weights(cfg, kind, seed)
        trees = TreeBatch(tuple(_tree(rng, int(rng.integers(1, 9))) for _ in range(B)))
        cache = V4Cache.random(cfg, w, B, 0, 60, dtype=torch.float32, seed=seed)
        parents, cu = tree_tensors(trees, B * 8)
        lens = torch.as_tensor(rng.integers(0, 50, B))
        plan_verify_device(cache, w, parents, cu, lens, 8, 50)   # pool row tables: built once per device
        with TorchCalls() as calls:
            dp = plan_verify_device(cache, w, parents, cu, lens, 8, 50)
            plan_commit_device(cache, w, dp, torch.zeros(B, dtype=torch.int64))
        assert not calls.host_reads(), calls.host_reads()
        counts.append(calls.names)
    assert counts[0] == counts[1]


def test_bad_inputs_raise_one_line_errors():
    cfg = CFGS["tiny"]
    w = random_layer_weights(cfg, "csa", 0)
    cache = V4Cache(cfg, w, 2, 30, dtype=torch.float32)
    par, cu, lens = torch.tensor([-1, 0, -1, 0, 1]), torch.tensor([0, 2, 5]), torch.tensor([3, 9])
    bad = [((par, cu, lens, 2), "node rows"),                                     # 5 rows > 2 x 2
           ((par, cu, lens.int(), 4), "lens must be int64"),
           ((par, cu[:2], lens, 4), "cu_nodes must be int64 \\[3\\]"),
           ((par, cu, lens, 4, 30), "max_context"),
           ((par, torch.tensor([0, 2, 6]), lens, 4), "cu_nodes must rise"),
           ((par, torch.tensor([0, 1, 5]), lens, 3), "more than max_nodes"),
           ((torch.tensor([-1, 0, -1, 2, 1]), cu, lens, 4), "tree 1 node 1 has parent 2"),
           ((par, cu, torch.tensor([3, 28]), 4, 29), "past the cache capacity"),
           ((par, cu, torch.tensor([3, 29]), 4, 28), "cache lengths must lie in")]
    for args, text in bad:
        with pytest.raises(SimtreeError, match=text) as err:
            plan_verify_device(cache, w, *args, validate=True)
        assert "\n" not in str(err.value)
    dp = plan_verify_device(cache, w, par, cu, lens, 4, validate=True)
    for acc, text in ((torch.tensor([0, 3]), "accepted node 3 of sequence 1"), (torch.tensor([0]), "int64 \\[2\\]")):
        with pytest.raises(SimtreeError, match=text):
            plan_commit_device(cache, w, dp, acc, validate=True)
    hp = plan_verify(cache, TreeBatch((DraftTree.chain(2), DraftTree.chain(3))), w)
    with pytest.raises(SimtreeError, match="plan_verify_device"):
        plan_commit_device(cache, w, hp, torch.tensor([0, 0]))
    with pytest.raises(SimtreeError, match="plan_commit_device"):
        plan_commit(cache, w, dp, [[0], [0]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("size", ["tiny", "flash"])
@pytest.mark.parametrize("kind", KINDS)
def test_plan_verify_commit_replay_in_one_cuda_graph(kind, size):
    """Plan + verify + commit captured once in a CUDA graph, replayed with new trees, lengths,
    inputs and accepted nodes copied into its static inputs: outputs, new lengths and caches
    equal an eager round on a twin cache bit for bit (the eager round under sync_debug_mode
    "error": it never waits for the device)."""
    dev, B, n, max_context = "cuda", 4, 8, 300
    cfg = CFGS["tiny"] if size == "tiny" else V4AttnConfig.flash(window=128, topk=64, page_size=64)
    w = random_layer_weights(cfg, kind, 0, torch.float32, dev)
    graph_cache, eager_cache = (V4Cache.random(cfg, w, B, 0, max_context + n + 1, device=dev, seed=0)
                                for _ in range(2))
    rows, gen, rng = B * n, torch.Generator(device=dev).manual_seed(0), np.random.default_rng(0)
    parents = torch.full((rows,), -1, dtype=torch.int64, device=dev)
    cu = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    lens, acc = (torch.zeros(B, dtype=torch.int64, device=dev) for _ in range(2))
    inp = random_inputs(cfg, rows, gen, torch.float32, dev)
    inp = V4Inputs(inp.q.bfloat16(), inp.kv.bfloat16(), inp.x.bfloat16(), inp.iq.bfloat16(), inp.iw)

    def new_round():
        trees = TreeBatch(tuple(random_tree(int(rng.integers(1, n + 1)), rng) for _ in range(B)))
        for static, new in zip((parents, cu), tree_tensors(trees, rows, dev)):
            static.copy_(new)
        lens.copy_(torch.as_tensor(rng.integers(0, max_context + 1, B)))
        acc.copy_(torch.as_tensor([int(rng.integers(-1, t.num_nodes)) for t in trees.trees]))
        fresh = random_inputs(cfg, rows, gen, torch.float32, dev)
        for k in ("q", "kv", "x", "iq", "iw"):
            getattr(inp, k).copy_(getattr(fresh, k))

    def verify_round(cache):
        plan = plan_verify_device(cache, w, parents, cu, lens, n, max_context)
        out, scratch = tree_verify(cache, w, inp, plan)
        cp = plan_commit_device(cache, w, plan, acc)
        apply_commit(cache, scratch, cp)
        return out, cp.new_lens

    new_round()
    saved = [t.clone() for t in graph_cache.persistent_tensors().values()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up: Triton compiles, the pools' row tables upload
        verify_round(graph_cache)
        plan_verify_device(eager_cache, w, parents, cu, lens, n, max_context)
    torch.cuda.current_stream().wait_stream(side)
    for t, s in zip(graph_cache.persistent_tensors().values(), saved):
        t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lens_g = verify_round(graph_cache)
    for _ in range(4):
        new_round()
        graph.replay()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out_e, lens_e = verify_round(eager_cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(out_g, out_e) and torch.equal(lens_g, lens_e)
        for name, t in graph_cache.persistent_tensors().items():
            assert torch.equal(t, eager_cache.persistent_tensors()[name]), name
