"""simtree bench-serve: traces, continuous batching, every policy side by side (SGLang's own
adaptive and DSpark planners in the loop; skipped where sglang is not importable)."""
import numpy as np
import pandas as pd
import pytest

from simtree.control.controller import MIN_DWELL_STEPS
from simtree.data import data_path
from simtree.errors import SimtreeError
from simtree.serving.traces import make_trace

QWEN = data_path("costs", "h200_qwen3.6-27b_tp1.json")


@pytest.mark.parametrize("kind", ["poisson", "bursty"])
def test_traces_keep_their_mean_rate(kind):
    tr = make_trace(kind, 5.0, 4000, seed=1)
    assert np.all(np.diff(tr.arrival_s) >= 0)
    assert len(tr.arrival_s) / tr.arrival_s[-1] == pytest.approx(5.0, rel=0.08)
    assert tr.prompt_len.min() >= 4 and tr.output_len.min() >= 4
    if kind == "bursty":   # arrivals crowd into the first quarter of each period
        phase = (tr.arrival_s % 20.0) < 5.0
        assert phase.mean() > 0.5
    with pytest.raises(SimtreeError):
        make_trace("uniform", 1.0, 10)


def test_bench_small(tmp_path):
    pytest.importorskip("sglang.srt.speculative.adaptive_spec_params")
    from simtree.serving.bench import COLUMNS, POLICIES, run_bench
    df = run_bench(tmp_path, models=[QWEN], loads=(0.4, 1.5), arrivals=("bursty",), num_requests=24,
                   keep_configs=True)
    assert list(df.columns) == COLUMNS and (tmp_path / "bench.png").stat().st_size > 0
    assert pd.read_csv(tmp_path / "bench.csv").shape == df.shape
    assert set(df.policy) == set(POLICIES) and len(df) == 2 * len(POLICIES)
    for _, g in df.groupby("load"):
        by = g.set_index("policy")
        assert by.loc["none", "tok_s"] < by.loc["best_static", "tok_s"]
        ctl = by.loc["controller"]
        assert ctl.switches <= ctl.steps // MIN_DWELL_STEPS
        assert np.isfinite(by.loc["sglang_dspark", "tok_s"]) and by.loc["sglang_dspark", "tok_s"] > 0
    assert (tmp_path / "configs" / "qwen3.6-27b" / "adaptive_config.json").is_file()
    assert "switch bound" in (tmp_path / "README.md").read_text()


def test_tier_table_not_covering_batch_1_is_one_line_and_writes_nothing(tmp_path):
    from typer.testing import CliRunner

    from simtree.cli import app
    tiers = tmp_path / "spec.json"
    tiers.write_text('{"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": {"4-16": 3, "17-64": 0}}')
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench-serve", "--out", str(out), "--threshold-tiers", str(tiers)])
    assert isinstance(r.exception, SimtreeError) and "does not cover batch 1" in str(r.exception)
    assert "\n" not in str(r.exception) and not out.exists()
