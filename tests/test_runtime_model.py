"""Tree verify + commit of the GDN-hybrid model against plain sequential decoding (float64).

Tree verify computes in a different order than sequential decoding, so these tests run the
model in float64 (the GDN state is stored in fp32 by the kernels' contract, hence the 1e-5
tolerances); near-tie argmax flips are then impossible in practice.
"""
import numpy as np
import pytest
import torch

from runtime_helpers import random_prompts, random_tree_parents, tiny_model
from simtree.errors import SimtreeError
from simtree.trees.tree import DraftTree, TreeBatch


def _prefilled(model, prompts, max_len=64):
    cache = model.new_cache(len(prompts), max_len)
    model.prefill(cache, prompts)
    return cache


def _sequential_logits(model, prompt, path_tokens):
    cache = model.new_cache(1, 64)
    for t in prompt + list(path_tokens):
        logits = model.step(torch.tensor([t]), cache)
    return logits[0], cache


@pytest.mark.parametrize("seed", [0, 1])
def test_verify_logits_equal_sequential_decoding_of_each_path(seed):
    rng = np.random.default_rng(seed)
    model = tiny_model(seed)
    prompts = random_prompts(rng, [5, 9])
    trees = [DraftTree(random_tree_parents(rng, n), rng.integers(0, 64, n)) for n in (7, 5)]
    cache = _prefilled(model, prompts)
    logits, _ = model.verify(TreeBatch(trees), cache)
    row = 0
    for prompt, tree in zip(prompts, trees):
        for j in range(tree.num_nodes):
            ref, _ = _sequential_logits(model, prompt, tree.tokens[tree.path_to(j)])
            torch.testing.assert_close(logits[row + j], ref, atol=1e-5, rtol=0)
        row += tree.num_nodes


def test_verify_never_writes_the_cache():
    rng = np.random.default_rng(2)
    model = tiny_model(2)
    cache = _prefilled(model, random_prompts(rng, [4, 6, 3]))
    before = cache.snapshot()
    trees = [DraftTree(random_tree_parents(rng, n), rng.integers(0, 64, n)) for n in (6, 1, 9)]
    model.verify(TreeBatch(trees), cache)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.snapshot()))


def test_commit_equals_sequential_decoding_of_the_accepted_path():
    rng = np.random.default_rng(3)
    model = tiny_model(3)
    prompts = random_prompts(rng, [6, 3, 8])
    trees = [DraftTree(random_tree_parents(rng, n), rng.integers(0, 64, n)) for n in (8, 5, 1)]
    accepted = [int(rng.integers(0, t.num_nodes)) for t in trees]
    cache = _prefilled(model, prompts)
    batch = TreeBatch(trees)
    _, pend = model.verify(batch, cache)
    model.commit(cache, batch, pend, accepted)
    for b, (prompt, tree, a) in enumerate(zip(prompts, trees, accepted)):
        _, ref = _sequential_logits(model, prompt, tree.tokens[tree.path_to(a)])
        for got, want in zip(cache.narrow(b).snapshot(), ref.snapshot()):
            torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=0)


def test_rejected_branches_never_reach_persistent_state():
    """Committing a branching tree leaves exactly what committing the accepted chain alone
    leaves; KV rows past the new length stay untouched (zero)."""
    rng = np.random.default_rng(4)
    model = tiny_model(4)
    prompts = random_prompts(rng, [5, 7])
    trees = [DraftTree(random_tree_parents(rng, 10), rng.integers(0, 64, 10)) for _ in prompts]
    accepted = [int(t.leaves[0]) for t in trees]
    branchy = _prefilled(model, prompts)
    batch = TreeBatch(trees)
    _, pend = model.verify(batch, branchy)
    model.commit(branchy, batch, pend, accepted)
    chain_only = _prefilled(model, prompts)
    chains = TreeBatch([DraftTree.chain(len(t.path_to(a)), t.tokens[t.path_to(a)]) for t, a in zip(trees, accepted)])
    _, pend = model.verify(chains, chain_only)
    model.commit(chain_only, chains, pend, [c.num_nodes - 1 for c in chains.trees])
    assert torch.equal(branchy.lengths, chain_only.lengths)
    for got, want in zip(branchy.snapshot(), chain_only.snapshot()):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-6, rtol=0)
    for i, k in enumerate(branchy.k):
        if k is not None:
            for b, n in enumerate(branchy.lengths.tolist()):
                assert torch.count_nonzero(k[b, n:]) == 0 and torch.count_nonzero(branchy.v[i][b, n:]) == 0


def test_training_forward_matches_sequential_decoding():
    rng = np.random.default_rng(5)
    model = tiny_model(5)
    ids = random_prompts(rng, [12])[0]
    full = model(torch.tensor([ids]))[0]
    cache = model.new_cache(1, 16)
    for t, tok in enumerate(ids):
        torch.testing.assert_close(model.step(torch.tensor([tok]), cache)[0], full[t], atol=1e-5, rtol=0)


def test_tree_larger_than_cache_is_refused():
    model = tiny_model(6)
    cache = model.new_cache(1, 8)
    with pytest.raises(SimtreeError, match="does not fit"):
        model.verify(TreeBatch([DraftTree.chain(12)]), cache)


def test_verify_with_lengths_read_by_the_caller_is_the_same():
    # the engine reads the cache lengths once a round and hands them to verify
    rng = np.random.default_rng(7)
    model = tiny_model(7)
    cache = _prefilled(model, random_prompts(rng, [4, 7]))
    trees = TreeBatch([DraftTree(random_tree_parents(rng, n), rng.integers(0, 64, n)) for n in (5, 8)])
    own, _ = model.verify(trees, cache)
    given, _ = model.verify(trees, cache, cache.lengths.tolist())
    assert torch.equal(own, given)
    shorter, _ = model.verify(trees, cache, [n - 1 for n in cache.lengths.tolist()])
    assert not torch.allclose(own, shorter)      # the lengths handed in are the ones used
    with pytest.raises(SimtreeError, match="1 cache lengths for a cache of 2"):
        model.verify(trees, cache, [4])


def test_tree_attention_layout_holds_each_node_to_its_cache_and_ancestors():
    from simtree.runtime.model import tree_attention_meta
    rng = np.random.default_rng(7)
    for _ in range(5):
        sizes = rng.integers(1, 12, size=int(rng.integers(1, 5)))
        trees = [DraftTree(random_tree_parents(rng, int(n)), rng.integers(0, 64, int(n))) for n in sizes]
        batch = TreeBatch(trees)
        lens = rng.integers(0, 20, size=len(trees)).tolist()
        att = tree_attention_meta(batch, lens, "cpu")
        mask, local = att["mask"].numpy(), att["local"].numpy()
        lmax, nmax = max(lens), int(sizes.max())
        assert mask.shape == (len(trees), nmax, lmax + nmax) and mask.any(axis=2).all()
        for b, (t, n) in enumerate(zip(trees, lens)):
            rows = np.arange(batch.cu_nodes[b], batch.cu_nodes[b + 1])
            assert (local[rows] == np.arange(t.num_nodes)).all()
            want = np.zeros((t.num_nodes, lmax + nmax), bool)
            want[:, :n] = True
            want[:, lmax:lmax + t.num_nodes] = t.ancestor_mask
            assert (mask[b, :t.num_nodes] == want).all()


@pytest.mark.parametrize("name", ["vocab_size", "hidden_size", "head_dim", "max_position_embeddings"])
@pytest.mark.parametrize("bad, got", [(True, "True"), (2.5, "2.5"), (float("nan"), "nan"), (0, "0"), (-2, "-2")])
def test_config_integers_must_be_positive(name, bad, got):
    import dataclasses

    from runtime_helpers import tiny_config

    with pytest.raises(SimtreeError) as err:
        dataclasses.replace(tiny_config(), **{name: bad}).validate()
    assert str(err.value) == f"config {name} must be an integer >= 1, got {got}"
    cfg = dataclasses.replace(tiny_config(), **{name: np.int64(32)}).validate()   # numpy ints: as ints
    assert type(getattr(cfg, name)) is int and getattr(cfg, name) == 32
