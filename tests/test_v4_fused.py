"""Fused V4 kernels vs their torch forms: compressor pooling, indexer scan, one-launch commit,
and the FlashMLA tree-verify path (FlashMLA emulated on the CPU by dequantise + torch)."""
import numpy as np
import pytest
import torch

from simtree.kernels.v4 import V4AttnConfig, V4Cache, plan_verify, random_inputs, random_layer_weights, tree_verify
from simtree.kernels.v4 import flashmla as fmla
from simtree.kernels.v4.commit import apply_commit, plan_commit
from simtree.kernels.v4.compressor import pool_window
from simtree.kernels.v4._indexer_kernels import indexer_scores, indexer_scores_torch
from simtree.kernels.v4 import _pool_kernel as pool_kernel_module
from simtree.kernels.v4._pool_kernel import pool_windows
from simtree.kernels.v4.steps import make_tree
from simtree.trees.tree import TreeBatch


@pytest.mark.parametrize("split,channels", [(False, 0), (True, 8), (True, 64)])   # 64: one block, part-filled
@pytest.mark.parametrize("kind,hca_ratio", [("csa", 8), ("hca", 8), ("hca", 20)])   # 20: slots in blocks 8, 8, 4
def test_fused_pool_matches_pool_window(kind, hca_ratio, split, channels, monkeypatch):
    cfg = V4AttnConfig.tiny(hca_ratio=hca_ratio)
    w = random_layer_weights(cfg, kind, 3, torch.float32)
    p = w.comp
    g = torch.Generator().manual_seed(3)
    B, N, M, S, C = 3, 7, 5, p.num_slots, p.coff * p.dim
    buf_kv, buf_s = torch.randn(B, S, C, generator=g), torch.randn(B, S, C, generator=g)
    proj = (torch.randn(N, C, generator=g), torch.randn(N, C, generator=g))
    src = torch.randint(-1, B * S + N, (M, S), generator=g)
    entry = torch.randint(0, 50, (M,), generator=g)
    half = p.rope_dim // 2
    ang = (entry.double() * p.ratio)[:, None] * p.theta ** (-torch.arange(half, dtype=torch.float64) * 2 / p.rope_dim)
    if split:                         # channels a split program: several blocks of the tiny dim (32), or one
        monkeypatch.setattr(pool_kernel_module, "SPLIT_CHANNELS", channels)
    got = pool_windows(p, buf_kv, buf_s, proj, src, ang.cos().float(), ang.sin().float(), split=split)
    kv = torch.cat([buf_kv.reshape(-1, C), proj[0]])[src.clamp(min=0)].masked_fill((src < 0)[..., None], 0.0)
    sc = torch.cat([buf_s.reshape(-1, C), proj[1]])[src.clamp(min=0)].masked_fill((src < 0)[..., None], float("-inf"))
    ref = pool_window(p.to(dtype=torch.float64), kv.double(), sc.double(), entry)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_indexer_scan_matches_torch():
    g = torch.Generator().manual_seed(4)
    N, Hi, Di, P, B, E = 9, 8, 16, 40, 2, 70
    iq, iw = torch.randn(N, Hi, Di, generator=g), torch.randn(N, Hi, generator=g)
    pool = torch.randn(P, Di, generator=g)
    rows = torch.randint(-1, P, (B, E), generator=g)
    pad = torch.tensor([[0, 1, 2, 3, 4, -1], [5, 6, 7, 8, -1, -1]])
    got = indexer_scores(iq, iw, pool, rows, pad, torch.full((N, E + 3), 7.0), block_e=32)
    ref = indexer_scores_torch(iq.double(), iw.double(), pool.double(), rows, pad, torch.full((N, E + 3), 7.0, dtype=torch.float64))
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def _step(kind, cfg, seed, dtype=torch.float32, lens=(21, 30), nodes=6):
    w = random_layer_weights(cfg, kind, seed, torch.float32)
    cache = V4Cache.random(cfg, w, len(lens), max(lens), max(lens) + 2 * nodes + 4, dtype=dtype, seed=seed)
    cache.lens[:] = lens
    rng = np.random.default_rng(seed)
    tb = TreeBatch(tuple(make_tree(nodes, "random", rng) for _ in lens))
    inp = random_inputs(cfg, tb.total_nodes, torch.Generator().manual_seed(seed), torch.float32)
    return w, cache, tb, inp


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_fused_commit_equals_torch_commit(kind):
    """Bit-identical persistent state: the one-launch kernel vs the index_copy_ form."""
    cfg = V4AttnConfig.tiny()
    w, cache, tb, inp = _step(kind, cfg, 5)
    plan = plan_verify(cache, tb, w)
    _, scratch = tree_verify(cache, w, inp, plan, attention="torch")
    accepted = [t.path_to(int(t.leaves[np.argmax(t.depth[t.leaves])])).tolist() for t in tb.trees]
    cp = plan_commit(cache, w, plan, accepted)
    twin = V4Cache.random(cfg, w, cache.batch, 1, cache.max_len, dtype=cache.window.pool.dtype, seed=5)
    for name, t in cache.persistent_tensors().items():
        twin.persistent_tensors()[name].copy_(t)
    apply_commit(cache, scratch, cp, impl="triton")
    apply_commit(twin, scratch, cp, impl="torch")
    for name, t in cache.persistent_tensors().items():
        assert torch.equal(t, twin.persistent_tensors()[name]), name


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_flashmla_path_emulated(kind, monkeypatch):
    """attention="flashmla": FP8 mirrors, spare rows and remapped lists give the Triton output
    up to FP8 rounding, also after a commit updated the mirrors."""
    monkeypatch.setattr(fmla, "flashmla_sparse_attention", fmla.emulate_flashmla_sparse_attention)
    cfg = V4AttnConfig.tiny(head_dim=512, rope_dim=64, indexer_dim=64, num_heads=2, window=8, topk=4, page_size=8)
    w, cache, tb, inp = _step(kind, cfg, 6, lens=(17, 26), nodes=5)
    for _ in range(2):
        plan = plan_verify(cache, tb, w)
        got, sc = tree_verify(cache, w, inp, plan, attention="flashmla")
        ref, _ = tree_verify(cache, w, inp, plan, attention="triton")
        assert float((got - ref).norm() / ref.norm()) < 0.05
        accepted = [t.path_to(int(t.leaves[0])).tolist() for t in tb.trees]
        apply_commit(cache, sc, plan_commit(cache, w, plan, accepted))
        cache.lens += [len(a) for a in accepted]


def test_triton_pack_matches_torch_pack():
    """One-launch FP8 packing writes the same bytes as the torch packing at scattered row slots.
    Values m * 2^s (|m| <= 7) and one 448 per 64-value tile make every conversion exact: the
    interpreter's float8 rounding is wrong at binade edges, the GPU's is not."""
    g = torch.Generator().manual_seed(8)
    m = torch.randint(-7, 8, (5, 512), generator=g).float()
    s = torch.randint(0, 6, (5, 512), generator=g).float()
    rows = m * torch.exp2(s)
    rows[:, 0:448:64] = 448.0
    rows = rows * torch.exp2(torch.tensor([-10.0, -3.0, 0.0, 2.0, 5.0])).unsqueeze(1)
    ids = torch.tensor([3, 64, 70, 129, 0])
    a, b = fmla.PackedRows(192, "cpu"), fmla.PackedRows(192, "cpu")
    a.write(ids, rows, use_triton=True)
    b.write(ids, rows, use_triton=False)
    assert torch.equal(a.raw, b.raw)
    torch.testing.assert_close(fmla.unpack_v4_rows(a.k_cache)[ids], rows)


@pytest.mark.parametrize("kind", ["csa", "hca"])        # csa: the overlapping C4 compressor
@pytest.mark.parametrize("split", [False, True])
def test_pool_skips_padding_rows(split, kind):
    """The device plan's padding rows (every slot empty) skip their slot loop under skip_padding
    and still pool to what the unskipped kernel gives them (0); live rows are unchanged."""
    cfg = V4AttnConfig.tiny(hca_ratio=8)
    p = random_layer_weights(cfg, kind, 5, torch.float32).comp
    g = torch.Generator().manual_seed(5)
    B, N, M, S, C = 2, 6, 6, p.num_slots, p.coff * p.dim
    buf_kv, buf_s = torch.randn(B, S, C, generator=g), torch.randn(B, S, C, generator=g)
    proj = (torch.randn(N, C, generator=g), torch.randn(N, C, generator=g))
    src = torch.randint(0, B * S + N, (M, S), generator=g)
    src[[1, 4]] = -1                                  # padding rows
    cos, sin = torch.randn(M, p.rope_dim // 2, generator=g), torch.randn(M, p.rope_dim // 2, generator=g)
    want = pool_windows(p, buf_kv, buf_s, proj, src, cos, sin)
    got = pool_windows(p, buf_kv, buf_s, proj, src, cos, sin, split=split, skip_padding=True)
    assert torch.count_nonzero(want[[1, 4]]) == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
