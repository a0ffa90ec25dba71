"""Tile-aware interpolation in n (simtree/costs/tiles.py, tile_fit.py): a verify step whose
matrix products run n * b token rows in M-tiles steps between measured node counts; the rule is
kept only where leaving node counts out of the profile shows it."""
import json
import warnings

import numpy as np
import pytest

from simtree.costs.forms import GridSurface, surface_from_dict
from simtree.costs.model import VERIFY_AXES
from simtree.costs.surface_fit import fit_surface
from simtree.costs.tile_fit import choose_tile_rows, with_tile_rows
from simtree.costs.tiles import TILE_NONCONVEX_REASON, tile_x
from simtree.errors import SimtreeError

NODES = [2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0]
CONTEXTS = [256.0, 4096.0]
BATCHES = [4.0, 16.0, 32.0, 64.0]


def _grid(rng, tile=None):
    # values non-decreasing in every axis: cumulative sums of positive steps
    v = np.cumsum(np.cumsum(np.cumsum(rng.uniform(1, 5, (len(BATCHES), len(CONTEXTS), len(NODES))), 0), 1), 2)
    return GridSurface(NODES, CONTEXTS, BATCHES, 1000 + v, VERIFY_AXES, tile_rows=tile)


def test_nodes_keep_their_values_and_the_step_follows_the_tiles():
    rng = np.random.default_rng(1)
    line, tiled = _grid(rng), None
    tiled = with_tile_rows(line, 128)
    for n in NODES:
        for b in BATCHES:
            assert tiled.predict(n, 1024.0, b) == pytest.approx(line.predict(n, 1024.0, b), rel=1e-12)
    # b = 32: n = 8 fills 2 tiles of 128 rows, n = 9..12 fill 3 -> every n in (8, 12] costs n = 12
    for n in (8.5, 9.0, 10.0, 11.0, 12.0):
        assert tiled.predict(n, 1024.0, 32.0) == pytest.approx(line.predict(12.0, 1024.0, 32.0), rel=1e-12)
    # b = 4: n = 8 and 12 both in one tile -> the straight line
    assert tiled.predict(10.0, 256.0, 4.0) == pytest.approx(line.predict(10.0, 256.0, 4.0), rel=1e-12)
    # b = 16: n = 12 (192 rows) and 16 (256 rows) fill the same 2 tiles -> the straight line
    assert tiled.predict(14.0, 256.0, 16.0) == pytest.approx(line.predict(14.0, 256.0, 16.0), rel=1e-12)
    # b = 64: n = 2 (128 rows, 1 tile), n = 3 (192 rows, 2 tiles): n = 2.5 (160 rows) costs n = 3
    assert tiled.predict(2.5, 256.0, 64.0) == pytest.approx(line.predict(3.0, 256.0, 64.0), rel=1e-12)
    # outside the measured n range nothing changes (extrapolation, the held value below)
    for n in (1.0, 20.0, 40.0):
        assert tiled.predict(n, 256.0, 32.0) == pytest.approx(line.predict(n, 256.0, 32.0), rel=1e-12)


def test_scalar_and_array_paths_agree_and_stay_monotone():
    rng = np.random.default_rng(2)
    s = _grid(rng, tile=128)
    n = rng.uniform(1, 24, 400)
    l = rng.uniform(0, 8192, 400)
    b = rng.choice([1.0, 3.0, 8.0, 24.0, 32.0, 48.0, 64.0, 80.0], 400)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arr = s.predict(n, l, b)
        one = np.array([s.predict(float(a), float(c), float(d)) for a, c, d in zip(n, l, b)])
        np.testing.assert_allclose(arr, one, rtol=1e-12)
        grid_n = np.linspace(1, 24, 500)
        for bb in (8.0, 24.0, 32.0, 64.0):
            assert np.all(np.diff(s.predict(grid_n, 1000.0, bb)) >= -1e-9)


def test_a_tiled_grid_says_it_is_not_convex_and_round_trips():
    rng = np.random.default_rng(3)
    plain, tiled = _grid(rng), _grid(rng, tile=128)
    assert plain.convex_in_x and "tile_rows" not in plain.to_dict()   # bundles without it are unchanged
    assert not tiled.convex_in_x and tiled.nonconvex_reason == TILE_NONCONVEX_REASON
    back = surface_from_dict(json.loads(json.dumps(tiled.to_dict())))
    assert back.tile_rows == 128 and not back.convex_in_x
    q = (np.array([9.0, 10.0, 13.0]), np.array([300.0, 2000.0, 4000.0]), np.array([32.0, 32.0, 64.0]))
    np.testing.assert_allclose(back.predict(*q), tiled.predict(*q), rtol=1e-12)
    assert with_tile_rows(tiled, None).convex_in_x
    with pytest.raises(SimtreeError, match="tile_rows"):
        _grid(rng, tile=0)


def test_tile_x_is_identity_at_nodes():
    np.testing.assert_allclose(tile_x(NODES, NODES, 32.0, 128), NODES)


def _profile(step: bool):
    """(n, l, b, latency) of a synthetic verify step: weights read once, attention ~ b l, the
    matrix products either in 128-row tiles of n b rows (step) or per row (no step)."""
    n, l, b = (a.ravel() for a in np.meshgrid([1.0, *NODES], CONTEXTS, BATCHES, indexing="ij"))
    rows = n * b
    gemm = 60.0 * np.ceil(rows / 128.0) if step else 0.47 * rows
    return n, l, b, 2000.0 + gemm + 0.002 * b * l + 0.001 * rows * l / 64


@pytest.mark.parametrize("step, kept", [(True, 128), (False, None)])
def test_leaving_node_counts_out_finds_the_tile_only_where_there_is_one(step, kept):
    n, l, b, lat = _profile(step)
    res = fit_surface(n, l, b, lat, "verify", VERIFY_AXES, forms=("grid",), folds=2)
    tile, record = choose_tile_rows(res, "verify", VERIFY_AXES)
    assert tile == kept and record["kept"] == kept
    assert record["held_out"] == [2.0, 3.0, 4.0, 6.0, 8.0, 12.0]
    if step:
        st = record["heldout_node"]
        assert st["128"]["max"] < st["none"]["max"] and st["128"]["mean"] < 0.9 * st["none"]["mean"]


def test_a_held_out_node_counts_pad_twins_leave_the_refit_with_it(monkeypatch):
    """The fit's envelope copies a pad target's latency into the cells padded to it: holding n out,
    those copies leave the training too (batch 32 pads 6 to 8 here), else the refit sees n's latency."""
    import simtree.costs.tile_fit as tile_fit
    n, l, b, lat = _profile(True)
    res = fit_surface(n, l, b, lat, "verify", VERIFY_AXES, forms=("grid",), folds=2)
    seen = {}
    real = tile_fit._fit_form

    def spy(form, x, y, z, lat_, *a, **k):
        held = sorted(set(res.points[0]) - set(x))
        seen[held[0] if held else None] = set(zip(x.tolist(), z.tolist()))
        return real(form, x, y, z, lat_, *a, **k)
    monkeypatch.setattr(tile_fit, "_fit_form", spy)
    pad = {"by_batch": {"32": {"6": 8}}}
    choose_tile_rows(res, "verify", VERIFY_AXES, pad=pad)
    assert (6.0, 32.0) not in seen[8.0] and (6.0, 16.0) in seen[8.0]     # 8 held out: its twin at batch 32 too
    assert (6.0, 32.0) in seen[4.0] and (8.0, 32.0) in seen[4.0]         # another n held out: both stay
    assert tile_fit._pad_twins(np.array([6.0, 6.0, 8.0]), np.array([32.0, 16.0, 32.0]), pad, 8.0).tolist() == [
        True, False, False]


def test_a_basis_fit_is_not_checked():
    n, l, b, lat = _profile(True)
    res = fit_surface(n, l, b, lat, "verify", VERIFY_AXES, forms=("basis",), folds=2)
    assert choose_tile_rows(res, "verify", VERIFY_AXES) == (None, None)


def test_an_moe_grid_keeps_its_expert_term_and_names_both_reasons():
    from simtree.costs.forms import MoEGridSurface
    rng = np.random.default_rng(4)
    g = _grid(rng)
    moe = MoEGridSurface("verify", g.xs, g.ys, g.zs, g.values, 400.0, 32, 8, VERIFY_AXES)
    tiled = with_tile_rows(moe, 128)
    assert isinstance(tiled, MoEGridSurface) and tiled.tile_rows == 128 and tiled.alpha == 400.0
    assert "MoE" in tiled.nonconvex_reason and TILE_NONCONVEX_REASON in tiled.nonconvex_reason
    back = surface_from_dict(json.loads(json.dumps(tiled.to_dict())))
    assert back.to_dict() == tiled.to_dict()
    # the expert term is read at the asked n; only the grid part steps
    plain = with_tile_rows(tiled, None)
    step = tiled.predict(10.0, 1024.0, 32.0) - plain.predict(10.0, 1024.0, 32.0)
    assert step == pytest.approx(g.predict(12.0, 1024.0, 32.0) - g.predict(10.0, 1024.0, 32.0), rel=1e-9)
