"""Expected accepted length: closed forms against brute force and Monte-Carlo (4 sigma)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from simtree.errors import SimtreeError
from simtree.acceptance.phi import (accepted_length_pmf, expected_accepted, expected_accepted_marginals,
                                    expected_accepted_positional, node_accept_probs_marginals,
                                    node_accept_probs_positional, sample_accepted_length, sibling_rank)
from simtree.acceptance.phi import _first_with_same_token
from simtree.trees.tree import DraftTree

MC_SAMPLES = 20_000


def random_tree(rng, n, vocab):
    parents = np.array([-1] + [rng.integers(max(0, i - 5), i) for i in range(1, n)])
    return DraftTree(parents, rng.integers(0, vocab, n), -rng.exponential(1.0, n))


def random_marginals(rng, P, K, vocab):
    probs = rng.dirichlet(np.r_[np.full(K, 1.0), 0.2], size=P)[:, :K]  # little unlisted mass
    tokens = np.stack([rng.choice(vocab, K, replace=False) for _ in range(P)])
    return tokens, probs


def random_accept_table(rng, depth, ranks):
    return rng.dirichlet(np.full(ranks + 1, 0.8), size=depth)[:, :ranks]


def test_expected_accepted_of_a_chain_is_sum_of_cumulative_products():
    p = np.array([1.0, 0.9, 0.5, 0.8])
    assert np.isclose(expected_accepted(DraftTree.chain(4), p), 0.9 + 0.45 + 0.36)


@given(st.integers(1, 60), st.integers(0, 10**6))
@settings(max_examples=30, deadline=None)
def test_expected_accepted_equals_brute_force_path_products(n, seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, n, 10)
    p = rng.random(n)
    brute = sum(np.prod(p[tree.path_to(i)[1:]]) for i in range(1, n))
    assert np.isclose(expected_accepted(tree, p), brute)


def test_marginal_accept_prob_is_token_prob_at_depth_and_zero_for_duplicate_sibling():
    tokens = np.array([[5, 6], [7, 8]])
    probs = np.array([[0.6, 0.3], [0.5, 0.2]])
    # root, children 5, 6, 5 (duplicate), 9 (unlisted); grandchild 8 under the first 5; depth 3
    tree = DraftTree([-1, 0, 0, 0, 0, 1, 5], tokens=[0, 5, 6, 5, 9, 8, 7])
    p = node_accept_probs_marginals(tree, tokens, probs)
    assert np.allclose(p, [1, 0.6, 0.3, 0.0, 0.0, 0.2, 0.0])
    assert np.isclose(expected_accepted_marginals(tree, tokens, probs), 0.6 + 0.3 + 0.6 * 0.2)


@given(st.integers(1, 40), st.integers(0, 10**6))
@settings(max_examples=30, deadline=None)
def test_sibling_rank_orders_children_by_log_prob(n, seed):
    tree = random_tree(np.random.default_rng(seed), n, 10)
    rank = sibling_rank(tree)
    for p in range(n):
        kids = [i for i in range(1, n) if tree.parents[i] == p]
        expected = sorted(kids, key=lambda i: (-tree.log_probs[i], i))
        assert [int(rank[i]) for i in expected] == list(range(len(kids)))


def within_4_sigma(samples, analytic):
    mean, sem = samples.mean(), samples.std(ddof=1) / np.sqrt(samples.size)
    return abs(mean - analytic) <= 4 * sem + 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_marginal_model_matches_monte_carlo(seed):
    rng = np.random.default_rng(seed)
    vocab = 5  # small vocab: duplicate sibling tokens and unlisted tokens both occur
    tokens, probs = random_marginals(rng, int(rng.integers(1, 8)), int(rng.integers(2, 5)), vocab)
    shape = random_tree(rng, int(rng.integers(10, 80)), vocab)
    # node tokens mostly drawn from the marginal list of their depth, so many nodes can match
    listed = tokens[np.minimum(shape.depth, tokens.shape[0]) - 1, rng.integers(0, tokens.shape[1], shape.num_nodes)]
    tree = DraftTree(shape.parents, np.where(rng.random(shape.num_nodes) < 0.8, listed, shape.tokens))
    assert not _first_with_same_token(tree).all()
    samples = sample_accepted_length(tree, rng, MC_SAMPLES, marginal_tokens=tokens, marginal_probs=probs)
    assert within_4_sigma(samples, expected_accepted_marginals(tree, tokens, probs))


@pytest.mark.parametrize("seed", range(6))
def test_positional_model_matches_monte_carlo(seed):
    rng = np.random.default_rng(100 + seed)
    tree = random_tree(rng, int(rng.integers(2, 80)), 50)
    table = random_accept_table(rng, int(rng.integers(1, 10)), int(rng.integers(1, 5)))
    samples = sample_accepted_length(tree, rng, MC_SAMPLES, accept_table=table)
    assert within_4_sigma(samples, expected_accepted_positional(tree, table))


@pytest.mark.parametrize("seed", range(6))
def test_accepted_length_pmf_matches_monte_carlo_and_phi(seed):
    """Each length's probability within 4 sigma of its Monte-Carlo frequency; the pmf sums to
    one and its mean is Phi(T)."""
    rng = np.random.default_rng(200 + seed)
    tree = random_tree(rng, int(rng.integers(2, 80)), 50)
    table = random_accept_table(rng, int(rng.integers(1, 10)), int(rng.integers(1, 5)))
    pmf = accepted_length_pmf(tree, node_accept_probs_positional(tree, table))
    assert pmf.shape == (tree.max_depth + 1,) and np.all(pmf >= 0)
    assert np.isclose(pmf.sum(), 1.0)
    assert np.isclose(pmf @ np.arange(pmf.size), expected_accepted_positional(tree, table))
    freq = np.bincount(sample_accepted_length(tree, rng, MC_SAMPLES, accept_table=table), minlength=pmf.size)
    sigma = np.sqrt(pmf * (1 - pmf) / MC_SAMPLES)
    assert np.all(np.abs(freq / MC_SAMPLES - pmf) <= 4 * sigma + 1e-9)


def test_positional_model_on_a_star_is_sum_of_first_row():
    tree = DraftTree([-1, 0, 0, 0], log_probs=[0, -2.0, -0.5, -1.0])  # ranks 2, 0, 1
    table = np.array([[0.5, 0.3, 0.1, 0.05]])
    assert np.isclose(expected_accepted_positional(tree, table), 0.9)


@pytest.mark.parametrize("call, fragment", [
    (lambda t: expected_accepted(t, [1.0, 0.5]), "2 acceptance probs for a tree of 3"),
    (lambda t: expected_accepted(t, [1.0, np.nan, 0.5]), "finite"),
    (lambda t: expected_accepted_positional(t, [[0.7, 0.6]]), "sum to <= 1"),
    (lambda t: expected_accepted_positional(t, [[np.nan]]), "finite"),
    (lambda t: expected_accepted_marginals(t, [[1, 1]], [[0.1, 0.2]]), "repeat"),
    (lambda t: expected_accepted_marginals(t, [[1, 2]], [[0.9, 0.2]]), "sum to <= 1"),
    (lambda t: sample_accepted_length(t, np.random.default_rng(0), 10), "either"),
])
def test_bad_acceptance_inputs_raise(call, fragment):
    with pytest.raises(SimtreeError) as info:
        call(DraftTree([-1, 0, 1]))
    assert fragment in str(info.value)
