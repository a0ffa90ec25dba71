"""--deployment through the loop: profile rows, fit bundles, plans and policies carry it; plan,
simulate, sglang and run take the flag; the composed-vs-live check; old tables stay readable."""
import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from simtree.cli import app
from simtree.costs import profile_table as pt
from simtree.costs.model import load_costs
from simtree.errors import SimtreeError
from simtree.profiler import sweep as sw

SWEEP = """
name: rank
device: cpu
dtype: fp32
max_minutes: 5
target_s: 0.002
models: [tiny-v4]
deployment: ep=2
grid: {batch_size: [1, 2], nodes_per_seq: [1, 4], context_len: [0], tree_shape: [any]}
stages:
  - {stage: mlp_step}
compose: false
"""


def test_a_sweep_times_the_ranks_shard_shape_and_labels_its_rows(tmp_path, monkeypatch):
    from simtree.profiler import pieces

    seen = []
    real = pieces.mlp_piece

    def spy(ctx, T):
        seen.append((ctx.model.mlp["n_experts"], ctx.model.deployment))
        return real(ctx, T)
    monkeypatch.setattr(pieces, "mlp_piece", spy)
    spec = tmp_path / "s.yaml"
    spec.write_text(SWEEP)
    out = tmp_path / "p.csv"
    sw.run_sweep(spec, out, progress=False, echo=lambda s: None)
    df = pt.load_profile(out)
    assert len(df) == 4 and set(df["deployment"]) == {"ep=2"} and set(df["message_bytes"]) == {0}
    assert set(seen) == {(4, "ep=2")}   # tiny-v4's 8 experts over 2 ranks
    assert json.loads(pt.meta_path(out).read_text())["deployments"] == {"tiny-v4": "ep=2"}
    # --deployment overrides the YAML; a second deployment of a model is refused, not mixed in
    with pytest.raises(SimtreeError, match="holds tiny-v4 rows at ep=2: a sweep at tp=1 writes its own table"):
        sw.run_sweep(spec, out, progress=False, echo=lambda s: None, deployment="tp=1")
    other = tmp_path / "tp1.csv"
    sw.run_sweep(spec, other, progress=False, echo=lambda s: None, deployment="tp=1")
    assert set(pt.load_profile(other)["deployment"]) == {"tp=1"} and seen[-1] == (8, "tp=1")
    timed = len(seen)
    with pytest.raises(SimtreeError, match="tiny-v4 at ep=8: 1 experts per rank, fewer than the 2"):
        sw.run_sweep(spec, tmp_path / "ep8.csv", progress=False, echo=lambda s: None, deployment="ep=8")
    assert len(seen) == timed and not (tmp_path / "ep8.csv").exists()   # refused before any point


def test_tables_without_the_deployment_columns_read_as_one_gpu(tmp_path):
    rows = [{"stage": "mlp_step", "model": m, "device": "cpu", "dtype": "fp32", "variant": "torch", "batch_size": b,
             "nodes_per_seq": 1, "context_len": 0, "tree_shape": "any", "latency_us_median": 10.0 + b,
             "latency_us_p10": 9.0, "latency_us_p90": 30.0, "repeats": 3} for m in ("a", "b") for b in (1, 2)]
    path = tmp_path / "old.csv"
    pt.append_rows(path, rows)
    df = pd.read_csv(path).drop(columns=["deployment", "message_bytes"])   # a table written before they existed
    df.to_csv(path, index=False)
    back = pt.load_profile(path)
    assert set(back["deployment"]) == {"tp=1"} and set(back["message_bytes"]) == {0}
    # a writer that names no deployment (a composition) gets its model's one in the table
    mixed = back.assign(deployment=np.where(back["model"] == "a", "ep=2", ""))
    mixed.loc[mixed.index[-1], "deployment"] = ""
    out = pt.validate_profile(mixed.assign(message_bytes=""))
    assert list(out["deployment"]) == ["ep=2", "ep=2", "tp=1", "tp=1"]
    with pytest.raises(SimtreeError, match="line 2 column deployment: deployment 'pp=2'"):
        pt.validate_profile(back.assign(deployment="pp=2"), path)


def _rank_profile(path, model="qwen3.6-27b", deployment="tp=2", device="NVIDIA H200", seed=0):
    """A rank's measured verify and draft steps (convex, monotone, 2% noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    base = dict(model=model, device=device, dtype="bf16", deployment=deployment, repeats=10)
    for b in (1, 4, 16):
        for l in (512, 4096):
            for n in (1, 2, 4, 8, 16):
                lat = (6000 + 20 * max(n * b - 32, 0) + 30 * b + 0.05 * b * l) * (1 + 0.02 * rng.standard_normal())
                rows.append({**base, "stage": "model_verify_step", "variant": "composed", "batch_size": b,
                             "nodes_per_seq": n, "context_len": l, "tree_shape": "eagle", "latency_us_median": lat,
                             "latency_us_p10": lat * 0.97, "latency_us_p90": lat * 1.03})
        for s in (1, 2, 4, 8, 15):
            for k in (1, 2, 4):
                lat = (100 + s * (300 + 2 * max(b * k - 8, 0))) * (1 + 0.02 * rng.standard_normal())
                rows.append({**base, "stage": "draft_step", "variant": "torch", "batch_size": b, "nodes_per_seq": k,
                             "context_len": 4096, "tree_shape": "eagle", "num_steps": s, "topk": k,
                             "latency_us_median": lat, "latency_us_p10": lat * 0.97, "latency_us_p90": lat * 1.03})
    pt.append_rows(path, rows)
    return path


@pytest.fixture(scope="module")
def tp2_bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    prof = _rank_profile(tmp / "tp2.csv")
    out = tmp / "qwen_tp2.json"
    res = CliRunner().invoke(app, ["fit", str(prof), "-o", str(out), "--deployment", "tp=2", "--form", "basis",
                                   "--folds", "2", "--no-png"])
    assert res.exit_code == 0, res.output
    return out


def test_fit_records_the_deployment_and_the_communication_it_rests_on(tp2_bundle, tmp_path):
    b = load_costs(tp2_bundle)
    assert b.meta["deployment"] == "tp=2" and b.meta["communication"]["measured"] is False
    # two deployments in one table: the fit asks which
    both = tmp_path / "both.csv"
    _rank_profile(both, deployment="tp=2")
    _rank_profile(both, deployment="tp=1", seed=1)
    with pytest.raises(SimtreeError, match="several deployments: tp=1, tp=2 \\(choose one with --deployment\\)"):
        from simtree.costs.profile_fit import fit_profile
        fit_profile(both, forms=("basis",), folds=2, reference_forms=())


def test_plan_of_a_deployment_says_communication_assumed(tp2_bundle, tmp_path):
    out = tmp_path / "plan"
    res = CliRunner().invoke(app, ["plan", "--costs", str(tp2_bundle), "--workload", "gsm8k", "--batch-sizes", "1,8",
                                   "--out", str(out), "--deployment", "tp=2"])
    assert res.exit_code == 0, res.output
    assert "COMMUNICATION ASSUMED" in res.output and "qwen3.6-27b at tp=2" in res.output
    policy = json.loads((out / "policy.json").read_text())
    assert policy["deployment"] == "tp=2" and policy["source"]["costs"]["communication"]["assumed"] is True
    assert "**communication assumed**" in (out / "plan.md").read_text()
    tvl = pd.read_csv(out / "tree_vs_linear.csv")
    assert list(tvl.columns) == ["workload", "batch_size", "budget", "shape", "linear_tok_s", "tree_tok_s", "gain"]
    assert np.allclose(tvl["gain"], tvl["tree_tok_s"] / tvl["linear_tok_s"]) and set(tvl["batch_size"]) == {1, 8}
    # a deployment the bundles do not hold, and one that cannot hold the model
    res = CliRunner().invoke(app, ["plan", "--costs", str(tp2_bundle), "--deployment", "tp=4", "--out", str(out)])
    assert "no cost bundle for tp=4" in str(res.exception)
    # the SGLang arguments of the policy's deployment come first
    res = CliRunner().invoke(app, ["sglang", str(out / "policy.json"), "--workload", "gsm8k", "--batch-size", "8"])
    assert res.exit_code == 0 and res.stdout.startswith("--tp-size 2 ")
    res = CliRunner().invoke(app, ["sglang", str(out / "policy.json"), "--workload", "gsm8k", "--batch-size", "8",
                                   "--deployment", "ep=8"])
    assert "planned for qwen3.6-27b at tp=2, not at ep=8" in str(res.exception)


def test_plan_refuses_v4_flash_on_one_gpu_in_one_line():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "simtree", "plan", "--model", "deepseek-v4-flash", "--deployment",
                           "tp=1"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("error: deepseek-v4-flash does not fit tp=1 on NVIDIA H200")
    assert "it needs 4 GPUs (ep=4), asked for 1" in line


def test_the_embedded_default_plans_every_shipped_deployment(tmp_path):
    res = CliRunner().invoke(app, ["plan", "--workload", "gsm8k", "--batch-sizes", "1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    index = (tmp_path / "plans.md").read_text()
    for model, dep in (("qwen3.6-27b", "tp=1"), ("qwen3.6-27b", "tp=2"), ("deepseek-v4-flash", "ep=8")):
        assert f"| {model} | {dep} |" in index
    assert "no shipped cost bundle yet" not in index
    v4 = next(line for line in index.splitlines() if line.startswith("| deepseek-v4-flash | ep=8 |"))
    assert "communication assumed" in v4


def test_simulate_composes_the_deployment(tp2_bundle):
    res = CliRunner().invoke(app, ["simulate", "--costs", str(tp2_bundle), "--deployment", "tp=2", "--batch-size",
                                   "4", "--output-len", "32", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["deployment"] == "tp=2" and out["communication"] == "communication assumed"
    rank = CliRunner().invoke(app, ["simulate", "--costs", str(tp2_bundle), "--batch-size", "4", "--output-len",
                                    "32", "--json"])
    assert json.loads(rank.stdout)["verify_us"] == out["verify_us"]   # the bundle's own deployment either way


def test_run_takes_one_rank_of_a_tensor_parallel_deployment(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", "--model", "tiny-gdn", "--device", "cpu", "--deployment", "tp=2",
                                   "--batch-size", "1", "--acceptance", "gsm8k", "--rounds", "2", "--context-len",
                                   "16", "--costs", "simtree/data/costs/h200_qwen3.6-27b_tp1.json", "--out", str(out),
                                   "--json"])
    assert res.exit_code == 0, res.output
    rows = pd.read_csv(out / "summary.csv")
    assert set(rows["deployment"]) == {"tp=2 rank"}           # policy files' label; the title says the rest
    assert (out / "summary.md").read_text().startswith("# simtree run: tiny-gdn (tp=2 rank, the all-reduce not run)")
    res = CliRunner().invoke(app, ["run", "--model", "tiny-v4", "--device", "cpu", "--deployment", "ep=4",
                                   "--costs", "x.json"])
    assert "runs tiny-v4 as one rank of ep=2" in str(res.exception)
    res = CliRunner().invoke(app, ["run", "--deployment", "tp=2"])
    assert "the tiny runtime runs on one device" in str(res.exception)


def test_check_compares_a_ranks_composed_and_live_steps(tmp_path):
    import subprocess
    import sys

    comp = _rank_profile(tmp_path / "rank.csv", deployment="ep=8", model="deepseek-v4-flash")
    df = pt.load_profile(comp)
    live = df[(df["stage"] == "model_verify_step") & (df["context_len"] == 512)]
    rng = np.random.default_rng(5)
    err = 1 + 0.02 * rng.uniform(-1, 1, len(live))
    lat = live["latency_us_median"].to_numpy() * err
    live = live.assign(variant="full_runtime", latency_us_median=lat, latency_us_p10=lat * 0.99,
                       latency_us_p90=lat * 1.01, deployment="tp=1")   # the runtime's rows name no deployment
    live.drop(columns=["deployment"]).to_csv(tmp_path / "live.csv", index=False)
    out = tmp_path / "check.csv"
    proc = subprocess.run([sys.executable, "-m", "simtree.deploy.check", "--profile", str(comp), "--live",
                           str(tmp_path / "live.csv"), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    table = pd.read_csv(out)
    assert len(table) == len(live) and np.allclose(table["rel_err"], 1 / err - 1, atol=1e-3)
    assert "median |err|" in proc.stdout and "met" in proc.stdout and "taken as the ep=8 rank" in proc.stderr
    (tmp_path / "bad.csv").write_text(live.assign(variant="full_runtime", latency_us_median=lat * 1.2,
                                                  latency_us_p90=lat * 1.3).to_csv(index=False))
    proc = subprocess.run([sys.executable, "-m", "simtree.deploy.check", "--profile", str(comp), "--live",
                           str(tmp_path / "bad.csv")], capture_output=True, text=True)
    assert proc.returncode == 1 and "MISSED" in proc.stdout


def test_a_plan_on_measured_collectives_stops_saying_assumed(tp2_bundle, tmp_path):
    from simtree.costs.comm import AlphaBeta, CommModel

    measured = CommModel({c: {2: AlphaBeta(7.0, 350.0)} for c in ("all_reduce", "all_gather")}, measured=True,
                         machine="h200", source={"profile": "comm.csv"})
    comm = measured.save(tmp_path / "comm.comm.json")
    out = tmp_path / "plan"
    res = CliRunner().invoke(app, ["plan", "--costs", str(tp2_bundle), "--workload", "gsm8k", "--batch-sizes", "1",
                                   "--out", str(out), "--comm", str(comm)])
    assert res.exit_code == 0, res.output
    assert "ASSUMED" not in res.output.upper() and "communication measured" in res.output
    assert "assumed" not in (out / "plan.md").read_text()
    assert json.loads((out / "policy.json").read_text())["source"]["costs"]["communication"]["assumed"] is False


def test_the_profile_command_takes_the_flag(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(SWEEP.replace("deployment: ep=2\n", ""))
    out = tmp_path / "p.csv"
    res = CliRunner().invoke(app, ["profile", "--sweep", str(spec), "--out", str(out), "--deployment", "ep=2", "--json"])
    assert res.exit_code == 0, res.output
    assert set(pt.load_profile(out)["deployment"]) == {"ep=2"}
    res = CliRunner().invoke(app, ["profile", "--sweep", str(spec), "--out", str(out), "--deployment", "tp=0"])
    assert "tp must be a whole number >= 1" in str(res.exception)
