"""The GDN layer's tree causal conv (kernels/layers/qwen.py: each node's taps over its ancestors
and the committed conv state; the conv and the accepted path's conv-state commit,
kernels/layers/reference.py) against the per-path reference (kernels/gdn/reference.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from simtree.kernels.gdn import tree_causal_conv_ref
from simtree.kernels.layers import qwen as Q
from simtree.kernels.layers import reference as ref
from simtree.models import get_model
from simtree.profiler.bench.gdn_util import eagle_like_tree
from simtree.trees.tree import DraftTree
from test_gdn_verify import random_tree

C = 8
DIMS = Q.QwenDims.of(get_model("tiny-gdn"))     # conv width W = 4
S1 = 64                                         # cache rows per sequence (max_len + 1)


def random_round(seed: int, n: int, B: int = 3):
    """B random trees of n nodes each, inputs, a conv state and weights (float64), and the
    round's metadata as the layer builds it."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(n, rng, reach=3) for _ in range(B)]
    parents = torch.as_tensor(np.stack([t.parents for t in trees]), dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B * n, C, generator=gen, dtype=torch.float64)
    state = torch.randn(B, C, DIMS.W - 1, generator=gen, dtype=torch.float64)     # [B, C, W-1] oldest first
    weight = torch.randn(C, DIMS.W, generator=gen, dtype=torch.float64)
    tables = Q.RoundTables(DIMS, "cpu", length=S1, dtype=torch.float64)
    rm = Q.round_meta(DIMS, tables, torch.full((B,), 5, dtype=torch.int64), parents, S1)
    return trees, tables, rm, x, state, weight


@pytest.mark.parametrize("seed, n", [(0, 6), (1, 9), (2, 1)])
@pytest.mark.parametrize("silu", [True, False])
def test_tree_conv_matches_per_path_reference(seed, n, silu):
    _, _, rm, x, state, weight = random_round(seed, n)
    flat = ref.tree_conv(x, state.transpose(1, 2), rm.conv_idx, weight, (C, C), silu)
    want = tree_causal_conv_ref(x, state, weight, rm.parents, rm.cu, activation="silu" if silu else None)
    assert torch.allclose(flat.view(-1, C), want, rtol=1e-12, atol=1e-12)


def test_per_path_reference_on_a_chain_is_a_flat_causal_conv():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, C, generator=gen, dtype=torch.float64)
    state = torch.randn(1, C, 3, generator=gen, dtype=torch.float64)
    weight = torch.randn(C, 4, generator=gen, dtype=torch.float64)
    chain = torch.tensor(DraftTree.chain(9).parents.tolist())
    got = tree_causal_conv_ref(x, state, weight, chain, torch.tensor([0, 9]), activation=None)
    full = torch.cat([state[0], x.T], dim=1)                      # [C, 3 + 9]
    flat = torch.nn.functional.conv1d(full[None], weight[:, None, :], groups=C)[0].T
    assert torch.allclose(got, flat, atol=1e-12)


@pytest.mark.parametrize("seed, n", [(3, 7), (4, 1)])
def test_conv_state_commit_keeps_last_inputs_of_accepted_path(seed, n):
    trees, tables, rm, x, state, _ = random_round(seed, n)
    accepted = torch.as_tensor([int(i) for i in np.random.default_rng(seed).integers(0, n, len(trees))])
    cm = Q.commit_meta(DIMS, tables, rm, accepted, S1)
    new = state.transpose(1, 2).contiguous()                      # the layer's [B, W-1, C]
    ref.gather_rows(new, x, cm.conv_idx)
    for b, t in enumerate(trees):
        rows = torch.as_tensor(t.path_to(int(accepted[b]))) + b * n
        hist = torch.cat([state[b], x[rows].T], dim=1)
        assert torch.equal(new[b].T, hist[:, -(DIMS.W - 1):])


def test_eagle_like_tree_has_n_nodes_and_scores_fall_along_paths():
    rng = np.random.default_rng(5)
    for n in (1, 4, 64, 128):
        t, steps, topk = eagle_like_tree(n, rng)
        assert t.num_nodes == n
        assert np.all(t.path_log_prob[1:] <= t.path_log_prob[t.parents[1:]])
