"""Tree builders against brute force: EAGLE top-k expansion, DDTree best-first, CaDDTree stop."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from simtree.trees.builders import (_grow, _order_by_levels, batched_best_first_tree, best_first_order, best_first_tree,
                              cost_aware_budget, cost_aware_tree, eagle_name, eagle_tree, eagle_tree_positional,
                              linear_tree, parse_eagle_name)
from simtree.errors import SimtreeError
from simtree.acceptance.phi import expected_accepted_marginals
from simtree.trees.tree import DraftTree


def random_marginals(rng, P, K, vocab=1000):
    """Per-position top-K (distinct tokens, probs sorted desc, summing to < 1)."""
    probs = np.sort(rng.dirichlet(np.full(K + 1, 0.5), size=P)[:, :K], axis=1)[:, ::-1]
    tokens = np.stack([rng.choice(vocab, K, replace=False) for _ in range(P)])
    return tokens, np.ascontiguousarray(probs)


class RecordingDrafter:
    """Random top-k proposals; remembers each call so the test can check the frontier."""

    def __init__(self, seed, topk, vocab=100):
        self.rng, self.topk, self.vocab, self.calls = np.random.default_rng(seed), topk, vocab, []

    def __call__(self, parents, tokens, frontier):
        f = frontier.shape[0]
        logp = np.log(np.sort(self.rng.dirichlet(np.ones(self.topk + 2), size=f)[:, :self.topk], 1)[:, ::-1])
        toks = self.rng.integers(0, self.vocab, (f, self.topk))
        self.calls.append((parents.copy(), frontier.copy(), toks, logp))
        return toks, logp


def test_linear_tree_is_a_chain_with_root_first():
    tree = linear_tree([7, 3, 5, 1], [0.0, -0.1, -0.2, -0.3])
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.tokens.tolist() == [7, 3, 5, 1]
    assert np.allclose(tree.log_probs, [0, -0.1, -0.2, -0.3])


@given(st.integers(1, 6), st.integers(0, 10**6))
@settings(max_examples=20, deadline=None)
def test_eagle_with_topk_1_is_the_linear_chain(steps, seed):
    drafter = RecordingDrafter(seed, 1)
    tree = eagle_tree(drafter, steps, 1, steps + 1, root_token=42)
    chain_tokens = [42] + [int(c[2][0, 0]) for c in drafter.calls]
    assert np.array_equal(tree.parents, linear_tree(chain_tokens).parents)
    assert tree.tokens.tolist() == chain_tokens


@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 10**6), st.data())
@settings(max_examples=40, deadline=None)
def test_eagle_expands_topk_frontier_and_keeps_best_budget(steps, topk, seed, data):
    max_nodes = 1 + topk + (steps - 1) * topk * topk
    budget = data.draw(st.integers(1, max_nodes))
    drafter = RecordingDrafter(seed, topk)
    tree = eagle_tree(drafter, steps, topk, budget, root_token=3)
    # Reference: rebuild every generated node's score from the recorded calls.
    scores, parents, tokens = {0: 0.0}, {0: -1}, {0: 3}
    prev_step = [0]
    for call_parents, frontier, toks, logp in drafter.calls:
        # the frontier is the top-k of the previous step by cumulative score
        best = sorted(prev_step, key=lambda i: (-scores[i], i))[:topk]
        assert frontier.tolist() == best
        prev_step = []
        for a, node in enumerate(frontier):
            for b in range(topk):
                new = len(scores)
                scores[new], parents[new], tokens[new] = scores[int(node)] + logp[a, b], int(node), int(toks[a, b])
                prev_step.append(new)
    assert len(drafter.calls) == steps and len(scores) == max_nodes
    kept = sorted(sorted(range(1, max_nodes), key=lambda i: (-scores[i], i))[:budget - 1])
    assert tree.num_nodes == budget
    ids = [0] + kept
    assert tree.tokens.tolist() == [tokens[i] for i in ids]
    assert tree.parents.tolist() == [-1] + [ids.index(parents[i]) for i in kept]
    assert np.allclose(tree.path_log_prob, [scores[i] for i in ids])


@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 8), st.integers(0, 10**6), st.data())
@settings(max_examples=40, deadline=None)
def test_positional_eagle_is_eagle_with_a_drafter_that_reads_its_depths_row(steps, topk, rows, seed, data):
    # the numbers-in builder against eagle_tree with a callback computing each frontier node's
    # depth from scratch; rows need not be sorted by rank (running minimum), nor reach the depth
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(topk + 1), rows)[:, :topk]
    budget = data.draw(st.integers(1, 1 + topk + (steps - 1) * topk * topk))
    scores = np.log(np.maximum(np.minimum.accumulate(probs, axis=1), 1e-300))

    def propose(parents, tokens, frontier):
        depth = [0] * parents.shape[0]
        for i in range(1, parents.shape[0]):
            depth[i] = depth[parents[i]] + 1
        got = scores[[min(depth[f], rows - 1) for f in frontier]]
        return np.tile(np.arange(topk), (frontier.shape[0], 1)), got

    want = eagle_tree(propose, steps, topk, budget, root_token=5)
    tree = eagle_tree_positional(probs, steps, topk, budget, root_token=5)
    assert tree.parents.tolist() == want.parents.tolist() and tree.tokens.tolist() == want.tokens.tolist()
    assert np.allclose(tree.log_probs, want.log_probs)


def test_positional_eagle_refuses_bad_rows():
    with pytest.raises(SimtreeError, match="draft probs"):
        eagle_tree_positional(np.full((2, 2), 0.7), 2, 2, 4)
    with pytest.raises(SimtreeError, match="\\[depth, rank\\]"):
        eagle_tree_positional(np.zeros(3), 2, 2, 4)


def test_eagle_name_round_trip_and_errors():
    assert eagle_name(4, 2, 5) == "s4_k2_d5"
    assert parse_eagle_name("s4_k2_d5") == (4, 2, 5)
    for bad in ["s4_k2", "s0_k2_d5", "k2_s4_d5", "s4_k2_d5x"]:
        with pytest.raises(SimtreeError, match="EAGLE tree name"):
            parse_eagle_name(bad)


def test_eagle_rejects_budget_beyond_generated_nodes_and_bad_drafter():
    with pytest.raises(SimtreeError, match="exceeds the 7 nodes"):
        eagle_tree(RecordingDrafter(0, 2), 2, 2, 8)
    with pytest.raises(SimtreeError, match="expected \\(1, 2\\)"):
        eagle_tree(lambda p, t, f: (np.zeros((1, 3), int), np.zeros((1, 3))), 2, 2, 4)
    with pytest.raises(SimtreeError, match="NaN"):
        eagle_tree(lambda p, t, f: (np.zeros((len(f), 2), int), np.full((len(f), 2), np.nan)), 2, 2, 4)
    with pytest.raises(SimtreeError, match="budget must be an integer >= 1"):
        eagle_tree(RecordingDrafter(0, 2), 2, 2, 0)


@pytest.mark.parametrize("budget", [float("inf"), float("nan"), 2.5, True])
def test_non_integral_budget_is_a_one_line_error(budget):
    tokens, probs = random_marginals(np.random.default_rng(0), 3, 2)
    with pytest.raises(SimtreeError, match="budget must be an integer >= 1, got"):
        best_first_tree(tokens, probs, budget)
    assert best_first_tree(tokens, probs, np.float64(3.0)).num_nodes == 3   # integral floats (JSON) pass


def brute_force_best(tokens, probs, budget):
    """All paths of the full K-ary tree of depth P; the best budget-1 by prefix probability."""
    P, K = probs.shape
    paths = [r for d in range(1, P + 1) for r in itertools.product(range(K), repeat=d)]
    prefix = {r: math.prod(probs[i, ri] for i, ri in enumerate(r)) for r in paths}
    return sorted(paths, key=lambda r: -prefix[r])[:budget - 1], prefix


def tree_paths(tree, tokens):
    """Each non-root node as its tuple of ranks (column of its token at each depth)."""
    out = []
    for i in range(1, tree.num_nodes):
        path = tree.path_to(i)[1:]
        out.append(tuple(int(np.flatnonzero(tokens[d] == tree.tokens[j])[0]) for d, j in enumerate(path)))
    return out


@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 10**6), st.data())
@settings(max_examples=40, deadline=None)
def test_best_first_tree_equals_brute_force_top_prefix_probs(P, K, seed, data):
    tokens, probs = random_marginals(np.random.default_rng(seed), P, K)
    total = sum(K ** d for d in range(1, P + 1))
    budget = data.draw(st.integers(1, total + 1))
    tree = best_first_tree(tokens, probs, budget, root_token=5)
    best, prefix = brute_force_best(tokens, probs, budget)
    assert tree.num_nodes == budget and tree.tokens[0] == 5
    assert sorted(tree_paths(tree, tokens)) == sorted(best)
    got = np.exp(tree.path_log_prob[1:])
    assert np.allclose(np.sort(got), np.sort([prefix[r] for r in best]))


def test_best_first_order_is_non_increasing_and_prefixes_are_the_trees():
    tokens, probs = random_marginals(np.random.default_rng(1), 6, 4)
    order = best_first_order(tokens, probs, 40)
    assert np.all(np.diff(order.prefix_probs[1:]) <= 0)
    for n in (1, 2, 7, 40):
        small = best_first_tree(tokens, probs, n)
        assert np.array_equal(order.tree(n).parents, small.parents)
        assert np.isclose(order.cum_phi[n - 1], expected_accepted_marginals(small, tokens, probs))


@given(st.integers(1, 7), st.integers(1, 5), st.integers(1, 120), st.booleans(), st.integers(0, 10**6))
@settings(max_examples=60, deadline=None)
def test_level_beam_order_equals_heap_order_including_ties(P, K, budget, coarse, seed):
    rng = np.random.default_rng(seed)
    tokens, probs = random_marginals(rng, P, K)
    if coarse:  # many exactly equal prefix probs: the tie-break must agree too
        probs = np.sort(rng.choice([0.0, 0.125, 0.25, 0.5, 1.0], (P, K)), 1)[:, ::-1]
    heap, _ = _grow(tokens, probs, budget, 1, 7)
    beam = _order_by_levels(tokens, probs, budget, 7)
    for name in ("parents", "tokens", "probs", "prefix_probs", "depth", "rank"):
        assert np.array_equal(getattr(heap, name), getattr(beam, name)), name


def test_best_first_stops_when_all_levels_exhausted_and_sorts_unsorted_input():
    tokens, probs = random_marginals(np.random.default_rng(2), 2, 2)
    assert best_first_tree(tokens, probs, 100).num_nodes == 1 + 2 + 4
    shuffled = best_first_tree(tokens[:, ::-1], probs[:, ::-1], 5)
    assert np.array_equal(shuffled.tokens, best_first_tree(tokens, probs, 5).tokens)


@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 40), st.integers(0, 10**6))
@settings(max_examples=40, deadline=None)
def test_batched_best_first_width_1_is_best_first_and_never_beats_it(P, K, budget, seed):
    tokens, probs = random_marginals(np.random.default_rng(seed), P, K)
    ref = best_first_tree(tokens, probs, budget)
    tree1, steps1 = batched_best_first_tree(tokens, probs, budget, 1)
    assert np.array_equal(tree1.parents, ref.parents) and np.array_equal(tree1.tokens, ref.tokens)
    assert steps1 == ref.num_nodes - 1
    for width in (2, 3, 8):
        tree, _ = batched_best_first_tree(tokens, probs, budget, width)
        assert tree.num_nodes == ref.num_nodes
        phi = expected_accepted_marginals(tree, tokens, probs)
        assert phi <= expected_accepted_marginals(ref, tokens, probs) + 1e-12


@pytest.mark.parametrize("budget, width", [(5, 4), (17, 4), (30, 3), (64, 8)])
def test_batched_best_first_takes_ceil_budget_over_width_steps(budget, width):
    tokens, probs = random_marginals(np.random.default_rng(budget), 8, 8)
    tree, steps = batched_best_first_tree(tokens, probs, budget, width)
    assert tree.num_nodes == budget
    assert steps == math.ceil((budget - 1) / width)


def random_convex_cost(rng, max_n):
    """C_v(n) table for n = 1..max_n: non-decreasing, convex (sorted non-negative increments)."""
    increments = np.sort(rng.exponential(rng.uniform(0.01, 3.0), max_n - 1))
    increments[: rng.integers(0, max_n)] = 0.0  # a flat, memory-bound stretch first
    table = rng.uniform(5, 50) + np.concatenate([[0.0], np.cumsum(increments)])
    return lambda n: table[np.asarray(n) - 1]


@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 64), st.integers(0, 10**6))
@settings(max_examples=80, deadline=None)
def test_cost_aware_tree_equals_brute_force_argmax(P, K, max_budget, seed):
    rng = np.random.default_rng(seed)
    tokens, probs = random_marginals(rng, P, K)
    verify_cost, draft_cost = random_convex_cost(rng, max_budget), rng.uniform(0, 30)
    trees = [best_first_tree(tokens, probs, n) for n in range(1, max_budget + 1)]
    sizes = np.array([t.num_nodes for t in trees])
    objective = np.array([(1 + expected_accepted_marginals(t, tokens, probs)) / (draft_cost + verify_cost(t.num_nodes))
                          for t in trees])
    best = int(np.argmax(objective))
    tree = cost_aware_tree(tokens, probs, verify_cost, draft_cost, max_budget)
    if tree.num_nodes != sizes[best]:  # only exact floating-point ties may differ
        assert np.isclose(objective[list(sizes).index(tree.num_nodes)], objective[best], rtol=1e-12)
    else:
        assert np.array_equal(tree.parents, trees[best].parents)


@pytest.mark.parametrize("seed", range(3))
def test_cost_aware_budget_at_large_budget_equals_brute_force_argmax(seed):
    rng = np.random.default_rng(seed)
    tokens, probs = random_marginals(rng, 16, 8)
    probs = probs / probs.sum(1, keepdims=True) * 0.99  # confident drafter: large trees pay off
    max_budget = 256
    order = best_first_order(tokens, probs, max_budget)
    verify_cost = lambda n: 20.0 + 0.002 * np.maximum(np.asarray(n) - 64, 0) ** 2  # noqa: E731
    objective = [(1 + expected_accepted_marginals(best_first_tree(tokens, probs, n), tokens, probs))
                 / (8.0 + verify_cost(n)) for n in range(1, max_budget + 1)]
    assert cost_aware_budget(order, verify_cost, 8.0) == int(np.argmax(objective)) + 1


def test_cost_aware_budget_accepts_scalar_only_cost_and_rejects_nan():
    tokens, probs = random_marginals(np.random.default_rng(3), 8, 4)
    order = best_first_order(tokens, probs, 32)
    scalar_only = lambda n: 10.0 + 0.5 * float(n) ** 2  # noqa: E731  (float() fails on arrays)
    vector = lambda n: 10.0 + 0.5 * np.asarray(n, float) ** 2  # noqa: E731
    assert cost_aware_budget(order, scalar_only, 3.0) == cost_aware_budget(order, vector, 3.0)
    with pytest.raises(SimtreeError, match="finite and > 0"):
        cost_aware_budget(order, lambda n: np.full(np.shape(n), np.nan), 3.0)


@pytest.mark.parametrize("tokens, probs, fragment", [
    (np.zeros((2, 2), int), np.full((2, 2), np.nan), "finite"),
    (np.zeros((2, 2), int), np.full((2, 3), 0.1), "must be equal"),
    (np.zeros((2, 2)), np.full((2, 2), 0.1), "integers"),
    (np.zeros((2, 2), int), np.full((2, 2), 1.5), "marginal probs: row 0 sums to 3 (must sum to <= 1)"),
    (np.zeros((2, 2), int), np.array([[0.5, -0.1], [0.2, 0.1]]), "marginal probs: entry [0, 1] is -0.1 (must be >= 0)"),
])
def test_best_first_rejects_bad_marginals(tokens, probs, fragment):
    with pytest.raises(SimtreeError) as info:
        best_first_tree(tokens, probs, 4)
    assert fragment in str(info.value)


def test_builders_reject_marginal_rows_summing_above_one_like_phi():
    """Each entry in [0, 1] but a row sums above 1: phi rejects it, so must every builder."""
    tokens = np.array([[1, 2], [3, 4], [5, 6]])
    probs = np.array([[0.6, 0.3], [0.7, 0.5], [0.2, 0.1]])  # row 1 sums to 1.2
    message = "marginal probs: row 1 sums to 1.2 (must sum to <= 1)"
    calls = [lambda: best_first_tree(tokens, probs, 4), lambda: best_first_order(tokens, probs, 4),
             lambda: batched_best_first_tree(tokens, probs, 4, 2),
             lambda: cost_aware_tree(tokens, probs, lambda n: 10.0 + np.asarray(n, float), 5.0, 4),
             lambda: expected_accepted_marginals(DraftTree.chain(3), tokens, probs)]
    for call in calls:
        with pytest.raises(SimtreeError) as info:
            call()
        assert str(info.value) == message
    ok = probs.copy()
    ok[1] = [0.7, 0.3 + 1e-7]  # sums to 1 within the shared 1e-6 tolerance
    assert best_first_tree(tokens, ok, 4).num_nodes == 4
