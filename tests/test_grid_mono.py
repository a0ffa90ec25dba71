"""The grid_mono form: plain decoding's cost over batch, monotone in every axis but not convex in
batch, so a staircase of kernel choices (simtree/costs/surface_fit.py, profile_fit.py's decode split)
is followed; n stays convex, and auto keeps it only where it predicts held-out points better."""
import json
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

from simtree.cli import app
from simtree.costs.base_forms import GRID_MONO_REASON, GridSurface
from simtree.costs.forms import surface_from_dict
from simtree.costs.model import VERIFY_AXES, load_costs
from simtree.costs.profile_fit import fit_profile
from simtree.costs.profile_table import append_rows
from simtree.costs.surface_fit import RELAX_MIN_GAIN, fit_surface
from simtree.errors import SimtreeError
from test_fit_cli import row

DECODE_AXES = ("batch_size", "context_len", "nodes_per_seq")
BS = (1, 2, 4, 8, 16)
LS = (64, 256, 1024)
STEP_US = {1: 165.0, 2: 229.0, 4: 232.0, 8: 811.0, 16: 830.0}   # the live run's n = 1 shape, one more step


def decode_points(truth, rng, noise=0.01):
    b, l = (a.ravel().astype(float) for a in np.meshgrid(BS, LS, indexing="ij"))
    y = np.array([truth(bb, ll) for bb, ll in zip(b, l)]) * (1 + noise * rng.standard_normal(b.size))
    return b, l, np.ones_like(b), y


def staircase(b, l):
    return STEP_US[int(b)] + 0.02 * l


def smooth(b, l):
    return 150.0 + 9.0 * b + 0.02 * l


def score(err):
    return err["median"] + err["p90"]


def kept_by_rule(res) -> str:
    """The form the held-out rule keeps: the lowest median + p90, grid_mono only RELAX_MIN_GAIN below
    the better convex grid."""
    h = res.heldout
    best = min(h, key=lambda f: score(h[f]))
    if best == "grid_mono" and score(h[best]) > (1 - RELAX_MIN_GAIN) * min(score(h["grid"]), score(h["grid_lin"])):
        best = min((f for f in h if f != "grid_mono"), key=lambda f: score(h[f]))
    return best


FORMS = ("basis", "grid", "grid_lin", "grid_mono")


@pytest.fixture(scope="module")
def stair_fit():
    return fit_surface(*decode_points(staircase, np.random.default_rng(0)), "verify", DECODE_AXES, forms=FORMS, folds=5)


def test_grid_mono_follows_a_batch_staircase_the_convex_forms_cannot(stair_fit):
    b, l, n, y = decode_points(staircase, np.random.default_rng(0))
    assert stair_fit.form == "grid_mono" == kept_by_rule(stair_fit)
    s = stair_fit.surface
    assert isinstance(s, GridSurface) and s.grid_convex is False and s.convex_in_x is False
    assert GRID_MONO_REASON in s.nonconvex_reason and any("NOT convex in batch_size" in t for t in stair_fit.notes)
    assert np.abs(s.predict(b, l, n) / y - 1).max() < 0.03
    for form in ("basis", "grid", "grid_lin"):   # convex in batch: the step from 4 to 8 is averaged away
        convex = fit_surface(b, l, n, y, "verify", DECODE_AXES, forms=(form,), folds=2).surface
        assert np.abs(convex.predict(b, l, n) / y - 1).max() > 0.10, form
        assert score(stair_fit.heldout["grid_mono"]) < score(stair_fit.heldout[form])


def test_grid_mono_is_monotone_everywhere_and_linear_beyond_its_batches(stair_fit):
    s = stair_fit.surface
    qb = np.concatenate([np.linspace(0.5, 16, 63), [20, 32, 64]])
    ql = np.array([0.0, 64, 100, 256, 600, 1024, 4096])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = s.predict(qb[:, None], ql[None, :], 1.0)
        for axis in (0, 1):
            assert np.all(np.diff(v, axis=axis) >= -1e-9 * v.max())
        # between profiled batch sizes: linear; beyond the largest: the last segment's slope
        v2, v4 = s.predict(2.0, 256.0, 1.0), s.predict(4.0, 256.0, 1.0)
        assert s.predict(3.0, 256.0, 1.0) == pytest.approx((v2 + v4) / 2)
        v8, v16 = s.predict(8.0, 256.0, 1.0), s.predict(16.0, 256.0, 1.0)
        assert s.predict(32.0, 256.0, 1.0) == pytest.approx(v16 + 2 * (v16 - v8))
        assert s.predict(0.5, 256.0, 1.0) == pytest.approx(s.predict(1.0, 256.0, 1.0))
        assert [s.predict(float(x), 300.0, 1.0) for x in qb] == pytest.approx(s.predict(qb, 300.0, 1.0).tolist())
    again = surface_from_dict(json.loads(json.dumps(s.to_dict())))
    assert again.grid_convex is False and not again.convex_in_x
    inside = qb[(qb >= 1) & (qb <= 16)]
    assert np.array_equal(again.predict(inside, 300.0, 1.0), s.predict(inside, 300.0, 1.0))


@pytest.mark.parametrize("seed", [0, 1])
def test_auto_keeps_a_convex_form_where_grid_mono_predicts_no_better(seed):
    res = fit_surface(*decode_points(smooth, np.random.default_rng(seed)), "verify", DECODE_AXES, forms=FORMS, folds=5)
    assert "grid_mono" in res.heldout and res.form == kept_by_rule(res) != "grid_mono"
    assert res.convex_in_x


def test_grid_mono_is_refused_where_x_must_stay_convex():
    n, l, b = (a.ravel().astype(float) for a in np.meshgrid((1, 2, 4), (64, 256), (1, 2), indexing="ij"))
    with pytest.raises(SimtreeError, match="only a surface over x = batch_size"):
        fit_surface(n, l, b, 100 + n * b, "verify", VERIFY_AXES, forms=("grid", "grid_mono"), folds=2)


def stair_profile(path, rng):
    """Verify rows: n = 1 a decode step whose cost is a staircase in batch, n >= 2 a smooth tree
    verify well above it; draft rows smooth."""
    rows = []
    for b in (1, 2, 4, 8):
        for l in (64, 256):
            for n in (1, 2, 4, 8, 16):
                lat = staircase(b, l) if n == 1 else 1500 + 20 * n * b + 0.05 * l
                rows.append(row("model_verify_step", n, l, b, lat * (1 + 0.01 * rng.standard_normal())))
        for s in (1, 2, 4):
            for k in (1, 2, 4):
                rows.append({**row("draft_step", k, 64, b, (10 + s * (8 + 0.1 * b * k)) * (1 + 0.01 * rng.standard_normal()),
                                   num_steps=s, topk=k), "variant": "torch_ref", "tree_shape": "eagle"})
    append_rows(path, rows)
    return path


def test_fit_keeps_grid_mono_for_plain_decoding_and_stays_convex_in_n_beyond(tmp_path):
    prof = stair_profile(tmp_path / "stairs.csv", np.random.default_rng(4))
    report = fit_profile(prof)   # 5 folds: 8 points at n = 1
    verify = report.bundle.verify
    record = verify.info["decode_split"]
    assert record["kept"] and record["decode_form"] == "grid_mono" and record["decode_convex_in_batch"] is False
    assert any("kept form grid_mono: monotone, NOT convex in batch" in t for t in report.notes)
    assert verify.surface.main.convex_in_x   # n >= 2: a form convex in n
    for b in (1, 2, 4, 8):
        assert verify.predict(1, 160, b) == pytest.approx(staircase(b, 160), rel=0.03)
        with warnings.catch_warnings():   # n up to twice the profiled 16
            warnings.simplefilter("ignore")
            pred = np.asarray(verify.predict(np.arange(2, 33), 160, b))
        assert np.all(np.diff(pred, 2) >= -1e-6 * pred.max())   # convex in n from n = 2 on
    out = tmp_path / "c.json"
    result = CliRunner().invoke(app, ["fit", str(prof), "-o", str(out), "--no-png", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verify"]["decode_split"]["decode_form"] == "grid_mono" and isinstance(data["warnings"], list)
    again = load_costs(out).verify
    assert again.predict(1, 160, 2) == pytest.approx(verify.predict(1, 160, 2))


def test_a_convex_decode_curve_that_misses_the_staircase_is_warned_about(tmp_path):
    prof = stair_profile(tmp_path / "stairs.csv", np.random.default_rng(4))
    convex = fit_profile(prof, forms=("basis", "grid", "grid_lin"))   # no grid_mono: the old choice
    assert convex.bundle.verify.info["decode_split"]["kept"]
    assert any(w.startswith("C_v of plain decoding (n = 1, ") for w in convex.misfit_warnings())
    assert not any("plain decoding" in w for w in fit_profile(prof).misfit_warnings())

