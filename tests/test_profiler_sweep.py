import json
import time

import pytest
import torch

from simtree.costs import profile_table as pt
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
    # the runtime path of each model timed (simtree plan compares it with today's)
    from simtree.costs.runtime_path import runtime_path
    from simtree.models import get_model
    assert meta["runtime_paths"] and all(meta["runtime_paths"][m] == runtime_path(get_model(m))
                                         for m in meta["runtime_paths"])
    # the composition covers every (b, n) where all parts were measured
    comp = df[df.stage == "model_verify_step"]
    assert len(comp) == 4 and (comp.variant == "composed").all()


def test_rerun_resumes_without_remeasuring(spec, tmp_path, monkeypatch):
    out = tmp_path / "p.csv"
    checks = _run(spec, out).checks
    timer, calls = _fake_timer()
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    res = _run(spec, out)
    assert calls == [] and res.measured == 0 and res.skipped_done == N_POINTS
    assert res.skipped_logged == 4 and res.exit_code == 0   # the unavailable triton_tree points
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
    res = sw.run_sweep(spec, tmp_path / "p.csv", progress=False, echo=lines.append, max_minutes=1e-9)
    assert res.measured == 0 and res.not_run == N_POINTS + 4 and "max" in res.stopped
    assert res.exit_code == 1 and not pt.meta_path(tmp_path / "p.csv").exists()   # nothing measured
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


def test_remeasure_of_every_row_leaves_a_valid_table_and_a_cut_short_one_finishes(spec, tmp_path, monkeypatch):
    out = tmp_path / "p.csv"
    one = tmp_path / "one.yaml"
    one.write_text("name: one\ndevice: cpu\nmodels: [tiny-gdn]\nstages: [{stage: mlp_step}]\n")
    _run(one, out)
    res = _run(one, out, remeasure=True)           # its only row dropped, then measured again
    assert res.measured == 1 and len(pt.load_profile(out)) == 1
    # a remeasure stopped by the time limit: the dropped rows are gone, the table stays
    # readable, and the same command without --remeasure measures the rest
    _run(spec, out)
    lines = []
    cut = sw.run_sweep(spec, out, progress=False, echo=lines.append, remeasure=True, max_minutes=1e-9)
    assert cut.measured == 0 and cut.not_run > 0 and "without --remeasure" in lines[-1]
    left = pt.load_profile(out, allow_empty=True)      # loads, though every measured row went
    assert (left.stage == "model_verify_step").all()
    timer, calls = _fake_timer()
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    rest = _run(spec, out)
    assert rest.measured == len(calls) == N_POINTS and rest.exit_code == 0


def test_a_call_that_adds_no_rows_leaves_the_sidecar_alone(spec, tmp_path):
    out = tmp_path / "p.csv"
    _run(spec, out)
    meta_before = pt.meta_path(out).read_text()
    table_before = out.read_bytes()
    with pytest.raises(SimtreeError, match="--device must be"):
        _run(spec, out, device="nonsense")
    res = _run(spec, out)                                 # everything done already
    assert res.measured == 0 and res.exit_code == 0
    assert pt.meta_path(out).read_text() == meta_before and out.read_bytes() == table_before
    assert res.compose["composed_rows"] == 4              # the last composition, read back


def test_sidecar_keeps_the_machine_of_earlier_sweeps(spec, tmp_path, monkeypatch):
    out = tmp_path / "p.csv"
    first = _run(spec, out, only_stage="mlp_step")
    first_id = pt.read_meta(out)["sweep_id"]
    monkeypatch.setattr("time.strftime", lambda fmt: "20990101T000000")
    _run(spec, out, only_stage="lm_head_step")
    prev = pt.read_meta(out)["previous_sweeps"]
    assert first.measured == 4 and prev[-1]["sweep_id"] == first_id and prev[-1]["device"] == "cpu"


def test_sidecar_of_the_old_format_lists_every_earlier_sweep_as_a_record(spec, tmp_path):
    out = tmp_path / "p.csv"
    _run(spec, out, only_stage="mlp_step")
    meta = pt.read_meta(out)
    meta["previous_sweeps"] = ["old-1", {"sweep_id": "old-2", "device": "cpu"}]   # bare ids: the old format
    pt.write_meta(out, meta)
    _run(spec, out, only_stage="lm_head_step")
    prev = pt.read_meta(out)["previous_sweeps"]
    assert [p["sweep_id"] for p in prev] == ["old-1", "old-2", meta["sweep_id"]]
    assert all(isinstance(p, dict) for p in prev) and prev[-1]["device"] == "cpu"


def test_points_past_a_stages_budget_count_as_not_run(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: b\ndevice: cpu\ndtype: fp32\ntarget_s: 0.002\nmodels: [tiny-gdn]\n"
                    "grid: {batch_size: [1, 2], nodes_per_seq: [1, 2]}\n"
                    "stages: [{stage: mlp_step}, {stage: lm_head_step, budget_s: 1.0e-9}]\n")
    res = _run(path, tmp_path / "p.csv")
    assert res.measured == 4 and res.not_run == 4 and res.to_run == 8 and res.stopped == ""


def test_interrupt_records_why_and_counts_each_point_once(spec, tmp_path, monkeypatch):
    out = tmp_path / "p.csv"
    timer, _ = _fake_timer(fail_at=5, exc=KeyboardInterrupt())
    monkeypatch.setattr("simtree.profiler.timing.time_workload", timer)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        sw.run_sweep(spec, out, progress=False, echo=lines.append)
    result = pt.read_meta(out)["result"]
    assert "4 measured" in result and "interrupted" in result and "interrupted" in lines[-1]
    # 28 points: 4 measured, 24 not run (the interrupted one included)
    assert f"{N_POINTS + 4 - 4} not run" in result


def test_points_log_lines_that_are_not_records_are_ignored(spec, tmp_path):
    out = tmp_path / "p.csv"
    (tmp_path / "p.points.jsonl").write_text('[1, 2]\n{"status": "failed"}\n"x"\n{"key": 5}\n{"key": [1], "st')
    assert _run(spec, out).measured == N_POINTS


@pytest.mark.parametrize("yaml_text, match", [
    ("models: [tiny-gdn]\nstages: [{stage: mlp_step, grid: {batch_size: [1.5]}}]", "batch_size value must be an integer >= 1"),
    ("models: [tiny-gdn]\nstages: [{stage: mlp_step, grid: {context_len: [-5, 0]}}]", "context_len value must be an integer >= 0"),
    ("models: [tiny-gdn]\nstages: [{stage: mlp_step, grid: {batch_size: [null]}}]", "must be an integer"),
    ("models: tiny-gdn\nstages: [{stage: mlp_step}]", "models must be a non-empty list"),
    ("models: [tiny-gdn]\nstages: [{stage: mlpstep}]", "unknown stage 'mlpstep'"),
    ("models: [tiny-gdn]\nstages: [{stage: attention, grid: {tree_shape: [Eagle]}}]", "unknown tree_shape 'Eagle'"),
    ("models: [tiny-gdn]\ntarget_s: abc\nstages: [{stage: mlp_step}]", "target_s must be a number > 0"),
    ("models: [tiny-gdn]\nmax_minutes: .nan\nstages: [{stage: mlp_step}]", "max_minutes must be a number > 0"),
    ("models: [tiny-gdn]\ncpu_threads: 0\nstages: [{stage: mlp_step}]", "cpu_threads must be an integer >= 1"),
    ("models: [tiny-gdn]\nstages: [{stage: mlp_step, variants: torch}]", "variants must be a non-empty list"),
    ("models: [tiny-gdn]\nstages: [{stage: mlp_step, budget_s: 0}]", "budget_s must be a number > 0"),
    ("models: [tiny-gdn]\ndevice: tpu\nstages: [{stage: mlp_step}]", "device must be cuda"),
    ("models: [tiny-gdn]\ncompose: {stack_layers: x}\nstages: [{stage: mlp_step}]", "stack_layers must be an integer"),
    # a typo'd key was ignored: the sweep ran with the default grid or budget
    ("models: [tiny-gdn]\ngird: {batch_size: [1]}\nstages: [{stage: mlp_step}]", r"s.yaml: unknown key\(s\) gird \(known: "),
    ("models: [tiny-gdn]\nstages: [{stage: mlp_step, budget: 5}]", r"stage entry 0: unknown key\(s\) budget \(known: "),
])
def test_sweep_yaml_is_checked_before_any_point_runs(tmp_path, yaml_text, match):
    path = tmp_path / "s.yaml"
    path.write_text("name: x\n" + yaml_text + "\n")
    with pytest.raises(SimtreeError, match=match):
        _run(path, tmp_path / "p.csv")
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "p.points.jsonl").exists()


def test_a_variant_a_stage_does_not_have_is_unavailable_not_mislabelled(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: x\ndevice: cpu\nmodels: [tiny-gdn]\nstages: [{stage: mlp_step, variants: [fast]}]\n")
    res = _run(path, tmp_path / "p.csv")
    assert res.measured == 0 and res.unavailable == 1 and res.exit_code == 1
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.parametrize("kw, match", [({"max_minutes": 0}, "--max-minutes must be a number > 0"),
                                       ({"max_minutes": float("inf")}, "--max-minutes must be a number > 0"),
                                       ({"only_stage": "mlp_step,nonsense"}, "unknown stage"),
                                       ({"device": "CPU"}, "--device must be")])
def test_bad_options_are_one_line_errors(spec, tmp_path, kw, match):
    with pytest.raises(SimtreeError, match=match):
        _run(spec, tmp_path / "p.csv", **kw)


def test_every_shipped_sweep_loads():
    """No shipped sweep sets a key the checks do not know."""
    for path in sorted(sw.SWEEP_DIR.glob("*.yaml")):
        assert sw.load_sweep(path)["stages"], path.name


def test_a_verify_over_an_empty_context_is_timed_not_a_crash(tmp_path):
    """context_len 0 for an attention verify: torch's CPU flash kernel died of SIGFPE (the whole
    sweep process, no line, no row); the tree part alone is the exact attention."""
    import torch

    from simtree.profiler.pieces import tree_attention
    torch.manual_seed(0)
    q, kt, vt = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    empty = torch.zeros(2, 2, 0, 8)
    bias = torch.zeros(2, 1, 3, 3).masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(), float("-inf"))
    got = tree_attention(q, empty, empty, kt, vt, bias, 0.3)
    k, v = kt.repeat_interleave(2, dim=1), vt.repeat_interleave(2, dim=1)
    want = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + bias, dim=-1) @ v
    torch.testing.assert_close(got, want)
    path = tmp_path / "s.yaml"
    path.write_text("models: [tiny-gdn]\ntarget_s: 0.001\nstages: [{stage: attn_tree_verify, grid: "
                    "{batch_size: [1], nodes_per_seq: [2], context_len: [0]}}]\n")
    assert _run(path, tmp_path / "p.csv").measured == 1
