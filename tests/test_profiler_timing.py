import time

import numpy as np
import pytest

from simtree.profiler.timing import rotation_copies, summarize_us, time_cpu, time_workload


def test_summary_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.lognormal(3, 0.5, size=101)
    s = summarize_us(x, "cpu")
    assert s.median_us == pytest.approx(np.median(x))
    assert s.p10_us == pytest.approx(np.percentile(x, 10))
    assert s.p90_us == pytest.approx(np.percentile(x, 90))
    assert s.p10_us <= s.median_us <= s.p90_us and s.repeats == 101


def test_summary_drops_invalid_samples_and_refuses_none():
    assert summarize_us([0.0, float("nan"), 5.0], "cpu").repeats == 1
    with pytest.raises(RuntimeError):
        summarize_us([0.0, -1.0], "cpu")


def test_cpu_timer_measures_a_known_delay():
    s = time_cpu([lambda: time.sleep(0.002)], target_s=0.02, min_reps=5)
    assert 1900 <= s.median_us <= 20000   # sleep never returns early; loaded CI may be slow
    assert s.repeats >= 5 and s.mode == "cpu"


def test_time_is_per_copy():
    # 3 copies of a 4 ms sleep: per-copy 4 ms; a timer that forgot to divide would give 12 ms
    s = time_workload([lambda: time.sleep(0.004)] * 3, "cpu", target_s=0.05)
    assert s.copies == 3 and 3900 <= s.median_us <= 8000


@pytest.mark.parametrize("inst, l2, want", [(10 * 2**20, 50 * 2**20, 10), (1 * 2**20, 50 * 2**20, 16), (40 * 2**20, 50 * 2**20, 3),
                                             (200 * 2**20, 50 * 2**20, 1), (1000, 0, 1)])
def test_rotation_covers_twice_l2(inst, l2, want):
    assert rotation_copies(inst, l2) == want


def test_measured_bandwidth_counts_read_and_written_bytes():
    from simtree.profiler.timing import measured_bandwidth
    bw = measured_bandwidth("cpu", numel=1 << 16)
    assert bw["buffer_bytes"] == 4 << 16
    assert 0 < bw["copy_GBps"] < 1e4 and 0 < bw["read_GBps"] < 1e4
    assert bw["floor_Bps"] == pytest.approx(max(bw["copy_GBps"], bw["read_GBps"]) * 1e9, rel=1e-12)
