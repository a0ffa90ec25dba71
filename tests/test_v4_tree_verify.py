"""V4 tree verify: every node equals sequential decoding of its root path; no sibling leaks.

Tiny config: window 8, C4 (CSA, top-3 of the indexer), C8 (HCA, ratio 8): histories are chosen
so that C4 and C8 windows complete inside the trees (positions history .. history + depth).
"""
import numpy as np
import pytest
import torch

from simtree.kernels.v4 import (V4AttnConfig, V4Cache, empty_state, decode_tokens, plan_verify,
                                random_inputs, random_layer_weights, random_tree, tree_verify)
from simtree.kernels.v4.check import check_against_reference
from simtree.trees.tree import DraftTree, TreeBatch

CFG = V4AttnConfig.tiny()


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
@pytest.mark.parametrize("seed", [0, 1])
def test_nodes_match_sequential_decoding(kind, seed):
    # 14 -> C8 boundary at position 15 inside the tree; 22, 5: C4 boundaries at depths 1-2
    r = check_against_reference(CFG, kind, [14, 22, 5], nodes=10, seed=seed)
    assert r["verify_err"] < 1e-12


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_deep_chain_crosses_several_boundaries(kind):
    """A 13-node chain from position 6 crosses C4 boundaries 3x and the C8 boundary at 15."""
    trees = [DraftTree.chain(13), random_tree(6, np.random.default_rng(4))]
    r = check_against_reference(CFG, kind, [6, 30], trees=trees, seed=5)
    assert r["verify_err"] < 1e-12


def test_empty_history_tree():
    """The root is the very first token: no persistent state at all."""
    r = check_against_reference(CFG, "csa", [0, 3], nodes=7, seed=6)
    assert r["verify_err"] < 1e-12


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_triton_path_matches_reference(kind):
    """Fused pooling, indexer, list and attention kernels + the one-launch commit (fp32)."""
    r = check_against_reference(CFG, kind, [13, 22], nodes=9, seed=7, dtype=torch.float32, attention="triton")
    assert r["verify_err"] < 1e-4
    assert r["commit_err"] < 1e-5


def _setup(kind, seed=0):
    w = random_layer_weights(CFG, kind, seed)
    gen = torch.Generator().manual_seed(seed)
    st = empty_state(CFG, w)
    decode_tokens(CFG, w, st, random_inputs(CFG, 15, gen))
    cache = V4Cache.from_states(CFG, w, [st], 40, dtype=torch.float64, state_dtype=torch.float64)
    return w, cache, gen


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_sibling_branch_does_not_leak(kind):
    """Changing every input of one branch leaves the other branch's outputs bit-identical."""
    w, cache, gen = _setup(kind)
    tree = DraftTree(np.array([-1, 0, 1, 2, 0, 4, 5]))  # two chains of 3 below the root
    inp = random_inputs(CFG, 7, gen)
    plan = plan_verify(cache, TreeBatch((tree,)), w)
    out_a, _ = tree_verify(cache, w, inp, plan, attention="torch")
    other = random_inputs(CFG, 7, gen)
    for name in ("q", "kv", "x", "iq", "iw"):
        getattr(inp, name)[4:] = getattr(other, name)[4:]
    out_b, _ = tree_verify(cache, w, inp, plan, attention="torch")
    assert torch.equal(out_a[:4], out_b[:4])
    assert not torch.allclose(out_a[4:], out_b[4:])


def test_index_lists_name_only_own_path():
    """Tree-node rows in a node's window list are exactly its ancestors-or-self in the window."""
    w, cache, gen = _setup("hca")
    tree = random_tree(12, np.random.default_rng(9))
    plan = plan_verify(cache, TreeBatch((tree,)), w)
    Pw = cache.window.num_rows
    win = plan.win_idx.numpy()
    for j in range(tree.num_nodes):
        nodes = set((win[j][win[j] >= Pw] - Pw).tolist())
        path = tree.path_to(j)
        expect = {int(a) for a in path if tree.depth[a] > tree.depth[j] - CFG.window}
        assert nodes == expect


def test_batch_of_different_trees_and_lengths():
    rng = np.random.default_rng(11)
    trees = [random_tree(n, rng) for n in (1, 4, 9, 12)]
    r = check_against_reference(CFG, "hca", [7, 16, 31, 2], trees=trees, seed=11)
    assert r["verify_err"] < 1e-12
