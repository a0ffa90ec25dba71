"""Measured-cell corrections of the fitted verify cost (simtree.costs.verify_cells): a cell the convex
fit misses at every context is corrected there and nowhere else, the held-out error never corrects
a point by its own measurement, the record round-trips and is checked on load, and the planner
prices the corrected cell."""
import json
import re

import numpy as np
import pandas as pd
import pytest

from simtree.costs.model import CostBundle, DraftCostModel, VerifyCostModel, load_costs
from simtree.costs.profile_fit import fit_profile
from simtree.costs.profile_fit import _pad_folds
from simtree.costs.surface_fit import fit_surface
from simtree.costs.verify_cells import CELLS_KEY, cell_corrections, heldout_corrected
from simtree.errors import SimtreeError

from test_verify_pad import verify_row

NODES = (1, 2, 3, 4, 5, 6, 7, 8)
CONTEXTS = (256, 2048)
BUMP = 1.05        # batch 64 x 5 nodes: a slow kernel at both contexts (n = 6 still dearer: no padding)
HALF_BUMP = 1.09   # batch 64 x 3 nodes: slow at context 256 only (not a cell-wide miss)


def _cost_us(b: int, n: int, l: int) -> float:
    us = 20000 + 40 * b * n + 300 * n + 0.1 * l * b
    if (b, n) == (64, 5):
        us *= BUMP
    if (b, n, l) == (64, 3, 256):
        us *= HALF_BUMP
    return us


def _table(path, bump: float = BUMP, fast_six: float = 1.0) -> pd.DataFrame:
    scale = {(64, 5): bump / BUMP, (64, 6): fast_six}
    df = pd.DataFrame([verify_row(b, n, l, _cost_us(b, n, l) * scale.get((b, n), 1.0))
                       for b in (16, 64) for n in NODES for l in CONTEXTS])
    df.to_csv(path, index=False)
    return df


def _fit(tmp_path, **kw):
    table = tmp_path / "p.csv"
    if not table.exists():
        _table(table)
    return fit_profile(table, forms=("grid",), folds=3, reference_forms=(), draft_from_verify=True, **kw)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cells")
    return tmp, _fit(tmp), _fit(tmp, verify_cells=False)


def test_the_bumped_cell_is_corrected_to_its_measured_cost_and_nothing_else(fitted):
    _, report, _ = fitted
    v = report.bundle.verify
    rec = v.info[CELLS_KEY]
    off = rec["offset_us"]["64"]["5"]
    assert rec["min_excess"] == 0.02 and rec["offset_us"] == {"64": {"5": off}}
    ratio = rec["ratio"]["64"]["5"]
    assert set(ratio) == {"256", "2048"} and all(1.02 < r < BUMP + 0.01 for r in ratio.values())
    # the excess nearest 0: measured - fitted at one of the timed contexts, the smaller
    excess = {l: _cost_us(64, 5, l) - v.surface.predict(5, l, 64) for l in CONTEXTS}
    assert off == pytest.approx(min(excess.values(), key=abs), abs=0.06)
    for l in CONTEXTS:     # the fit's plus the offset: the measured at the nearest context, within 2% at the other
        assert v.predict(5, l, 64) == pytest.approx(_cost_us(64, 5, l), rel=0.02)
    nearest = min(CONTEXTS, key=lambda l: abs(excess[l]))
    assert v.predict(5, nearest, 64) == pytest.approx(_cost_us(64, 5, nearest), abs=0.06)
    # at contexts never timed the same microseconds, not the same ratio (the kernel's excess has no l)
    for l in (1000, 4096, 32768):
        assert v.predict(5, l, 64) - v.surface.predict(5, l, 64) == pytest.approx(off, abs=1e-6)
    # a fractional n blends the two neighbouring cells' corrections: continuous in n, no spike at 5 and
    # no drop just above it (cells 4 and 6 are not corrected)
    for n in (4.01, 4.5, 4.99, 5.01, 5.5, 5.99):
        t = n - 4 if n < 5 else 6 - n
        assert v.predict(n, 700, 64) == pytest.approx(v.surface.predict(n, 700, 64) + t * off, abs=1e-6)
    for a, c in ((4.999, 5), (5.001, 5), (4.001, 4), (5.999, 6)):
        assert v.predict(a, 700, 64) == pytest.approx(v.predict(c, 700, 64), rel=1e-3)
    # a count a floating-point sum leaves a hair off an integer is that integer's cell (4 + 1e-15 is 4, not 5)
    assert v.predict(4 + 1e-15, 700, 64) == v.predict(4, 700, 64) == v.surface.predict(4, 700, 64)
    assert v.predict(5 - 1e-15, 700, 64) == pytest.approx(v.predict(5, 700, 64), abs=1e-9)
    assert v.predict(np.array([4 + 1e-15, 5 + 1e-15]), 700, 64) == pytest.approx(
        [v.predict(4, 700, 64), v.predict(5, 700, 64)], abs=1e-9)
    # elsewhere the surface as fitted: other node counts, between them, another batch, a batch never timed
    for n, l, b in ((4, 256, 64), (6, 2048, 64), (3, 256, 64), (6.5, 256, 64), (3.5, 256, 64), (5, 256, 16),
                    (5, 256, 32), (4.5, 256, 32), (5, 256, 63), (1, 256, 64)):
        assert v.predict(n, l, b) == v.surface.predict(n, l, b)
    assert not v.convex_in_n and "verify_cells" in v.info["nonconvex_reason"]
    assert any("corrected at 1 measured cells" in note for note in report.notes)


def test_a_padded_cell_is_priced_at_the_bucket_it_is_verified_in(tmp_path):
    """A slower kernel at 64 x 5 (+12%) and a faster one at 64 x 6 (-6%, below the convex fit at
    every context: corrected): the round pads to 6 nodes, and 5 nodes are priced as the 6 the
    runtime verifies, corrected, not at the fit's 5 nor at 5's own measurement."""
    table = tmp_path / "p.csv"
    _table(table, bump=1.12, fast_six=0.94)
    report = fit_profile(table, forms=("grid",), folds=3, reference_forms=(), draft_from_verify=True)
    v = report.bundle.verify
    assert v.padded_nodes(5, 64) == 6 and "6" in v.info[CELLS_KEY]["offset_us"]["64"]
    for l in CONTEXTS:
        six = 0.94 * _cost_us(64, 6, l)
        assert v.predict(5, l, 64) == pytest.approx(six, rel=0.01)
        assert v.predict(6, l, 64) == pytest.approx(six, rel=0.01)
    # the envelope copied 6's latency into 5 at each context: held out together, or a fold surface
    # trained on the copy would predict the held-out twin (the corrected held-out error a leak)
    fold = dict(zip(zip(*report.verify.points[:3]), report.verify.fold_of))
    for l in CONTEXTS:
        assert fold[(5.0, float(l), 64.0)] == fold[(6.0, float(l), 64.0)]


def test_the_folds_hold_a_key_s_points_out_together_and_without_keys_are_as_before():
    rng = np.random.default_rng(3)
    x = np.repeat(np.arange(2.0, 9.0), 4)
    y = np.tile([256.0, 1024.0, 2048.0, 4096.0], 7)
    z = np.full(x.shape, 64.0)
    lat = 20000 + 900 * x + 2 * y + rng.normal(0, 50, x.size)
    args = (x, y, z, lat, "verify", ("nodes_per_seq", "context_len", "batch_size"))
    plain = fit_surface(*args, forms=("grid",), folds=3)
    alone = fit_surface(*args, forms=("grid",), folds=3, fold_key=lambda a, b, c: list(zip(a, b, c)))
    assert plain.fold_of.tolist() == alone.fold_of.tolist()            # distinct keys: the folds of no key
    pad = {"by_batch": {"64": {"3": 4, "5": 8, "6": 8}}}
    grouped = fit_surface(*args, forms=("grid",), folds=3, fold_key=_pad_folds(pad))
    fold = dict(zip(zip(*grouped.points[:3]), grouped.fold_of))
    for l in (256.0, 1024.0, 2048.0, 4096.0):
        assert fold[(3.0, l, 64.0)] == fold[(4.0, l, 64.0)]
        assert fold[(5.0, l, 64.0)] == fold[(6.0, l, 64.0)] == fold[(8.0, l, 64.0)]
    assert len(set(grouped.fold_of.tolist())) == 3


def test_array_inputs_are_corrected_at_the_same_cells_as_scalars(fitted):
    v = fitted[1].bundle.verify
    n = np.array([2.0, 5.0, 5.0, 5.5, 8.0, 4.5, 4.5, 1.0])
    b = np.array([64, 64, 16, 64, 64, 64, 16, 64])
    got = v.predict(n, 1000.0, b)
    assert got == pytest.approx([v.predict(float(x), 1000.0, int(y)) for x, y in zip(n, b)], rel=1e-12)
    assert got[1] == v.predict(5, 1000.0, 64) and got[5] != v.surface.predict(4.5, 1000.0, 64)
    # no correction reaches an infinite or NaN node count (the surface's own answer, no exception)
    for n in (float("inf"), float("nan")):
        same = v.surface.predict(n, 1000.0, 64)
        assert np.array_equal(v.predict(n, 1000.0, 64), same, equal_nan=True)
        assert np.array_equal(v.predict(np.array([n]), 1000.0, 64), np.asarray(same).reshape(1), equal_nan=True)
    grid = v.predict(np.arange(1, 9)[:, None], np.array(CONTEXTS)[None, :], 64)
    assert grid.shape == (8, 2) and grid[4].tolist() == [v.predict(5, l, 64) for l in CONTEXTS]


def test_without_cells_the_fit_is_as_before(fitted):
    _, report, plain = fitted
    assert CELLS_KEY not in plain.bundle.verify.info and plain.bundle.verify.convex_in_n
    assert plain.bundle.verify.to_dict()["surface"] == report.bundle.verify.to_dict()["surface"]
    assert plain.bundle.verify.predict(5, 256, 64) == report.bundle.verify.surface.predict(5, 256, 64)
    assert plain.bundle.verify.info["fit_error"] == report.bundle.verify.info["fit_error"]


def test_the_record_round_trips_and_a_bad_one_is_one_line(fitted, tmp_path):
    _, report, _ = fitted
    out = report.bundle.save(tmp_path / "b.json")
    loaded = load_costs(out)
    assert loaded.verify.info[CELLS_KEY] == report.bundle.verify.info[CELLS_KEY]
    assert loaded.verify.predict(5, 700.0, 64) == report.bundle.verify.predict(5, 700.0, 64)
    assert loaded.verify.heldout_median_error == report.bundle.verify.info[CELLS_KEY]["heldout"]["median"]
    d = json.loads(out.read_text())
    bad_cells = ({"64": {"5": float("inf")}}, {"64": {"1": 10.0}}, {"x": {"5": 10.0}}, {"64": {"5": True}},
                 {"64": {"5": "10"}}, [], {"064": {"5": 10.0}}, {"64": {"05": 10.0}}, {"+64": {"5": 10.0}})
    good = {"offset_us": {"64": {"5": 10.0}}, "min_excess": 0.02}
    bad = [{"offset_us": c, "min_excess": 0.02} for c in bad_cells] + [
        {"offset_us": {"64": {"5": 1.1}}}, {**good, "min_excess": 0}, "1.09", {**good, "heldout": {"median": "x"}},
        {**good, "by_batch": {"64": {"5": 1.1}}},                          # both forms
        {"by_batch": {"64": {"5": -1.1}}, "min_excess": 0.02},             # an earlier record's ratio <= 0
        {"by_batch": {"064": {"5": 1.1}}, "min_excess": 0.02},
        {**good, "ratio": {"64": {"5": {"256": -1.0}}}}, {**good, "ratio": []}]
    for record in bad:
        d["verify"]["info"][CELLS_KEY] = record
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(d))
        with pytest.raises(SimtreeError, match=CELLS_KEY) as err:
            load_costs(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_the_held_out_path_never_corrects_a_point_by_its_own_measurement():
    # one cell (b 64, n 5) at three contexts, all in different folds; the fold surfaces miss it by
    # +10% at 256, +20% at 2048, +2.5% at 8192 (measured / fitted)
    x = np.array([5.0, 5.0, 5.0, 4.0])
    y = np.array([256.0, 2048.0, 8192.0, 256.0])
    z = np.array([64.0, 64.0, 64.0, 64.0])
    fold_of = np.array([0, 1, 2, 0])
    fold_pred = np.tile(np.array([100.0, 100.0, 100.0, 100.0]), (3, 1))
    lat = np.array([110.0, 120.0, 102.5, 100.0])
    held = fold_pred[0].copy()
    got = heldout_corrected((x, y, z, lat), fold_of, fold_pred, held)
    # each point by the other two contexts' nearest-1 ratio; the n = 4 cell has nothing to correct
    assert got.tolist() == pytest.approx([102.5, 102.5, 110.0, 100.0])
    # in sample the cell takes its own three: the nearest 1
    rec = cell_corrections((x, y, z, lat), fold_pred[0])
    assert rec["offset_us"] == {"64": {"5": 2.5}} and rec["ratio"] == {"64": {"5": {"256": 1.1, "2048": 1.2,
                                                                                  "8192": 1.025}}}
    # a cell timed at one context only is corrected in sample, never held out (no other measurement)
    one = (x[:1], y[:1], z[:1], lat[:1])
    assert cell_corrections(one, fold_pred[0][:1])["offset_us"] == {"64": {"5": 10.0}}
    assert heldout_corrected(one, fold_of[:1] + 1, fold_pred[:, :1], held[:1]).tolist() == [100.0]


def test_a_held_out_padded_point_is_not_corrected_by_the_envelope_copy_of_itself():
    # 64 x 5 pads to 6: its row at 256 is 6's row at 256 (the envelope), which the fold surface misses
    # by -10%; 6 at 2048 by -20%.  Held out, 5 at 256 is priced as 6 at 256 corrected by 2048's ratio.
    x, y, z = np.array([6.0, 6.0, 5.0]), np.array([256.0, 2048.0, 256.0]), np.full(3, 64.0)
    lat = np.array([90.0, 80.0, 90.0])
    fold_of = np.array([1, 2, 0])
    fold_pred = np.tile(np.array([100.0, 100.0, 95.0]), (3, 1))
    pad = {"by_batch": {"64": {"5": 6}}}
    got = heldout_corrected((x, y, z, lat), fold_of, fold_pred, fold_pred[0].copy(), pad)
    assert got.tolist() == pytest.approx([80.0, 90.0, 80.0])


def test_the_held_out_error_is_reported_before_and_after(fitted):
    _, report, plain = fitted
    rec = report.bundle.verify.info[CELLS_KEY]
    before = plain.bundle.verify.info["fit_error"]["heldout"]["grid"]
    # the bumped cell was among the worst points in sample and held out: both p90s fall
    assert rec["in_sample"]["p90"] < report.verify.in_sample["p90"] and rec["heldout"]["p90"] < before["p90"]
    assert rec["heldout"]["max"] <= before["max"] + 1e-12 and rec["in_sample"]["max"] <= report.verify.in_sample["max"]
    assert report.bundle.verify.heldout_median_error == rec["heldout"]["median"]


def test_simtree_fit_lists_the_corrected_cells_unless_told_not_to(tmp_path):
    from typer.testing import CliRunner

    from simtree.cli import app

    table = tmp_path / "p.csv"
    _table(table)
    args = ["fit", str(table), "--draft-from-verify", "--form", "grid", "--folds", "3"]
    ok = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "a.json")], env={"COLUMNS": "200"})
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"     # the plot marks the corrected cell
    assert "corrected measured cells" in ok.output
    rec = load_costs(tmp_path / "a.json").verify.info[CELLS_KEY]
    off, ratio = rec["offset_us"]["64"]["5"], rec["ratio"]["64"]["5"]
    shown = re.escape(f"{off / 1000:+.2f}")
    assert re.search(rf"│\s+64\s+│\s+5\s+│\s+{shown} ms\s+│\s+{ratio['256']:.3f} \(l=256\), "
                     rf"{ratio['2048']:.3f} \(l=2048\)\s+│", ok.output)      # batch, nodes, offset, ratios
    off = CliRunner().invoke(app, [*args, "--no-png", "--no-verify-cells", "-o", str(tmp_path / "b.json")])
    assert off.exit_code == 0 and CELLS_KEY not in load_costs(tmp_path / "b.json").verify.info
    assert "corrected measured cells" not in off.output
    bad = CliRunner().invoke(app, [*args, "--no-png", "--cells-min-excess", "0", "-o", str(tmp_path / "c.json")])
    assert isinstance(bad.exception, SimtreeError) and "minimum excess" in str(bad.exception)
    assert not (tmp_path / "c.json").exists()


def _linear_bundle(cells: dict | None, key: str = "offset_us") -> CostBundle:
    from simtree.costs.forms import BasisSurface

    verify = BasisSurface("verify", [64.0], [900.0, 0.5, 40.0, 30.0, 0.01, 0.0005])
    draft = BasisSurface("draft", [64.0], [50.0, 2.0, 120.0, 0.1, 0.01, 0.5])
    info = {} if cells is None else {CELLS_KEY: {"min_excess": 0.02, key: cells}}
    return CostBundle(VerifyCostModel(verify, info), DraftCostModel(draft),
                      {"model": "toy", "device": "cpu", "source": "test", "synthetic": False})


def test_a_bumped_cell_makes_the_planner_choose_another_tree_size():
    from simtree.acceptance.model import Workload, calibrate_linear
    from simtree.planning.planner import SearchSpace, plan

    wl = Workload("w", calibrate_linear(2.6, 4, name="w", spread=0.0), np.full(4, 300), 64)
    space = SearchSpace(budgets=tuple(range(2, 9)), eagle_steps=(), draft_depths=(), adaptive=False)
    chosen = lambda cells: plan(_linear_bundle(cells), [wl], [32], space).chosen.iloc[0]["policy"]  # noqa: E731
    before = chosen(None)
    assert before.startswith("linear_d")
    d = before.removeprefix("linear_d")
    cv = _linear_bundle(None).verify.predict(int(d), 300.0, 32)
    after = chosen({"32": {d: 0.3 * cv}})
    assert after != before
    assert chosen({"16": {d: 0.3 * cv}}) == before                # a batch the plan does not ask about: as before
    assert chosen({"32": {d: -0.02 * cv}}) == before               # a cheaper cell keeps it


def test_cost_aware_is_priced_at_its_bucket_s_corrected_cost():
    """cost_aware verifies a static bucket every round (simtree.planning.adaptive.adaptive_bucket):
    the simulator (and so the planner and the live run's prediction) prices it with the
    correction of that cell; its decisions price a fractional mean n with the neighbouring cells'
    corrections blended, so a slow bucket cell never draws a larger bucket.  An earlier record's ratios
    still apply, at exact integers only (as when such a bundle was fitted)."""
    from simtree.acceptance.model import Workload, get_workload
    from simtree.planning.adaptive import adaptive_bucket
    from simtree.planning.simulate import PolicySpec, analytic_run

    acc = get_workload("gsm8k").acceptance
    spec = PolicySpec.from_dict("cost_aware", {"max_budget": 16, "draft_depth": 3})
    plain = _linear_bundle(None)
    bucket = adaptive_bucket(acc, spec, plain, 32, 256.0)
    wl = Workload("gsm8k", acc, np.array([256]), 64, "test")
    before = analytic_run(wl, spec, plain, 32, bucket=bucket)
    off = 0.2 * plain.verify.predict(bucket, 256.0, 32)
    for bumped in (_linear_bundle({"32": {str(bucket): off}}), _linear_bundle({"32": {str(bucket): 1.2}}, "by_batch")):
        after = analytic_run(wl, spec, bumped, 32, bucket=bucket)
        assert after["verify_us"] == pytest.approx(1.2 * before["verify_us"], rel=0.02)
    additive = _linear_bundle({"32": {str(bucket): off}})
    assert additive.verify.predict(bucket - 0.5, 256.0, 32) == pytest.approx(
        plain.verify.predict(bucket - 0.5, 256.0, 32) + 0.5 * off, rel=1e-3)
    assert adaptive_bucket(acc, spec, additive, 32, 256.0) <= bucket     # a dearer cell never draws a larger bucket
    legacy = _linear_bundle({"32": {str(bucket): 1.2}}, "by_batch")      # exact integers only
    assert legacy.verify.predict(bucket - 0.5, 256.0, 32) == plain.verify.predict(bucket - 0.5, 256.0, 32)
