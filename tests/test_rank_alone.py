"""One rank of a deployment planned alone (simtree.deploy.costs.one_rank): what the full runtime's
V4 rank measures (b sequences on the rank, no all-to-all) is labelled so in the policy file, and
nothing that serves a deployment takes it for one."""
import json
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simtree.acceptance.model import get_workload
from simtree.cli import app
from simtree.costs.model import load_costs
from simtree.data import data_path
from simtree.deploy.costs import one_rank
from simtree.errors import SimtreeError
from simtree.planning.planner import plan
from simtree.planning.policy_file import Policy, deployment_label

V4_EP8 = data_path("costs", "h200_deepseek-v4-flash_ep8.json")


@pytest.fixture(scope="module")
def rank_plan(tmp_path_factory):
    """(policy.json of the V4 ep=8 rank planned alone, the deployment's plan) at batch 4."""
    out = tmp_path_factory.mktemp("rank")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bundle = load_costs(V4_EP8)
        alone = plan(one_rank(bundle), [get_workload("gsm8k")], [4])
        deployed = plan(bundle, [get_workload("gsm8k")], [4])
    alone.candidates.to_csv(out / "candidates.csv", index=False)
    return alone.to_policy().save(out / "policy.json"), deployed


def test_a_rank_planned_alone_is_labelled_the_rank_of_its_deployment(rank_plan):
    path, deployed = rank_plan
    d = json.loads(path.read_text())
    assert d["deployment"] == "ep=8 rank" and d["source"]["costs"]["rank_of"] == "ep=8"
    pol = Policy.load(path)
    assert pol.deployment == "ep=8 rank" and pol.rank_of == "ep=8"
    assert deployed.deployment == "ep=8" and deployed.to_policy().rank_of is None
    assert deployed.communication is not None     # the deployment's collectives; the rank alone prices none
    # a file written before the label said rank ("tp=1", the bundle's rank_of in its source) reads as the rank
    (path.parent / "old.json").write_text(json.dumps({**d, "deployment": "tp=1"}))
    assert Policy.load(path.parent / "old.json").deployment == "ep=8 rank"


@pytest.mark.parametrize("text, want", [("ep=8 rank", "ep=8 rank"), ("ep = 8 rank", "ep=8 rank"),
                                        ("tp=1 rank", "tp=1"), ("ep=8", "ep=8"), ("", "tp=1"), (None, "tp=1")])
def test_deployment_labels(text, want):
    assert deployment_label(text) == want


def test_a_bad_rank_label_is_one_line(tmp_path, rank_plan):
    d = json.loads(rank_plan[0].read_text())
    (tmp_path / "p.json").write_text(json.dumps({**d, "deployment": "ep=x rank"}))
    with pytest.raises(SimtreeError, match="ep must be a whole number") as err:
        Policy.load(tmp_path / "p.json")
    assert "\n" not in str(err.value)


def test_serving_refuses_a_rank_planned_alone(rank_plan, tmp_path):
    path, _ = rank_plan
    for args in (["sglang", str(path), "--workload", "gsm8k", "--batch-size", "4"],
                 ["export", "vllm", str(path), "--out", str(tmp_path / "x")],
                 ["simulate", "--policy", str(path), "--workload", "gsm8k", "--batch-size", "4"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code != 0 and isinstance(res.exception, SimtreeError), (args, res.output)
        line = str(res.exception)
        assert "\n" not in line and "plans one rank of ep=8 alone" in line and "--deployment ep=8" in line
    assert not (tmp_path / "x").exists()


# ---- what the full runtime measures: the rank's own plan --------------------------------------
DEPLOYMENT_PLAN = "reports/h200/plan/deepseek-v4-flash_ep8_NVIDIA_H200/policy.json"   # the ep=8 deployment's


def test_which_ranks_are_planned_alone():
    from simtree.runtime.full.rank_plan import plans_rank_alone
    assert plans_rank_alone("ep=8") and plans_rank_alone("ep=2")
    assert not plans_rank_alone("tp=1") and not plans_rank_alone("tp=2")    # a tp rank's batch is the deployment's


def test_the_runtime_refuses_a_plan_of_the_deployments_batch(tmp_path, capsys, rank_plan):
    """gpu_run, full_run and simtree run: a policy of the ep=8 deployment (batch b = ceil(b / 8) a
    rank plus the all-to-all) is one line before anything is built; the rank's own plan passes."""
    from simtree.runtime.full import gpu_run
    from simtree.runtime.full.measure import full_run

    assert Policy.load(DEPLOYMENT_PLAN).deployment == "ep=8"
    assert gpu_run.main(["--model", "tiny-v4", "--device", "cpu", "--out", str(tmp_path / "s"),
                         "--policy", DEPLOYMENT_PLAN]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "plans the ep=8 deployment's batch" in err and "ceil(b / 8) a rank" in err
    assert not (tmp_path / "s").exists()
    with pytest.raises(SimtreeError, match="runs one rank with b sequences and no collectives"):
        full_run("tiny-v4", device="cpu", policy=DEPLOYMENT_PLAN, batch_sizes=(1,), acceptance="gsm8k")
    res = CliRunner().invoke(app, ["run", "--model", "deepseek-v4-flash", "--deployment", "ep=8", "--device", "cpu",
                                   "--policy", DEPLOYMENT_PLAN, "--acceptance", "gsm8k"])
    assert res.exit_code != 0 and "plans the ep=8 deployment's batch" in str(res.exception)
    Policy.load(rank_plan[0]).check_rank_run("the rank's plan")     # passes


def test_gpu_run_measures_the_rank_planned_alone_by_default(tmp_path):
    """No --policy on a rank of ep=N: the session plans the rank alone from its bundle over its batch
    sizes (DIR/plan/) and measures that plan's choice beside plain and linear."""
    import pandas as pd

    from simtree.runtime.full import gpu_run

    out = tmp_path / "s"
    assert gpu_run.main(["--model", "tiny-v4", "--device", "cpu", "--out", str(out), "--costs", str(V4_EP8),
                         "--phases", "build,measure", "--batch-sizes", "1", "--rounds", "2", "--min-draws", "0",
                         "--modes", "", "--eagle", ""]) == 0
    pol = Policy.load(out / "plan" / "policy.json")
    assert pol.deployment == "ep=8 rank" and (out / "plan" / "candidates.csv").exists()
    rows = pd.read_csv(out / "summary.csv")
    chosen = pol.lookup("gsm8k", 1).params.name
    assert f"plan:{chosen}" in set(rows["policy"]) and len(rows) == 3
    log = (out / "log.txt").read_text()
    assert "planned the rank alone (ep=8 rank: b sequences on the rank, no collectives)" in log and f"the plan's choice from {out / 'plan' / 'policy.json'}" in log


def test_simtree_run_plans_the_rank_alone_without_a_policy(tmp_path):
    from simtree.cli.run import _rank_plan

    said = []
    path = _rank_plan("tiny-v4", None, str(V4_EP8), "gsm8k", [1, 4], tmp_path, said.append)
    assert Policy.load(path).deployment == "ep=8 rank" and "ep=8 rank" in said[0] and "plan batch 4" in said[2]
    assert _rank_plan("tiny-gdn", None, str(V4_EP8), "gsm8k", [1], tmp_path / "q", said.append) is None
    assert _rank_plan("tiny-gdn", "tp=2", str(V4_EP8), "gsm8k", [1], tmp_path / "q", said.append) is None
    assert not (tmp_path / "q").exists()


def test_the_rank_run_alone_holds_every_sequence_of_its_batch(monkeypatch):
    """simtree run --deployment ep=8 runs the rank alone with b sequences: batch 512 at 32k fits the
    deployment (64 sequences a rank) but not the rank holding all 512 - one line, nothing built."""
    from simtree.deploy.memory import check_fits, check_rank_fits, largest_batch
    from simtree.machine.machines import get_machine
    from simtree.runtime.full.drafting import round_shape
    from simtree.runtime.full.measure import MIN_DRAWS, PLAIN, RunConfig, memory_use
    import simtree.cli.run as cli_run
    import simtree.machine.metadata as metadata

    assert check_fits("deepseek-v4-flash", "ep=8", "h200", 512, 32768).rank_batch == 64
    plain = memory_use(PLAIN, round_shape(PLAIN), RunConfig(32768, min_draws=MIN_DRAWS).for_batch(512))  # as it runs
    most = largest_batch("deepseek-v4-flash", "ep=8", "h200", 32768, rank_alone=True, **plain)
    assert 64 <= most < 512
    assert check_rank_fits("deepseek-v4-flash", "ep=8", "h200", most, 32768, **plain).rank_batch == most
    monkeypatch.setattr(cli_run, "_gpu_machine", lambda device: get_machine("h200"))
    monkeypatch.setattr(metadata, "require_device", lambda device: None)
    res = CliRunner().invoke(app, ["run", "--model", "deepseek-v4-flash", "--deployment", "ep=8", "--device", "cuda",
                                   "--batch-size", "1,512", "--context-len", "32768", "--acceptance", "gsm8k"])
    assert isinstance(res.exception, SimtreeError), res.output
    line = str(res.exception)
    assert "\n" not in line and line.startswith("run plain:none at batch 512, context 32768, 1 node a sequence: ")
    assert "does not fit NVIDIA H200 at batch 512" in line and f"at most batch {most} fits" in line


@pytest.mark.filterwarnings("ignore::simtree.errors.ExtrapolationWarning")
def test_dspark_schedules_the_sequences_of_one_rank():
    """Under data-parallel attention a rank schedules its own ceil(b / dp) sequences: DSpark's
    verified prefixes and bucket at the ep=8 deployment's batch 64 are the rank's 8 sequences'
    (each level B w_l of them) - the rank planned alone at batch 8 chooses the same chain."""
    import dataclasses

    import numpy as np

    from simtree.costs.forms import BasisSurface
    from simtree.costs.model import DrafterCostModel
    from simtree.deploy.costs import deployment_costs, rank_batch_of
    from simtree.drafters import MARGINAL_TOPK
    from simtree.planning.allocation import batch_allocation
    from simtree.planning.drafter_candidates import _dspark_survival, dspark_bucket, score_spec
    from simtree.planning.modes import PolicySpec

    surf = BasisSurface("draft", [64.0], [2000.0, 1.0, 50.0, 30.0, 0.01, 0.5], ("nodes_per_seq", "num_steps", "batch_size"),
                        {"nodes_per_seq": [1, 32], "num_steps": [4, 10], "batch_size": [1, 64]})
    rank = dataclasses.replace(load_costs(V4_EP8), drafters={"dspark": DrafterCostModel(surf, {"block_len": 7}, "dspark")})
    costs, acc = deployment_costs(rank), get_workload("gsm8k").acceptance
    assert rank_batch_of(costs, 64) == 8 and rank_batch_of(rank, 64) == 64 and rank_batch_of(one_rank(rank), 9) == 9
    for params in ({"block_len": 7}, {"block_len": 7, "threshold": 0.3}):
        row = score_spec(costs, acc, PolicySpec.from_dict("dspark", params), 64, 1024)
        surv, w = _dspark_survival(acc, 7), acc.weights
        draft = float(costs.drafter("dspark").predict(MARGINAL_TOPK, 7, 64, 1024))
        lens = (batch_allocation(list(surv), 8 * w, lambda n: costs.verify.predict(n, 1024, 64), draft, 8)
                if "threshold" not in params else (surv >= 0.3).sum(1))
        assert row["nodes_per_seq"] == dspark_bucket(lens) and row["params"]["verified_per_seq"] == round(w @ lens, 4)
        want = 1 + float(w @ (surv * (np.arange(7)[None, :] < lens[:, None])).sum(1))
        assert row["tokens_per_round"] == pytest.approx(want, rel=1e-12)
    alone = score_spec(one_rank(rank), acc, PolicySpec.from_dict("dspark", params), 8, 1024)
    assert alone["tokens_per_round"] == row["tokens_per_round"] and alone["nodes_per_seq"] == row["nodes_per_seq"]


def test_simtree_run_checks_each_run_it_measures(monkeypatch, tmp_path):
    """simtree run --model on one H100 checks every run full_run measures as full_run makes it: each
    batch's plain, linear D=4 and the plan's choice, at the bucket it verifies, with its drafter, the
    cache rows of its rounds and the context it runs.  Qwen3.6-27B at context 1536 (the H100 runs'
    bundle): the plan's DSpark at batch 64 (its 4-node bucket of the 8-node chain; it ran on the
    H100) passes, the block drafter at D=16 (it ran out of memory) is refused in one line naming the
    run, nothing built.  Without --context-len, batch 130 runs at gsm8k's mean prompt (256 tokens),
    where linear D=4 does not fit (at context 0 it would)."""
    from simtree.deploy.memory import rank_memory
    from simtree.machine.machines import get_machine
    from simtree.planning.modes import PolicySpec
    from simtree.planning.policy_file import PolicyEntry
    from simtree.runtime.full import measure
    from simtree.runtime.full.drafting import round_shape
    import simtree.cli.run as cli_run
    import simtree.machine.metadata as metadata
    import simtree.runtime.full.build as build

    h100_modes = str(Path(__file__).resolve().parents[1] / "reports" / "validation" /
                     "frozen_h100_qwen3.6-27b_tp1_modes.json")
    monkeypatch.setattr(cli_run, "_gpu_machine", lambda device: get_machine("h100"))
    monkeypatch.setattr(metadata, "require_device", lambda device: None)
    monkeypatch.setattr(build, "build_model", lambda *a, **k: pytest.fail("built"))

    def reached(model, **runs):
        raise SimtreeError(f"full_run reached with {model}")
    monkeypatch.setattr(measure, "full_run", reached)
    linear = PolicySpec.from_dict("linear", {"budget": 4})

    def run(entry: PolicySpec, *args):
        path = Policy("qwen3.6-27b", "NVIDIA H100 80GB HBM3", [PolicyEntry("gsm8k", 1, 16, linear, 1.0, 1.0, 1.0),
                                                                PolicyEntry("gsm8k", 17, 64, entry, 1.0, 1.0, 1.0)])
        path = path.save(tmp_path / f"{entry.name}.json")
        res = CliRunner().invoke(app, ["run", "--model", "qwen3.6-27b", "--deployment", "tp=1", "--device", "cuda",
                                       "--costs", h100_modes, "--policy", str(path), "--acceptance", "gsm8k", *args])
        assert isinstance(res.exception, SimtreeError), res.output
        return str(res.exception)

    dspark = PolicySpec.from_dict("dspark", {"block_len": 7})
    at_1536 = ["--batch-size", "8,64", "--context-len", "1536"]
    assert run(dspark, *at_1536) == "full_run reached with qwen3.6-27b"
    assert not rank_memory("qwen3.6-27b", "tp=1", "h100", 64, 1536, rank_alone=True, drafter=dspark,
                           cache_len=1536 + 38 * 8 + 8).fits          # at the chain's 8 nodes it would be refused
    line = run(PolicySpec.from_dict("block", {"budget": 16, "block_len": 7}), *at_1536)
    assert "\n" not in line and line.startswith("run plan:block_d16_p7 at batch 64, context 1536, 16 nodes a "
                                                "sequence: one tp=1 rank of qwen3.6-27b run alone does not fit")
    assert "of the block drafter" in line and f"(64 sequences x {1536 + 38 * 8 + 8} rows" in line
    line = run(dspark, "--batch-size", "130")
    assert line.startswith("run linear_d4:linear_d4 at batch 130, context 256, 4 nodes a sequence: ")
    assert rank_memory("qwen3.6-27b", "tp=1", "h100", 130, 0, rank_alone=True, drafter=linear,
                       cache_len=measure.run_max_len(0, round_shape(linear).path_rows, 4, 32)).fits
    # the weights at the dtype the runtime builds: --dtype float32 doubles them (batch 8 no longer fits
    # an H100 at 1536), the default is bf16 whatever a checkpoint's config says
    line = run(dspark, "--batch-size", "8", "--context-len", "1536", "--dtype", "float32")
    assert line.startswith("run plain:none at batch 8, context 1536") and "does not fit" in line
    assert run(dspark, "--batch-size", "8", "--context-len", "1536") == "full_run reached with qwen3.6-27b"


def test_the_check_of_the_runs_defaults_to_the_runs_own_config():
    """check_runs_fit checks the runs full_run measures given the same arguments: every argument
    they share defaults alike, the rounds and replay to RunConfig's."""
    import inspect

    from simtree.runtime.full.measure import RunConfig, check_runs_fit, full_run
    run, check = inspect.signature(full_run).parameters, inspect.signature(check_runs_fit).parameters
    shared = set(run) & set(check)
    assert shared >= {"batch_sizes", "context_len", "rounds", "warmup_rounds", "seed", "sampling", "min_draws",
                      "device", "extra", "policy", "replay", "acceptance", "costs"}
    assert {k: check[k].default for k in shared} == {k: run[k].default for k in shared}
    assert {k: run[k].default for k in ("rounds", "warmup_rounds", "seed", "sampling", "min_draws")} == \
        {k: getattr(RunConfig(), k) for k in ("rounds", "warmup_rounds", "seed", "sampling", "min_draws")}
    assert run["batch_sizes"].default == (1, 4, 16, 64) and run["rounds"].default == 32


def test_simtree_run_without_a_deployment_leaves_memory_to_the_runs(monkeypatch, tmp_path):
    """Without --deployment the CLI checks nothing before the runs (a run that does not fit fails as
    its own row, the others are measured): batch 64 at context 4096 reaches full_run."""
    from simtree.machine.machines import get_machine
    from simtree.runtime.full import measure
    import simtree.cli.run as cli_run
    import simtree.machine.metadata as metadata

    monkeypatch.setattr(cli_run, "_gpu_machine", lambda device: get_machine("h100"))
    monkeypatch.setattr(metadata, "require_device", lambda device: None)

    def reached(model, **runs):
        raise SimtreeError(f"full_run reached with {model}")
    monkeypatch.setattr(measure, "full_run", reached)
    res = CliRunner().invoke(app, ["run", "--model", "qwen3.6-27b", "--device", "cuda", "--context-len", "4096",
                                   "--replay", "gsm8k", "--batch-size", "1,64", "--out", str(tmp_path / "o")])
    assert isinstance(res.exception, SimtreeError) and str(res.exception) == "full_run reached with qwen3.6-27b"
