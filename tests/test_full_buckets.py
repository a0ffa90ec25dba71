"""Static shapes of the full runtime: bucket padding, the device-built trees, the tree
attention kernel and the routed experts against plain references."""
import warnings

import numpy as np
import pytest
import torch

from simtree.planning.simulate import PolicySpec
from simtree.kernels.layers.attention import chain_bits, tree_attention_ref
from simtree.runtime.full.drafting import (RoundShape, TreeBuffers, accepted_path, draft_tree, own_row_bits,
                                           round_shape, topk_logp)
from simtree.runtime.full.engine import FullEngine
from simtree.kernels.layers.moe import routed_experts
from simtree.runtime.full.layers import DraftState
from simtree.trees.builders import eagle_tree

from full_helpers import FAMILIES, PROMPTS, tiny_model

EAGLE = PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6})


@pytest.mark.parametrize("name", FAMILIES)
def test_bucket_padding_never_changes_outputs(name):
    runs = []
    for nodes in (6, 9):
        engine = FullEngine(tiny_model(name), round_shape(EAGLE, nodes), 2, 128)
        engine.prefill(PROMPTS[:2])
        stats = engine.run(max_new_tokens=16)
        runs.append((engine.outputs(), stats.accepted.tolist()))
    assert runs[0] == runs[1]


def test_padding_nodes_are_never_accepted_and_leave_real_logits_alone():
    model = tiny_model("tiny-gdn")
    outs = []
    for nodes in (6, 10):
        engine = FullEngine(model, round_shape(EAGLE, nodes), 2, 96)
        engine.prefill(PROMPTS[:2])
        engine._draft()
        hidden, _ = model.verify(engine.st, engine.tree.tokens, engine.tree.parents)
        outs.append(hidden.view(2, nodes, -1)[:, :6])
        assert not bool(engine.tree.valid[:, 6:].any())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)


class _TokenDrafter:
    """A drafter whose next-token distribution depends on the input token only (table T)."""

    def __init__(self, vocab: int, seed: int):
        self.T = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2

    def draft_forward(self, ds, tokens, prev_hidden, pos, rows, bits):
        return tokens[..., None].double()

    def draft_logits(self, hidden):
        return self.T[hidden[..., 0].long()]


@pytest.mark.parametrize("steps, topk, budget", [(3, 2, 6), (4, 3, 10), (3, 1, 4), (1, 4, 3), (5, 2, 12)])
def test_device_tree_is_the_planners_eagle_tree(steps, topk, budget):
    drafter = _TokenDrafter(40, steps * 10 + topk)
    rs = RoundShape(steps, topk, budget, budget + 2)
    roots = torch.tensor([3, 7, 11])
    lp, ids = topk_logp(drafter.T[roots], topk)
    out = TreeBuffers.empty(3, rs.nodes, "cpu")
    ds = DraftState(torch.zeros(3, dtype=torch.int64), 10, None, None)
    draft_tree(drafter, ds, rs, roots, lp, ids, roots[:, None].double(), out, own_row_bits(rs, "cpu"))
    for b in range(3):
        def propose(parents, tokens, frontier):
            v, i = torch.log_softmax(drafter.T[torch.as_tensor(tokens[frontier])], -1).topk(topk, -1)
            return i.numpy(), v.numpy()
        ref = eagle_tree(propose, steps, topk, budget, int(roots[b]))
        assert np.array_equal(out.parents[b, :budget].numpy(), ref.parents)
        assert np.array_equal(out.tokens[b, :budget].numpy(), ref.tokens)
        assert np.array_equal(out.depth[b, :budget].numpy(), ref.depth)
        assert np.allclose(out.score[b, :budget].numpy(), ref.path_log_prob)


def test_accepted_path_walks_the_root_path():
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2]])
    depth = torch.tensor([[0, 1, 1, 2, 3, 2]])
    assert accepted_path(parents, depth, torch.tensor([4]), 5)[0, :4].tolist() == [0, 1, 3, 4]
    assert accepted_path(parents, depth, torch.tensor([0]), 5)[0, :1].tolist() == [0]


def _attention_inputs(seed, B=2, Q=3, Hq=4, Hkv=2, D=16, S=40, T=5):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    bits = torch.randint(0, 32, (B, Q, 1), generator=g) | 1
    return (r(B, Q, Hq, D), r(B, S, Hkv, D), r(B, S, Hkv, D), torch.tensor([7, 33]),
            torch.tensor([[7, 8, 9], [33, 34, 34]]), r(B, T, Hkv, D), r(B, T, Hkv, D), bits)


@pytest.mark.parametrize("window, sink", [(0, False), (8, True)])
def test_tree_attention_kernel_matches_the_reference(window, sink):
    from simtree.kernels.layers._attention_kernel import tree_attention_triton
    args = _attention_inputs(0)
    s = torch.randn(4) if sink else None
    got = tree_attention_triton(*args, scale=0.25, window=window, sink=s)
    want = tree_attention_ref(*args, scale=0.25, window=window, sink=s)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tree_attention_kernel_with_several_row_blocks_and_two_bit_words():
    """72 (query, head) rows of one KV head (two program blocks), 70 tree rows (two 64-bit words
    per query), per-query window starts and a sink."""
    from simtree.kernels.layers._attention_kernel import tree_attention_triton
    g = torch.Generator().manual_seed(5)
    B, Q, Hq, Hkv, D, S, T = 2, 9, 8, 1, 16, 50, 70
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    bits = torch.randint(-(1 << 62), 1 << 62, (B, Q, 2), generator=g)
    bits[..., 0] |= 1
    args = (r(B, Q, Hq, D), r(B, S, Hkv, D), r(B, S, Hkv, D), torch.tensor([3, 50]),
            torch.tensor([[3 + i for i in range(Q)], [50 + i for i in range(Q)]]), r(B, T, Hkv, D),
            r(B, T, Hkv, D), bits)
    sink = r(Hq)
    got = tree_attention_triton(*args, scale=0.25, window=12, sink=sink)
    want = tree_attention_ref(*args, scale=0.25, window=12, sink=sink)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tree_attention_reference_is_softmax_over_visible_rows():
    q, kc, vc, lens, pos, kt, vt, bits = _attention_inputs(1)
    out = tree_attention_ref(q, kc, vc, lens, pos, kt, vt, bits, scale=0.25)
    b, i, h = 1, 2, 3
    hk = h // 2
    visible = [kc[b, :33, hk]] + [kt[b, m, hk][None] for m in range(5) if int(bits[b, i, 0]) >> m & 1]
    keys = torch.cat(visible)
    vals = torch.cat([vc[b, :33, hk]] + [vt[b, m, hk][None] for m in range(5) if int(bits[b, i, 0]) >> m & 1])
    want = torch.softmax(keys @ q[b, i, h] * 0.25, 0) @ vals
    torch.testing.assert_close(out[b, i, h], want, rtol=1e-5, atol=1e-6)
    assert chain_bits(1, 3, "cpu")[0, :, 0].tolist() == [1, 3, 7]


def test_routed_experts_match_a_per_token_sum():
    g = torch.Generator().manual_seed(0)
    T, h, E, I, k = 7, 8, 4, 6, 2
    x = torch.randn(T, h, generator=g, dtype=torch.float64)
    wgu = torch.randn(E, 2 * I, h, generator=g, dtype=torch.float64)
    wd = torch.randn(E, h, I, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g, dtype=torch.float64)
    want = torch.zeros(T, h, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            a, b = (wgu[ids[t, j]] @ x[t]).chunk(2)
            want[t] += w[t, j] * (wd[ids[t, j]] @ (torch.nn.functional.silu(a) * b))
    torch.testing.assert_close(routed_experts(x, ids, w, wgu, wd), want)


def test_routed_experts_through_grouped_mm_match_the_per_expert_loop(monkeypatch):
    """The grouped-GEMM path (the one CUDA takes) on this CPU's torch._grouped_mm, fp32."""
    from simtree.kernels.layers import moe as layers
    g = torch.Generator().manual_seed(1)
    T, h, E, I, k = 9, 8, 4, 8, 2
    x = torch.randn(T, h, generator=g)
    wgu, wd = torch.randn(E, 2 * I, h, generator=g), torch.randn(E, h, I, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[:, 0] = 0                                   # an expert with many rows, and maybe one with none
    w = torch.rand(T, k, generator=g)
    loop = routed_experts(x, ids, w, wgu, wd)
    monkeypatch.setattr(layers, "grouped_mm_capturable", lambda *a: True)
    monkeypatch.setitem(layers._GROUPED_MM, "ok", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # a fallback to the loop would warn: fail instead
        grouped = routed_experts(x, ids, w, wgu, wd)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
