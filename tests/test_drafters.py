"""The block drafters (kernels/layers/drafters): shapes, determinism, and plain torch references
of the backbone forward, the best-first tree from marginals, the TfM adapter's tree and
DSpark's Markov chain and confidence; one-line refusals of bad sizes and thresholds."""
import heapq
import math

import pytest
import torch
import torch.nn.functional as F

from simtree.errors import SimtreeError
from simtree.kernels.layers.drafters import (BackboneState, backbone_forward, block_marginals, drafter_config,
                                             drafter_specs, dspark_draft, prepare, survival, tfm_steps, tfm_tree,
                                             tree_from_marginals, verify_prefix_len)
from simtree.kernels.layers.drafters.tfm import _expand, tfm_candidates
from simtree.kernels.layers.rope import RopeTable
from simtree.kernels.layers.weights import make_weights
from simtree.models import get_model

B, A, S = 3, 4, 32


def _setup(family, model="tiny-gdn", dtype=torch.float64, seed=0, **kw):
    sizes = dict(layers=2, target_layers=3, block_len=5)
    sizes.update({"dspark": dict(markov_rank=16), "tfm": dict(cand_k=24, adapter_dim=16), "block": {}}[family])
    sizes.update(kw)
    cfg = drafter_config(get_model(model), family, **sizes)
    w = prepare(make_weights(drafter_specs(cfg), "cpu", dtype, seed=seed), cfg)
    st = BackboneState.new(cfg, B, S, A, dtype, "cpu")
    rope = RopeTable(cfg.dims.rope, 1e4, "cpu", 128, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    feats = torch.randn(B, A, cfg.target_layers * cfg.h, generator=g, dtype=dtype)
    return cfg, w, st, rope, feats


def _rot(x, cs):
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    r1, r2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([r1 * cos - r2 * sin, r1 * sin + r2 * cos, x[..., 2 * half:]], -1)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _backbone_ref(w, cfg, rope, feats, n_new, anchor, lengths, caches):
    """Per sequence, dense: the block rows attend to the cache rows, the real context rows and
    the whole block; returns the final-normed hidden states and each layer's context K/V."""
    d, L = cfg.dims, cfg.block_len
    out, ctx_kv = [], []
    for b in range(feats.shape[0]):
        n, l0 = int(n_new[b]), int(lengths[b])
        xc = _rms(feats[b, :n] @ w["fc"].T, w["hidden_norm"])
        toks = torch.full((L,), cfg.mask_token)
        toks[0] = anchor[b]
        x = w["embed"][toks]
        pc, pb = torch.arange(l0, l0 + n), torch.arange(l0 + n, l0 + n + L)
        kvs = []
        for i, lw in enumerate(w["layers"]):
            qkv = _rms(x, lw["ln1"]) @ lw["qkv"].T
            q = _rot(_rms(qkv[:, :d.q_out].view(L, d.Hq, d.D), lw["q_norm"]), rope.rows(pb))
            kvd = d.Hkv * d.D

            def kv(p, pos):
                return (_rot(_rms(p[:, :kvd].view(-1, d.Hkv, d.D), lw["k_norm"]), rope.rows(pos)),
                        p[:, kvd:].view(-1, d.Hkv, d.D))
            kb, vb = kv(qkv[:, d.q_out:], pb)
            kc, vc = kv(xc @ lw["qkv"][d.q_out:].T, pc)
            kvs.append((kc, vc))
            k = torch.cat([caches[i][b, :l0, 0], kc, kb])
            v = torch.cat([caches[i][b, :l0, 1], vc, vb])
            g = d.Hq // d.Hkv
            att = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * d.D ** -0.5
            o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v.repeat_interleave(g, 1)).reshape(L, -1)
            x = x + o @ lw["o"].T
            gu = _rms(x, lw["ln2"]) @ lw["gate_up"].T
            x = x + (F.silu(gu[:, :d.I]) * gu[:, d.I:]) @ lw["down"].T
        out.append(_rms(x, w["norm"]))
        ctx_kv.append(kvs)
    return torch.stack(out), ctx_kv


@pytest.mark.parametrize("model", ["tiny-gdn", "tiny-v4"])
def test_backbone_matches_dense_reference_and_commits_context(model):
    cfg, w, st, rope, feats = _setup("block", model)
    for c in st.caches:   # an earlier round's context
        c.normal_(generator=torch.Generator().manual_seed(3))
    st.lengths.copy_(torch.tensor([0, 5, 2]))
    lengths0 = st.lengths.clone()
    n_new, anchor = torch.tensor([1, 4, 2]), torch.tensor([5, 6, 7])
    ref, ctx_kv = _backbone_ref(w, cfg, rope, feats, n_new, anchor, lengths0, [c.clone() for c in st.caches])
    hid = backbone_forward(w, cfg, st, rope, feats, n_new, anchor)
    assert hid.shape == (B, cfg.block_len, cfg.h)
    torch.testing.assert_close(hid, ref, rtol=1e-9, atol=1e-9)
    assert st.lengths.tolist() == (lengths0 + n_new).tolist()
    for b in range(B):   # the real context rows are committed at their positions
        l0, n = int(lengths0[b]), int(n_new[b])
        for i, c in enumerate(st.caches):
            torch.testing.assert_close(c[b, l0:l0 + n, 0], ctx_kv[b][i][0])
            torch.testing.assert_close(c[b, l0:l0 + n, 1], ctx_kv[b][i][1])


def test_backbone_is_deterministic_and_fp32_close():
    cfg, w, st, rope, feats = _setup("block", dtype=torch.float32)
    args = (feats, torch.tensor([2, 1, 4]), torch.tensor([1, 2, 3]))
    a = backbone_forward(w, cfg, st, rope, *args, commit=False)
    b = backbone_forward(w, cfg, st, rope, *args, commit=False)
    assert torch.equal(a, b) and st.lengths.tolist() == [0, 0, 0]


def _best_first_ref(lp, K, N):
    """Heap best-first over independent marginals lp [L, K] (one sequence): (parent, depth, rank, score)."""
    L = lp.shape[0]
    nodes = [(-1, 0, 0, 0.0)]
    heap = [(-float(lp[0, 0]), 0, 0)] if L else []     # (-score, parent node, rank)
    while len(nodes) < N and heap:
        negs, par, r = heapq.heappop(heap)
        d = nodes[par][1]
        nodes.append((par, d + 1, r, -negs))
        i = len(nodes) - 1
        if r + 1 < K:
            heapq.heappush(heap, (-(nodes[par][3] + float(lp[d, r + 1])), par, r + 1))
        if d + 1 < L:
            heapq.heappush(heap, (-(nodes[i][3] + float(lp[d + 1, 0])), i, 0))
    return nodes


def test_tree_from_marginals_is_best_first():
    g = torch.Generator().manual_seed(0)
    L, K, N = 4, 3, 12
    lp = torch.log_softmax(torch.randn(B, L, 50, generator=g, dtype=torch.float64), -1).topk(K, -1).values
    ids = torch.randint(0, 50, (B, L, K), generator=g)
    tree = tree_from_marginals(lp.float(), ids, torch.tensor([1, 2, 3]), N)
    for b in range(B):
        ref = _best_first_ref(lp[b], K, N)
        got = sorted(float(s) for s in tree.score[b])
        assert got == pytest.approx(sorted(r[3] for r in ref), abs=1e-5)
        for i in range(1, N):   # topological, depth and token consistent with the marginals
            p = int(tree.parents[b, i])
            assert 0 <= p < i and int(tree.depth[b, i]) == int(tree.depth[b, p]) + 1
            d, r = int(tree.depth[b, i]) - 1, int(tree.rank[b, i])
            assert int(tree.tokens[b, i]) == int(ids[b, d, r])
            assert float(tree.score[b, i]) == pytest.approx(float(tree.score[b, p]) + float(lp[b, d, r]), abs=1e-5)


def test_tree_from_marginals_pads_past_the_reachable_nodes():
    lp = torch.log_softmax(torch.randn(1, 2, 2, dtype=torch.float64), -1).float()
    tree = tree_from_marginals(lp, torch.zeros(1, 2, 2, dtype=torch.int64), torch.tensor([0]), 9)
    assert tree.valid[0].tolist() == [True] * 7 + [False] * 2     # 1 + 2 + 4 reachable
    assert tree.parents[0, 7:].tolist() == [0, 0] and tree.depth[0, 7:].tolist() == [1, 1]


def test_block_marginals_are_the_lm_heads_topk():
    cfg, w, st, rope, feats = _setup("block")
    hid = backbone_forward(w, cfg, st, rope, feats, torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]))
    lp, ids = block_marginals(w, hid, 4)
    ref = torch.log_softmax(hid @ w["lm_head"].T, -1)
    torch.testing.assert_close(lp, ref.topk(4, -1).values.float())
    assert torch.equal(ids, ref.topk(4, -1).indices)


def test_dspark_matches_its_sequential_reference():
    cfg, w, st, rope, feats = _setup("dspark")
    anchor = torch.tensor([4, 5, 6])
    hid = backbone_forward(w, cfg, st, rope, feats, torch.tensor([1, 2, 3]), anchor)
    lp, ids, conf = dspark_draft(w, hid, anchor, 3)
    assert lp.shape == ids.shape == (B, cfg.block_len, 3) and conf.shape == (B, cfg.block_len)
    for b in range(B):
        prev = int(anchor[b])
        for j in range(cfg.block_len):
            e = w["markov.w1"][prev]
            logits = hid[b, j] @ w["lm_head"].T + w["markov.w2"] @ e
            ref = torch.log_softmax(logits, -1).topk(3)
            torch.testing.assert_close(lp[b, j], ref.values.float())
            assert ids[b, j].tolist() == ref.indices.tolist()
            c = torch.sigmoid(torch.cat([hid[b, j], e]) @ w["conf.w"][0] + w["conf.b"][0])
            assert float(conf[b, j]) == pytest.approx(float(c), rel=1e-5)
            prev = int(ref.indices[0])


def test_verify_prefix_len_and_threshold_bounds():
    conf = torch.tensor([[0.9, 0.9, 0.5, 0.9], [0.2, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(survival(conf), torch.cumprod(conf, -1))
    assert verify_prefix_len(conf, 0.8).tolist() == [2, 0]
    assert verify_prefix_len(conf, 0.0).tolist() == [4, 4]
    assert verify_prefix_len(conf, 0.2).tolist() == [4, 4]
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(SimtreeError, match="outside"):
            verify_prefix_len(conf, bad)


def _tfm_ref_width1(w, hid, anchor, cand_k, N):
    """Sequential best-first over the adapter's conditionals, one node at a time (one sequence),
    every child of every expanded node in a heap: (score list sorted)."""
    cand_lp, cand_ids = tfm_candidates(w, hid[None], cand_k)
    q_in = hid[None] @ w["tfm.in"].T
    cand_emb = w["tfm.emb"][cand_ids]
    L = hid.shape[0]
    a = q_in.shape[-1]
    s0, c0 = _expand(w, torch.zeros(1, 1, a, dtype=hid.dtype), anchor.view(1, 1), q_in, cand_emb, cand_lp,
                     torch.zeros(1, 1, dtype=torch.int64), L)
    nodes = [(0.0, 0, s0[0, 0])]
    heap = [(-float(c0[0, 0, k]), k, 0) for k in range(cand_k)]
    heapq.heapify(heap)
    while len(nodes) < N:
        negs, k, par = heapq.heappop(heap)
        d = nodes[par][1]
        tok = cand_ids[0, d, k].view(1, 1)
        s, c = _expand(w, nodes[par][2].view(1, 1, a), tok, q_in, cand_emb, cand_lp,
                       torch.tensor([[d + 1]]), L)
        nodes.append((-negs, d + 1, s[0, 0]))
        if d + 1 < L:
            for kk in range(cand_k):
                heapq.heappush(heap, (negs - float(c[0, 0, kk]), kk, len(nodes) - 1))
    return sorted(n[0] for n in nodes)


@pytest.mark.parametrize("width", [1, 3])
def test_tfm_tree_is_best_first_over_the_adapters_conditionals(width):
    cfg, w, st, rope, feats = _setup("tfm")
    anchor = torch.tensor([4, 5, 6])
    hid = backbone_forward(w, cfg, st, rope, feats, torch.tensor([1, 2, 3]), anchor)
    N = 9
    tree = tfm_tree(w, hid, anchor, cfg.cand_k, N, width)
    assert tree.tokens.shape == (B, N) and bool(tree.valid.all())
    for b in range(B):
        for i in range(1, N):
            p = int(tree.parents[b, i])
            assert 0 <= p < i and int(tree.depth[b, i]) == int(tree.depth[b, p]) + 1
            assert float(tree.score[b, i]) <= float(tree.score[b, p]) + 1e-9
        if width == 1:
            assert sorted(float(s) for s in tree.score[b]) == pytest.approx(
                _tfm_ref_width1(w, hid[b], anchor[b], cfg.cand_k, N), abs=1e-5)   # float32 scores
    assert tfm_steps(N, width) == {1: 8, 3: 3}[width]
    again = tfm_tree(w, hid, anchor, cfg.cand_k, N, width)
    assert all(torch.equal(x, y) for x, y in zip(tree, again))


def test_public_sizes_and_bad_sizes():
    cfg = drafter_config(get_model("qwen3.6-27b"), "dspark")
    assert (cfg.block_len, cfg.layers, cfg.target_layers, cfg.markov_rank) == (7, 5, 5, 256)
    assert cfg.dims.h == 5120 and not cfg.dims.gate
    v4 = drafter_config(get_model("deepseek-v4-flash"), "tfm")
    assert (v4.cand_k, v4.dims.Hkv, v4.dims.D, v4.dims.I) == (512, 1, 512, 6 * 2048 + 2048)
    for kw, msg in ((dict(block_len=0), "block_len"), (dict(block_len=65), "block_len"), (dict(nope=1), "unknown")):
        with pytest.raises(SimtreeError, match=msg):
            drafter_config(get_model("tiny-gdn"), "block", **kw)
    with pytest.raises(SimtreeError, match="unknown drafter family"):
        drafter_config(get_model("tiny-gdn"), "medusa")


def _capture(fn):
    """fn's outputs from a CUDA-graph replay (warmed up on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model", ["qwen3.6-27b", "deepseek-v4-flash"])
def test_gpu_backbone_matches_float64_and_graphs_replay_every_round(model):
    """On CUDA: the backbone at the public widths with 2 layers and a 4096-token vocabulary
    (bf16, Triton attention and fused ops) against the float64 reference; each family's whole
    round replayed from a CUDA graph equals the eager round."""
    from dataclasses import replace

    from simtree.kernels.layers.drafters import drafter_dims
    dev = torch.device("cuda")
    shape = get_model(model)
    small = dict(layers=2, dims=replace(drafter_dims(shape), vocab=4096), mask_token=4095)
    cfg = drafter_config(shape, "dspark", **small)
    w64 = prepare(make_weights(drafter_specs(cfg), "cpu", torch.float64, seed=0), cfg)
    w = prepare({k: v.to(dev, torch.bfloat16) for k, v in w64.items() if k != "layers"}, cfg)
    st = BackboneState.new(cfg, 2, 64, A, torch.bfloat16, dev)
    rope = RopeTable(cfg.dims.rope, 1e4, dev, 128)
    rope64 = RopeTable(cfg.dims.rope, 1e4, "cpu", 128, dtype=torch.float64)
    feats = torch.randn(2, A, cfg.target_layers * cfg.h, dtype=torch.float64)
    n_new, anchor = torch.tensor([2, 4]), torch.tensor([3, 9])
    ref, _ = _backbone_ref(w64, cfg, rope64, feats, n_new, anchor, torch.zeros(2, dtype=torch.int64),
                           [torch.zeros(2, 0, 2, cfg.dims.Hkv, cfg.dims.D, dtype=torch.float64)] * cfg.layers)
    args = (feats.to(dev, torch.bfloat16), n_new.to(dev), anchor.to(dev))
    hid = backbone_forward(w, cfg, st, rope, *args, commit=False)
    err = float((hid.double().cpu() - ref).abs().max() / ref.abs().max())
    assert err < 3e-2, err
    tfm_cfg = drafter_config(shape, "tfm", cand_k=64, **small)
    tfm_w = prepare(make_weights(drafter_specs(tfm_cfg), dev, torch.bfloat16, seed=0), tfm_cfg)
    rounds = {
        "dspark": lambda: dspark_draft(w, backbone_forward(w, cfg, st, rope, *args, commit=False), args[2], 4),
        "block": lambda: tree_from_marginals(*block_marginals(w, backbone_forward(w, cfg, st, rope, *args,
                                                                                   commit=False), 4), args[2], 12),
        "tfm": lambda: tfm_tree(tfm_w, backbone_forward(tfm_w, tfm_cfg, st, rope, *args, commit=False), args[2],
                                64, 12, 3)}
    for fam, fn in rounds.items():
        eager = fn()
        for a, b in zip(eager, _capture(fn)):
            torch.testing.assert_close(a, b, msg=f"{model} {fam}: graph replay differs from the eager round")
