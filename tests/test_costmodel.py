"""Cost models: recovery of known convex surfaces, shape guarantees everywhere, JSON round trip."""
import json
import warnings

import numpy as np
import pytest

from simtree.costs.surface_fit import fit_surface
from simtree.costs.forms import ScaledVerifyDraft
from simtree.costs.model import (DRAFT_AXES, VERIFY_AXES, CostBundle, DraftCostModel,
                               VerifyCostModel, load_costs)
from simtree.errors import SimtreeError

NS = np.array([1, 2, 4, 8, 16, 32, 64])
LS = np.array([4096, 32768, 131072])
BS = np.array([1, 4, 16, 64])


def verify_truth(n, l, b):
    """Flat while weights dominate, a hinge in T = b n, per-sequence b l and per-token T l terms."""
    return 100 + 0.5 * np.maximum(n * b - 128, 0) + 2 * b + 1e-3 * b * l + 1e-6 * n * b * l


def verify_points(rng, noise=0.02, truth=verify_truth):
    n, l, b = (a.ravel() for a in np.meshgrid(NS, LS, BS, indexing="ij"))
    return n, l, b, truth(n, l, b) * (1 + noise * rng.standard_normal(n.shape))


def check_shape(predict, n_max=64, l_max=131072, b_max=64, tol=1e-6):
    """Convex + non-decreasing in n, non-decreasing in l and b on a dense grid reaching 2x
    beyond the measured range and below it (also between grid points: fractional n, l, b)."""
    n = np.linspace(0.5, 2 * n_max, 257)
    l = np.linspace(0, 2 * l_max, 23)
    b = np.array([1, 2.5, 3, 7, 16, 40, 64, 100, 2 * b_max])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        v = predict(n[:, None, None], l[None, :, None], b[None, None, :])
    scale = np.abs(v).max()
    assert np.all(np.diff(v, axis=0) >= -tol * scale), "decreasing in n"
    assert np.all(np.diff(v, n=2, axis=0) >= -tol * scale), "not convex in n"
    assert np.all(np.diff(v, axis=1) >= -tol * scale), "decreasing in l"
    assert np.all(np.diff(v, axis=2) >= -tol * scale), "decreasing in b"


@pytest.mark.parametrize("form", ["basis", "grid", "grid_lin"])
def test_fit_recovers_known_convex_surface(form):
    rng = np.random.default_rng(0)
    n, l, b, y = verify_points(rng, noise=0.02)
    res = fit_surface(n, l, b, y, "verify", VERIFY_AXES, forms=(form,), folds=3)
    pred = res.surface.predict(n, l, b)
    err = np.abs(pred / verify_truth(n, l, b) - 1)
    assert np.median(err) < 0.02 and err.max() < 0.12
    assert res.heldout[form]["median"] < 0.05


def test_basis_form_interpolates_between_grid_points():
    rng = np.random.default_rng(1)
    n, l, b, y = verify_points(rng, noise=0.01)
    s = fit_surface(n, l, b, y, "verify", VERIFY_AXES, forms=("basis",), folds=3).surface
    q = np.meshgrid(np.linspace(1, 64, 50), np.linspace(4096, 131072, 9), [2.0, 5.0, 30.0], indexing="ij")
    assert np.median(np.abs(s.predict(*q) / verify_truth(*q) - 1)) < 0.02


@pytest.mark.parametrize("form", ["basis", "grid", "grid_lin"])
def test_shape_holds_everywhere_even_for_non_convex_data(form):
    # A tile-size step (latency jumps at n = 16 then plateaus) is not convex: the fit must
    # still be convex/monotone on a dense grid, in and beyond the range.
    rng = np.random.default_rng(2)
    step = lambda n, l, b: verify_truth(n, l, b) * np.where(n >= 16, 1.6, 1.0)  # noqa: E731
    n, l, b, y = verify_points(rng, noise=0.03, truth=step)
    res = fit_surface(n, l, b, y, "verify", VERIFY_AXES, forms=(form,), folds=3)
    check_shape(res.surface.predict)
    assert abs(res.worst[0]["rel_err"]) > 0.1   # the step is reported, not hidden


def test_grid_with_missing_cells_and_one_context_keeps_shape():
    # OOM-skipped points leave cells without data; a table at one context length leaves the
    # l axis flat: both must still give a convex, monotone surface everywhere.
    rng = np.random.default_rng(9)
    n, l, b, y = verify_points(rng)
    keep = rng.random(len(y)) > 0.25
    check_shape(fit_surface(n[keep], l[keep], b[keep], y[keep], "verify", VERIFY_AXES,
                            forms=("grid",), folds=2).surface.predict)
    one = l == 32768
    res = fit_surface(n[one], l[one], b[one], y[one], "verify", VERIFY_AXES, forms=("grid",), folds=2)
    check_shape(res.surface.predict)
    assert res.surface.predict(8, 4096, 4) == res.surface.predict(8, 131072, 4)


def test_grid_lin_fills_missing_cells_by_the_linear_continuation_in_l():
    # Linear in l at fixed (n, b) and strongly convex in n, within every grid constraint.
    # Cells without data at the ends of the n and l axes: the plain grid fills them with the
    # least-curved continuation in n (far too low), grid_lin with the linear continuation in
    # l of their (n, b) column.
    from simtree.costs.surface_fit import fit_grid
    truth = lambda n, l, b: 100 + 2 * b + 0.02 * n * n * b + 1e-3 * b * l + 1e-6 * n * b * l  # noqa: E731
    n, l, b = (a.ravel() for a in np.meshgrid(NS, [1024, *LS], BS, indexing="ij"))
    y = truth(n, l, b)
    holes = [(64, 131072, 16), (64, 1024, 64), (32, 32768, 64)]
    keep = ~np.any([(n == hn) & (l == hl) & (b == hb) for hn, hl, hb in holes], axis=0)
    vr = {a: [float(v.min()), float(v.max())] for a, v in zip(VERIFY_AXES, (n, l, b))}
    args = (n[keep], l[keep], b[keep], y[keep], VERIFY_AXES, vr, 0.05)
    plain = fit_grid(*args)
    lin = fit_grid(*args, curvature_weight=1e-4, y_linear_weight=1e-3)
    hn, hl, hb = (np.array(c, dtype=float) for c in zip(*holes))
    err_lin = np.abs(lin.predict(hn, hl, hb) / truth(hn, hl, hb) - 1)
    err_plain = np.abs(plain.predict(hn, hl, hb) / truth(hn, hl, hb) - 1)
    assert err_lin.max() < 0.04 and np.all(err_lin < err_plain) and err_plain.max() > 0.1
    assert np.abs(lin.predict(n, l, b) / y - 1)[keep].max() < 0.03   # small bias on data
    check_shape(lin.predict)
    res = fit_surface(n[keep], l[keep], b[keep], y[keep], "verify", VERIFY_AXES, forms=("grid_lin",), folds=3)
    assert res.form == "grid_lin" and res.surface.form == "grid" and res.convex_in_x


def test_auto_selection_keeps_lower_heldout_error():
    rng = np.random.default_rng(3)
    res = fit_surface(*verify_points(rng), "verify", VERIFY_AXES, folds=3)
    score = {f: e["median"] + e["p90"] for f, e in res.heldout.items()}
    assert set(score) == {"basis", "grid", "grid_lin"} and res.form == min(score, key=score.get)
    assert res.worst_heldout and all(w["rel_err"] == pytest.approx(w["heldout_us"] / w["measured_us"] - 1)
                                     for w in res.worst_heldout)
    assert abs(res.worst_heldout[0]["rel_err"]) == pytest.approx(res.heldout[res.form]["max"])


def test_per_bin_reference_is_scored_but_never_kept():
    # Context barely matters here, so independent per-(l, b) fits cross each other in l; the
    # joint forms stay monotone in l by construction.
    from simtree.costs.surface_fit import monotone_violations
    rng = np.random.default_rng(10)
    flat_l = lambda n, l, b: verify_truth(n, 0 * l, b)  # noqa: E731
    n, l, b, y = verify_points(rng, noise=0.03, truth=flat_l)
    res = fit_surface(n, l, b, y, "verify", VERIFY_AXES, folds=3, reference_forms=("per_bin",))
    assert res.heldout["per_bin"]["reference"] and res.form in ("basis", "grid", "grid_lin")
    assert res.heldout["per_bin"]["monotone_violations"] > 0
    assert monotone_violations(res.surface, res.surface.valid_range, VERIFY_AXES) == 0


def test_huber_loss_resists_an_outlier():
    rng = np.random.default_rng(4)
    n, l, b, y = verify_points(rng, noise=0.01)
    i = 40
    y[i] *= 4.0
    res = fit_surface(n, l, b, y, "verify", VERIFY_AXES, forms=("basis",), folds=3)
    others = np.arange(len(y)) != i
    err = np.abs(res.surface.predict(n, l, b) / verify_truth(n, l, b) - 1)
    assert np.median(err[others]) < 0.02
    assert res.worst[0]["nodes_per_seq"] == n[i] and res.worst[0]["context_len"] == l[i]


def draft_truth(s, k, b):
    return 20 + 0.5 * b + s * (15 + 0.05 * np.maximum(b * k - 64, 0) + 0.1 * b)


@pytest.mark.parametrize("form", ["basis", "grid", "grid_lin"])
def test_draft_fit_recovers_and_is_monotone(form):
    rng = np.random.default_rng(5)
    s, k, b = (a.ravel() for a in np.meshgrid([1, 2, 3, 4, 6], [1, 2, 4, 8], BS, indexing="ij"))
    y = draft_truth(s, k, b) * (1 + 0.02 * rng.standard_normal(s.shape))
    res = fit_surface(k, s, b, y, "draft", DRAFT_AXES, forms=(form,), folds=3)
    model = DraftCostModel(res.surface)
    assert np.median(np.abs(model.predict(s, k, b) / draft_truth(s, k, b) - 1)) < 0.03
    # x = topk convex non-decreasing; num_steps and batch non-decreasing
    check_shape(lambda k_, s_, b_: model.predict(s_, k_, b_), n_max=8, l_max=6)


@pytest.mark.parametrize("form", ["basis", "grid", "grid_lin"])
def test_scalar_fast_path_matches_vector_path(form):
    rng = np.random.default_rng(6)
    s = fit_surface(*verify_points(rng), "verify", VERIFY_AXES, forms=(form,), folds=2).surface
    q = [(1, 4096, 1), (3, 10000, 5), (64, 131072, 64), (100, 300000, 90), (0.5, 0, 0.5), (17, 50000, 33)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        vec = s.predict(*(np.array(c, dtype=float) for c in zip(*q)))
        for i, p in enumerate(q):
            assert s.predict(*p) == pytest.approx(vec[i], rel=1e-12)


@pytest.mark.parametrize("scalar", [True, False], ids=["scalar", "vector"])
def test_out_of_range_warns_once_per_axis_and_extrapolates_upward(scalar):
    rng = np.random.default_rng(7)
    model = VerifyCostModel(fit_surface(*verify_points(rng), "verify", VERIFY_AXES, folds=2).surface)
    model.surface.range_label = "toy verify cost model"
    q = (lambda *a: a) if scalar else (lambda *a: tuple(np.array([v], float) for v in a))
    inside = model.predict(*q(64, 131072, 64))
    with pytest.warns(RuntimeWarning, match=r"toy verify cost model .*\(nodes_per_seq in \[1, 64\], asked 128\)"):
        beyond = model.predict(*q(128, 131072, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.predict(*q(256, 131072, 64))  # the same axis again: no second warning
    # a second axis out of range warns once more, naming that axis (and only it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.predict(*q(256, 262144, 64))
        model.predict(*q(256, 300000, 64))
    assert [str(w.message).split("(")[1].split(" in ")[0] for w in caught] == ["context_len"]
    with pytest.warns(RuntimeWarning, match="batch_size"):
        model.predict(*q(8, 4096, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.predict(*q(512, 10 ** 6, 512))  # every axis has warned
    assert np.all(np.asarray(beyond) > np.asarray(inside))


def test_refuses_a_single_n_value_and_too_few_points():
    with pytest.raises(SimtreeError, match="only one nodes_per_seq value"):
        fit_surface([4, 4, 4, 4], [1, 2, 3, 4], [1, 1, 1, 1], [5, 6, 7, 8], "verify", VERIFY_AXES)
    with pytest.raises(SimtreeError, match="need at least 4"):
        fit_surface([1, 2, 4], [1, 1, 1], [1, 1, 1], [5, 6, 7], "verify", VERIFY_AXES)


@pytest.mark.parametrize("form", ["basis", "grid", "grid_lin"])
def test_bundle_save_load_round_trips_bit_for_bit(tmp_path, form):
    rng = np.random.default_rng(8)
    vs = fit_surface(*verify_points(rng), "verify", VERIFY_AXES, forms=(form,), folds=2).surface
    bundle = CostBundle(VerifyCostModel(vs, {"form": form}),
                        DraftCostModel(ScaledVerifyDraft(vs, 0.05, 32768.0)),
                        {"model": "toy", "device": "cpu", "source": "test", "synthetic": True})
    loaded = load_costs(bundle.save(tmp_path / "costs.json"))
    q = (rng.uniform(1, 64, 500), rng.uniform(4096, 131072, 500), rng.uniform(1, 64, 500))
    assert np.array_equal(bundle.verify.predict(*q), loaded.verify.predict(*q))
    steps, topk = rng.integers(1, 6, 500), rng.integers(1, 8, 500)
    assert np.array_equal(bundle.draft.predict(steps, topk, q[2]), loaded.draft.predict(steps, topk, q[2]))
    assert loaded.meta == bundle.meta and loaded.decode_step_us(4096, 4) == bundle.verify.predict(1, 4096, 4)


def test_load_costs_rejects_other_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"schema": "simtree.policy/1"}')
    with pytest.raises(SimtreeError, match="not a simtree cost bundle"):
        load_costs(p)


@pytest.mark.parametrize("part, value", [("verify", [1]), ("draft", "x")])
def test_a_bundle_whose_model_is_not_an_object_is_one_line(tmp_path, part, value):
    # an AttributeError traceback before ('list' object has no attribute 'get')
    from simtree.data import data_path

    d = json.loads(data_path("costs", "h200_qwen3.6-27b_tp1.json").read_text())
    d[part] = value
    p = tmp_path / "c.json"
    p.write_text(json.dumps(d))
    with pytest.raises(SimtreeError, match=f"cost bundle {p}: {part} model: must be an object with a surface, "
                                           f"got {type(value).__name__}"):
        load_costs(p)
