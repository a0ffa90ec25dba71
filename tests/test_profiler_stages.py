import numpy as np
import pytest
import torch

from simtree.models import get_model
from simtree.profiler import pieces
from simtree.costs.steps import Point, Unavailable, random_tree
from simtree.profiler.pieces import Ctx, tree_batch, v4_window_index
from simtree.profiler.stages import build_workload, check_variant


def _ctx(name="tiny-gdn"):
    return Ctx(get_model(name), torch.device("cpu"), torch.float32, seed=0)


@pytest.mark.parametrize("shape", ["linear", "eagle", "random"])
def test_random_trees_have_n_nodes_and_bounded_width(shape):
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 33):
        t = random_tree(n, shape, rng)
        assert t.num_nodes == n
        if shape == "linear":
            assert t.max_depth == n - 1
        if shape == "eagle":
            assert t.num_children.max() <= 4


def test_tree_attention_equals_dense_masked_attention():
    g = torch.Generator().manual_seed(0)
    b, Hq, Hkv, n, l, D = 2, 4, 2, 7, 11, 8
    tb = tree_batch(b, n, "eagle", 3)
    q = torch.randn(b, Hq, n, D, generator=g, dtype=torch.float64)
    kc, vc = (torch.randn(b, Hkv, l, D, generator=g, dtype=torch.float64) for _ in range(2))
    kt, vt = (torch.randn(b, Hkv, n, D, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.as_tensor(np.stack([t.ancestor_mask for t in tb.trees]))
    bias = torch.zeros(b, 1, n, n, dtype=torch.float64).masked_fill_(~mask.unsqueeze(1), float("-inf"))
    out = pieces.tree_attention(q, kc, vc, kt, vt, bias, 0.3)
    G = Hq // Hkv
    K = torch.cat([kc, kt], 2).repeat_interleave(G, 1)
    V = torch.cat([vc, vt], 2).repeat_interleave(G, 1)
    full = torch.cat([torch.ones(b, 1, n, l, dtype=torch.bool), mask.unsqueeze(1)], -1)
    ref = torch.softmax(((q @ K.transpose(-1, -2)) * 0.3).masked_fill(~full, float("-inf")), -1) @ V
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_v4_window_sees_own_ancestors_and_own_sequence_only():
    b, n, W, l = 3, 9, 6, 100
    tb = tree_batch(b, n, "eagle", 2)
    idx = v4_window_index(tb, l, W)
    for r in range(tb.total_nodes):
        seq, start = int(tb.seq_ids[r]), int(tb.cu_nodes[tb.seq_ids[r]])
        row = idx[r][idx[r] >= 0]
        assert row.size == W                                   # a full window: l >= W
        tree_rows = row[row >= b * W] - b * W
        anc = set((np.flatnonzero(tb.trees[seq].ancestor_mask[r - start]) + start).tolist())
        assert set(tree_rows.tolist()) <= anc and r in tree_rows  # never a sibling branch
        pers = row[row < b * W]
        assert np.all(pers // W == seq)                        # never another sequence's cache


def test_v4_gather_attention_check_passes():
    ctx = _ctx("tiny-v4")
    assert check_variant(ctx, "v4_csa_verify", "torch_gather").startswith("ok")


@pytest.mark.parametrize("stage, variant, l", [
    ("gdn_proj_step", "torch", 0), ("attn_proj_step", "torch", 0), ("mlp_step", "torch", 0),
    ("lm_head_step", "torch", 0), ("attn_tree_verify", "torch_sdpa", 32), ("gdn_tree_verify", "torch_ref", 32),
    ("gdn_tree_commit", "torch_ref", 0), ("gdn_round_meta", "torch", 0),
    ("gdn_round_meta", "torch_graph", 0), ("gdn_round_meta", "host", 0),
])
def test_gdn_model_stages_run_on_cpu(stage, variant, l):
    ctx = _ctx()
    step, nb = build_workload(ctx, Point(stage, variant, "tiny-gdn", 2, 4, l, "eagle")).make()
    out = step()
    assert nb > 0
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("stage", ["v4_swa_verify", "v4_csa_verify", "v4_hca_verify", "csa_proj_step"])
def test_v4_stages_run_on_cpu(stage):
    ctx = _ctx("tiny-v4")
    variant = "torch" if stage.endswith("proj_step") else "torch_gather"
    step, _ = build_workload(ctx, Point(stage, variant, "tiny-v4", 2, 5, 96, "eagle")).make()
    out = step()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("tokens, touched", [(1, 2), (3, 5), (40, 8)])
def test_moe_gemm_covers_only_touched_experts(monkeypatch, tokens, touched):
    # T tokens x top-2 of 8 experts touch 8 (1 - (3/4)^T) experts in expectation under uniform
    # routing (2, 4.6, 8.0), rounded: the expert GEMM's batch
    ctx = _ctx("tiny-v4")
    seen = []
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: seen.append(b.shape[0]) or real(a, b))
    step, _ = build_workload(ctx, Point("mlp_step", "torch", "tiny-v4", tokens, 1)).make()
    seen.clear()
    step()
    assert seen == [touched, touched]


def test_missing_layer_kind_or_cpu_triton_is_unavailable():
    ctx = _ctx()
    with pytest.raises(Unavailable):
        build_workload(ctx, Point("v4_csa_verify", "torch_gather", "tiny-gdn", 1, 2, 64, "eagle"))
    with pytest.raises(Unavailable):
        build_workload(ctx, Point("gdn_tree_verify", "triton_tree", "tiny-gdn", 1, 2, 64, "eagle"))


def test_draft_step_runs_num_steps_times():
    ctx = _ctx()
    calls = []
    orig = pieces.lm_head_piece

    def counting(*a, **k):
        f, nb = orig(*a, **k)
        return (lambda: calls.append(1) or f()), nb
    pieces.lm_head_piece = counting
    try:
        build_workload(ctx, Point("draft_step", "torch", "tiny-gdn", 2, 3, 64, "eagle", 4, 3)).make()[0]()
    finally:
        pieces.lm_head_piece = orig
    assert len(calls) == 4


def test_v4_kernel_adapter_runs_the_projects_verify_step():
    pytest.importorskip("simtree.kernels.v4.steps")
    ctx = _ctx("tiny-v4")
    step, _ = build_workload(ctx, Point("v4_hca_verify", "torch_tree", "tiny-v4", 2, 5, 96, "eagle")).make()
    assert torch.isfinite(step()).all()


def test_gdn_commit_stage_rewrites_the_state_like_sequential_decoding(monkeypatch):
    # the timed step commits each tree's deepest node: one call must leave, per sequence, the
    # state of decoding that node's root path token by token (float64 reference)
    from simtree.kernels import gdn as kg
    from simtree.kernels.gdn import _launched
    from simtree.profiler.stages import _gdn_inputs
    ctx = _ctx()
    p = Point("gdn_tree_commit", "torch_ref", "tiny-gdn", 3, 6, 0, "eagle")
    tb, meta, args = _gdn_inputs(ctx, p.batch_size, p.nodes_per_seq, p.tree_shape)  # same seed
    seen = []
    real = _launched.launched_commit   # what the stage times: the commit on the variant's backend
    monkeypatch.setattr(_launched, "launched_commit",
                        lambda state, *a, **kw: seen.append(state) or real(state, *a, **kw))
    step, nb = build_workload(ctx, p).make()
    step()
    assert nb > 0 and len(seen) == 1
    assert all(t.depth[a] == t.max_depth for t, a in zip(tb.trees, tb.deepest_nodes))
    want = kg.gdn_accepted_paths_ref(*(a.double() for a in args[:6]), tb.trees, meta["cu_nodes"],
                                     tb.deepest_nodes)
    for b in range(len(tb.trees)):
        assert float((seen[0][b].double() - want[b]).abs().max() / want[b].abs().max()) < 1e-4


def test_gdn_commit_check_compares_triton_with_torch():
    # the GPU sweep's check of the Triton commit, here through Triton's interpreter
    assert check_variant(_ctx(), "gdn_tree_commit", "triton_tree").startswith("ok")


@pytest.mark.parametrize("b", [1, 40])
def test_gdn_round_meta_stage_builds_what_the_verify_launch_walks(b):
    # the timed step returns the round's TreeMeta with the default verify launch's walk tables
    # already cached (the verify then reuses them), equal to building them afresh; eager.  Its
    # trees are in the runtime's order: depth-first where that pays (one tree of 70 nodes), as
    # built otherwise
    from simtree.kernels import gdn as kg
    from simtree.kernels.gdn._launch import verify_launch_config
    from simtree.profiler.pieces import tree_batch
    ctx = _ctx()
    wl = build_workload(ctx, Point("gdn_round_meta", "torch", "tiny-gdn", b, 70, 0, "eagle"))
    step, _ = wl.make()
    meta = step()
    built = set(meta._derived)
    dfs = kg.depth_first_pays(70, b)
    assert dfs == (b == 1) and meta.depth_first == dfs
    tb = tree_batch(b, 70, "eagle", ctx.seed)
    tb = tb.depth_first() if dfs else tb
    md = tb.to_torch()
    g = ctx.model.gdn
    cfg = verify_launch_config(b, g["value_heads"], g["value_dim"], "cpu", tb.max_nodes, dfs)
    walk = meta.heavy_first(md["cu_nodes"])[1] if cfg.heavy_first else meta
    cached = walk.subchunk_pairs(md["cu_nodes"], cfg.block_t)
    assert built == {("heavy_first",) if cfg.heavy_first else ("pairs", cfg.block_t)}
    fresh = kg.walk_tables(kg.tree_meta(md["parents"], md["cu_nodes"], depth_first=dfs), md["cu_nodes"],
                           cfg.block_t)
    assert wl.eager and cached[2] == fresh[2][2]
    assert torch.equal(cached[0], fresh[2][0]) and torch.equal(cached[1], fresh[2][1])


def test_gdn_decode_stage_is_one_recurrent_token_per_sequence(monkeypatch):
    # the timed step decodes one token per sequence: its state update equals the sequential
    # reference on that token; the GPU variant's check (through the interpreter) compares the
    # Triton per-node kernel with the torch step; trees of more than one node are refused
    from simtree.kernels import gdn as kg
    from simtree.profiler.stages import _gdn_inputs
    from simtree.kernels.gdn import ops as gdn_ops
    ctx = _ctx()
    _, _, args = _gdn_inputs(ctx, 3, 1, "linear")     # same seed: the stage's own inputs
    x = [a.double() for a in args]
    want = [kg.gdn_sequential_ref(*(y[b:b + 1] for y in x[:5]), x[5][b])[1] for b in range(3)]
    seen, real = [], gdn_ops.recurrent_step
    monkeypatch.setattr(gdn_ops, "recurrent_step", lambda *a: seen.append(a[5]) or real(*a))
    step, nb = build_workload(ctx, Point("gdn_decode_step", "torch_ref", "tiny-gdn", 3, 1, 0, "linear")).make()
    step()
    assert nb > 0 and len(seen) == 1
    for b in range(3):
        assert float((seen[0][b].double() - want[b]).abs().max() / want[b].abs().max()) < 1e-4
    assert check_variant(ctx, "gdn_decode_step", "triton_recurrent").startswith("ok")
    with pytest.raises(Unavailable, match="one token"):
        build_workload(ctx, Point("gdn_decode_step", "torch_ref", "tiny-gdn", 3, 4, 0, "linear"))
