"""DraftTree / TreeBatch: derived views against brute force, and one-line errors on bad input."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from simtree.errors import TreeError
from simtree.trees.tree import DraftTree, TreeBatch

SETTINGS = settings(max_examples=40, deadline=None)


def random_parents(n: int, seed: int, style: str) -> np.ndarray:
    """Topologically ordered parent array of n nodes: random, chain-like, star-like or wide."""
    rng = np.random.default_rng(seed)
    parents = np.full(n, -1, np.int64)
    for i in range(1, n):
        if style == "chain":
            parents[i] = i - 1 if rng.random() < 0.9 else rng.integers(0, i)
        elif style == "star":
            parents[i] = 0 if rng.random() < 0.7 else rng.integers(0, i)
        elif style == "recent":  # EAGLE-like: parents among the last few nodes
            parents[i] = rng.integers(max(0, i - 4), i)
        else:
            parents[i] = rng.integers(0, i)
    return parents


trees = st.builds(lambda n, seed, style: DraftTree(random_parents(n, seed, style),
                                                   np.random.default_rng(seed).integers(0, 50, n),
                                                   -np.random.default_rng(seed + 1).exponential(1.0, n)),
                  st.integers(1, 512), st.integers(0, 2**31), st.sampled_from(["random", "chain", "star", "recent"]))


def brute_ancestors(parents: np.ndarray, i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = int(parents[i])
        out.add(i)
    return out


def unpack(bits: np.ndarray, n: int) -> np.ndarray:
    u = bits.view(np.uint64)
    shifts = np.arange(64, dtype=np.uint64)
    full = ((u[:, :, None] >> shifts) & np.uint64(1)).astype(bool).reshape(u.shape[0], -1)
    return full[:, :n]


@SETTINGS
@given(trees)
def test_ancestor_mask_and_bits_match_brute_force_walk(tree):
    n = tree.num_nodes
    brute = np.zeros((n, n), bool)
    for i in range(n):
        brute[i, list(brute_ancestors(tree.parents, i))] = True
    assert np.array_equal(tree.ancestor_mask, brute)
    assert tree.ancestor_bits.shape == (n, (n + 63) // 64)
    assert np.array_equal(unpack(tree.ancestor_bits, n), brute)
    assert np.array_equal(tree.depth, brute.sum(1) - 1)


@SETTINGS
@given(trees)
def test_chains_are_root_to_leaf_paths_covering_every_node(tree):
    covered = np.zeros(tree.num_nodes, bool)
    assert len(tree.chains) == tree.leaves.size
    for chain, leaf in zip(tree.chains, tree.leaves):
        assert chain[0] == 0 and chain[-1] == leaf
        assert np.all(tree.parents[chain[1:]] == chain[:-1])
        covered[chain] = True
    assert covered.all()


@SETTINGS
@given(trees)
def test_next_token_and_next_sibling_rebuild_children_lists(tree):
    expected = [[] for _ in range(tree.num_nodes)]
    for i in range(1, tree.num_nodes):
        expected[tree.parents[i]].append(i)
    for p in range(tree.num_nodes):
        got, c = [], int(tree.next_token[p])
        while c >= 0:
            got.append(c)
            c = int(tree.next_sibling[c])
        assert got == expected[p]
    assert np.array_equal(tree.num_children, [len(c) for c in expected])


@SETTINGS
@given(trees)
def test_path_log_prob_is_sum_along_path(tree):
    i = tree.num_nodes - 1
    path = tree.path_to(i)
    assert np.isclose(tree.path_log_prob[i], tree.log_probs[path[1:]].sum())
    assert np.array_equal(tree.positions(17), 17 + tree.depth)


@SETTINGS
@given(st.lists(trees, min_size=1, max_size=5), st.integers(0, 2**31))
def test_batch_offsets_and_flat_views(tree_list, seed):
    batch = TreeBatch(tuple(tree_list))
    sizes = [t.num_nodes for t in tree_list]
    assert np.array_equal(batch.cu_nodes, np.concatenate([[0], np.cumsum(sizes)]))
    cache = np.random.default_rng(seed).integers(0, 1000, len(tree_list))
    pos = batch.positions(cache)
    for b, t in enumerate(tree_list):
        lo, hi = batch.cu_nodes[b], batch.cu_nodes[b + 1]
        assert np.array_equal(batch.parents[lo:hi], t.parents)
        assert np.array_equal(batch.seq_ids[lo:hi], np.full(t.num_nodes, b))
        assert np.array_equal(batch.tokens[lo:hi], t.tokens)
        assert np.array_equal(pos[lo:hi], cache[b] + t.depth)
        glob = batch.parents_global[lo:hi]
        assert glob[0] == -1 and np.array_equal(glob[1:], t.parents[1:] + lo)
        bits = batch.ancestor_bits[lo:hi]
        assert np.array_equal(unpack(bits, batch.max_nodes)[:, :t.num_nodes], t.ancestor_mask)
        assert not unpack(bits, batch.max_nodes)[:, t.num_nodes:].any()


def test_subtree_keeps_ancestor_closed_set_and_renumbers():
    tree = DraftTree([-1, 0, 0, 1, 2, 3], tokens=[9, 1, 2, 3, 4, 5], log_probs=[0, -1, -2, -3, -4, -5])
    sub = tree.subtree([0, 2, 4])
    assert sub.parents.tolist() == [-1, 0, 1]
    assert sub.tokens.tolist() == [9, 2, 4]
    assert sub.log_probs.tolist() == [0, -2, -4]


def test_tree_does_not_alias_caller_arrays():
    parents = np.array([-1, 0, 0, 1])
    tree = DraftTree(parents)
    parents[3] = 2
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert parents.flags.writeable


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(parents=[]), "empty"),
    (dict(parents=[0, 0]), "node 0 must be the root"),
    (dict(parents=[-1, -1, 0]), "several roots"),
    (dict(parents=[-1, 0, 2]), "cycle through node 2"),
    (dict(parents=[-1, 2, 1]), "cycle"),
    (dict(parents=[-1, 0, 3, 1]), ">= 2"),
    (dict(parents=[-1, 7]), "outside [0, 1]"),
    (dict(parents=[-1, -3]), "outside"),
    (dict(parents=[-1, 0.5]), "not an integer"),
    (dict(parents=["a", "b"]), "not an integer type"),
    (dict(parents=[-1, 0], tokens=[1, 2, 3]), "token/parent length mismatch"),
    (dict(parents=[-1, 0], tokens=[1, float("nan")]), "token array"),
    (dict(parents=[-1, 0], log_probs=[0.0]), "score/parent length mismatch"),
    (dict(parents=[-1, 0], log_probs=[0.0, float("nan")]), "invalid draft log-prob at node 1"),
    (dict(parents=[-1, 0], log_probs=[0.0, 0.5]), "must be finite and <= 0"),
])
def test_invalid_tree_raises_one_line_tree_error(kwargs, fragment):
    with pytest.raises(TreeError) as info:
        DraftTree(**kwargs)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("call, fragment", [
    (lambda t: t.subtree([1, 2]), "must keep the root"),
    (lambda t: t.subtree([0, 3]), "not ancestor-closed"),
    (lambda t: t.subtree([0, 9]), "not in a tree of 4 nodes"),
    (lambda t: t.path_to(4), "not in a tree"),
    (lambda t: TreeBatch(()), "batch is empty"),
    (lambda t: TreeBatch((t, [-1, 0])), "not a DraftTree"),
    (lambda t: TreeBatch((t,)).positions([1, 2]), "2 cache lengths for a batch of 1"),
    (lambda t: DraftTree.chain(0), "chain length must be an integer >= 1, got 0"),
    (lambda t: DraftTree.chain(2.5), "chain length must be an integer >= 1, got 2.5"),
    (lambda t: DraftTree.chain(True), "chain length must be an integer >= 1, got True"),
    (lambda t: DraftTree.chain(float("nan")), "chain length must be an integer >= 1, got nan"),
])
def test_invalid_use_raises_tree_error(call, fragment):
    tree = DraftTree([-1, 0, 0, 2])
    with pytest.raises(TreeError, match=None) as info:
        call(tree)
    assert fragment in str(info.value)


def loop_reference(parents: np.ndarray, log_probs: np.ndarray) -> dict:
    """The straightforward per-node recurrences (parents precede children) the fast views replace."""
    n = parents.shape[0]
    depth, score = np.zeros(n, np.int64), np.array(log_probs, np.float64)
    score[0] = 0.0
    mask = np.zeros((n, n), bool)
    mask[0, 0] = True
    first, nxt, last = np.full(n, -1, np.int64), np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    for i in range(1, n):
        p = int(parents[i])
        depth[i] = depth[p] + 1
        score[i] = score[i] + score[p]
        mask[i] = mask[p]
        mask[i, i] = True
        if first[p] < 0:
            first[p] = i
        if last[p] >= 0:
            nxt[last[p]] = i
        last[p] = i
    words = np.zeros((n, (n + 63) // 64), np.uint64)
    for i, j in zip(*np.nonzero(mask)):
        words[i, j // 64] |= np.uint64(1) << np.uint64(j % 64)
    return {"depth": depth, "path_log_prob": score, "ancestor_mask": mask, "next_token": first,
            "next_sibling": nxt, "ancestor_bits": words.view(np.int64)}


def _fast_view_cases():
    cases = [("root only", np.array([-1]), np.zeros(1)), ("chain of 64", np.arange(-1, 63), None),
             ("two nodes", np.array([-1, 0]), np.array([0.0, -0.0]))]
    for n in (2, 17, 64, 65, 300):
        for style in ("random", "chain", "star", "recent"):
            seed = 1000 * n + len(style)
            cases.append((f"{style} {n}", random_parents(n, seed, style), None))
    rng = np.random.default_rng(0)
    out = []
    for name, parents, log_probs in cases:
        if log_probs is None:  # exponential scores, some exactly -0.0 (a log-prob of 1)
            log_probs = -rng.exponential(1.0, parents.shape[0]) * (rng.random(parents.shape[0]) < 0.9)
        out.append(pytest.param(parents, log_probs, id=name))
    return out


@pytest.mark.parametrize("parents, log_probs", _fast_view_cases())
def test_fast_views_equal_the_per_node_loop_bit_for_bit(parents, log_probs):
    tree = DraftTree(parents, None, log_probs)
    ref = loop_reference(tree.parents, tree.log_probs)
    for name, want in ref.items():
        got = getattr(tree, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name  # path_log_prob too: same additions, same order
    assert np.all(tree.path_log_prob[1:] <= tree.path_log_prob[tree.parents[1:]])
    assert tree.max_depth == ref["depth"].max()
    for node in range(tree.num_nodes):
        assert tree.path_to(node).tolist() == np.flatnonzero(ref["ancestor_mask"][node]).tolist()
    assert np.array_equal(TreeBatch((tree, tree)).depth, np.concatenate([ref["depth"]] * 2))


def test_deepest_nodes_and_depth_first_batch_keep_paths():
    # TreeBatch.deepest_nodes: per tree a node of maximal depth (the last such in stored order);
    # depth_first() renumbers every tree, keeping each node's root path of tokens
    rng = np.random.default_rng(41)
    trees = [DraftTree(np.array([-1] + [int(rng.integers(max(0, i - 5), i)) for i in range(1, n)]),
                       rng.integers(0, 50, n)) for n in rng.integers(1, 60, 8)]
    batch = TreeBatch(trees)
    for t, d in zip(trees, batch.deepest_nodes):
        assert t.depth[d] == t.max_depth and not np.any(t.depth[d + 1:] == t.max_depth)
    dfs = batch.depth_first()
    assert dfs.is_depth_first and dfs.cu_nodes.tolist() == batch.cu_nodes.tolist()
    for t, u in zip(trees, dfs.trees):
        paths = lambda x: sorted(tuple(x.tokens[x.path_to(i)]) for i in range(x.num_nodes))  # noqa: E731
        assert paths(t) == paths(u) and u.max_depth == t.max_depth
