import json

import pandas as pd
import pytest

from simtree.errors import SimtreeError
from simtree.planner import plan_and_write
from simtree.sglang import export, server_args


def _flag(args, name):
    return int(args[args.index(name) + 1])


@pytest.mark.parametrize("budget", [2, 4, 9, 16])
def test_linear_is_topk1_with_budget_minus_one_steps(budget):
    args = server_args("linear", {"budget": budget})
    assert _flag(args, "--speculative-eagle-topk") == 1
    assert _flag(args, "--speculative-num-steps") == budget - 1
    assert _flag(args, "--speculative-num-draft-tokens") == budget


def test_eagle_maps_steps_topk_budget_and_none_has_no_args():
    args = server_args("eagle", {"num_steps": 4, "topk": 2, "budget": 5})
    assert (_flag(args, "--speculative-num-steps"), _flag(args, "--speculative-eagle-topk"),
            _flag(args, "--speculative-num-draft-tokens")) == (4, 2, 5)
    assert server_args("none", {}) == ()


def test_adaptive_modes_are_refused_by_name():
    with pytest.raises(SimtreeError, match="cost_aware"):
        server_args("cost_aware", {"max_budget": 8})


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
