"""Greedy acceptance: brute force over all paths, batched == per tree, and losslessness."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from simtree.trees.greedy import greedy_accept, greedy_accept_batch
from simtree.trees.builders import best_first_tree, eagle_tree
from simtree.errors import SimtreeError
from simtree.trees.tree import DraftTree, TreeBatch


def random_tree_and_target(rng, n, vocab=4):
    """Small vocab so sibling tokens repeat; targets mostly name an existing child's token."""
    parents = np.array([-1] + [rng.integers(max(0, i - 6), i) for i in range(1, n)])
    tree = DraftTree(parents, rng.integers(0, vocab, n), -rng.exponential(1.0, n))
    target = rng.integers(0, vocab, n)
    for i in range(n):
        kids = np.flatnonzero(tree.parents == i)
        if kids.size and rng.random() < 0.8:
            target[i] = tree.tokens[rng.choice(kids)]
    return tree, target


def brute_force_accept(tree, target):
    """Deepest node whose whole path is valid: each node matches the target at its parent and
    no lower-index sibling carries the same token (that sibling would win)."""
    def valid(j):
        p = tree.parents[j]
        earlier = [s for s in range(1, j) if tree.parents[s] == p and tree.tokens[s] == tree.tokens[j]]
        return tree.tokens[j] == target[p] and not earlier
    best = 0
    for i in range(1, tree.num_nodes):
        if all(valid(j) for j in tree.path_to(i)[1:]) and tree.depth[i] > tree.depth[best]:
            best = i
    return best


@given(st.integers(1, 120), st.integers(0, 10**6))
@settings(max_examples=60, deadline=None)
def test_greedy_accept_equals_brute_force_over_paths(n, seed):
    tree, target = random_tree_and_target(np.random.default_rng(seed), n)
    result = greedy_accept(tree, target)
    last = brute_force_accept(tree, target)
    assert result.path.tolist() == tree.path_to(last).tolist()
    assert result.num_accepted == tree.depth[last]
    assert result.accepted_tokens.tolist() == tree.tokens[tree.path_to(last)[1:]].tolist()
    assert result.bonus_token == target[last]


@given(st.lists(st.integers(1, 60), min_size=1, max_size=6), st.integers(0, 10**6))
@settings(max_examples=40, deadline=None)
def test_batched_greedy_accept_equals_per_tree(sizes, seed):
    rng = np.random.default_rng(seed)
    pairs = [random_tree_and_target(rng, n) for n in sizes]
    batch = TreeBatch(tuple(t for t, _ in pairs))
    out = greedy_accept_batch(batch, np.concatenate([g for _, g in pairs]))
    for b, (tree, target) in enumerate(pairs):
        ref = greedy_accept(tree, target)
        got = out.result(b)
        assert got.path.tolist() == ref.path.tolist()
        assert got.accepted_tokens.tolist() == ref.accepted_tokens.tolist()
        assert (out.num_accepted[b], out.bonus_tokens[b], out.last_node[b]) == \
               (ref.num_accepted, ref.bonus_token, ref.last_node)
        assert out.last_row[b] == batch.cu_nodes[b] + ref.last_node


def test_lowest_index_sibling_wins_on_shared_token():
    tree = DraftTree([-1, 0, 0, 2], tokens=[0, 7, 7, 3])
    result = greedy_accept(tree, [7, 9, 3, 5])  # node 2's subtree would match deeper
    assert result.path.tolist() == [0, 1] and result.bonus_token == 9


@pytest.mark.parametrize("target, fragment", [([1, 2], "expected [3]"), ([1.0, 2.0, 3.0], "integer")])
def test_greedy_accept_rejects_bad_targets(target, fragment):
    with pytest.raises(SimtreeError) as info:
        greedy_accept(DraftTree([-1, 0, 1]), target)
    assert fragment in str(info.value)


# ---- losslessness: speculative rounds reproduce plain greedy decoding ----------------------
VOCAB = 8


class Target:
    """Deterministic toy target: next token = table[previous token, current token]."""

    def __init__(self, rng):
        self.table = rng.integers(0, VOCAB, (VOCAB, VOCAB))

    def greedy(self, prefix, length):
        seq = list(prefix)
        while len(seq) < length:
            seq.append(int(self.table[seq[-2], seq[-1]]))
        return seq

    def next_for_tree(self, tree, context_token):
        """target_next [n]: the target's greedy token after each node's path."""
        prev = np.where(tree.parents >= 0, tree.tokens[np.maximum(tree.parents, 0)], context_token)
        return self.table[prev, tree.tokens]


def noisy_candidates(rng, true_token, k, hit=0.7):
    """k distinct tokens, the true one among them with probability ``hit`` (random rank)."""
    cands = list(rng.permutation([t for t in range(VOCAB) if t != true_token])[:k])
    if rng.random() < hit:
        cands[rng.integers(0, k)] = true_token
    return np.array(cands)


def eagle_builder(target, rng, steps, topk, budget):
    def build(seq):
        def propose(parents, tokens, frontier):
            prev = np.where(parents[frontier] >= 0, tokens[np.maximum(parents[frontier], 0)], seq[-2])
            true = target.table[prev, tokens[frontier]]
            toks = np.stack([noisy_candidates(rng, t, topk) for t in true])
            logp = np.log(np.sort(rng.dirichlet(np.ones(topk + 1), len(frontier))[:, :topk], 1)[:, ::-1])
            return toks, logp
        return eagle_tree(propose, steps, topk, budget, root_token=seq[-1])
    return build


def best_first_builder(target, rng, positions, topk, budget):
    def build(seq):
        truth = target.greedy(seq[-2:], positions + 2)[2:]  # a block drafter's noisy guess
        tokens = np.stack([noisy_candidates(rng, t, topk) for t in truth])
        probs = np.sort(rng.dirichlet(np.ones(topk + 1), positions)[:, :topk], 1)[:, ::-1]
        return best_first_tree(tokens, probs, budget, root_token=seq[-1])
    return build


@pytest.mark.parametrize("kind, shape", [("eagle", (4, 2, 8)), ("eagle", (3, 1, 4)), ("eagle", (5, 3, 16)),
                                         ("best_first", (6, 3, 12)), ("best_first", (4, 1, 5))])
def test_speculative_rounds_reproduce_greedy_decoding(kind, shape):
    rng = np.random.default_rng(sum(shape))
    target = Target(rng)
    length, batch = 80, 3
    seqs = [[int(a), int(b)] for a, b in rng.integers(0, VOCAB, (batch, 2))]
    expected = [target.greedy(s, length) for s in seqs]
    make = eagle_builder if kind == "eagle" else best_first_builder
    build = make(target, rng, *shape)
    rounds = accepted = 0
    while min(len(s) for s in seqs) < length:
        trees = [build(s) for s in seqs]
        flat_target = np.concatenate([target.next_for_tree(t, s[-2]) for t, s in zip(trees, seqs)])
        out = greedy_accept_batch(TreeBatch(tuple(trees)), flat_target)
        for b, s in enumerate(seqs):
            r = out.result(b)
            s.extend(r.accepted_tokens.tolist() + [r.bonus_token])
            accepted += r.num_accepted
        rounds += 1
    assert [s[:length] for s in seqs] == expected
    assert accepted > rounds  # the drafts were really used, not only bonus tokens
