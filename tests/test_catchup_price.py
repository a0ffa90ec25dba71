"""The drafter's catch-up after plain rounds, priced: its buckets, what an engine that lags pays
step by step (:class:`CatchUpClock`), the serving simulator adding it to the steps that pay it
(only for drivers whose engine runs plain and drafted steps), the controller's plain tier
carrying its share, and the live report's catch-up columns."""
import numpy as np
import pandas as pd
import pytest

from simtree.acceptance.model import get_workload
from simtree.control import Controller, tier_shape
from simtree.control.catchup import LAG_ROWS, CatchUpClock, bucket_rows, catch_up_buckets, catch_up_us
from simtree.costs.model import load_costs
from simtree.data import data_path
from simtree.planning.modes import EagleParams, NoneParams
from simtree.serving.costgrid import CostGrid


@pytest.fixture(scope="module")
def setup():
    costs = load_costs(data_path("costs", "h200_qwen3.6-27b_tp1.json"))
    return CostGrid(costs), get_workload("sharegpt").acceptance


def test_buckets_and_the_price_of_one_catch_up(setup):
    grid, _ = setup
    assert catch_up_buckets(LAG_ROWS) == (1, 2, 4, 8, 16, 32, 64) and bucket_rows(3) == 4
    assert catch_up_us(grid, 0, 8) == 0.0
    for n, b in ((1, 1), (3, 8), (33, 2), (64, 64)):   # one draft step over bucket x batch rows
        assert catch_up_us(grid, n, b) == grid.draft.predict(1, 1, bucket_rows(n) * b)
    assert catch_up_us(grid, 3, 8) == catch_up_us(grid, 4, 8) < catch_up_us(grid, 5, 8)


def test_the_clock_pays_when_drafting_resumes_and_on_a_full_buffer(setup):
    grid, _ = setup
    clock = CatchUpClock(grid, rows=4)
    paid = [clock.step_us(plain, 2) for plain in [True] * 3 + [False, False] + [True] * 9 + [False]]
    one = lambda n: catch_up_us(grid, n, 2, 4)   # noqa: E731
    # 3 plain, drafting resumes (3 rows -> bucket 4); 9 plain: the 5th and 9th find 4 waiting; 1 waits at the end
    assert paid == [0, 0, 0, one(3), 0] + [0, 0, 0, 0, one(4), 0, 0, 0, one(4)] + [one(1)]
    assert clock.count == 4 and clock.total_us == pytest.approx(sum(paid)) and clock.waiting == 0


class _Alternating:
    """A driver whose engine lags: plain and drafted steps in turn."""

    lags = True

    def __init__(self, costs, acc, lags=True):
        self.costs, self.lags, self.n = costs, lags, 0
        self.tiers = [tier_shape(acc, NoneParams()), tier_shape(acc, EagleParams(2, 2, 4))]

    def step(self, b, ctx, levels, u, rounds=None):
        from simtree.serving.policies import _step_us, sample_tier
        tier = self.tiers[self.n % 2]
        self.n += 1
        return _step_us(self.costs, tier, levels, ctx), sample_tier(tier, levels, u), tier.name


def test_the_simulator_prices_the_catch_ups_of_an_engine_that_lags(setup):
    from simtree.serving.sim import serve
    from simtree.serving.traces import Trace, make_trace
    grid, acc = setup
    real = make_trace("poisson", 2.0, 12, seed=3)   # every request there at once: the same steps either way
    trace = Trace(np.zeros(12), real.prompt_len + 256, real.output_len, "at_once", 0.0)
    lagging = serve(trace, _Alternating(grid, acc), acc.weights, seed=0)
    free = serve(trace, _Alternating(grid, acc, lags=False), acc.weights, seed=0)
    assert free.catch_ups == 0 and free.catch_up_s == 0.0
    assert lagging.steps == free.steps and lagging.catch_ups == lagging.steps // 2   # each drafted step after a plain one
    assert lagging.makespan_s == pytest.approx(free.makespan_s + lagging.catch_up_s, rel=1e-9)
    assert lagging.catch_up_s > 0 and lagging.tok_s < free.tok_s


def test_the_controllers_plain_tier_carries_its_share_of_the_catch_up(setup):
    grid, acc = setup
    both = Controller(grid, acc, specs=[NoneParams(), EagleParams(2, 2, 4)])
    plain_only = Controller(grid, acc, specs=[NoneParams()])
    for b in (1, 64):
        plain_us = b / both.predicted_tok_s(b, 512.0)[0] * 1e6
        assert plain_us == pytest.approx(grid.verify.predict(1.0, 512.0, b) + catch_up_us(grid, LAG_ROWS, b) / LAG_ROWS)
        assert b / plain_only.predicted_tok_s(b, 512.0)[0] * 1e6 == pytest.approx(grid.verify.predict(1.0, 512.0, b))


def test_the_live_report_shows_the_catch_ups(tmp_path):
    from simtree.serving.live_report import CATCH_UP_COLUMNS, COLUMNS, live_section
    row = {c: 0 for c in COLUMNS} | {"phase": 0, "batch_size": 2, "new_tokens": 96, "rounds": 95, "tiers": "none:95",
                                     "measured_tpot_ms": 0.2, "predicted_tpot_ms": 0.19, "predicted_model_tpot_ms": 0.19,
                                     "device": "GPU", "costs": "c.json", "prompts": "sharegpt", "catch_ups": 1,
                                     "measured_catchup_ms": 0.31, "predicted_catchup_ms": 0.25}
    csv = tmp_path / "live.csv"
    pd.DataFrame([row], columns=COLUMNS + CATCH_UP_COLUMNS).to_csv(csv, index=False)
    section = live_section(csv, "cmd")
    assert "catch-ups | measured catch-up ms" in section and "| 1 | 0.310 | 0.250 |" in section
    pd.DataFrame([row], columns=COLUMNS).to_csv(csv, index=False)     # an earlier run's CSV: no catch-up columns
    assert "catch-ups" not in live_section(csv, "cmd")
