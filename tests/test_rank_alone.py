"""One rank of a deployment planned alone (simtree.deploy.costs.one_rank): what the full runtime's
V4 rank measures (b sequences on the rank, no all-to-all) is labelled so in the policy file, and
nothing that serves a deployment takes it for one."""
import json
import warnings

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
    import simtree.cli.run as cli_run
    import simtree.machine.metadata as metadata

    assert check_fits("deepseek-v4-flash", "ep=8", "h200", 512, 32768).rank_batch == 64
    most = largest_batch("deepseek-v4-flash", "ep=8", "h200", 32768, rank_alone=True)
    assert 64 <= most < 512
    assert check_rank_fits("deepseek-v4-flash", "ep=8", "h200", most, 32768).rank_batch == most
    monkeypatch.setattr(cli_run, "_gpu_machine", lambda device: get_machine("h200"))
    monkeypatch.setattr(metadata, "require_device", lambda device: None)
    res = CliRunner().invoke(app, ["run", "--model", "deepseek-v4-flash", "--deployment", "ep=8", "--device", "cuda",
                                   "--batch-size", "1,512", "--context-len", "32768", "--acceptance", "gsm8k"])
    assert isinstance(res.exception, SimtreeError), res.output
    line = str(res.exception)
    assert "\n" not in line and "does not fit NVIDIA H200 at batch 512" in line and f"at most batch {most} fits" in line


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


def test_simtree_run_checks_the_block_drafter_its_policy_names(monkeypatch, tmp_path):
    """simtree run --policy on one H100: a plan whose batch-64 entry is the block drafter at D=16
    is refused in one line naming that drafter (Qwen3.6-27B at context 1536: the MTP layer fits,
    the block drafter does not), nothing built; its MTP-drafted entries pass the same check."""
    from simtree.cli.run import _block_drafted, _rank_model
    from simtree.machine.machines import get_machine
    from simtree.planning.modes import PolicySpec
    from simtree.planning.policy_file import PolicyEntry
    import simtree.cli.run as cli_run

    block = PolicySpec.from_dict("block", {"budget": 16, "block_len": 7})
    linear = PolicySpec.from_dict("linear", {"budget": 4})
    planned = Policy("qwen3.6-27b", "NVIDIA H100 80GB HBM3", [PolicyEntry("gsm8k", 1, 16, linear, 1.0, 1.0, 1.0),
                                                               PolicyEntry("gsm8k", 17, 64, block, 1.0, 1.0, 1.0)])
    assert _block_drafted(planned, None, [8, 64]) == [(64, block)] == _block_drafted(planned, "gsm8k", [64])
    assert _block_drafted(planned, None, [8]) == []
    monkeypatch.setattr(cli_run, "_gpu_machine", lambda device: get_machine("h100"))
    assert _rank_model("qwen3.6-27b", "tp=1", "cuda", [8, 64], 1536) == "qwen3.6-27b"       # the MTP layer fits
    with pytest.raises(SimtreeError, match="at batch 64: .* of the block drafter") as err:
        _rank_model("qwen3.6-27b", "tp=1", "cuda", [8, 64], 1536, _block_drafted(planned, None, [8, 64]))
    assert "\n" not in str(err.value)
