"""GDN tree verify + commit: Triton (interpreter) vs float64 references on random trees."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from simtree.errors import SimtreeError
from simtree.kernels.gdn import (gdn_accepted_paths_ref, gdn_tree_commit, gdn_tree_verify,
                                 gdn_tree_verify_dense_ref, gdn_tree_verify_recurrent,
                                 gdn_tree_verify_ref, tree_meta)
from simtree.kernels.gdn._launch import (CommitLaunch, LaunchNotApplicable, VerifyLaunch,
                                         verify_launch_config)
from simtree.kernels.gdn._launched import launched_commit, launched_verify
from simtree.kernels.gdn import _launch as gdn_launch
from simtree.kernels.gdn._bits import _popcount64, _select_bit64
from simtree.trees.tree import DraftTree, TreeBatch

H, HV, K, V = 2, 4, 16, 32
KEYS = ("q", "k", "v", "g", "beta", "state")
TORCH, COMMIT_TRITON = VerifyLaunch(backend="torch"), CommitLaunch(backend="triton")


def on_triton(**switches) -> VerifyLaunch:
    """The Triton kernels (through the interpreter here) at the rule's launch but ``switches``."""
    return VerifyLaunch(backend="triton", **switches)


def random_tree(n: int, rng: np.random.Generator, reach: int = 4) -> DraftTree:
    """Random branching: each node's parent is one of the `reach` nodes before it."""
    return DraftTree([-1] + [int(rng.integers(max(0, i - reach), i)) for i in range(1, n)])


def make_inputs(trees, seed: int, dtype=torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tb = TreeBatch(trees)
    md = tb.to_torch()
    N, B = tb.total_nodes, tb.batch_size
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=rnd(N, H, K).to(dtype), k=rnd(N, H, K).to(dtype), v=rnd(N, HV, V).to(dtype),
                g=-torch.rand(N, HV, generator=gen) * 0.5, beta=torch.rand(N, HV, generator=gen),
                state=rnd(B, HV, K, V) * 0.3, parents=md["parents"], cu_nodes=md["cu_nodes"], tb=tb)


def f64(inp):
    return [inp[k].double() for k in KEYS]


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_matches_both_references_fp32(seed):
    rng = np.random.default_rng(seed)
    trees = [random_tree(int(n), rng) for n in rng.integers(1, 30, size=3)]
    inp = make_inputs(trees, seed)
    tree = (inp["parents"], inp["cu_nodes"])
    ref_a = gdn_tree_verify_ref(*f64(inp), *tree)
    ref_b = gdn_tree_verify_dense_ref(*f64(inp), *tree)
    out, _ = launched_verify(*(inp[k] for k in KEYS), *tree, launch=on_triton())
    assert rel_err(ref_b, ref_a) < 1e-12
    assert rel_err(out, ref_a) < 1e-4


def test_triton_bf16_inputs():
    # the reference sees the same bf16-rounded q/k/v (upcast to fp64); the kernel keeps u, G,
    # the solve and accumulators in fp32 and rounds only the output to bf16 (2^-8 ~ 4e-3
    # relative), so 2e-2 leaves room for tf32 dots and the bf16 operands of the dots on earlier
    # sub-chunks' u on the GPU (measured there: <= 5.7e-3, reports/h200/gdn) without hiding real
    # bugs.
    rng = np.random.default_rng(2)
    inp = make_inputs([random_tree(20, rng), random_tree(9, rng)], 2, dtype=torch.bfloat16)
    out, _ = launched_verify(*(inp[k] for k in KEYS), inp["parents"], inp["cu_nodes"],
                             launch=on_triton())
    assert out.dtype == torch.bfloat16
    assert rel_err(out, gdn_tree_verify_ref(*f64(inp), inp["parents"], inp["cu_nodes"])) < 2e-2


@pytest.mark.parametrize("block_t", [None, 16, 32, 64])   # default (32 here), and the others
def test_trees_larger_than_one_chunk(block_t):
    # 150-node branching tree and a 130-deep chain: ancestor-masked off-diagonal blocks, deep paths
    rng = np.random.default_rng(3)
    inp = make_inputs([random_tree(150, rng, reach=8), DraftTree.chain(130)], 3)
    tree = (inp["parents"], inp["cu_nodes"])
    out, _ = launched_verify(*(inp[k] for k in KEYS), *tree, launch=on_triton(block_t=block_t))
    assert rel_err(out, gdn_tree_verify_dense_ref(*f64(inp), *tree)) < 1e-4


def test_verify_does_not_touch_state():
    rng = np.random.default_rng(4)
    inp = make_inputs([random_tree(12, rng)], 4)
    before = inp["state"].clone()
    launched_verify(*(inp[k] for k in KEYS), inp["parents"], inp["cu_nodes"], launch=on_triton())
    assert torch.equal(inp["state"], before)


def test_torch_backend_matches_reference():
    rng = np.random.default_rng(5)
    inp = make_inputs([random_tree(17, rng), random_tree(3, rng)], 5)
    tree = (inp["parents"], inp["cu_nodes"])
    out, _ = launched_verify(*(inp[k] for k in KEYS), *tree, launch=TORCH)
    assert rel_err(out, gdn_tree_verify_ref(*f64(inp), *tree)) < 1e-4


def sequential_commit(inp, trees, accepted):
    """Ground truth: decode each tree's accepted root path token by token in float64."""
    return gdn_accepted_paths_ref(*f64(inp), trees, inp["cu_nodes"], accepted)


@pytest.mark.parametrize("backend,block_t,path,block_v", [
    ("triton", 16, 0, None), ("triton", 32, 0, None), ("triton", 64, 0, 16), ("torch", 16, 0, None),
    ("triton", 16, 1, None), ("triton", 32, 1, 16), ("triton", 64, 1, None)])
def test_commit_equals_sequential_decode_of_accepted_path(backend, block_t, path, block_v):
    # walked in stored order or gathered along the path (path = 1: up to block_t path nodes of
    # one 64-node word per product; the 150-node chain puts 64 path nodes in a word)
    rng = np.random.default_rng(6)
    trees = [random_tree(int(n), rng) for n in (25, 1, 70)] + [DraftTree(list(range(-1, 149)))]
    inp = make_inputs(trees, 6)
    tree = (inp["parents"], inp["cu_nodes"])
    _, cache = launched_verify(*(inp[k] for k in KEYS), *tree, launch=VerifyLaunch(backend=backend))
    accepted = torch.tensor([int(rng.integers(0, t.num_nodes)) for t in trees])
    accepted[2] = 69 if trees[2].depth[69] > 0 else accepted[2]   # a node in the second chunk
    accepted[3] = int(rng.integers(130, 150))                      # a path through three words
    S = inp["state"].clone()
    launched_commit(S, inp["k"], cache, *tree, accepted, launch=CommitLaunch(
        backend=backend, block_t=block_t, path=path, block_v=block_v))
    assert rel_err(S, sequential_commit(inp, trees, accepted)) < 1e-4


def test_root_only_commit_leaves_other_sequences_alone():
    rng = np.random.default_rng(7)
    trees = [random_tree(10, rng), random_tree(10, rng)]
    inp = make_inputs(trees, 7)
    tree = (inp["parents"], inp["cu_nodes"])
    _, cache = launched_verify(*(inp[k] for k in KEYS), *tree, launch=on_triton())
    accepted = torch.tensor([0, 7])
    S = inp["state"].clone()
    launched_commit(S, inp["k"], cache, *tree, accepted, launch=COMMIT_TRITON)
    want = sequential_commit(inp, trees, accepted)
    assert rel_err(S[0], want[0]) < 1e-4                  # only the root token folded in
    assert rel_err(S[1], want[1]) < 1e-4                  # the other sequence: its own path
    solo = make_inputs([trees[1]], 7)                     # same tree alone gives the same state
    for k in KEYS[:5]:
        solo[k] = inp[k][10:]
    solo["state"] = inp["state"][1:].clone()
    _, c1 = launched_verify(*(solo[k] for k in KEYS), solo["parents"], solo["cu_nodes"],
                            launch=on_triton())
    launched_commit(solo["state"], solo["k"], c1, solo["parents"], solo["cu_nodes"], accepted[1:],
                    launch=COMMIT_TRITON)
    assert torch.allclose(solo["state"][0], S[1], rtol=0, atol=1e-6)


def test_inverse_is_exactly_zero_across_branches():
    rng = np.random.default_rng(8)
    t = random_tree(24, rng)
    inp = make_inputs([t], 8)
    _, aux = gdn_tree_verify_dense_ref(*f64(inp), inp["parents"], inp["cu_nodes"], return_aux=True)
    inv = aux["inverse"][0]                               # [HV, n, n]
    unrelated = torch.as_tensor(~t.ancestor_mask)         # m not an ancestor-or-self of j
    assert unrelated.any()
    assert torch.all(inv[:, unrelated] == 0)
    diag = torch.diagonal(inv, dim1=-2, dim2=-1)
    assert torch.allclose(diag, torch.ones_like(diag))   # unit lower triangular


def test_recurrent_baseline_matches_reference():
    rng = np.random.default_rng(9)
    inp = make_inputs([random_tree(9, rng), random_tree(5, rng)], 9)
    tree = (inp["parents"], inp["cu_nodes"])
    out, states = gdn_tree_verify_recurrent(*(inp[k] for k in KEYS), *tree)
    ref, ref_states = gdn_tree_verify_ref(*f64(inp), *tree, return_states=True)
    assert rel_err(out, ref) < 1e-4
    assert rel_err(states, ref_states) < 1e-4


def test_tree_meta_matches_tree_batch():
    rng = np.random.default_rng(10)
    tb = TreeBatch([random_tree(int(n), rng, reach=6) for n in (1, 65, 130, 7)])
    md = tb.to_torch()
    meta = tree_meta(md["parents"], md["cu_nodes"])
    assert torch.equal(meta.bits, md["ancestor_bits"])
    assert torch.equal(meta.depth, md["depth"])


@pytest.mark.parametrize("seed", range(6))
def test_host_built_meta_equals_the_device_built_one(seed):
    # tree_meta_host (numpy, one copy) gives the tables tree_meta and subchunk_pairs give,
    # bit for bit, on ragged random batches (one-node trees, trees past 64 and 128 nodes,
    # max_nodes given larger than the largest tree: wider words), for every sub-chunk size
    from simtree.kernels.gdn import tree_meta_host
    rng = np.random.default_rng(70 + seed)
    sizes = [int(n) for n in rng.integers(1, 150, size=int(rng.integers(1, 6)))]
    sizes[0] = 1 if seed % 2 else sizes[0]
    tb = TreeBatch([random_tree(n, rng, reach=int(rng.integers(1, 9))) for n in sizes])
    md = tb.to_torch()
    max_nodes = tb.max_nodes + (70 if seed == 3 else 0)
    ref = tree_meta(md["parents"], md["cu_nodes"], max_nodes=max_nodes, validate=False)
    host = tree_meta_host(tb.parents, tb.cu_nodes, max_nodes, pair_blocks=(16, 32, 64))
    for f in ("bits", "depth", "anc", "seq_ids"):
        assert torch.equal(getattr(ref, f), getattr(host, f)), f
    assert host.max_nodes == ref.max_nodes and host.bits.dtype == torch.int64
    for bt in (16, 32, 64):
        want, got = ref.subchunk_pairs(md["cu_nodes"], bt), host.subchunk_pairs(md["cu_nodes"], bt)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]) and want[2] == got[2]


def test_host_round_meta_holds_the_default_launch_tables():
    # verify_round_meta_host holds the walk tables the default launch reads, the heavy-first
    # walk too where that launch takes it (13 sequences x 4 value heads of 65-100 nodes),
    # equal to the device-built verify_round_meta's; and the verify on it equals the reference
    from simtree.kernels.gdn import verify_round_meta, verify_round_meta_host, walk_tables
    rng = np.random.default_rng(78)
    tb = TreeBatch([random_tree(int(n), rng, reach=4) for n in rng.integers(65, 101, size=13)])
    md = tb.to_torch()
    cfg = verify_launch_config(13, HV, V, "cpu", tb.max_nodes)
    assert cfg.heavy_first
    host = verify_round_meta_host(tb.parents, tb.cu_nodes, tb.max_nodes, HV, V)
    dev = verify_round_meta(md["parents"], md["cu_nodes"], tb.max_nodes, HV, V)
    assert ("heavy_first",) in host._derived
    (o1, w1, p1), (o2, w2, p2) = (walk_tables(m, md["cu_nodes"], 16) for m in (host, dev))
    assert torch.equal(o1, o2) and torch.equal(w1.bits, w2.bits)
    assert torch.equal(p1[0], p2[0]) and torch.equal(p1[1], p2[1]) and p1[2] == p2[2]
    rng = np.random.default_rng(77)
    trees = [random_tree(n, rng, reach=5) for n in (90, 3, 70)]
    inp = make_inputs(trees, 77)
    tb = inp["tb"]
    meta = verify_round_meta_host(tb.parents, tb.cu_nodes, tb.max_nodes, HV, V)
    cfg = verify_launch_config(3, HV, V, "cpu", tb.max_nodes)
    key = ("heavy_first",) if cfg.heavy_first else ("pairs", cfg.block_t)
    assert key in meta._derived
    out, _ = launched_verify(*(inp[k] for k in KEYS), inp["parents"], inp["cu_nodes"],
                             meta=meta, check=False, launch=on_triton())
    assert rel_err(out, gdn_tree_verify_dense_ref(*f64(inp), inp["parents"], inp["cu_nodes"])) < 1e-4


def _bad(fn):
    with pytest.raises(SimtreeError) as exc:
        fn()
    assert "\n" not in str(exc.value) and str(exc.value)
    return str(exc.value)


def test_bad_inputs_give_one_line_errors():
    rng = np.random.default_rng(11)
    inp = make_inputs([random_tree(6, rng)], 11)
    args = [inp[k] for k in KEYS]
    tree = (inp["parents"], inp["cu_nodes"])
    assert "shape" in _bad(lambda: gdn_tree_verify(args[0][:5], *args[1:], *tree))
    assert "multiple" in _bad(lambda: gdn_tree_verify(
        torch.randn(6, 3, K), torch.randn(6, 3, K), *args[2:], *tree))
    assert "parent" in _bad(lambda: gdn_tree_verify(*args, torch.tensor([-1, 0, 5, 1, 2, 3]), tree[1]))
    assert "parent" in _bad(lambda: gdn_tree_verify(*args, torch.tensor([0, 0, 1, 1, 2, 3]), tree[1]))
    assert "state" in _bad(lambda: gdn_tree_verify(*args[:5], args[5][:, :2], *tree))
    g_nan = args[3].clone()
    g_nan[0, 0] = float("nan")
    assert "NaN" in _bad(lambda: gdn_tree_verify(*args[:3], g_nan, *args[4:], *tree))
    _, cache = launched_verify(*args, *tree, launch=TORCH)
    assert "accepted" in _bad(lambda: gdn_tree_commit(inp["state"], inp["k"], cache, *tree, torch.tensor([6])))
    assert "block_t" in _bad(lambda: launched_commit(inp["state"], inp["k"], cache, *tree,
                                                     torch.tensor([5]),
                                                     launch=CommitLaunch(block_t=48)))
    # the K-side kernel's launch switches: warps and value heads per program
    assert "kside" in _bad(lambda: launched_verify(*args, *tree, launch=on_triton(kside=3)))
    assert "kside_heads" in _bad(lambda: launched_verify(*args, *tree,
                                                         launch=on_triton(kside=1, kside_heads=3)))
    assert "backend" in _bad(lambda: VerifyLaunch(backend="cuda"))
    assert "VerifyLaunch" in _bad(lambda: launched_verify(*args, *tree, launch=dict(kside=1)))


def test_strong_decay_does_not_overflow():
    # g = -30 per token: G differs by hundreds between branches; exp must only see ancestors
    rng = np.random.default_rng(12)
    trees = [random_tree(12, rng)]
    inp = make_inputs(trees, 12)
    inp["g"] = inp["g"] * 60.0
    tree = (inp["parents"], inp["cu_nodes"])
    ref = gdn_tree_verify_ref(*f64(inp), *tree)
    for backend in ("torch", "triton"):
        out, _ = launched_verify(*(inp[k] for k in KEYS), *tree,
                                 launch=VerifyLaunch(backend=backend))
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-4



def _needed_pairs(tree: DraftTree, bt: int) -> list[list[int]]:
    """Brute force: for each sub-chunk c, the c2 < c holding an ancestor of some row of c."""
    m = np.asarray(tree.ancestor_mask)                     # [j, m]: m ancestor-or-self of j
    c_n = (tree.num_nodes + bt - 1) // bt
    return [[c2 for c2 in range(c) if m[c * bt:(c + 1) * bt, c2 * bt:(c2 + 1) * bt].any()]
            for c in range(c_n)]


@pytest.mark.parametrize("bt", [16, 32, 64])
def test_subchunk_pairs_list_exactly_the_pairs_with_ancestors(bt):
    rng = np.random.default_rng(14)
    trees = [random_tree(150, rng, reach=40), DraftTree([-1] + [0] * 99), DraftTree.chain(70),
             random_tree(5, rng)]
    md = TreeBatch(trees).to_torch()
    meta = tree_meta(md["parents"], md["cu_nodes"])
    pairs, counts, nc = meta.subchunk_pairs(md["cu_nodes"], bt)
    assert nc == (150 + bt - 1) // bt and tuple(pairs.shape) == (4, nc, nc)
    for b, t in enumerate(trees):
        want = _needed_pairs(t, bt)
        for c in range(nc):
            got = pairs[b, c, :counts[b, c]].tolist()
            assert got == (want[c] if c < len(want) else []), (b, c)


def test_skipped_subchunk_pairs_match_dense_reference():
    # wide shallow tree (root + 8 children + grandchildren: sub-chunks past the first hold no
    # ancestors of each other, so the kernel skips most pairs) next to a deep chain (keeps all)
    wide = DraftTree([-1] + [0] * 8 + [1 + i % 8 for i in range(87)])
    chain = DraftTree.chain(70)
    assert sum(map(len, _needed_pairs(wide, 16))) == 5      # of 15 pairs c2 < c
    assert sum(map(len, _needed_pairs(chain, 16))) == 10    # all 10
    inp = make_inputs([wide, chain], 13)
    tree = (inp["parents"], inp["cu_nodes"])
    out, cache = launched_verify(*(inp[k] for k in KEYS), *tree, launch=on_triton())
    assert rel_err(out, gdn_tree_verify_dense_ref(*f64(inp), *tree)) < 1e-4
    accepted = torch.tensor([95, 69])          # a leaf of the last sub-chunk; the chain's end
    S = inp["state"].clone()
    launched_commit(S, inp["k"], cache, *tree, accepted, launch=COMMIT_TRITON)
    assert rel_err(S, sequential_commit(inp, [wide, chain], accepted)) < 1e-4


def test_every_default_launch_is_correct():
    # the launch rule picks sub-chunk / V block / warps / kernel switches by (batch x value
    # heads, tree size); whatever it picks at Qwen-like head counts must compute the same outputs
    # (for trees stored breadth-first and, with its own rule, stored depth-first)
    rng = np.random.default_rng(15)
    trees = [random_tree(int(n), rng, reach=5) for n in (70, 33, 5)]
    seen = set()
    for depth_first in (False, True):
        batch = [t.depth_first() for t in trees] if depth_first else trees
        inp = make_inputs(batch, 15)
        tree = (inp["parents"], inp["cu_nodes"])
        ref = gdn_tree_verify_dense_ref(*f64(inp), *tree)
        meta = tree_meta(*tree, depth_first=depth_first)
        assert meta.depth_first == depth_first
        for B in (1, 4, 16, 64):
            for max_nodes in (4, 16, 32, 64, 128):
                cfg = verify_launch_config(B, 48, V, "cuda", max_nodes, depth_first)
                key = (depth_first,) + tuple(sorted(   # register caps: same arithmetic
                    (k, v) for k, v in cfg.switches().items()
                    if k not in ("max_registers", "kside_registers")))
                if key in seen:
                    continue
                seen.add(key)
                # the CUDA walk and K-side kernel where the rule takes them run on a GPU
                # only: left to the default there, so the launch falls back to the Triton
                # kernels as it does wherever the CUDA ones cannot run
                launch = replace(cfg, cuda_walk=None, walk_kside=None, kside_cuda=None,
                                 l2_prefetch=None)
                out, _ = launched_verify(*(inp[k] for k in KEYS), *tree, meta=meta,
                                         launch=launch)
                assert rel_err(out, ref) < 1e-4, cfg
    assert len(seen) >= 6


def test_kside_register_cap_where_measured(monkeypatch):
    # the K-side kernel is capped at 128 registers only where its programs (sub-chunks x
    # sequences x key heads) are more than the 12 per SM its 158 registers allow and at most
    # the 16 the cap allows (132 SMs where no GPU is visible): measured faster at 16 sequences
    # of 128 nodes (tuning runs 73-76), slower where they fit either way (b16 n64) or not at all
    # (b64 n128); never without the K-side kernel
    monkeypatch.setattr(gdn_launch, "sm_count", lambda device: 132)   # the H200's, on any machine
    rule = lambda b, n, H=None: verify_launch_config(b, 48, 128, "cuda", n, True, H)  # noqa: E731
    for b, n in ((16, 128), (16, 100), (13, 128)):          # 2048, 1792, 1664 programs
        assert rule(b, n).kside and rule(b, n).kside_registers == 128, (b, n)
    for b, n in ((16, 96), (8, 128), (12, 128), (16, 64), (64, 128), (64, 64), (4, 128),
                 (1, 128), (16, 32)):
        assert rule(b, n).kside_registers == 0, (b, n)
    assert rule(16, 128, H=16).kside_registers == 128 and rule(16, 128, H=8).kside_registers == 0
    monkeypatch.setattr(gdn_launch, "sm_count", lambda device: 108)   # fewer SMs: 2048 do not fit at 16
    assert rule(16, 128).kside_registers == 0 and rule(13, 128).kside_registers == 128


@pytest.mark.parametrize("depth_first", [False, True])
def test_transposed_walk_where_measured(depth_first, monkeypatch):
    # the transposed walk at more than 16 sequences of more than 32 nodes (faster at 64
    # sequences of 64 and 128 nodes, slower at 64 of 32 and at 16 sequences: runs 78-80), and
    # at two warps for 65-256 nodes where its programs fit in one wave and the untransposed
    # walk's do not (3-5 rows per SM: runs 86-87, 132 SMs); only where the rule launches the
    # K-side kernel and the pre-normalised rows it walks on
    monkeypatch.setattr(gdn_launch, "sm_count", lambda device: 132)
    rule = lambda b, n, hv=48: verify_launch_config(b, hv, 128, "cuda", n, depth_first, 16)  # noqa: E731
    for b, n, hv in ((64, 64, 48), (64, 128, 48), (17, 33, 48), (64, 256, 48), (25, 33, 32),
                     (9, 65, 48), (13, 128, 48), (13, 256, 48), (16, 96, 32), (20, 128, 32)):
        cfg = rule(b, n, hv)
        assert cfg.transposed == 1 and cfg.kside and cfg.prenorm, (b, n, hv)
        assert cfg.num_warps == 2, (b, n, hv)
    for b, n, hv in ((64, 32, 48), (16, 128, 48), (16, 64, 48), (4, 128, 48), (1, 128, 48),
                     (64, 16, 48), (17, 32, 48), (64, 257, 48), (8, 128, 48), (13, 64, 48),
                     (14, 128, 48), (12, 128, 32), (22, 128, 32), (24, 128, 32),
                     (13, 257, 48)):   # above 256 nodes there is no K-side kernel
        cfg = rule(b, n, hv)
        assert cfg.transposed == 0, (b, n, hv)
        assert cfg.num_warps == (2 if b * hv > 16 * 48 else 4), (b, n, hv)
    monkeypatch.setattr(gdn_launch, "sm_count", lambda device: 108)   # fewer SMs: 3-5 per SM shift
    assert rule(8, 128).transposed == 1 and rule(12, 128).transposed == 0



def test_fp32_inputs_take_eight_warps_untransposed(monkeypatch):
    # fp32 / fp64 inputs (exact fp32 dots): the untransposed walk at eight warps beyond 4
    # sequences' rows (run 88: two-warp fp32 walks spill, 15-19x slower at 64 sequences);
    # the bf16 rule elsewhere, and gdn_tree_verify asks for it by its inputs' dtype
    monkeypatch.setattr(gdn_launch, "sm_count", lambda device: 132)
    rule = lambda b, n, ieee: verify_launch_config(b, 48, 128, "cuda", n, True, 16, ieee=ieee)  # noqa: E731
    for b, n in ((64, 16), (64, 128), (12, 128), (16, 64), (5, 32)):
        bf16, fp32 = rule(b, n, False), rule(b, n, True)
        assert fp32.num_warps == 8 and fp32.transposed == 0 and fp32.cuda_walk == 0, (b, n)
        assert fp32.kside_cuda == 0, (b, n)   # the CUDA kernels take bf16 only
        walk = dict(num_warps=None, transposed=None, cuda_walk=None, kside_cuda=None,
                    l2_prefetch=None)
        assert replace(fp32, **walk) == replace(bf16, **walk), (b, n)
    for b, n in ((4, 128), (1, 64)):
        assert rule(b, n, True) == rule(b, n, False), (b, n)
    seen = []
    real = gdn_launch.verify_launch_config
    monkeypatch.setattr(gdn_launch, "verify_launch_config",
                        lambda *a, **kw: seen.append(kw.get("ieee")) or real(*a, **kw))
    rng, sizes, trees, inp, tree = random_batch(130, 2)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        launched_verify(*(inp[k].to(dtype) if inp[k].is_floating_point() else inp[k] for k in KEYS),
                        *tree, launch=on_triton())
    assert seen == [True, False, True]


def test_rule_transposed_walk_gives_way_to_explicit_switches(monkeypatch, spy_kernel):
    # where the rule takes the transposed walk but the caller turns off the K-side kernel or
    # the pre-normalised rows it walks on, the launch falls back to the untransposed walk
    # (same results as the reference); asking for it explicitly there is an error
    real = gdn_launch.verify_launch_config
    monkeypatch.setattr(gdn_launch, "verify_launch_config",
                        lambda *a, **kw: replace(real(*a, **kw), kside=1, transposed=1))
    rng, sizes, trees, inp, tree = random_batch(130, 3)
    walks = []
    for name in ("_tree_verify_kernel", "_tree_verify_t_kernel"):
        spy_kernel(name, lambda grid, kw, name=name: walks.append(name))
    run = lambda **kw: launched_verify(*(inp[k] for k in KEYS), *tree, launch=on_triton(**kw))  # noqa: E731
    ref = gdn_tree_verify_dense_ref(*f64(inp), *tree)
    for off in (dict(prenorm=0), dict(kside=0), dict(g_prologue=0)):
        assert rel_err(run(**off)[0], ref) < 1e-4, off
    assert walks == ["_tree_verify_kernel"] * 3
    assert rel_err(run()[0], ref) < 1e-4 and walks[-1] == "_tree_verify_t_kernel"
    for bad in (dict(prenorm=0), dict(kside=0)):   # asked for explicitly there: an error
        with pytest.raises(LaunchNotApplicable, match="transposed walks the K-side kernel's tiles"):
            run(transposed=1, **bad)


@pytest.fixture
def spy_kernel(monkeypatch):
    """spy_kernel(name, on_launch): for the rest of the test every launch of the Triton kernel
    ``tree_verify.<name>`` first calls on_launch(grid, kwargs), which may edit the kwargs."""
    from simtree.kernels.gdn import _tree_kernels as tree_verify

    def spy(name, on_launch):
        kernel = getattr(tree_verify, name)

        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    on_launch(grid, kw)
                    return kernel[grid](*args, **kw)
                return launch
        monkeypatch.setattr(tree_verify, name, Spy())
    return spy


def test_kside_register_cap_reaches_only_the_kside_launch(monkeypatch, spy_kernel):
    # kside_registers caps the K-side kernel's launch (max_registers the verify's); under the
    # interpreter no cap is passed, so the launches are recorded with caps forced on
    caps = {}
    monkeypatch.setattr(gdn_launch, "register_cap", lambda n: {"maxnreg": n} if n else {})
    for name in ("_tree_kside_kernel", "_tree_verify_kernel"):
        spy_kernel(name, lambda grid, kw, name=name: caps.__setitem__(name, kw.pop("maxnreg", 0)))
    rng = np.random.default_rng(21)
    trees = [random_tree(n, rng, reach=4) for n in (40, 23)]
    inp = make_inputs(trees, 21)
    tree = (inp["parents"], inp["cu_nodes"])
    out, _ = launched_verify(*(inp[k] for k in KEYS), *tree,
                             launch=on_triton(kside=1, kside_registers=128, max_registers=200))
    assert caps == {"_tree_kside_kernel": 128, "_tree_verify_kernel": 200}
    assert rel_err(out, gdn_tree_verify_dense_ref(*f64(inp), *tree)) < 1e-4


@pytest.fixture
def launched(spy_kernel):
    """The keyword arguments (constexprs) of every tree-kernel launch during the test."""
    calls = []
    spy_kernel("_tree_verify_kernel", lambda grid, kw: calls.append(kw))
    return calls


@pytest.mark.parametrize("g_prologue,prefetch,block_t,big,heavy,prenorm,g_pass,kside",
                         [(0, 0, 16, 300, 1, 1, 1, 0), (1, 0, 16, 120, 0, 0, 0, 0),
                          (0, 1, 32, 120, 1, 0, 1, 0), (1, 1, 16, 300, 0, 1, 1, 2),
                          (1, 1, 16, 120, 1, 1, 0, 0), (1, 0, 32, 300, 1, 0, 0, 0),
                          (0, 1, 32, 120, 0, 1, 0, 0), (1, 0, 32, 120, 0, 1, 1, 0),
                          (1, 0, 16, 120, 1, 0, 1, 0), (1, 1, 32, 120, 0, 0, 1, 0),
                          (1, 0, 16, 200, 1, 1, 1, 0), (1, 0, 16, 200, 1, 1, 0, 2),
                          (1, 1, 16, 120, 0, 0, 0, 1), (1, 0, 32, 120, 1, 1, 1, 4),
                          (0, 0, 16, 120, 0, 1, 0, 2), (1, 0, 64, 120, 0, 1, 1, 4)])
def test_kernel_switches_keep_the_result(launched, g_prologue, prefetch, block_t, big, heavy,
                                         prenorm, g_pass, kside):
    # G summed per sub-chunk or in one prologue (asked for, and the largest tree at most
    # G_PROLOGUE_MAX_NODES = 256 nodes: a 300-node tree falls back) - in the verify or by the
    # pre-pass kernel before it (g_pass, with or without its q/k rows) - rows loaded in place
    # or one sub-chunk ahead, nodes walked as stored or depth-first, q/k normalised in the
    # kernel or once before it, the V-free products in the walk or by a kernel before it
    # (kside, which needs every node's G first: off without the prologue, g_pass forced on
    # with it): the launch gets the path asked for, and every path gives the same outputs and the
    # same cache (stored order) for the commit
    from simtree.kernels.gdn._launch import G_PROLOGUE_MAX_NODES
    rng = np.random.default_rng(16)
    sizes = (40, big, 1, 17)
    trees = [random_tree(n, rng, reach=6) for n in sizes]
    inp = make_inputs(trees, 16)
    tree = (inp["parents"], inp["cu_nodes"])
    out, cache = launched_verify(*(inp[k] for k in KEYS), *tree, launch=on_triton(
        block_t=block_t, g_prologue=g_prologue, prefetch=prefetch, heavy_first=heavy,
        prenorm=prenorm, g_pass=g_pass, kside=kside, kside_heads=kside % 2))
    prologue = bool(g_prologue) and big <= G_PROLOGUE_MAX_NODES
    assert len(launched) == 1 and launched[0]["PREFETCH"] == bool(prefetch)
    assert launched[0]["QK_READY"] == bool(prenorm)
    assert launched[0]["KSIDE"] == (bool(kside) and prologue)
    assert launched[0]["G_READY"] == (bool(g_pass or kside) and prologue)
    assert launched[0]["ORDER"] == bool(heavy)
    assert launched[0]["NT"] == ((128 if big <= 128 else 256) if prologue else 0)
    _, ref_cache = launched_verify(*(inp[k] for k in KEYS), *tree, launch=TORCH)
    assert rel_err(out, gdn_tree_verify_dense_ref(*f64(inp), *tree)) < 1e-4
    assert rel_err(cache.G, ref_cache.G) < 1e-5
    assert rel_err(cache.u, ref_cache.u) < 1e-4
    accepted = torch.tensor([int(rng.integers(0, n)) for n in sizes])
    S = inp["state"].clone()
    launched_commit(S, inp["k"], cache, *tree, accepted, launch=COMMIT_TRITON)
    assert rel_err(S, sequential_commit(inp, trees, accepted)) < 1e-4


@pytest.mark.parametrize("block_v,kside_heads", [(16, 0), (16, 1)])
def test_kside_tiles_serve_every_value_block(block_v, kside_heads):
    # the K-side tiles depend on no V column: every V block of a head reads the same tiles, and
    # the outputs and the commit's cache equal the fused walk's and the reference's
    rng = np.random.default_rng(40 + kside_heads)
    trees = [random_tree(int(n), rng, reach=int(rng.integers(2, 7))) for n in (50, 17, 33)]
    inp = make_inputs(trees, 40 + kside_heads)
    tree = (inp["parents"], inp["cu_nodes"])
    out, cache = launched_verify(*(inp[k] for k in KEYS), *tree,
                                 launch=on_triton(block_v=block_v, kside=1,
                                               kside_heads=kside_heads))
    ref_out, ref_cache = launched_verify(*(inp[k] for k in KEYS), *tree,
                                         launch=on_triton(block_v=block_v, kside=0))
    assert rel_err(out, gdn_tree_verify_dense_ref(*f64(inp), *tree)) < 1e-4
    assert rel_err(out, ref_out) < 1e-5 and rel_err(cache.u, ref_cache.u) < 1e-5
    assert torch.equal(cache.G, ref_cache.G)


def random_batch(seed: int, count: int, max_nodes: int = 90):
    """(rng, sizes, trees, inputs, (parents, cu_nodes)): ``count`` random trees of 1 to
    ``max_nodes`` - 1 nodes, random depth and branching, and random inputs for them."""
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(1, max_nodes, size=count)]
    trees = [random_tree(n, rng, reach=int(rng.integers(2, 7))) for n in sizes]
    inp = make_inputs(trees, seed)
    return rng, sizes, trees, inp, (inp["parents"], inp["cu_nodes"])


@pytest.mark.parametrize("heavy", [0, 1])
def test_early_diagonal_tiles_keep_the_result(launched, heavy):
    # the K-side diagonal tiles loaded at the top of each sub-chunk's step (early, the rule's
    # default with kside) or after its pairs: the launch gets the flag only with the K-side
    # kernel, and both give the same outputs and u, equal to the reference
    rng, sizes, trees, inp, tree = random_batch(80 + heavy, 3)
    run = lambda **kw: launched_verify(*(inp[k] for k in KEYS), *tree,  # noqa: E731
                                       launch=on_triton(block_t=16, heavy_first=heavy, **kw))
    out, cache = run(kside=1, early=1)
    out0, cache0 = run(kside=1, early=0)
    run(kside=0, early=1)
    assert [kw["EARLY"] for kw in launched] == [True, False, False]
    assert rel_err(out, gdn_tree_verify_dense_ref(*f64(inp), *tree)) < 1e-4
    assert rel_err(out, out0) < 1e-6 and rel_err(cache.u, cache0.u) < 1e-6


@pytest.mark.parametrize("heavy,block_v,block_t", [(0, None, 16), (1, None, 16), (0, 16, 16),
                                                  (1, 16, 32), (1, None, 64)])
def test_transposed_walk_keeps_the_result(heavy, block_v, block_t, spy_kernel):
    # the walk with value rows as the products' M dimension (transposed, K-side tiles read
    # transposed): the same outputs and u as the untransposed walk, equal to the reference,
    # and a commit from its cache matches sequential decoding of the accepted paths
    rng, sizes, trees, inp, tree = random_batch(90 + heavy, 4)
    run = lambda **kw: launched_verify(*(inp[k] for k in KEYS), *tree,  # noqa: E731
                                       launch=on_triton(heavy_first=heavy, block_v=block_v,
                                                     block_t=block_t, **kw))
    calls = []
    spy_kernel("_tree_verify_t_kernel", lambda grid, kw: calls.append(grid))
    out, cache = run(kside=1, transposed=1)
    out0, cache0 = run(kside=1, transposed=0)
    assert len(calls) == 1
    assert rel_err(out, gdn_tree_verify_dense_ref(*f64(inp), *tree)) < 1e-4
    assert rel_err(out, out0) < 1e-5 and rel_err(cache.u, cache0.u) < 1e-5
    accepted = torch.tensor([int(rng.integers(0, n)) for n in sizes])
    S = inp["state"].clone()
    launched_commit(S, inp["k"], cache, *tree, accepted, launch=COMMIT_TRITON)
    assert rel_err(S, sequential_commit(inp, trees, accepted)) < 1e-4


def _assert_heavy_first(t: DraftTree, order) -> None:
    """The defining properties of the heavy-first walk, checked from the ancestor mask (no walk
    of its own): every subtree is one contiguous run starting at its root, and siblings come
    larger subtree first, ties by lower index - which fixes the order."""
    order = np.asarray(order)
    assert sorted(order.tolist()) == list(range(t.num_nodes)) and order[0] == 0
    pos = np.empty(t.num_nodes, np.int64)
    pos[order] = np.arange(t.num_nodes)
    mask = t.ancestor_mask
    size = mask.sum(axis=0)
    for v in range(t.num_nodes):
        assert sorted(pos[mask[:, v]].tolist()) == list(range(pos[v], pos[v] + size[v])), v
        kids = np.flatnonzero(t.parents == v)
        kids = kids[np.argsort(pos[kids])]
        assert all((size[a], -a) > (size[b], -b) for a, b in zip(kids, kids[1:])), v


def test_heavy_first_order_and_renumbered_meta():
    from simtree.profiler.bench.gdn_util import eagle_like_tree
    rng = np.random.default_rng(17)
    trees = ([random_tree(int(n), rng, reach=int(r)) for n, r in zip(rng.integers(1, 90, 5),
                                                                      rng.integers(1, 9, 5))]
             + [eagle_like_tree(128, rng)[0], DraftTree.chain(40), DraftTree([-1] + [0] * 20)])
    md = TreeBatch(trees).to_torch()
    meta = tree_meta(md["parents"], md["cu_nodes"])
    order, walk = meta.heavy_first(md["cu_nodes"])
    assert meta.heavy_first(md["cu_nodes"])[0] is order          # built once per round
    cu = md["cu_nodes"].tolist()
    for b, t in enumerate(trees):
        want = t.heavy_first_order.tolist()   # the host walk (numpy-free Python) == device tables
        _assert_heavy_first(t, want)
        assert order[cu[b]:cu[b + 1]].tolist() == [cu[b] + x for x in want], b
        renum = t.depth_first()
        got = tree_meta(torch.as_tensor(renum.parents.copy()), torch.tensor([0, t.num_nodes]),
                        max_nodes=meta.max_nodes)
        assert torch.equal(walk.bits[cu[b]:cu[b + 1]], got.bits), b
        assert torch.equal(walk.depth[cu[b]:cu[b + 1]], got.depth), b
        near = walk.anc[cu[b]:cu[b + 1]]
        assert torch.equal(torch.where(near >= 0, near - cu[b], -1), got.anc), b
    # the renumbering keeps fewer sub-chunk pairs on the EAGLE-like tree (28 of 28 as stored)
    assert int(meta.subchunk_pairs(md["cu_nodes"], 16)[1][5].sum()) == 28
    assert int(walk.subchunk_pairs(md["cu_nodes"], 16)[1][5].sum()) < 20


def test_host_depth_first_order_matches_the_kernel_walk():
    # DraftTree.heavy_first_order (numpy, host) is the walk TreeMeta.heavy_first builds on the
    # device; renumbered trees keep every root path's tokens, and tree_meta finds (or checks)
    # that a batch is stored depth-first
    from simtree.errors import TreeError
    from simtree.profiler.bench.gdn_util import eagle_like_tree
    rng = np.random.default_rng(19)
    trees = ([random_tree(int(n), rng, reach=int(r)) for n, r in zip(rng.integers(1, 90, 6),
                                                                      rng.integers(1, 9, 6))]
             + [eagle_like_tree(int(n), rng)[0] for n in rng.integers(2, 130, 3)])
    trees = [DraftTree(t.parents, rng.integers(0, 1000, t.num_nodes)) for t in trees]
    for t in trees:
        _assert_heavy_first(t, t.heavy_first_order)
        d = t.depth_first()
        assert d.is_heavy_first and d.depth_first() is d
        assert sorted(tuple(d.tokens[d.path_to(i)]) for i in range(d.num_nodes)) == \
            sorted(tuple(t.tokens[t.path_to(i)]) for i in range(t.num_nodes))
    batch = TreeBatch(trees)
    dfs = batch.depth_first()
    assert dfs.is_depth_first and dfs.depth_first() is dfs
    md, mdd = batch.to_torch(), dfs.to_torch()
    assert tree_meta(md["parents"], md["cu_nodes"]).depth_first == batch.is_depth_first
    assert tree_meta(mdd["parents"], mdd["cu_nodes"]).depth_first
    assert not tree_meta(mdd["parents"], mdd["cu_nodes"], validate=False).depth_first
    if not batch.is_depth_first:
        with pytest.raises(TreeError, match="depth-first"):
            tree_meta(md["parents"], md["cu_nodes"], depth_first=True)
    with pytest.raises(TreeError, match="not a permutation"):
        trees[-1].renumbered(np.zeros(trees[-1].num_nodes, np.int64))


def test_depth_first_walk_follows_the_effective_sub_chunk(launched):
    # the default walk order comes from the sub-chunk actually launched: depth-first for
    # 16-node sub-chunks on trees of 65-256 nodes, as stored otherwise (also when a block_t
    # override differs from the launch rule's, and for larger trees: dense tables)
    rng = np.random.default_rng(18)
    for n, block_t, want in ((70, 16, True), (70, 32, False), (64, 16, False), (70, None, None),
                             (300, 16, False)):
        inp = make_inputs([random_tree(n, rng, reach=5), random_tree(9, rng)], 18)
        tree = (inp["parents"], inp["cu_nodes"])
        out, _ = launched_verify(*(inp[k] for k in KEYS), *tree, launch=on_triton(block_t=block_t))
        bt = launched[-1]["BT"]
        assert launched[-1]["ORDER"] == (want if want is not None else (bt == 16 and 64 < n <= 256)), \
            (n, block_t)
        assert rel_err(out, gdn_tree_verify_dense_ref(*f64(inp), *tree)) < 1e-4


def test_pair_counts_table_is_the_kernel_walk_of_the_bench_trees():
    # tune_gdn --pairs (reports/h200/gdn/tuning/pairs.md): per tree, the pairs the kernel's
    # loop visits in stored and depth-first order, never more than every pair
    from simtree.kernels.gdn import walk_tables
    from simtree.profiler.bench.gdn_util import shape_trees
    from simtree.profiler.bench.tune_gdn import pair_counts
    lines = [ln.split(" | ") for ln in pair_counts([2], [70], seed=3).splitlines()[2:]]
    assert [int(ln[2]) for ln in lines] == [16, 32]
    md = TreeBatch(shape_trees(2, 70, 3)[0]).to_torch()
    for ln in lines:
        bt, possible = int(ln[2]), int(ln[3])
        stored, depth_first = float(ln[4]), float(ln[5].rstrip(" |"))
        for heavy, want in ((0, stored), (1, depth_first)):
            meta = tree_meta(md["parents"], md["cu_nodes"])
            counts = walk_tables(meta, md["cu_nodes"], bt, heavy)[2][1]
            assert abs(float(counts.sum(1).float().mean()) - want) < 1e-9
        assert depth_first <= stored <= possible


@pytest.mark.parametrize("prenorm", [0, 1])
def test_scale_and_no_l2norm_in_both_qk_paths(prenorm):
    # q/k normalised and scaled inside the kernel or by the pre-pass: a custom scale and
    # qk_l2norm=False reach both paths (the pre-pass then only scales q)
    rng = np.random.default_rng(30 + prenorm)
    trees = [random_tree(int(n), rng, reach=5) for n in rng.integers(1, 40, size=3)]
    inp = make_inputs(trees, 30 + prenorm)
    inp["q"], inp["k"] = inp["q"] * 0.2, inp["k"] * 0.2    # unnormalised: keep the solve tame
    tree = (inp["parents"], inp["cu_nodes"])
    for kw in (dict(scale=0.3), dict(qk_l2norm=False)):
        ref = gdn_tree_verify_dense_ref(*f64(inp), *tree, **kw)
        out, _ = launched_verify(*(inp[k] for k in KEYS), *tree, **kw,
                                 launch=on_triton(prenorm=prenorm))
        assert rel_err(out, ref) < 1e-4, kw


@triton.jit
def _bit_probe(w_ptr, pos_ptr, cnt_ptr, BT: tl.constexpr):
    i = tl.program_id(0)
    w = tl.load(w_ptr + i).to(tl.uint64, bitcast=True)
    s = tl.arange(0, BT).to(tl.int64)
    tl.store(pos_ptr + i * BT + tl.arange(0, BT), _select_bit64(w + tl.zeros([BT], dtype=tl.uint64), s))
    tl.store(cnt_ptr + i, _popcount64(w).to(tl.int64))


def test_path_bit_selection_finds_every_set_bit_in_order():
    # the gathered-path commit ranks an ancestor word's set bits in registers (SWAR popcount,
    # then halving per slot); random words, bit 63 (the sign bit of the stored int64) included
    rng = np.random.default_rng(40)
    sets = [sorted(rng.choice(64, size=int(rng.integers(1, 17)), replace=False).tolist())
            for _ in range(64)] + [[63], [0, 63], list(range(48, 64))]
    words = torch.tensor([sum(1 << b for b in bits) - (1 << 64 if 63 in bits else 0)
                          for bits in sets], dtype=torch.int64)
    pos = torch.zeros((len(sets), 16), dtype=torch.int64)
    cnt = torch.zeros(len(sets), dtype=torch.int64)
    _bit_probe[(len(sets),)](words, pos, cnt, BT=16)
    for i, bits in enumerate(sets):
        assert int(cnt[i]) == len(bits)
        assert pos[i, :len(bits)].tolist() == bits


def test_commit_launch_rule_gathers_the_path_for_larger_trees():
    # fp32 products: the gathered path for larger trees at every batch; bf16 products (a bf16
    # u buffer): the stored-order walk except at one sequence of > 64 nodes
    from simtree.kernels.gdn._launch import commit_launch_config
    for B in (1, 4, 16, 64):
        small, large = (commit_launch_config(B, 48, 128, n) for n in (16, 128))
        assert small.path == 0 and large.path == 1
        assert small.block_v == large.block_v == 64
        for n in (16, 64, 128):
            assert commit_launch_config(B, 48, 128, n, dot16=True).path == int(B == 1 and n > 64)
    assert commit_launch_config(1, 48, 32, 128).block_v == 32   # never wider than V


def test_fused_decode_step_updates_the_state_in_place_like_the_torch_step():
    # the runtime's plain decoding step on the Triton per-node kernel (node states written over
    # the state they read): output and new state equal the torch delta-rule step (float64)
    from simtree.kernels.gdn.ops import recurrent_step
    B = 3
    inp = make_inputs([DraftTree([-1]) for _ in range(B)], 23)
    state = inp["state"].clone()
    out = recurrent_step(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], state, backend="triton")
    want_state = inp["state"].double().clone()
    want = recurrent_step(*(inp[x].double() for x in ("q", "k", "v", "g", "beta")), want_state,
                          backend="torch")
    assert rel_err(out, want) < 1e-4 and rel_err(state, want_state) < 1e-4


@pytest.mark.parametrize("seed,kside", [(60, 0), (61, 1)])
def test_u_cache_bf16_verify_and_commit(seed, kside):
    # u stored in bf16 (u_cache_bf16, 16-bit inputs): outputs read u back for later
    # sub-chunks and the commit folds it into the fp32 state. bf16 rounds u by <= 2^-9
    # relative, below the 2e-2 that bf16 inputs are held to (test_triton_bf16_inputs); the
    # committed state is checked against sequential float64 decoding of the same inputs
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(2, 80, size=3)]
    trees = [random_tree(n, rng, reach=5) for n in sizes]
    inp = make_inputs(trees, seed, dtype=torch.bfloat16)
    tree = (inp["parents"], inp["cu_nodes"])
    out, cache = launched_verify(*(inp[k] for k in KEYS), *tree,
                                 launch=on_triton(kside=kside, u_cache_bf16=1))
    assert cache.u.dtype == torch.bfloat16
    assert rel_err(out, gdn_tree_verify_dense_ref(*f64(inp), *tree)) < 2e-2
    _, ref_cache = launched_verify(*(inp[k] for k in KEYS), *tree, launch=TORCH)
    assert rel_err(cache.u, ref_cache.u) < 2e-2
    accepted = torch.tensor([int(rng.integers(0, n)) for n in sizes])
    S = inp["state"].clone()
    launched_commit(S, inp["k"], cache, *tree, accepted, launch=COMMIT_TRITON)
    assert rel_err(S, sequential_commit(inp, trees, accepted)) < 2e-2
    # fp32 inputs keep an fp32 u whatever the switch says
    inp32 = make_inputs(trees, seed)
    _, cache32 = launched_verify(*(inp32[k] for k in KEYS), *tree, launch=on_triton(u_cache_bf16=1))
    assert cache32.u.dtype == torch.float32


def test_no_dependent_launch_off_hopper(launched):
    # programmatic dependent launch (pdl, on by the rule) only for compiled CUDA kernels on
    # sm_90+: here (CPU / interpreter) the verify gets PDL = 0 and no launch_pdl, asked or not
    rng = np.random.default_rng(70)
    inp = make_inputs([random_tree(40, rng), random_tree(9, rng)], 70)
    for pdl in (None, 1):
        launched_verify(*(inp[k] for k in KEYS), inp["parents"], inp["cu_nodes"],
                        launch=on_triton(kside=1, pdl=pdl))
    assert not gdn_launch.pdl_ok("cpu") and len(launched) == 2
    assert all(kw["PDL"] == 0 and "launch_pdl" not in kw for kw in launched)
