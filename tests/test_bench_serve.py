"""simtree bench-serve: traces, continuous batching, every policy side by side (SGLang's own
adaptive and DSpark planners in the loop; skipped where sglang is not importable)."""
import re

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
    df, lengths = run_bench(tmp_path, models=[QWEN], loads=(0.4, 1.5), arrivals=("bursty",), num_requests=24,
                   keep_configs=True, replicas=2, out_of_sample=(7,))
    assert list(df.columns) == COLUMNS and (tmp_path / "bench.png").stat().st_size > 0
    oos = pd.read_csv(tmp_path / "bench_oos.csv")   # another arrivals seed, served the same way
    assert list(oos.columns) == COLUMNS and not np.allclose(oos.rate_req_s, df.rate_req_s)
    assert set(oos.seed) == {7} and set(df.seed) == {0}
    assert pd.read_csv(tmp_path / "bench.csv").shape == df.shape
    assert set(df.policy) == set(POLICIES) and len(df) == 2 * len(POLICIES)
    for _, g in df.groupby("load"):
        by = g.set_index("policy")
        assert by.loc["none", "tok_s"] < by.loc["best_static", "tok_s"]
        ctl = by.loc["controller"]   # the bound holds run by run, not only summed over the replicas
        switches, steps = (np.array(str(ctl[c]).split(), int) for c in ("switches_runs", "steps_runs"))
        assert switches.size == steps.size == 2
        assert np.all(switches <= steps // MIN_DWELL_STEPS)
        assert np.isfinite(by.loc["sglang_dspark", "tok_s"]) and by.loc["sglang_dspark", "tok_s"] > 0
        # every policy served under the same 2 acceptance seeds: tok/s is their mean
        runs = by.tok_s_runs.map(lambda x: np.array(str(x).split(), float))
        assert (by.replicas == 2).all() and all(r.size == 2 for r in runs)
        assert np.allclose([r.mean() for r in runs], by.tok_s, rtol=1e-5)
        # paired with best_static: its own difference is 0, every band holds the policy's p99 difference
        assert by.loc["best_static", ["tpot_p99_diff_lo_ms", "tpot_p99_diff_hi_ms"]].tolist() == [0.0, 0.0]
        assert (by.tpot_p99_diff_lo_ms <= by.tpot_p99_diff_hi_ms).all()
    # the files SGLang's and vLLM's policies ran on, read back by SGLang's own loaders
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveStepSlot, _load_adaptive_config
    from sglang.srt.speculative.dspark_components.dspark_sps import load_sps_table_from_path

    from simtree.serving.bench import read_vllm_tiers
    cfg_dir = tmp_path / "configs" / "qwen3.6-27b"
    cfg, slots = _load_adaptive_config(str(cfg_dir / "adaptive_config.json"))
    assert 1 in slots and all(AdaptiveStepSlot(3, {**cfg, **e}).candidate_steps for e in slots.values())
    assert type(load_sps_table_from_path(str(cfg_dir / "sps_table.json"))).__name__ == "SpsAdditiveCostTable"
    assert read_vllm_tiers(cfg_dir / "vllm_tiers.json")[0][0] == 1
    # simtree's controller as SGLang's policy: the same slots, SGLang's loader reads them; the policy
    # reads the bundle beside them, and its runs keep the controller's switch bound
    from simtree.engines.sglang_controller import SimtreeAdaptiveParams
    assert _load_adaptive_config(str(cfg_dir / "adaptive_controller.json"))[1] == slots
    policy = SimtreeAdaptiveParams(3, str(cfg_dir / "adaptive_controller.json"))
    assert policy.candidate_steps == sorted({s for e in slots.values() for s in e["candidate_steps"]})
    for _, g in df.groupby("load"):
        sc = g.set_index("policy").loc["sglang_controller"]
        switches, steps = (np.array(str(sc[c]).split(), int) for c in ("switches_runs", "steps_runs"))
        assert np.all(switches <= steps // MIN_DWELL_STEPS + 1)   # + SGLang's move off the launch's steps
    text = (tmp_path / "README.md").read_text()
    assert f"switches <= steps // {MIN_DWELL_STEPS}" in text and "every controller run within it: yes" in text
    assert "Targets over 2 points" in text and "served under 2 acceptance seed(s)" in text and "of 4 runs" in text
    assert "Out of sample, arrivals seed 7, acceptance seeds 7 .. 8" in text and f"ShareGPT lengths ({lengths})" in text
    assert text.count("Paired with best_static") == 2
    assert "simtree's controller inside SGLang (`sglang_controller`" in text and "over the 4 points of the 2 seeds" in text
    assert (df.tpot_p99_lo_ms <= df.tpot_p99_ms).all()
    assert (df.tpot_p99_ms <= df.tpot_p99_hi_ms).all()


def test_switch_bound_is_checked_replica_by_replica():
    """A run over its bound is caught even where the replicas' totals stay within it."""
    from simtree.serving.bench_report import switch_bound_use
    row = {"policy": "controller", "switches_runs": f"{3 * 16} 0", "steps_runs": f"{2 * 16 * 16} {16 * 16 * 16}"}
    df = pd.DataFrame([row])
    assert 3 * 16 <= (2 * 16 * 16 + 16 * 16 * 16) // MIN_DWELL_STEPS   # the sums are within the bound
    within, used = switch_bound_use(df)
    assert not within and used == pytest.approx(3 * 16 / (2 * 16 * 16 // MIN_DWELL_STEPS))
    assert switch_bound_use(df.assign(switches_runs="32 0"))[0]


def test_statics_cache_key_changes_with_what_changes_the_result():
    from simtree.control.controller import tier_shape
    from simtree.planning.modes import EagleParams, NoneParams
    from simtree.acceptance.model import get_workload
    from simtree.serving.bench import statics_key
    acc = get_workload("sharegpt").acceptance
    statics = [tier_shape(acc, NoneParams(), 0), tier_shape(acc, EagleParams(2, 2, 5), 1)]
    m, trace = {"path": QWEN}, make_trace("poisson", 2.0, 10, seed=0)
    key = statics_key(m, statics, trace, range(0, 2))
    assert key == statics_key(m, statics, trace, range(0, 2))
    assert key != statics_key(m, statics, trace, range(1, 3))                            # acceptance seeds
    assert key != statics_key(m, statics, make_trace("poisson", 2.0, 10, seed=1), range(0, 2))   # trace
    assert key != statics_key(m, statics[:1], trace, range(0, 2))                         # tiers
    other = get_workload("gsm8k").acceptance
    assert key != statics_key(m, [tier_shape(other, NoneParams(), 0), tier_shape(other, EagleParams(2, 2, 5), 1)],
                              trace, range(0, 2))                                         # acceptance model
    assert key != statics_key({"path": data_path("costs", "h200_deepseek-v4-flash_ep8.json")}, statics, trace,
                              range(0, 2))                                                # cost bundle


def test_tier_table_not_covering_batch_1_is_one_line_and_writes_nothing(tmp_path):
    from typer.testing import CliRunner

    from simtree.cli import app
    tiers = tmp_path / "spec.json"
    tiers.write_text('{"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": {"4-16": 3, "17-64": 0}}')
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench-serve", "--out", str(out), "--threshold-tiers", str(tiers)])
    assert isinstance(r.exception, SimtreeError) and "does not cover batch 1" in str(r.exception)
    assert "\n" not in str(r.exception) and not out.exists()


def test_live_report_section_kept_by_the_benchmark(tmp_path):
    from simtree.serving.live_report import COLUMNS, SECTION, existing_section, live_section, main, merge_section
    rows = [{c: 0 for c in COLUMNS} | {"phase": i, "batch_size": b, "new_tokens": 96, "rounds": 40, "tiers": "eagle_s2_k2_d5:40",
             "measured_tpot_ms": 1.0, "predicted_tpot_ms": p, "predicted_model_tpot_ms": 1.02, "device": "GPU",
             "costs": "costs.json", "prompts": "sharegpt", "controller_steps": 80, "controller_switches": 2,
             "switch_bound": 5} for i, (b, p) in enumerate([(1, 1.05), (8, 0.97)])]
    csv = tmp_path / "live.csv"
    pd.DataFrame(rows, columns=COLUMNS).to_csv(csv, index=False)
    section = live_section(csv, "cmd")
    assert "at every phase: yes (2 of 2 phases; worst 5.0%)" in section and "| 1 | 8 | 40 |" in section
    later = tmp_path / "later.csv"       # a later session's run, predicted by a bundle fixed before it
    pd.DataFrame([r | {"predicted_tpot_ms": 1.2 - 0.1 * r["phase"]} for r in rows], columns=COLUMNS).to_csv(later, index=False)
    both = live_section(csv, "cmd", later, "frozen.json")
    assert both.startswith(section.rstrip("\n")) and "### The same schedule again in a later session" in both
    assert "`frozen.json`" in both and "at every phase: NO (1 of 2 phases; worst 20.0%)" in both
    readme = tmp_path / "README.md"
    readme.write_text("# Bench\n\ntext\n")
    main([str(csv), "--readme", str(readme)])
    once = readme.read_text()
    assert once.count(SECTION) == 1 and once.startswith("# Bench")
    assert existing_section(readme).startswith(SECTION)
    assert merge_section(once, existing_section(readme)) == once   # a rerun replaces the section, nothing else
    assert merge_section(once + "\n## Later\n", section).endswith("\n## Later\n")
    pd.DataFrame(rows).drop(columns=["predicted_tpot_ms"]).to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(SimtreeError, match="missing predicted_tpot_ms"):
        live_section(tmp_path / "bad.csv", "cmd")


def test_paired_band_cancels_what_the_requests_drawn_move():
    """Two policies served on the same requests: the paired band of their p99 difference is
    narrower than what either p99 alone moves, and a policy paired with itself differs by 0."""
    from simtree.serving.bench import paired_p99_diff_band
    from simtree.serving.sim import p99_band
    rng = np.random.default_rng(4)
    base = rng.lognormal(2.5, 0.3, 1200)
    other = base * 1.01 + rng.normal(0, 0.01, 1200)   # 1% slower on every request
    lo, hi = paired_p99_diff_band(other, base)
    alone = p99_band(base)
    assert 0 < lo <= hi and hi - lo < alone[1] - alone[0]
    assert paired_p99_diff_band(base, base) == (0.0, 0.0)
    with pytest.raises(SimtreeError):
        paired_p99_diff_band(base, base[:-1])


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], r"--seed must be an integer in \[0, 9223372036854775804\], got -1"),
    (["--out-of-sample", "3,-2"], r"--out-of-sample seed must be an integer in \[0, 9223372036854775807\], got -2"),
    (["--loads", "0.4,nan"], "--loads '0.4,nan': every load must be a finite number > 0"),
])
def test_negative_seeds_and_a_nan_load_are_one_line_and_write_nothing(tmp_path, args, message):
    """A negative seed reached numpy in the worker (its traceback); a NaN load passed the > 0 check
    and failed later as a trace's rate."""
    from typer.testing import CliRunner

    from simtree.cli import app
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench-serve", "--out", str(out), "--requests", "5", *args])
    assert isinstance(r.exception, SimtreeError), r.output
    assert re.fullmatch(message, str(r.exception)) and not out.exists()


def _controller_prices_script():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "controller_prices.py"
    spec = importlib.util.spec_from_file_location("controller_prices", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_controller_prices_records_without_changing_the_run_and_prices_as_the_simulator(capsys, tmp_path):
    """scripts/controller_prices.py: its recording driver leaves the run as it was (the same tok/s
    and steps as the driver alone), and at the full batch the simulator's price of a fixed tier's
    steps is the controller's own (the same grid, mean context and nodes), as its output says;
    the controller's ranking (rate and objective) is recorded before each choice, not after."""
    import warnings

    from simtree.control.controller import Controller
    from simtree.serving.bench import _model_setup, default_models, serve_points
    from simtree.serving.policies import ControllerDriver, FixedDriver
    from simtree.serving.sim import MAX_BATCH, serve
    script = _controller_prices_script()
    warnings.simplefilter("ignore")
    m = _model_setup(next(p for p in default_models() if "v4-flash" in p.name), tmp_path, "sharegpt")
    trace = make_trace("bursty", 8.5, 120, 0)
    tier = next(t for t in Controller(m["grid"], m["acc"]).tiers if t.name == "linear_d3")
    for make in (lambda: FixedDriver(m["grid"], tier), lambda: ControllerDriver(Controller(m["grid"], m["acc"]))):
        alone = serve(trace, make(), m["acc"].weights, seed=1)
        steps, tok_s = script.serve_recorded(trace, make, m["acc"].weights, [1])
        assert tok_s == [alone.tok_s] and len(steps) == alone.steps
    assert sum(r["b"] == MAX_BATCH for r in steps) > 0 and all("by_objective" in r for r in steps)
    assert script.main(["--requests", "120", "--tiers", "linear_d3,eagle_s2_k2_d4"]) == 0
    out = capsys.readouterr().out
    priced = re.findall(r"\(b\) simulator [\d.]+ us \(([+-][\d.]+)%; step by step at most ([\d.]+)%\)", out)
    assert len(priced) == 2 and all(float(a) == 0 and float(b) == 0 for a, b in priced)
    assert "controller at the full batch" in out
    served = dict(re.findall(r"^  (\S+): tok/s ([\d.]+);", out, re.M))
    assert list(served) == ["linear_d3", "eagle_s2_k2_d4", "controller"]
    # the benchmark's own point (its trace, acceptance seeds and drivers) gives the same tok/s
    bench = serve_points(models=[m["path"]], loads=(1.5,), arrivals=("bursty",), num_requests=120, seed=0,
                         policies=("best_static",), extra={"controller": lambda setup: lambda: ControllerDriver(
                             Controller(setup["grid"], setup["acc"]))}).set_index("policy")
    assert f"{bench.loc['controller', 'tok_s']:.2f}" == served["controller"]


def test_controller_prices_bad_tier_or_model_is_one_line(capsys):
    script = _controller_prices_script()
    assert script.main(["--tiers", "linear_d9"]) == 2
    assert script.main(["--model", "no-such-model"]) == 2
    assert script.main(["--seed", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and err[0].startswith("error: unknown tiers ['linear_d9']")
    assert "no-such-model" in err[1] and "--seed" in err[2]
