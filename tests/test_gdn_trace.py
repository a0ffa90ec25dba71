"""scripts/gdn_trace.py: how a CUDA activity trace of several verify calls is cut into calls
(each kernel's durations, each call's span), on generated traces (no GPU needed)."""
import runpy
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
split_calls = runpy.run_path(str(ROOT / "scripts" / "gdn_trace.py"))["split_calls"]


def test_calls_are_cut_in_start_order_with_overlapping_kernels():
    rng = np.random.default_rng(0)
    for _ in range(30):
        reps, names = int(rng.integers(1, 6)), ["kside", "walk", "prepass"][:int(rng.integers(1, 4))]
        events, want_spans, want = [], [], {}
        t = 0.0
        for _ in range(reps):
            starts, ends = [], []
            for name in names:   # each kernel starts after the one before, may outlast the next
                s = t + float(rng.uniform(0.1, 2.0))
                e = s + float(rng.uniform(1.0, 30.0))
                events.append((name, s, e))
                want.setdefault(name, []).append(e - s)
                starts.append(s)
                ends.append(e)
                t = s
            want_spans.append(max(ends) - starts[0])
            t = max(ends) + float(rng.uniform(5.0, 50.0))   # calls do not overlap
        order = rng.permutation(len(events))
        durations, spans = split_calls([events[i] for i in order], reps)
        assert durations.keys() == want.keys()
        for name in names:
            assert np.allclose(durations[name], want[name])
        assert np.allclose(spans, want_spans)


def test_a_trace_that_is_not_whole_calls_is_one_line():
    events = [("walk", 0.0, 1.0), ("walk", 2.0, 3.0), ("kside", 4.0, 5.0)]
    with pytest.raises(SystemExit, match="3 kernels in 2 calls"):
        split_calls(events, 2)
    with pytest.raises(SystemExit, match="0 kernels in 3 calls"):
        split_calls([], 3)
