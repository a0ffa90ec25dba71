import json

import numpy as np
import pandas as pd
import pytest

from simtree.errors import SimtreeError
from simtree.planning.modes import CostAwareParams, EagleParams, LinearParams, NoneParams
from simtree.planning.sglang import export, server_args
from simtree.cli.plan import plan_and_write


def _flag(args, name):
    return int(args[args.index(name) + 1])


@pytest.mark.parametrize("budget", [2, 4, 9, 16])
def test_linear_is_topk1_with_budget_minus_one_steps(budget):
    args = server_args(LinearParams(budget))
    assert _flag(args, "--speculative-eagle-topk") == 1
    assert _flag(args, "--speculative-num-steps") == budget - 1
    assert _flag(args, "--speculative-num-draft-tokens") == budget


def test_eagle_maps_steps_topk_budget_and_none_has_no_args():
    args = server_args(EagleParams(num_steps=4, topk=2, budget=5))
    assert (_flag(args, "--speculative-num-steps"), _flag(args, "--speculative-eagle-topk"),
            _flag(args, "--speculative-num-draft-tokens")) == (4, 2, 5)
    assert server_args(NoneParams()) == ()


def test_adaptive_modes_are_refused_by_name():
    with pytest.raises(SimtreeError, match="cost_aware"):
        server_args(CostAwareParams(max_budget=8, draft_depth=3))


def test_export_picks_the_best_static_candidate_of_the_plan(tmp_path):
    out = plan_and_write((), ["sharegpt"], [1, 8], str(tmp_path))[0]
    policy_path = out["policy"]
    cands = pd.read_csv(policy_path.with_name("candidates.csv"))
    for b in (1, 8):
        result = export(policy_path, "sharegpt", b)
        static = cands[(cands.batch_size == b) & cands["mode"].isin(["none", "linear", "eagle"])]
        assert result.predicted_tok_s == pytest.approx(static.tok_s.max())
        assert result.loss_vs_planned >= -1e-9  # the plan's choice is never worse than a static one
        planned = json.loads(policy_path.read_text())
        assert any(e["workload"] == "sharegpt" for e in planned["entries"])


QWEN = "simtree/data/costs/h200_qwen3.6-27b_tp1.json"


@pytest.fixture(scope="module")
def qwen_plan(tmp_path_factory):
    # Qwen3.6-27B at batch 4, 8, 64: adaptive / best-first choices SGLang cannot express
    out = plan_and_write([QWEN], ["gsm8k"], [4, 8, 64], str(tmp_path_factory.mktemp("plan")))[0]
    return out["policy"]


@pytest.mark.parametrize("seed", range(3))
def test_export_uses_the_batch_size_the_policy_entry_was_planned_at(qwen_plan, seed):
    # any serving batch size (ties such as 6 between 4 and 8 included) exports a candidate from
    # the batch size its entry was planned at, and the loss compares predictions at that size
    from simtree.planning.policy_file import Policy

    policy = Policy.load(qwen_plan)
    cands = pd.read_csv(qwen_plan.with_name("candidates.csv"))
    rng = np.random.default_rng(seed)
    for b in sorted({5, 6, 7, *rng.integers(1, 65, 6).tolist()}):
        entry = policy.lookup("gsm8k", b)
        result = export(qwen_plan, "gsm8k", b)
        assert result.planned_batch_size == entry.batch_max
        static = cands[(cands.batch_size == entry.batch_max) & cands["mode"].isin(["none", "linear", "eagle"])]
        assert result.predicted_tok_s == pytest.approx(static.tok_s.max())
        assert result.loss_vs_planned == pytest.approx(1 - static.tok_s.max() / entry.predicted_tok_s)
        assert 0 <= result.loss_vs_planned < 0.15


def test_batch_beyond_the_plan_warns_that_it_is_clamped(qwen_plan, tmp_path):
    import subprocess
    import sys

    with pytest.warns(RuntimeWarning, match="clamped to its largest planned batch size 64"):
        result = export(qwen_plan, "gsm8k", 1000)
    assert result.planned_batch_size == 64
    # 100 sequences still fit one H200 (1000 would not: simulate refuses that batch's caches)
    for args in (["sglang", str(qwen_plan), "--workload", "gsm8k", "--batch-size", "100"],
                 ["simulate", "--policy", str(qwen_plan), "--workload", "gsm8k", "--batch-size", "100",
                  "--output-len", "16"]):
        proc = subprocess.run([sys.executable, "-m", "simtree", *args], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        notes = [x for x in proc.stderr.splitlines() if "clamped" in x]
        assert len(notes) == 1 and notes[0].startswith("note: batch size 100 is outside"), proc.stderr


def test_export_refuses_candidates_of_another_plan_or_a_broken_table(qwen_plan, tmp_path):
    import shutil

    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(qwen_plan, other / "policy.json")
    cands = pd.read_csv(qwen_plan.with_name("candidates.csv"))
    cands.assign(tok_s=cands.tok_s * 0.5).to_csv(other / "candidates.csv", index=False)   # another plan's numbers
    with pytest.raises(SimtreeError, match="are not from one plan"):
        export(other / "policy.json", "gsm8k", 8)
    for content, fragment in (("", "not a readable"), (",".join(cands.columns) + "\n", "no candidate rows")):
        (other / "candidates.csv").write_text(content)
        with pytest.raises(SimtreeError, match=fragment):
            export(other / "policy.json", "gsm8k", 8)
