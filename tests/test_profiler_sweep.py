import json
import time

import pytest
import torch

from simtree import profile_table as pt
from simtree.errors import SimtreeError
from simtree.profiler import sweep as sw
from simtree.profiler.timing import TimingStats

SWEEP = """
name: t
device: cpu
dtype: fp32
max_minutes: 5
target_s: 0.002
models: [tiny-gdn]
grid: {batch_size: [1, 2], nodes_per_seq: [1, 4], context_len: [0], tree_shape: [any]}
stages:
  - {stage: proj}
  - {stage: mlp_step}
  - {stage: lm_head_step}
  - {stage: attn_tree_verify, grid: {context_len: [32], tree_shape: [eagle]}}
  - {stage: gdn_tree_verify, variants: [torch_ref, triton_tree], grid: {context_len: [32], tree_shape: [eagle]}}
compose: true
"""
N_POINTS = 6 * 4  # gdn_proj, attn_proj, mlp, lm_head, attn core, gdn torch_ref; triton is unavailable


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SWEEP)
    return path


def _fake_timer(fail_at=None, exc=None):
    calls = []

    def timer(fns, device, **kw):
        calls.append(1)
        if fail_at is not None and len(calls) == fail_at:
            raise exc
        return TimingStats(10.0 + len(calls), 9.0 + len(calls), 12.0 + len(calls), 5, "cpu")
    return timer, calls


def _run(spec, out, **kw):
    return sw.run_sweep(spec, out, progress=False, echo=lambda s: None, **kw)


def test_sweep_writes_a_valid_table_with_meta(spec, tmp_path):
    out = tmp_path / "p.csv"
    res = _run(spec, out)
    df = pt.load_profile(out)
    measured = df[df.stage != "model_verify_step"]
    assert res.measured == N_POINTS == len(measured)
    assert set(measured.device) == {"cpu"} and (measured.latency_us_median > 0).all()
    assert res.unavailable == 4                    # triton_tree on CPU: recorded, not fatal
    meta = pt.read_meta(out)
    assert meta["device"] == "cpu" and meta["sweep"] == "t" and meta["torch_version"]
    # the composition covers every (b, n) where all parts were measured
    comp = df[df.stage == "model_verify_step"]
    assert len(comp) == 4 and (comp.variant == "composed").all()


def test_rerun_resumes_without_remeasuring(spec, tmp_path, monkeypatch):
    out = tmp_path / "p.csv"
    checks = _run(spec, out).checks
    timer, calls = _fake_timer()
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    res = _run(spec, out)
    assert calls == [] and res.measured == 0 and res.skipped_done == N_POINTS + 4
    # the second sweep checked nothing; the table's meta keeps the first sweep's checks
    assert checks and res.checks == {} and pt.read_meta(out)["checks"] == checks


def test_remeasure_times_the_selected_stage_again_and_keeps_the_rest(spec, tmp_path, monkeypatch):
    out = tmp_path / "p.csv"
    _run(spec, out)
    before = pt.load_profile(out)
    timer, calls = _fake_timer()
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    res = _run(spec, out, only_stage="mlp_step", remeasure=True)
    assert res.measured == len(calls) == 4 and res.skipped_done == 0
    after = pt.load_profile(out)
    assert len(after) == len(before)                       # replaced, not duplicated
    mlp = after[after.stage == "mlp_step"]
    assert sorted(mlp.latency_us_median) == [11.0, 12.0, 13.0, 14.0]   # the fake timer's
    rest = ~after.stage.isin(["mlp_step", "model_verify_step"])
    assert after[rest].latency_us_median.sort_values().tolist() == \
        before[~before.stage.isin(["mlp_step", "model_verify_step"])].latency_us_median.sort_values().tolist()
    # recomposed from the new rows, and the sidecar says how
    assert pt.read_meta(out)["compose"] == res.compose and res.compose["composed_rows"] == 4


def test_interrupted_sweep_keeps_finished_points_and_resumes(spec, tmp_path, monkeypatch):
    out = tmp_path / "p.csv"
    timer, _ = _fake_timer(fail_at=7, exc=KeyboardInterrupt())
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    with pytest.raises(KeyboardInterrupt):
        _run(spec, out)
    assert len(pt.load_profile(out)) == 6          # the 6 finished points, a valid table
    timer, calls = _fake_timer()
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    res = _run(spec, out)
    df = pt.load_profile(out)
    assert res.measured == N_POINTS - 6 and len(calls) == N_POINTS - 6
    assert len(df[df.stage != "model_verify_step"]) == N_POINTS   # no duplicates, nothing lost


def test_oom_point_is_recorded_and_skipped(spec, tmp_path, monkeypatch):
    out = tmp_path / "p.csv"
    timer, _ = _fake_timer(fail_at=3, exc=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    res = _run(spec, out)
    assert res.oom == 1 and res.measured == N_POINTS - 1
    log = [json.loads(x) for x in (tmp_path / "p.points.jsonl").read_text().splitlines()]
    assert sum(r["status"] == "oom" for r in log) == 1
    timer, calls = _fake_timer()
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    assert _run(spec, out).measured == 0           # not retried ...
    assert _run(spec, out, retry_failed=True).measured == 1   # ... unless asked


def test_failing_point_does_not_stop_the_sweep(spec, tmp_path, monkeypatch):
    timer, _ = _fake_timer(fail_at=2, exc=RuntimeError("boom"))
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    res = _run(spec, tmp_path / "p.csv")
    assert res.failed == 1 and res.measured == N_POINTS - 1


def test_max_minutes_stops_between_points(spec, tmp_path):
    lines = []
    res = sw.run_sweep(spec, tmp_path / "p.csv", progress=False, echo=lines.append, max_minutes=0)
    assert res.measured == 0 and res.not_run == N_POINTS + 4 and "max" in res.stopped
    # the last line tells the user how to get the rest
    assert lines[-1].startswith(f"{N_POINTS + 4} points not run") and "run the same command again" in lines[-1]
    lines.clear()
    done = sw.run_sweep(spec, tmp_path / "q.csv", progress=False, echo=lines.append)
    assert done.not_run == 0 and not any("points not run" in line for line in lines)


def test_only_stage_and_aliases(spec):
    pts = sw.expand_points(sw.load_sweep(spec), "cpu", only_stage="gdn_proj_step")
    assert {p.stage for _, p in pts} == {"gdn_proj_step"} and len(pts) == 4
    stages = {p.stage for _, p in sw.expand_points(sw.load_sweep(spec), "cpu")}
    assert {"gdn_proj_step", "attn_proj_step"} <= stages


def test_shipped_sweeps_expand(tmp_path):
    gpu = sw.expand_points(sw.load_sweep(sw.SWEEP_DIR / "default_gpu.yaml"), "cuda")
    assert {p.model for _, p in gpu} == {"deepseek-v4-flash", "qwen3.6-27b"}
    assert {"v4_csa_verify", "gdn_tree_verify", "draft_step", "stack_verify_step"} <= {p.stage for _, p in gpu}
    assert sw.default_sweep_path("cpu").name == "quick_cpu.yaml"


def test_bad_sweep_is_one_line_error(tmp_path):
    bad = tmp_path / "b.yaml"
    bad.write_text("name: x\nmodels: [tiny-gdn]\nstages:\n  - {stage: mlp_step, grid: {batch: [1]}}\n")
    with pytest.raises(SimtreeError, match="unknown grid key 'batch'"):
        _run(bad, tmp_path / "p.csv")


def test_point_overrunning_the_budget_is_interrupted(tmp_path, monkeypatch):
    # a point stuck past max_minutes + grace (e.g. autotuning) is stopped by SIGALRM;
    # what was measured before it is kept
    path = tmp_path / "s.yaml"
    path.write_text("name: d\ndevice: cpu\ndtype: fp32\nmax_minutes: 0.01\ngrace_s: 0.5\n"
                    "models: [tiny-gdn]\ngrid: {batch_size: [1, 2], nodes_per_seq: [1, 2]}\n"
                    "stages: [{stage: mlp_step}]\n")
    calls = []

    def timer(fns, device, **kw):
        calls.append(1)
        if len(calls) == 2:
            time.sleep(3)
        return TimingStats(5.0, 4.0, 6.0, 3, "cpu")
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    t0 = time.monotonic()
    res = _run(path, tmp_path / "p.csv")
    assert time.monotonic() - t0 < 2.5
    assert res.measured == 1 and res.not_run == 3 and "deadline" in res.stopped
    assert len(pt.load_profile(tmp_path / "p.csv")) == 1


@pytest.mark.slow
def test_shipped_quick_cpu_sweep_runs_clean(tmp_path):
    res = _run(sw.SWEEP_DIR / "quick_cpu.yaml", tmp_path / "p.csv")
    assert res.failed == res.oom == res.unavailable == res.not_run == 0
    assert res.elapsed_s < 120    # < 60 s on an idle 2-core machine
    df = pt.load_profile(tmp_path / "p.csv")
    assert {"draft_step", "stack_verify_step", "model_verify_step", "v4_csa_verify",
            "gdn_tree_commit", "gdn_round_meta"} <= set(df.stage)
    assert all(v.startswith(("ok", "no reference")) for v in res.checks.values())
    # the GDN model's composed steps carry its state commit and tree metadata, V4's neither
    assert res.compose["round_extras"] == {"tiny-gdn": ["gdn_round_meta/torch",
                                                        "gdn_tree_commit/torch_ref"],
                                           "tiny-v4": []}
