"""MoE cost forms: expert-saturation recovery, reported non-convexity, global-argmax budgets."""
import types
import warnings

import numpy as np
import pytest

from simtree.acceptance.model import calibrate_linear
from simtree.trees.builders import best_first_order, best_first_tree, cost_aware_budget
from simtree.costs.surface_fit import fit_surface
from simtree.costs.forms import MoEGridSurface, MoESurface, ScaledVerifyDraft, touched_experts
from simtree.costs.surface_fit import MOE_FORMS
from simtree.costs.model import VERIFY_AXES, CostBundle, DraftCostModel, VerifyCostModel, load_costs
from simtree.errors import SimtreeError
from simtree.acceptance.phi import expected_accepted_marginals
from simtree.planning.modes import BatchAllocParams, CostAwareParams
from simtree.planning.adaptive import AdaptiveRounds

E, K = 64, 4                 # experts, experts per token: saturates at T = b n = 16 tokens
ALPHA = 4000.0               # us for reading every expert once
NS = np.array([1, 2, 4, 8, 16, 32, 64])
LS = np.array([4096, 32768, 131072])
BS = np.array([1, 4, 16])


def convex_part(n, l, b):
    return 300 + 2.0 * np.maximum(n * b - 128, 0) + 5 * b + 2e-3 * b * l + 1e-5 * n * b * l


def moe_truth(n, l, b):
    return convex_part(n, l, b) + ALPHA * touched_experts(n * b, E, K) / E


def moe_points(rng, noise=0.01):
    n, l, b = (a.ravel() for a in np.meshgrid(NS, LS, BS, indexing="ij"))
    return n, l, b, moe_truth(n, l, b) * (1 + noise * rng.standard_normal(n.shape))


@pytest.fixture(scope="module")
def moe_fit():
    n, l, b, y = moe_points(np.random.default_rng(0))
    return fit_surface(n, l, b, y, "verify", VERIFY_AXES, forms=("basis", "grid", *MOE_FORMS),
                       folds=3, moe=(E, K))


def test_saturating_profile_is_recovered_within_noise_by_an_moe_form(moe_fit):
    n, l, b, _ = moe_points(np.random.default_rng(0))
    assert moe_fit.form in MOE_FORMS
    err = np.abs(moe_fit.surface.predict(n, l, b) / moe_truth(n, l, b) - 1)
    assert np.median(err) < 0.01 and err.max() < 0.05
    assert moe_fit.heldout[moe_fit.form]["median"] < 0.02
    convex_best = min(moe_fit.heldout[f]["median"] + moe_fit.heldout[f]["p90"] for f in ("basis", "grid"))
    assert moe_fit.heldout[moe_fit.form]["median"] + moe_fit.heldout[moe_fit.form]["p90"] < convex_best
    assert moe_fit.surface.alpha == pytest.approx(ALPHA, rel=0.15)


def test_kept_moe_form_is_reported_not_convex(moe_fit):
    assert moe_fit.convex_in_x is False and not moe_fit.surface.convex_in_x
    assert "E(1-(1-k/E)^T) experts touched (uniform routing)" in moe_fit.surface.nonconvex_reason
    assert moe_fit.surface.routing == "uniform"
    assert any("NOT convex in nodes_per_seq" in note for note in moe_fit.notes)


@pytest.mark.parametrize("form", MOE_FORMS)
def test_moe_forms_are_monotone_everywhere_but_concave_where_experts_saturate(form):
    n, l, b, y = moe_points(np.random.default_rng(1), noise=0.03)
    s = fit_surface(n, l, b, y, "verify", VERIFY_AXES, forms=(form,), folds=2, moe=(E, K)).surface
    v = assert_monotone(s, np.linspace(0.5, 128, 256), np.linspace(0, 262144, 17),
                        np.array([1, 2.5, 3, 7, 16, 30, 64]))
    assert np.diff(v, n=2, axis=0).min() < -1.0   # the kink at saturation: truly not convex


def assert_monotone(surface, qn, ql, qb) -> np.ndarray:
    """Assert ``surface`` non-decreasing along n, l and b on the query grid (in range and beyond);
    return its values there [n, l, b]."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        v = surface.predict(qn[:, None, None], ql[None, :, None], qb[None, None, :])
    tol = 1e-9 * np.abs(v).max()
    for axis, name in enumerate(("n", "l", "b")):
        assert np.all(np.diff(v, axis=axis) >= -tol), f"decreasing in {name}"
    return v


@pytest.mark.parametrize("form", MOE_FORMS)
def test_scalar_fast_path_matches_vector_path(form):
    n, l, b, y = moe_points(np.random.default_rng(2))
    s = fit_surface(n, l, b, y, "verify", VERIFY_AXES, forms=(form,), folds=2, moe=(E, K)).surface
    q = [(1, 4096, 1), (3, 10000, 5), (64, 131072, 16), (100, 300000, 90), (0.5, 0, 0.5), (5, 50000, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        vec = s.predict(*(np.array(c, dtype=float) for c in zip(*q)))
        for i, p in enumerate(q):
            assert s.predict(*p) == pytest.approx(vec[i], rel=1e-12)


@pytest.mark.parametrize("form", MOE_FORMS)
def test_save_load_round_trip_keeps_convex_in_n(tmp_path, form):
    rng = np.random.default_rng(3)
    s = fit_surface(*moe_points(rng), "verify", VERIFY_AXES, forms=(form,), folds=2, moe=(E, K)).surface
    info = {"form": form, "convex_in_n": False, "nonconvex_reason": s.nonconvex_reason}
    bundle = CostBundle(VerifyCostModel(s, info), DraftCostModel(ScaledVerifyDraft(s, 0.05, 32768.0)),
                        {"model": "toy-moe", "device": "cpu", "source": "test", "synthetic": True})
    loaded = load_costs(bundle.save(tmp_path / "costs.json"))
    assert isinstance(loaded.verify.surface, MoESurface if form == "moe" else MoEGridSurface)
    assert loaded.verify.convex_in_n is False and loaded.draft.convex_in_topk is False
    q = (rng.uniform(1, 64, 300), rng.uniform(4096, 131072, 300), rng.uniform(1, 16, 300))
    assert np.array_equal(bundle.verify.predict(*q), loaded.verify.predict(*q))


def test_bundle_without_the_key_loads_as_convex(tmp_path):
    rng = np.random.default_rng(4)
    n, l, b, y = moe_points(rng)
    s = fit_surface(n, l, b, convex_part(n, l, b), "verify", VERIFY_AXES, forms=("basis",), folds=2).surface
    d = CostBundle(VerifyCostModel(s, {"form": "basis"}), DraftCostModel(s), {"model": "toy"}).to_dict()
    assert "convex_in_n" not in d["verify"]["info"]
    assert CostBundle.from_dict(d).verify.convex_in_n is True


def test_moe_forms_need_expert_counts():
    n, l, b, y = moe_points(np.random.default_rng(5))
    with pytest.raises(SimtreeError, match="need an MoE model"):
        fit_surface(n, l, b, y, "verify", VERIFY_AXES, forms=("basis", "moe"))


def test_draft_moe_form_recovers_saturating_draft_steps():
    rng = np.random.default_rng(6)
    s, k, b = (a.ravel() for a in np.meshgrid([1, 2, 4], [1, 2, 4, 8], [1, 4, 16], indexing="ij"))
    truth = 50 + 2 * b + s * (40 + 0.5 * k * b + 600 * touched_experts(k * b, E, K) / E)
    y = truth * (1 + 0.01 * rng.standard_normal(s.shape))
    res = fit_surface(k, s, b, y, "draft", ("topk", "num_steps", "batch_size"),
                      forms=("basis", "grid", *MOE_FORMS), folds=3, moe=(E, K))
    assert res.form in MOE_FORMS and not res.convex_in_x
    assert np.median(np.abs(res.surface.predict(k, s, b) / truth - 1)) < 0.01


def _confident_order(rng, depth=12, vocab=6, max_budget=160):
    top = rng.uniform(0.85, 0.97, size=(depth, 1))           # a confident drafter: deep trees pay
    rest = np.sort(rng.dirichlet(np.ones(vocab - 1), size=depth), axis=1)[:, ::-1] * (0.99 - top)
    probs = np.concatenate([top, rest], axis=1)
    tokens = np.stack([rng.permutation(vocab) for _ in range(depth)])
    return tokens, probs, best_first_order(tokens, probs, max_budget)


def saturating_cv(n, experts_us=100.0, per_node_us=0.3):
    """Steep while experts are being touched (n * 8 < 64), then nearly flat: concave in n."""
    n = np.asarray(n, float)
    return 10.0 + experts_us * np.minimum(n * 8, 64) / 64 + per_node_us * n


@pytest.mark.parametrize("seed", range(3))
def test_nonconvex_budget_is_the_global_argmax_of_brute_force(seed):
    rng = np.random.default_rng(seed)
    tokens, probs, order = _confident_order(rng)
    m = order.num_nodes
    objective = np.array([(1 + expected_accepted_marginals(best_first_tree(tokens, probs, n), tokens, probs))
                          / (1.0 + saturating_cv(n)) for n in range(1, m + 1)])
    best = int(np.argmax(objective)) + 1
    assert 8 < best < m                       # an interior optimum past saturation
    assert cost_aware_budget(order, saturating_cv, 1.0, convex=False) == best
    assert cost_aware_budget(order, saturating_cv, 1.0) == best          # the default: the global argmax
    # The first-stop rule stops in the dip before saturation: the case the flag exists for.
    assert cost_aware_budget(order, saturating_cv, 1.0, convex=True) < best


def test_adaptive_decisions_are_the_global_optimum_for_a_nonconvex_model():
    # a geometric drafter (no horizon) whose Phi keeps growing over 24 nodes, on a saturating
    # cost: a first-stop rule would stop in the dip before saturation.  Both adaptive modes'
    # analytic decision (level l standing for b w_l requests) is the brute-force best rate over
    # every combination of per-level budgets, whether or not the model says it is convex.
    import itertools
    acc = calibrate_linear(2.39, 4, name="sharegpt")
    cv = lambda n: saturating_cv(n, experts_us=10.0, per_node_us=0.1)  # noqa: E731  (sharegpt: weaker drafter)
    b, w = 4, acc.weights
    for convex, spec in itertools.product((False, True), (CostAwareParams(max_budget=24, draft_depth=6),
                                                          BatchAllocParams(max_budget_per_seq=24, draft_depth=6))):
        verify = types.SimpleNamespace(predict=lambda n, l, b: cv(n), convex_in_n=convex)
        costs = types.SimpleNamespace(verify=verify, draft=types.SimpleNamespace(predict=lambda s, k, b: 1.0))
        ad = AdaptiveRounds(acc, spec, costs, b)
        nodes, weights = ad.decide(1000.0)
        assert np.array_equal(weights, w)   # one text state: the rounds spread as the levels' weights
        phi = np.array([[ad.phi(lv, n) for n in range(1, 25)] for lv in range(acc.num_levels)])
        grid = np.stack(np.meshgrid(*[np.arange(1, 25)] * acc.num_levels, indexing="ij"), -1).reshape(-1, acc.num_levels)
        rate = (1 + (phi[np.arange(acc.num_levels), grid - 1] * w).sum(1)) / (1.0 + cv(grid @ w))
        got = (1 + sum(w[lv] * ad.phi(lv, int(n)) for lv, n in enumerate(nodes))) / (1.0 + cv(w @ nodes))
        assert got == pytest.approx(rate.max(), rel=1e-12)
        assert nodes.max() > 8   # past saturation: where a first-stop rule would not go


def test_touched_experts_under_uniform_and_balanced_routing():
    """One token touches its k experts; T tokens touch the uniform expectation E(1-(1-k/E)^T),
    a Monte-Carlo mean of top-k draws, never more than min(T k, E) (balanced)."""
    rng = np.random.default_rng(0)
    for T in (1, 2, 5, 16, 40):
        draws = [len({int(e) for _ in range(T) for e in rng.choice(E, K, replace=False)}) for _ in range(400)]
        u = float(touched_experts(T, E, K))
        assert abs(np.mean(draws) - u) < 4 * np.std(draws) / np.sqrt(len(draws)) + 1e-9
        assert float(touched_experts(T, E, K, "balanced")) == min(T * K, E)
        assert u <= min(T * K, E) + 1e-9
    assert float(touched_experts(1, E, K)) == pytest.approx(K)
    with pytest.raises(SimtreeError, match="MoE routing 'skewed' unknown"):
        touched_experts(3, E, K, "skewed")


def test_a_bundle_without_a_routing_predicts_as_it_was_fitted_balanced():
    """Surfaces record their routing; one saved before the routing was recorded reads as
    balanced (min(T k, E)), so an older bundle keeps its predictions."""
    from simtree.costs.forms import surface_from_dict
    grid = MoEGridSurface("verify", [1, 64], [0, 4096], [1, 16], np.full((2, 2, 2), 50.0), 400.0, E, K)
    d = grid.to_dict()
    assert d["routing"] == "uniform" and surface_from_dict(d).routing == "uniform"
    old = {k: v for k, v in d.items() if k != "routing"}
    legacy = surface_from_dict(old)
    assert legacy.routing == "balanced"
    ns = np.array([1, 3, 8, 30])
    for n in ns:     # the scalar path ...
        assert legacy.predict(int(n), 100.0, 2) == pytest.approx(50.0 + 400.0 * min(n * 2 * K, E) / E)
        assert grid.predict(int(n), 100.0, 2) == pytest.approx(50.0 + 400.0 * float(touched_experts(n * 2, E, K)) / E)
    # ... and the array path agree
    assert np.allclose(legacy.predict(ns, 100.0, 2), [legacy.predict(int(n), 100.0, 2) for n in ns])
    assert np.allclose(grid.predict(ns, 100.0, 2), [grid.predict(int(n), 100.0, 2) for n in ns])
