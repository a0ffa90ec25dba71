"""The batched dense solve (torch backend) against the plain per-tree reference (b)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from simtree.kernels.gdn import gdn_tree_verify_dense_batched, gdn_tree_verify_dense_ref, tree_meta
from simtree.kernels.gdn._launch import CommitLaunch, VerifyLaunch
from simtree.kernels.gdn._launched import launched_commit, launched_verify
from simtree.trees.tree import DraftTree, TreeBatch
from test_gdn_verify import random_tree


def make(trees, seed, H=2, HV=4, K=16, V=32, g_scale=0.5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    md = TreeBatch(trees).to_torch()
    N, B = int(md["cu_nodes"][-1]), len(trees)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = [rnd(N, H, K), rnd(N, H, K), rnd(N, HV, V), -torch.rand(N, HV, generator=gen, dtype=torch.float64) * g_scale,
         torch.rand(N, HV, generator=gen, dtype=torch.float64), rnd(B, HV, K, V) * 0.3]
    return [t.to(dtype) for t in x], (md["parents"], md["cu_nodes"])


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


CASES = {
    "ragged": lambda rng: [random_tree(int(n), rng) for n in (1, 17, 70, 5, 33, 2, 64)],
    "chains": lambda rng: [DraftTree.chain(40), DraftTree.chain(1), DraftTree.chain(65)],
    "single_nodes": lambda rng: [DraftTree.chain(1) for _ in range(4)],
    "one_tree": lambda rng: [random_tree(24, rng, reach=8)],
    "wide": lambda rng: [DraftTree([-1] + [0] * 30), random_tree(31, rng, reach=2)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("g_scale", [0.5, 60.0])        # 60: g down to -30 per token
@pytest.mark.parametrize("heads", [(2, 4), (3, 3)])
def test_batched_matches_dense_reference_float64(case, g_scale, heads):
    rng = np.random.default_rng(sorted(CASES).index(case))
    trees = CASES[case](rng)
    x, tree = make(trees, 3, H=heads[0], HV=heads[1], g_scale=g_scale)
    ref, aux = gdn_tree_verify_dense_ref(*x, *tree, return_aux=True)
    for bucket in (16, 0, 1):
        out, got = gdn_tree_verify_dense_batched(*x, *tree, return_aux=True, return_inverse=True,
                                                 bucket=bucket)
        assert out.dtype == torch.float64 and out.shape == ref.shape
        assert torch.isfinite(out).all()
        assert rel(out, ref) < 1e-10, bucket
        assert rel(got["u"], aux["u"]) < 1e-10, bucket
        assert rel(got["G"], aux["G"]) < 1e-12, bucket
        assert len(got["inverse"]) == len(trees)
        for a, b in zip(got["inverse"], aux["inverse"]):
            assert a.shape == b.shape and rel(a, b) < 1e-10


@pytest.mark.parametrize("g_scale", [0.5, 60.0])
def test_batched_float32_close_to_float64_reference(g_scale):
    rng = np.random.default_rng(7)
    trees = [random_tree(int(n), rng) for n in rng.integers(1, 65, size=6)] + [DraftTree.chain(64)]
    x, tree = make(trees, 7, g_scale=g_scale)
    ref, aux = gdn_tree_verify_dense_ref(*x, *tree, return_aux=True)
    out, got = gdn_tree_verify_dense_batched(*[t.float() for t in x], *tree, return_aux=True)
    assert out.dtype == torch.float32
    assert rel(out, ref) < 1e-5
    assert rel(got["u"], aux["u"]) < 1e-5
    assert rel(got["G"], aux["G"]) < 1e-5


def test_options_and_prebuilt_meta():
    rng = np.random.default_rng(9)
    trees = [random_tree(int(n), rng) for n in (9, 30, 1)]
    x, tree = make(trees, 9)
    for kw in (dict(scale=0.3), dict(qk_l2norm=False)):
        ref = gdn_tree_verify_dense_ref(*x, *tree, **kw)
        assert rel(gdn_tree_verify_dense_batched(*x, *tree, **kw), ref) < 1e-10
    meta = tree_meta(tree[0], tree[1], max_nodes=64, validate=False)    # wider than needed
    assert rel(gdn_tree_verify_dense_batched(*x, *tree, meta=meta),
               gdn_tree_verify_dense_ref(*x, *tree)) < 1e-10


def test_torch_backend_uses_batched_solve():
    rng = np.random.default_rng(10)
    trees = [random_tree(int(n), rng) for n in (12, 40, 3)]
    x, tree = make(trees, 10, dtype=torch.float32)
    out, cache = launched_verify(*x, *tree, launch=VerifyLaunch(backend="torch"))
    ref, aux = gdn_tree_verify_dense_ref(*[t.double() for t in x], *tree, return_aux=True)
    assert out.dtype == torch.float32 and cache.u.dtype == cache.G.dtype == torch.float32
    assert rel(out, ref) < 1e-5 and rel(cache.u, aux["u"]) < 1e-5 and rel(cache.G, aux["G"]) < 1e-5


def test_batched_is_differentiable_like_the_reference():
    rng = np.random.default_rng(11)
    trees = [random_tree(6, rng), DraftTree.chain(4), DraftTree.chain(1)]
    x, tree = make(trees, 11, K=8, V=8)
    w = torch.randn(int(tree[1][-1]), 4, 8, dtype=torch.float64)
    grads = []
    for fn in (gdn_tree_verify_dense_ref, gdn_tree_verify_dense_batched):
        xs = [t.clone().requires_grad_(True) for t in x]
        (fn(*xs, *tree) * w).sum().backward()
        grads.append([t.grad for t in xs])
    for a, b in zip(*grads):
        assert rel(b, a) < 1e-10


@pytest.mark.parametrize("g_scale", [0.5, 60.0])
def test_torch_commit_matches_sequential_decode(g_scale):
    # g = -30: off-path G differences are huge; only the accepted path may enter exp
    from simtree.kernels.gdn import gdn_accepted_paths_ref
    rng = np.random.default_rng(12)
    trees = [random_tree(int(n), rng) for n in (25, 1, 40)] + [DraftTree.chain(9)]
    x, tree = make(trees, 12, dtype=torch.float32, g_scale=g_scale)
    _, cache = launched_verify(*x, *tree, launch=VerifyLaunch(backend="torch"))
    accepted = torch.tensor([int(rng.integers(0, t.num_nodes)) for t in trees])
    accepted[0], accepted[3] = trees[0].num_nodes - 1, 8
    S = x[5].clone()
    launched_commit(S, x[1], cache, *tree, accepted, launch=CommitLaunch(backend="torch"))
    want = gdn_accepted_paths_ref(*(y.double() for y in x[:6]), trees, tree[1], accepted)
    assert torch.isfinite(S).all()
    assert rel(S, want) < 1e-5
