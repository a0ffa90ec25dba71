"""Tree causal conv over ancestors and the accepted-path conv-state commit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.gdn import conv_state_commit, tree_causal_conv, tree_causal_conv_ref
from simtree.profiler.bench.gdn_util import eagle_like_tree
from simtree.trees.tree import DraftTree, TreeBatch
from test_gdn_verify import random_tree

D = 8


def random_batch(seed: int):
    rng = np.random.default_rng(seed)
    trees = [random_tree(n, rng, reach=3) for n in (1, 2, 5, 23)]
    tb = TreeBatch(trees)
    md = tb.to_torch()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tb.total_nodes, D, generator=gen, dtype=torch.float64)
    state = torch.randn(tb.batch_size, D, 3, generator=gen, dtype=torch.float64)
    weight = torch.randn(D, 4, generator=gen, dtype=torch.float64)
    return trees, md, x, state, weight


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_matches_per_path_reference(seed, activation):
    trees, md, x, state, weight = random_batch(seed)
    bias = torch.randn(D, dtype=torch.float64)
    got = tree_causal_conv(x, state, weight, md["parents"], md["cu_nodes"], bias=bias, activation=activation)
    want = tree_causal_conv_ref(x, state, weight, md["parents"], md["cu_nodes"], bias=bias, activation=activation)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_conv_on_chain_equals_flat_causal_conv():
    _, _, _, state, weight = random_batch(2)
    x = torch.randn(9, D, dtype=torch.float64)
    md = TreeBatch([DraftTree.chain(9)]).to_torch()
    got = tree_causal_conv(x, state[:1], weight, md["parents"], md["cu_nodes"], activation=None)
    full = torch.cat([state[0], x.T], dim=1)                      # [D, 3 + 9]
    flat = torch.nn.functional.conv1d(full[None], weight[:, None, :], groups=D)[0].T
    assert torch.allclose(got, flat, atol=1e-12)


def test_conv_state_commit_keeps_last_inputs_of_accepted_path():
    trees, md, x, state, _ = random_batch(3)
    accepted = torch.tensor([0, 1, 4, 17])
    new = state.clone()
    conv_state_commit(new, x, md["parents"], md["cu_nodes"], accepted)
    for b, t in enumerate(trees):
        rows = torch.as_tensor(t.path_to(int(accepted[b]))) + int(md["cu_nodes"][b])
        hist = torch.cat([state[b], x[rows].T], dim=1)
        assert torch.equal(new[b], hist[:, -3:])


def test_conv_bad_shapes():
    _, md, x, state, weight = random_batch(4)
    with pytest.raises(SimtreeError, match="conv"):
        tree_causal_conv(x[:, :5], state, weight, md["parents"], md["cu_nodes"])
    with pytest.raises(SimtreeError, match="conv"):
        conv_state_commit(state, x, md["parents"], md["cu_nodes"], torch.tensor([0]))


def test_eagle_like_tree_has_n_nodes_and_scores_fall_along_paths():
    rng = np.random.default_rng(5)
    for n in (1, 4, 64, 128):
        t, steps, topk = eagle_like_tree(n, rng)
        assert t.num_nodes == n
        assert np.all(t.path_log_prob[1:] <= t.path_log_prob[t.parents[1:]])
