"""Accepted-path refresh: committed state == sequential decoding; rejected rounds change nothing."""
import numpy as np
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.v4 import (V4AttnConfig, V4Cache, commit, decode_tokens, empty_state, plan_verify,
                                random_inputs, random_layer_weights, random_tree, tree_verify)
from simtree.kernels.v4.check import check_against_reference
from simtree.trees.tree import DraftTree, TreeBatch

CFG = V4AttnConfig.tiny()


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_commit_deepest_path_equals_sequential(kind):
    r = check_against_reference(CFG, kind, [14, 21, 6], nodes=10, seed=2)
    assert r["commit_err"] < 1e-12
    assert not r["verify_wrote_cache"]


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_commit_long_chain_across_c8_boundary(kind):
    """An accepted 13-token chain: several C4 entries, one C8 entry, buffers mid-window."""
    r = check_against_reference(CFG, kind, [6, 3], trees=[DraftTree.chain(13), DraftTree.chain(5)], seed=3)
    assert r["commit_err"] < 1e-12


def test_root_only_and_rejected_sequences():
    """[0] commits exactly the root token; [] leaves that sequence bit-identical."""
    r = check_against_reference(CFG, "csa", [14, 22, 5], nodes=8, seed=4, accepted=[[0], [], [0]])
    assert r["commit_err"] < 1e-12
    assert r["rejected_identical"]


def _round(kind="csa", seed=0):
    w = random_layer_weights(CFG, kind, seed)
    gen = torch.Generator().manual_seed(seed)
    states = []
    for L in (11, 18):
        st = empty_state(CFG, w)
        decode_tokens(CFG, w, st, random_inputs(CFG, L, gen))
        states.append(st)
    cache = V4Cache.from_states(CFG, w, states, 48, dtype=torch.float32, state_dtype=torch.float32)
    rng = np.random.default_rng(seed)
    tb = TreeBatch((random_tree(8, rng), random_tree(6, rng)))
    plan = plan_verify(cache, tb, w)
    _, scratch = tree_verify(cache, w, random_inputs(CFG, tb.total_nodes, gen, torch.float32), plan, attention="torch")
    return w, cache, plan, scratch, tb


def test_fully_rejected_round_is_bit_identical():
    w, cache, plan, scratch, _ = _round()
    before = cache.checksum()
    commit(cache, w, plan, scratch, [[], []])
    assert cache.checksum() == before


@pytest.mark.parametrize("bad", [[[1], [0]], [[0, 5, 1], [0]], [[0]], [[0, 99], [0]]])
def test_invalid_accepted_path_is_rejected(bad):
    w, cache, plan, scratch, _ = _round()
    before = cache.checksum()
    with pytest.raises(SimtreeError):
        commit(cache, w, plan, scratch, bad)
    assert cache.checksum() == before


def test_commit_twice_with_one_plan_is_refused():
    w, cache, plan, scratch, _ = _round()
    commit(cache, w, plan, scratch, [[0], [0]])
    with pytest.raises(SimtreeError):
        commit(cache, w, plan, scratch, [[0], [0]])
