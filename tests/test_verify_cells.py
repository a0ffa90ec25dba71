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
    assert rec["min_excess"] == 0.02 and rec["by_batch"] == {"64": {"5": rec["by_batch"]["64"]["5"]}}
    assert 1.02 < rec["by_batch"]["64"]["5"] < BUMP
    for l in CONTEXTS:     # the fit's times the ratio nearest 1: within 1% of the measured at each context
        assert v.predict(5, l, 64) == pytest.approx(_cost_us(64, 5, l), rel=0.01)
    # elsewhere the surface as fitted: other node counts, between them, another batch, a batch never timed
    for n, l, b in ((4, 256, 64), (6, 2048, 64), (3, 256, 64), (5.5, 256, 64), (5, 256, 16), (5, 256, 32),
                    (5, 256, 63), (1, 256, 64)):
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
    assert v.padded_nodes(5, 64) == 6 and "6" in v.info[CELLS_KEY]["by_batch"]["64"]
    for l in CONTEXTS:
        six = 0.94 * _cost_us(64, 6, l)
        assert v.predict(5, l, 64) == pytest.approx(six, rel=0.01)
        assert v.predict(6, l, 64) == pytest.approx(six, rel=0.01)


def test_array_inputs_are_corrected_at_the_same_cells_as_scalars(fitted):
    v = fitted[1].bundle.verify
    n = np.array([2.0, 5.0, 5.0, 5.5, 8.0])
    b = np.array([64, 64, 16, 64, 64])
    got = v.predict(n, 1000.0, b)
    assert got.tolist() == [v.predict(float(x), 1000.0, int(y)) for x, y in zip(n, b)]
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
    bad_cells = ({"64": {"5": -1.0}}, {"64": {"1": 1.1}}, {"x": {"5": 1.1}}, {"64": {"5": True}}, {"64": {"5": "1.1"}}, [])
    bad = [{"by_batch": c, "min_excess": 0.02} for c in bad_cells] + [
        {"by_batch": {"64": {"5": 1.1}}}, {"by_batch": {"64": {"5": 1.1}}, "min_excess": 0}, "1.09",
        {"by_batch": {"64": {"5": 1.1}}, "min_excess": 0.02, "heldout": {"median": "x"}}]
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
    assert cell_corrections((x, y, z, lat), fold_pred[0])["by_batch"] == {"64": {"5": 1.025}}
    # a cell timed at one context only is corrected in sample, never held out (no other measurement)
    one = (x[:1], y[:1], z[:1], lat[:1])
    assert cell_corrections(one, fold_pred[0][:1])["by_batch"] == {"64": {"5": 1.1}}
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
    ratio = load_costs(tmp_path / "a.json").verify.info[CELLS_KEY]["by_batch"]["64"]["5"]
    assert re.search(rf"│\s+64\s+│\s+5\s+│\s+{ratio:.3f}\s+│", ok.output)      # batch, nodes, ratio
    off = CliRunner().invoke(app, [*args, "--no-png", "--no-verify-cells", "-o", str(tmp_path / "b.json")])
    assert off.exit_code == 0 and CELLS_KEY not in load_costs(tmp_path / "b.json").verify.info
    assert "corrected measured cells" not in off.output
    bad = CliRunner().invoke(app, [*args, "--no-png", "--cells-min-excess", "0", "-o", str(tmp_path / "c.json")])
    assert isinstance(bad.exception, SimtreeError) and "minimum excess" in str(bad.exception)
    assert not (tmp_path / "c.json").exists()


def _linear_bundle(cells: dict | None) -> CostBundle:
    from simtree.costs.forms import BasisSurface

    verify = BasisSurface("verify", [64.0], [900.0, 0.5, 40.0, 30.0, 0.01, 0.0005])
    draft = BasisSurface("draft", [64.0], [50.0, 2.0, 120.0, 0.1, 0.01, 0.5])
    info = {} if cells is None else {CELLS_KEY: {"min_excess": 0.02, "by_batch": cells}}
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
    after = chosen({"32": {d: 1.3}})
    assert after != before
    assert chosen({"16": {d: 1.3}}) == before                # a batch the plan does not ask about: as before
    assert chosen({"32": {d: 0.98}}) == before               # a cheaper cell keeps it


def test_cost_aware_is_priced_at_its_bucket_s_corrected_cost():
    """cost_aware verifies a static bucket every round (simtree.planning.adaptive.adaptive_bucket):
    the simulator (and so the planner and the live run's prediction) prices it with the
    correction of that cell."""
    from simtree.acceptance.model import Workload, get_workload
    from simtree.planning.adaptive import adaptive_bucket
    from simtree.planning.simulate import PolicySpec, analytic_run

    acc = get_workload("gsm8k").acceptance
    spec = PolicySpec.from_dict("cost_aware", {"max_budget": 16, "draft_depth": 3})
    plain = _linear_bundle(None)
    bucket = adaptive_bucket(acc, spec, plain, 32, 256.0)
    wl = Workload("gsm8k", acc, np.array([256]), 64, "test")
    before = analytic_run(wl, spec, plain, 32, bucket=bucket)
    bumped = _linear_bundle({"32": {str(bucket): 1.2}})
    after = analytic_run(wl, spec, bumped, 32, bucket=adaptive_bucket(acc, spec, bumped, 32, 256.0))
    assert after["verify_us"] == pytest.approx(1.2 * before["verify_us"], rel=0.02)
    assert after["g"] == before["g"]
