"""The block drafters in plans and runs: the planner offers them only where the cost bundle
prices them, every candidate it offers is a round the full runtime builds, a plan that chooses
one runs through `simtree run --model` (policy file), and bad policies stop in one line."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from simtree.acceptance.model import Workload, calibrate_linear
from simtree.cli import app
from simtree.costs.synthetic import synthetic_costs
from simtree.errors import SimtreeError
from simtree.planning.modes import BLOCK_DRAFTER_MODES, PolicySpec
from simtree.planning.planner import SearchSpace, plan
from simtree.planning.policy_file import Policy
from simtree.planning.sglang import export
from simtree.runtime.full.block_engine import make_engine
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.measure import full_run

from full_helpers import drafter_costs, tiny_model

SMALL = SearchSpace(budgets=(2, 4, 8), eagle_steps=(2, 3), eagle_topk=(2,), draft_depths=(2, 3), adaptive_max_budget=8)
WL = Workload("w", calibrate_linear(3.0, 4, name="w", spread=0.25), np.full(4, 64), 32)
# a drafter whose round is nearly free: the plan chooses it
CHEAP = drafter_costs(per_token_us=10.0, drafter_us=0.0)


def test_the_planner_offers_block_drafters_only_where_the_bundle_prices_them():
    without = plan(synthetic_costs(), [WL], [1, 16], SMALL).candidates
    assert not without["mode"].isin(BLOCK_DRAFTER_MODES).any()
    res = plan(drafter_costs(families=("block", "dspark")), [WL], [1, 16], SMALL)
    offered = res.candidates[res.candidates["mode"].isin(BLOCK_DRAFTER_MODES)]
    assert set(offered["mode"]) == {"block", "dspark"}
    model = tiny_model("tiny-gdn")
    for row in offered.drop_duplicates("policy").itertuples():     # each one the runtime builds
        spec = PolicySpec.from_dict(row.mode, json.loads(row.params))
        engine = make_engine(model, round_shape(spec), 1, 64, costs=drafter_costs(), sizes={"layers": 1})
        assert engine.rs.spec == spec and row.tok_s > 0


def test_a_plan_that_chooses_a_block_drafter_runs_from_its_policy_file(tmp_path):
    res = plan(CHEAP, [WL], [1, 4], SMALL)
    assert res.chosen["mode"].isin(BLOCK_DRAFTER_MODES).all(), res.chosen[["batch_size", "policy"]]
    path = res.to_policy().save(tmp_path / "policy.json")
    assert Policy.load(path).entries[0].params == PolicySpec.from_dict(res.chosen.iloc[0]["mode"],
                                                                      json.loads(res.chosen.iloc[0]["params"]))
    res.candidates.to_csv(tmp_path / "candidates.csv", index=False)
    static = export(path, "w", 4)          # SGLang runs one static tree: the best static candidate
    assert static.exported_policy.startswith(("eagle", "linear", "none"))
    assert static.planned_policy.startswith(res.chosen.iloc[-1]["mode"]) and static.loss_vs_planned >= 0
    dspark = PolicySpec.from_dict("dspark", {"block_len": 7})
    out = full_run(tiny_model("tiny-gdn"), device="cpu", costs=CHEAP, policy=path, policy_workload="w",
                   batch_sizes=[4], acceptance="gsm8k", context_len=16, rounds=2, warmup_rounds=0,
                   extra=[("dspark", dspark)])
    plan_row = next(r for r in out["rows"] if r["policy"].startswith("plan:"))
    assert plan_row["policy"] == f"plan:{res.chosen.iloc[-1]['policy']}"
    assert plan_row["measured_tok_s"] > 0 and np.isfinite(plan_row["predicted_round_ms"]), plan_row
    # DSpark's schedule verifies the chain cut to its decision's longest prefix, every round
    from simtree.acceptance.model import get_workload
    from simtree.planning.drafter_candidates import score_spec
    bucket = score_spec(CHEAP, get_workload("gsm8k").acceptance, dspark, 4, 16)["nodes_per_seq"]
    row = next(r for r in out["rows"] if r["policy"] == f"dspark:{dspark.name}")
    assert row["nodes"] == bucket and 2 <= bucket <= 8 and row["measured_tok_s"] > 0


def _policy_file(tmp_path, mode, params) -> str:
    """A policy file whose one entry (workload w, batch 2) names ``mode`` with ``params``."""
    pol = plan(synthetic_costs(), [WL], [2], SearchSpace(budgets=(2,), eagle_steps=(), draft_depths=(),
                                                          adaptive=False, modes=("none",))).to_policy()
    obj = pol.to_dict()
    obj["model"] = "tiny-gdn"
    obj["entries"][0].update(mode=mode, params=params, tree_on=mode != "dspark")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(obj))
    return str(path)


def _one_line_error(got, fragment: str) -> None:
    """The command raised the SimtreeError that `simtree` prints as one ``error:`` line (exit 2)."""
    assert isinstance(got.exception, SimtreeError), got.output
    assert fragment in str(got.exception) and "\n" not in str(got.exception)


def test_bad_block_drafter_policies_stop_simtree_run_in_one_line(tmp_path):
    runner = CliRunner()
    base = ["run", "--model", "tiny-gdn", "--device", "cpu", "--batch-size", "2", "--acceptance", "gsm8k",
            "--context-len", "16", "--rounds", "1", "--min-draws", "0", "--policy-workload", "w"]
    bad = _policy_file(tmp_path, "dspark", {"block_len": 7, "threshold": 1.5})
    _one_line_error(runner.invoke(app, base + ["--policy", bad]), "outside [0, 1]")
    long = _policy_file(tmp_path, "block", {"budget": 8, "block_len": 12})
    _one_line_error(runner.invoke(app, base + ["--policy", long]), "block length 12 is beyond the block drafter's 7")
    with pytest.raises(SimtreeError, match="no cost for drafter 'tfm'"):
        full_run(tiny_model("tiny-gdn"), device="cpu", costs=drafter_costs(families=("block",)),
                 policy=_policy_file(tmp_path, "tfm", {"budget": 8, "width": 2}), policy_workload="w",
                 batch_sizes=[2], acceptance="gsm8k", context_len=16, rounds=1, warmup_rounds=0)


def test_simulate_and_the_tiny_runtime_refuse_block_drafter_modes_in_one_line():
    from simtree.planning.simulate import simulate
    with pytest.raises(SimtreeError, match="simulator does not run block-drafter rounds"):
        simulate(synthetic_costs(), WL, 2, PolicySpec.from_dict("block", {"budget": 8}))
    _one_line_error(CliRunner().invoke(app, ["run", "--mode", "tfm", "--batch-size", "1", "--max-new-tokens", "4"]),
                    "run it with --model")


def test_the_modes_table_ranks_every_mode_beside_the_plans_choice():
    from simtree.runtime.full.modes_gpu import modes_table
    nan = float("nan")
    rows = [{"batch_size": b, "policy": p, "measured_tok_s": t, "predicted_tok_s": 1.0, "rel_err": 0.0,
             "measured_accepted": 2.0, "measured_round_ms": 1.0}
            for b, p, t in [(1, "plain:none", 10.0), (1, "plan:block_d8_p7", 30.0), (1, "eagle:eagle_s3_k2_d6", 40.0),
                            (4, "plain:none", 20.0), (4, "plan:dspark_p7_sched", 90.0), (4, "tfm:tfm_d16_w4_p7", nan)]]
    table = modes_table(rows, "m", "")
    one = [r for r in table if r["batch_size"] == 1]
    assert [r["measured_rank"] for r in one] == [3, 2, 1]
    assert all(r["best_measured"] == "eagle:eagle_s3_k2_d6" and r["plan_over_best"] == 0.75 for r in one)
    four = [r for r in table if r["batch_size"] == 4]
    assert len(four) == 2 and four[1]["plan_choice"] and four[1]["plan_over_best"] == 1.0   # a failed run: no row


def test_a_deployments_costs_keep_the_ranks_drafters_at_the_ranks_batch():
    """A bundle of one rank of several GPUs is planned composed with its collectives: the block
    drafters' C_d are the rank's, asked at the rank's own batch (a dense drafter on each rank's
    own sequences; tests/test_deploy.py prices a plan's candidate with it)."""
    from simtree.deploy.costs import DeploymentCosts
    from simtree.parallel import parse_deployment
    rank, dep = drafter_costs(families=("dspark",)), parse_deployment("ep=8")
    composed = DeploymentCosts(rank, dep, None, rank.verify, rank.draft, rank.meta)
    assert list(composed.drafters) == ["dspark"] and composed.drafter("dspark").rank is rank.drafters["dspark"]
    assert composed.drafter("dspark").predict(1, 7, 64) == rank.drafters["dspark"].predict(1, 7, 8)
    with pytest.raises(SimtreeError, match="no cost for drafter 'block'"):
        composed.drafter("block")


def test_given_prompts_decode_with_a_block_drafter_from_the_command_line(tmp_path):
    """simtree run --model M --prompt-ids ... --mode block --draft-depth L: plain decoding's
    tokens, and the round's traces beside run.json."""
    base = ["run", "--model", "tiny-gdn", "--device", "cpu", "--dtype", "float32", "--prompt-ids", "5,6,7,8",
            "--prompt-ids", "9,3", "--max-new-tokens", "6", "--json"]
    plain = CliRunner().invoke(app, base + ["--mode", "none", "--out", str(tmp_path / "plain")])
    got = CliRunner().invoke(app, base + ["--mode", "block", "--budget", "6", "--draft-depth", "5",
                                          "--out", str(tmp_path / "block")])
    assert plain.exit_code == 0 and got.exit_code == 0, got.output
    report = json.loads(got.stdout)
    assert report["policy"] == "block_d6_p5" and report["outputs"] == json.loads(plain.stdout)["outputs"]
    assert (tmp_path / "block" / "traces.jsonl").is_file()
    _one_line_error(CliRunner().invoke(app, base + ["--mode", "dspark", "--out", str(tmp_path / "d")]),
                    "mode dspark needs a cost model")


def test_the_planner_leaves_out_a_block_drafter_whose_memory_does_not_fit():
    """A bundle of Qwen3.6-27B on one H100 whose block drafters cost nearly nothing: at batch 8 the
    plan chooses one; at batch 48, context 4096 (the out-of-sample point where every block
    drafter ran out of memory) the deployment memory check refuses the rank with every block
    drafter, so none is a candidate there, a note says why in one line, and the plan chooses an
    MTP-drafted mode.  A bundle of a device no machine table describes is planned as before."""
    from full_helpers import CostBundle

    from simtree.planning.drafter_candidates import drafter_memory_check

    wl = Workload("long", calibrate_linear(3.0, 4, name="long", spread=0.25), np.full(4, 3840), 256)
    h100 = CostBundle(CHEAP.verify, CHEAP.draft, {"model": "qwen3.6-27b", "device": "NVIDIA H100 80GB HBM3",
                                                  "deployment": "tp=1"}, CHEAP.drafters)
    res = plan(h100, [wl], [8, 48], SMALL)
    cands = res.candidates
    blocks = cands[cands["mode"].isin(BLOCK_DRAFTER_MODES)]
    assert set(blocks["batch_size"]) == {8} and set(blocks["mode"]) == {"block", "tfm", "dspark"}
    chosen = res.chosen.set_index("batch_size")["mode"]
    assert chosen[8] in BLOCK_DRAFTER_MODES and chosen[48] not in BLOCK_DRAFTER_MODES
    notes = [n for n in res.notes if "deployment memory check" in n]
    n_refused = len(blocks.drop_duplicates("policy"))
    assert len(notes) == 1 and notes[0].startswith(f"batch 48: {n_refused} block-drafter candidate(s) not planned")
    assert "refuses one tp=1 rank on NVIDIA H100 80GB HBM3 with their drafter" in notes[0] and "\n" not in notes[0]
    assert "48 sequences at context 4096: 84.3 GB, 6.9 GB of it the block drafter's, of 80.8 GB usable" in notes[0]
    # each refusal is the check's own: the rank with that drafter over the GPU's usable memory
    fits = drafter_memory_check(h100)
    for row in blocks.drop_duplicates("policy").itertuples():
        spec = PolicySpec.from_dict(row.mode, json.loads(row.params))
        assert fits(spec, 8, 4096).fits and not fits(spec, 48, 4096).fits
    unknown = CostBundle(CHEAP.verify, CHEAP.draft, {**h100.meta, "device": "cpu"}, CHEAP.drafters)
    assert drafter_memory_check(unknown) is None
    again = plan(unknown, [wl], [8, 48], SMALL)
    assert set(again.candidates.loc[again.candidates["mode"].isin(BLOCK_DRAFTER_MODES), "batch_size"]) == {8, 48}


def test_one_rank_planned_alone_is_checked_holding_all_its_sequences():
    """A rank planned alone (``meta["rank_of"]``: the full runtime's rank, b sequences on it) is
    checked as the rank run alone; a deployment's bundle at its ceil(b / dp) share."""
    from full_helpers import CostBundle

    from simtree.planning.drafter_candidates import drafter_memory_check

    meta = {"model": "deepseek-v4-flash", "device": "NVIDIA H100 80GB HBM3"}
    block = PolicySpec.from_dict("block", {"budget": 8, "block_len": 7})
    alone = drafter_memory_check(CostBundle(CHEAP.verify, CHEAP.draft, {**meta, "deployment": "tp=1",
                                                                         "rank_of": "ep=8"}, CHEAP.drafters))
    shared = drafter_memory_check(CostBundle(CHEAP.verify, CHEAP.draft, {**meta, "deployment": "ep=8"},
                                             CHEAP.drafters))
    assert alone(block, 64, 4096).rank_batch == 64 and shared(block, 64, 4096).rank_batch == 8
    assert str(alone(block, 64, 4096).deployment) == "ep=8"
    assert alone(block, 64, 4096).drafter.use.family == "block"
