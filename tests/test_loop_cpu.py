"""A miniature CPU loop (scripts/loop_cpu.sh in small): profile the runtime's own models ->
fit -> traces -> plan -> run with the policy; the plan must predict the run on this machine."""
import json

import numpy as np
import pytest
import yaml

from simtree.acceptance.model import get_workload
from simtree.costs.model import load_costs
from simtree.reporting.loop import contrast_runs, run_flags
from simtree.costs.profile_fit import fit_profile
from simtree.planning.planner import SearchSpace, plan
from simtree.planning.policy_file import Policy
from simtree.costs.profile_table import load_profile
from simtree.profiler.sweep import run_sweep
from simtree.runtime.live import live_run
from simtree.runtime.profile_steps import step_builders
from simtree.planning.modes import (BatchAllocParams, BestFirstParams, CostAwareParams, EagleParams, LinearParams,
                                    NoneParams, PolicySpec, params_from_flags)

# Measured throughput on a shared 2-core machine moves by tens of percent between the profile
# and the run (reports/cpu_loop: errors up to ~45% as the load changed); the miniature grid
# also extrapolates in context length. Predictions must land within this factor of measured.
FACTOR = 2.0
B, NEW = 2, 24
MINI_SWEEP = {"name": "mini_runtime_cpu", "device": "cpu", "dtype": "fp32", "max_minutes": 1,
              "target_s": 0.02, "cpu_threads": 1, "models": ["runtime-tiny"],
              "grid": {"batch_size": [1, 2], "nodes_per_seq": [1, 2, 4, 8], "context_len": [64],
                       "tree_shape": ["eagle"]},
              "stages": [{"stage": "model_verify_step", "variants": ["runtime_tiny"]},
                         {"stage": "draft_step", "variants": ["runtime_tiny"],
                          "grid": {"num_steps": [1, 2, 3], "topk": [1, 2]}}],
              "compose": False}
SPACE = SearchSpace(budgets=(2, 3, 4), eagle_steps=(1, 2), eagle_topk=(2,), draft_depths=(1, 2), adaptive=False)


def _close_loop(d):
    sweep = d / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(MINI_SWEEP))
    res = run_sweep(sweep, d / "profile.csv", progress=False, echo=lambda s: None, builders=step_builders())
    fit = fit_profile(d / "profile.csv", forms=("basis",), folds=2, reference_forms=())
    fit.bundle.save(d / "costs.json")
    live_run(spec=EagleParams(num_steps=2, topk=2, budget=4), batch_size=B,
             max_new_tokens=NEW, out=d / "traces")
    workload = get_workload(str(d / "traces" / "traces.jsonl"), output_len=NEW)
    result = plan(load_costs(d / "costs.json"), [workload], [1, B], SPACE)
    result.to_policy().save(d / "plan" / "policy.json")
    result.candidates.to_csv(d / "plan" / "candidates.csv", index=False)
    run = live_run(policy=d / "plan" / "policy.json", costs=d / "costs.json", batch_size=B, prompts=2 * B,
                   max_new_tokens=NEW, out=d / "run")
    return {"dir": d, "sweep": res, "workload": workload, "run": run}


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    return _close_loop(tmp_path_factory.mktemp("cpu_loop"))


def _within(run) -> list[str]:
    """The run's predictions outside FACTOR of its measured throughput (empty: all within)."""
    measured = run["measured"]["tokens_per_s"]
    bad = []
    for what, pred in (("planned", run["predicted_tok_s_in_policy"]),
                       ("cost model", run["predicted"]["tokens_per_s"])):
        if not measured / FACTOR < pred < measured * FACTOR:
            bad.append(f"{what} {pred:.0f} vs measured {measured:.0f} tok/s")
    return bad


def test_profile_rows_are_the_runtime_models_on_cpu(loop):
    df = load_profile(loop["dir"] / "profile.csv")
    assert loop["sweep"].failed == 0 and all(v.startswith("ok") for v in loop["sweep"].checks.values())
    assert set(df["stage"]) == {"model_verify_step", "draft_step"} and set(df["variant"]) == {"runtime_tiny"}
    assert set(df["device"]) == {"cpu"} and len(df) == 8 + 12


def test_bundle_and_policy_name_this_model_and_device(loop):
    bundle = load_costs(loop["dir"] / "costs.json")
    assert bundle.meta["device"] == "cpu" and bundle.meta["model"] == "runtime-tiny"
    assert not bundle.meta["synthetic"]
    policy = Policy.load(loop["dir"] / "plan" / "policy.json")
    assert policy.device == "cpu" and policy.model == "runtime-tiny"
    entry = policy.lookup(loop["workload"].name, B)
    run = loop["run"]
    assert (run["mode"], run["params"]) == (entry.mode, entry.params.to_dict())
    assert run["predicted_tok_s_in_policy"] == pytest.approx(entry.predicted_tok_s)


def test_plan_predicts_the_measured_throughput(loop, tmp_path):
    # planned: the policy's prediction; cost model: the same costs with this run's own
    # acceptance. A load burst on a shared machine during the seconds-long profile or run can
    # move one side by 2x (seen in CI once: planned 326 vs measured 661 tok/s); such a miss
    # closes the whole loop once more, and the second loop must land within FACTOR
    bad = _within(loop["run"])
    again = _within(_close_loop(tmp_path)["run"]) if bad else []
    assert not bad or not again, f"first loop: {bad}; second loop: {again}"


def test_the_run_sets_its_host_against_the_bundles_profile(loop, tmp_path):
    # the sweep records a host probe in the profile's meta, fit carries it in the bundle, and
    # simtree run probes again and reports the ratio; a bundle without one gives no ratio
    from simtree.machine.hostprobe import ratio
    bundle = load_costs(loop["dir"] / "costs.json")
    then = bundle.meta["profile_meta"]["host_probe"]
    assert then["python_us"] > 0 and then["torch_us"] > 0
    host = loop["run"]["host"]
    assert host["profile_probe"] == then
    assert host["vs_profile"] == pytest.approx(ratio(host["probe"], then)) and host["vs_profile"] > 0
    assert ratio({"python_us": 2.0, "torch_us": 8.0, "launch_us": float("nan")},
                 {"python_us": 1.0, "torch_us": 2.0, "launch_us": 3.0}) == pytest.approx(8 ** 0.5)
    del bundle.meta["profile_meta"]["host_probe"]
    run = live_run(spec=LinearParams(2), batch_size=1, max_new_tokens=4, costs=bundle,
                   out=tmp_path / "r")
    assert run["host"] is None


def test_contrast_runs_are_other_policies_with_valid_flags(loop):
    rows = contrast_runs(loop["dir"] / "plan", loop["workload"].name, B)
    entry = Policy.load(loop["dir"] / "plan" / "policy.json").lookup(loop["workload"].name, B)
    run_name = entry.params.name
    assert all(name != run_name for _, name, _ in rows)
    if entry.mode != "none":   # plain decoding is always a contrast (as "none", or as the
        # planner's second choice when that is plain decoding: each policy runs once)
        assert [r for r in rows if r[2] == "--mode none"]
        assert rows[-1][0] == "none" or rows[0][2] == "--mode none"
    assert all(flags.startswith("--mode ") for _, _, flags in rows)
    assert run_flags(entry.params).startswith(f"--mode {entry.mode}")
    assert json.loads((loop["dir"] / "run" / "run.json").read_text())["batch_size"] == B


@pytest.mark.parametrize("spec", [NoneParams(), LinearParams(5), EagleParams(num_steps=3, topk=2, budget=6),
                                  BestFirstParams(budget=8, draft_depth=3, width=2),
                                  CostAwareParams(max_budget=16, draft_depth=4),
                                  BatchAllocParams(max_budget_per_seq=12, draft_depth=2)], ids=lambda s: s.name)
def test_run_flags_select_the_same_policy(spec):
    # `simtree run` reads the flags back with params_from_flags; the flags it leaves out take
    # the command's defaults (--budget 6 --width 1; no --steps, --topk, --draft-depth)
    words = run_flags(spec).split()
    flags = {k.removeprefix("--").replace("-", "_"): v for k, v in zip(words[::2], words[1::2])}
    args = {"steps": None, "topk": None, "budget": 6, "width": 1, "draft_depth": None,
            **{k: int(v) for k, v in flags.items() if k != "mode"}}
    assert params_from_flags(flags["mode"], args["steps"], args["topk"], args["budget"], args["width"],
                             args["draft_depth"]) == spec


def test_runtime_variant_refuses_points_it_cannot_time():
    import torch

    from simtree.costs.steps import Point, Unavailable
    from simtree.errors import SimtreeError
    from simtree.models import get_model
    from simtree.profiler.pieces import Ctx
    from simtree.profiler.stages import build_workload

    ctx = Ctx(get_model("runtime-tiny"), torch.device("cpu"), torch.float32)
    with pytest.raises(SimtreeError, match="context_len >= 1"):
        build_workload(ctx, Point("model_verify_step", "runtime_tiny", "runtime-tiny", 1, 2, 0), step_builders())
    with pytest.raises(Unavailable, match="model_verify_step and draft_step only"):
        build_workload(ctx, Point("mlp_step", "runtime_tiny", "runtime-tiny", 1, 2, 64), step_builders())


@pytest.mark.parametrize("stage", ["model_verify_step", "draft_step"])
def test_runtime_variant_needs_the_runtimes_builders(stage):
    # the profiler does not import the runtime: without the builders `simtree profile` passes,
    # the runtime's points are unavailable (logged and skipped), not built some other way
    import torch

    from simtree.costs.steps import Point, Unavailable
    from simtree.models import get_model
    from simtree.profiler.pieces import Ctx
    from simtree.profiler.stages import build_workload, check_variant

    ctx = Ctx(get_model("runtime-tiny"), torch.device("cpu"), torch.float32)
    point = Point(stage, "runtime_tiny", "runtime-tiny", 1, 2, 16, "eagle", 1, 2)
    with pytest.raises(Unavailable, match="no step builder .*`simtree profile` adds the runtime's runtime_tiny"):
        build_workload(ctx, point)
    assert "runtime_model" not in ctx.notes
    assert build_workload(ctx, point, step_builders()).eager
    assert check_variant(ctx, stage, "runtime_tiny", step_builders()).startswith("ok")


def test_lossless_report_lists_every_checked_run_and_refuses_unchecked(tmp_path):
    from simtree.reporting.loop import write_lossless_report
    from simtree.errors import SimtreeError
    rng = np.random.default_rng(3)
    want = {}
    for i, mode in enumerate(("linear", "eagle", "best_first")):
        wrong, tps = int(rng.integers(0, 3)), float(rng.uniform(50, 500))
        want[f"{mode}_b{i + 1}"] = (wrong, tps)
        run = dict(mode=mode, params={"budget": 4 + i}, batch_size=i + 1, prompts=8, max_new_tokens=32,
                   device="cpu", lossless_checked=True, lossless_mismatches=wrong,
                   measured={"tokens_per_s": tps})
        (tmp_path / f"{mode}_b{i + 1}").mkdir()
        (tmp_path / f"{mode}_b{i + 1}" / "run.json").write_text(json.dumps(run))
    rows = [line.split(" | ") for line in write_lossless_report(tmp_path).read_text().splitlines()
            if line.startswith("| ") and line.split(" | ")[0].strip("| ") in want]
    assert len(rows) == 3
    for cells in rows:
        wrong, tps = want[cells[0].strip("| ")]
        assert int(cells[7]) == wrong and cells[8].rstrip(" |") == f"{tps:.1f}"
    unchecked = json.loads((tmp_path / "eagle_b2" / "run.json").read_text())
    unchecked["lossless_checked"] = False
    (tmp_path / "eagle_b2" / "run.json").write_text(json.dumps(unchecked))
    with pytest.raises(SimtreeError, match="not run with --check"):
        write_lossless_report(tmp_path)
    with pytest.raises(SimtreeError, match="no \\*/run.json"):
        write_lossless_report(tmp_path / "eagle_b2")


@pytest.mark.parametrize("b, n", [(1, 1), (3, 1), (2, 4)])
def test_runtime_verify_point_times_what_the_engine_runs(monkeypatch, b, n):
    # at n = 1 the engine runs one decode step (no tree, no verify, no commit), so the profile's
    # point must time that step; trees of n > 1 go through verify and commit
    import torch

    from simtree.costs.steps import Point
    from simtree.models import get_model
    from simtree.profiler.pieces import Ctx
    from simtree.profiler.stages import build_workload
    from simtree.runtime.full.qwen import QwenModel

    calls = []
    for name in ("decode", "verify", "commit"):
        orig = getattr(QwenModel, name)
        monkeypatch.setattr(QwenModel, name, lambda self, *a, _o=orig, _n=name, **k:
                            (calls.append(_n), _o(self, *a, **k))[1])
    ctx = Ctx(get_model("runtime-tiny"), torch.device("cpu"), torch.float32)
    fn, _ = build_workload(ctx, Point("model_verify_step", "runtime_tiny", "runtime-tiny", b, n, 16),
                           step_builders()).make()
    calls.clear()     # the context's prefill is not part of the timed step
    fn()
    fn()
    assert calls == (["decode"] * 2 if n == 1 else ["verify", "commit"] * 2)


def _fake_run(folder, b, role, mode, params, tps):
    run = dict(batch_size=b, mode=mode, params=params, workload="w", prompts=4, max_new_tokens=16,
               measured=dict(tokens_per_s=tps, accepted_tokens_per_round=1.5, mean_nodes_per_seq=2.0,
                             round_us_median=1000.0, decode_s=0.1, rounds=100))
    (folder / f"b{b}_{role}").mkdir(parents=True)
    (folder / f"b{b}_{role}" / "run.json").write_text(json.dumps(run))


def test_repeat_report_pairs_the_two_repetitions(tmp_path):
    from simtree.reporting.loop import main, write_repeat_report
    from simtree.errors import SimtreeError
    rng = np.random.default_rng(5)
    pols = {"chosen": ("none", {}), "linear": ("linear", {"budget": 3})}
    cands, tps = [], {}
    for b in (1, 4):
        for role, (mode, params) in pols.items():
            planned = float(rng.uniform(100, 900))
            cands.append(dict(batch_size=b, policy=PolicySpec.from_dict(mode, params).name, workload="w",
                              tok_s=planned, tokens_per_round=1.5, nodes_per_seq=2.0))
            t1, t2 = (float(x) for x in rng.uniform(100, 900, 2))
            tps[(b, role)] = (t1, t2, planned)
            _fake_run(tmp_path / "runs", b, role, mode, params, t1)
            _fake_run(tmp_path / "runs_repeat", b, role, mode, params, t2)
    (tmp_path / "plan").mkdir()
    import pandas as pd
    pd.DataFrame(cands).to_csv(tmp_path / "plan" / "candidates.csv", index=False)
    paths = write_repeat_report(tmp_path)
    df = pd.read_csv(paths["csv"])
    assert len(df) == 4 and paths["png"].stat().st_size > 0
    for r in df.itertuples():
        t1, t2, planned = tps[(r.batch_size, r.role)]
        assert r.ratio_2_over_1 == pytest.approx(t2 / t1)
        assert r.err_mean == pytest.approx(planned / ((t1 + t2) / 2) - 1)
    both = sum(all(tps[(b, "chosen")][i] > tps[(b, "linear")][i] for i in (0, 1)) for b in (1, 4))
    assert f"best in both repetitions at {both} of 2 batch sizes" in paths["markdown"].read_text()
    assert "host rep. 1" not in paths["markdown"].read_text()
    # with host probes: each repetition's run set against the probe before the profile
    host = {"profile": 100.0}
    with open(tmp_path / "host_probe.tsv", "w") as f:
        f.write("profile\t100\t5\tnan\n")
        for (b, role) in tps:
            for pre in ("run", "repeat"):
                x = float(rng.uniform(0.7, 1.6))
                host[f"{pre}_b{b}_{role}"] = x
                f.write(f"{pre}_b{b}_{role}\t{100 * x}\t{5 * x}\tnan\n")
    df = pd.read_csv(write_repeat_report(tmp_path)["csv"])
    for r in df.itertuples():
        assert r.host_1 == pytest.approx(host[f"run_b{r.batch_size}_{r.role}"])
        assert r.host_2 == pytest.approx(host[f"repeat_b{r.batch_size}_{r.role}"])
    assert "host probe between the repetitions" in (tmp_path / "repeat.md").read_text()
    # a second pass kept under another folder name ran with loop.sh's run_* step names, so the
    # probes cannot tell its runs from the first pass's: no host columns then
    import shutil
    shutil.copytree(tmp_path / "runs_repeat", tmp_path / "runs_again")
    df = pd.read_csv(write_repeat_report(tmp_path, "runs_again")["csv"])
    assert "host_1" not in df and "host rep. 1" not in (tmp_path / "repeat.md").read_text()
    with pytest.raises(SimtreeError, match="no elsewhere/"):
        write_repeat_report(tmp_path, "elsewhere")
    assert main(["repeat", str(tmp_path), "elsewhere"]) == 2


def test_packed_runs_read_as_the_folders_did(tmp_path):
    # runs/ and runs_repeat/ packed into runs.tgz (one file): the reports read the same runs
    import pandas as pd
    from simtree.reporting.loop import RUNS_ARCHIVE, collect_runs, main, pack_runs, write_repeat_report
    from simtree.errors import SimtreeError

    pols = {"chosen": ("none", {}), "linear": ("linear", {"budget": 3})}
    cands = []
    for b in (1, 4):
        for i, (role, (mode, params)) in enumerate(pols.items()):
            cands.append(dict(batch_size=b, policy=PolicySpec.from_dict(mode, params).name, workload="w",
                              tok_s=500.0 + i, tokens_per_round=1.5, nodes_per_seq=2.0))
            _fake_run(tmp_path / "runs", b, role, mode, params, 300.0 + 10 * b + i)
            _fake_run(tmp_path / "runs_repeat", b, role, mode, params, 310.0 + 10 * b + i)
    (tmp_path / "plan").mkdir()
    pd.DataFrame(cands).to_csv(tmp_path / "plan" / "candidates.csv", index=False)
    before = [collect_runs(tmp_path, r) for r in ("runs", "runs_repeat")]
    repeat_before = pd.read_csv(write_repeat_report(tmp_path)["csv"])
    assert main(["pack", str(tmp_path)]) == 0
    assert (tmp_path / RUNS_ARCHIVE).is_file() and not (tmp_path / "runs").exists()
    assert not (tmp_path / "runs_repeat").exists()
    for r, df in zip(("runs", "runs_repeat"), before):
        pd.testing.assert_frame_equal(collect_runs(tmp_path, r), df)
    pd.testing.assert_frame_equal(pd.read_csv(write_repeat_report(tmp_path)["csv"]), repeat_before)
    first = (tmp_path / RUNS_ARCHIVE).read_bytes()
    pack_runs(tmp_path)                    # packed again from the archive: the same bytes
    assert (tmp_path / RUNS_ARCHIVE).read_bytes() == first
    # a folder run again is read in place of its packed copy
    _fake_run(tmp_path / "runs", 1, "chosen", "none", {}, 999.0)
    assert collect_runs(tmp_path)["measured_tok_s"].tolist() == [999.0]
    with pytest.raises(SimtreeError, match="no runs"):
        pack_runs(tmp_path / "plan")


def test_host_probe_measures_and_the_report_sets_each_run_against_the_profile(tmp_path):
    # the probe times Python, a torch op and (CUDA only) launches; the loop report divides the
    # probe before each run by the probe before the profile (geometric mean over the metrics
    # both measured, the last line of a step that was probed twice) and shows it per run
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd

    from simtree.reporting.loop import host_probe, host_ratio, write_loop_report
    from simtree.machine.hostprobe import probe

    r = probe("cpu", repeats=3)
    assert r["python_us"] > 0 and r["torch_us"] > 0 and r["launch_us"] is None
    line = subprocess.run([sys.executable, "-m", "simtree.machine.hostprobe", "--step", "s1", "--repeats", "2"],
                          capture_output=True, text=True, check=True).stdout.strip().split("\t")
    assert line[0] == "s1" and float(line[1]) > 0 and float(line[2]) > 0 and line[3] == "nan"

    d = tmp_path / "loop"
    shutil.copytree(Path(__file__).parents[1] / "reports" / "cpu_loop", d)
    runs = pd.read_csv(d / "loop_results.csv")
    rng = np.random.default_rng(5)
    steps = ["profile"] + [f"run_b{b}_{role}" for b, role in zip(runs["batch_size"], runs["role"])]
    skip = steps[-1]                       # a run the probe missed: no ratio
    want = {}
    base = (400.0, 6.0)
    with open(d / "host_probe.tsv", "w") as f:
        f.write(f"{steps[1]}\t9999\t99\tnan\n")    # probed twice: the later line counts
        for st in steps[:-1]:
            a, b = rng.uniform(0.5, 2.0, size=2)
            if st == "profile":
                a = b = 1.0
            f.write(f"{st}\t{base[0] * a:.4f}\t{base[1] * b:.4f}\tnan\n")
            want[st] = float(np.sqrt(a * b))
    probe_df = host_probe(d)
    assert probe_df.loc[steps[1], "python_us"] != 9999
    for st in steps[1:-1]:
        assert host_ratio(probe_df, st) == pytest.approx(want[st], rel=1e-3)
    assert np.isnan(host_ratio(probe_df, skip))
    md = write_loop_report(d)["markdown"].read_text()
    assert "host vs profile |" in md and "## Host probe before each step" in md
    got = pd.read_csv(d / "loop_results.csv")
    for row in got.itertuples():
        st = f"run_b{row.batch_size}_{row.role}"
        if st == skip:
            assert np.isnan(row.host_vs_profile)
        else:
            assert row.host_vs_profile == pytest.approx(want[st], rel=1e-3)
    (d / "host_probe.tsv").unlink()
    assert "host vs profile" not in write_loop_report(d)["markdown"].read_text()


def test_cli_profile_times_the_runtimes_steps(tmp_path):
    # `simtree profile` hands the runtime's step builders to the profiler's sweep
    from typer.testing import CliRunner

    from simtree.cli import app

    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({**MINI_SWEEP, "grid": {"batch_size": [1], "nodes_per_seq": [1, 2],
                                                            "context_len": [16], "tree_shape": ["eagle"]},
                                     "stages": MINI_SWEEP["stages"][:1]}))
    res = CliRunner().invoke(app, ["profile", "--sweep", str(sweep), "--out", str(tmp_path / "p.csv"), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["measured"] == 2 and summary["unavailable"] == 0
    assert summary["checks"]["runtime-tiny/model_verify_step/runtime_tiny"].startswith("ok")
