"""Planner candidates of the block drafters (simtree/planning/drafter_candidates.py): priced by
their own C_d, bad input refused in one line."""
from dataclasses import dataclass

import pytest

from simtree.acceptance.drafter_presets import drafter_preset
from simtree.costs.model import DrafterCostModel
from simtree.errors import SimtreeError
from simtree.planning.drafter_candidates import score_drafter_candidates


@dataclass
class _Surface:
    base: float

    def predict(self, x, y, z):
        return self.base + 2.0 * x + 10.0 * y + z


@dataclass
class _Verify:
    per_token: float

    def predict(self, n, l, b):
        return 2000.0 + self.per_token * n * b


class _Costs:
    def __init__(self, per_token=1.0, families=("block", "tfm", "dspark")):
        self.verify = _Verify(per_token)
        self.drafters = {f: DrafterCostModel(_Surface(300.0), {"block_len": 7}, f) for f in families}

    def drafter(self, family):
        from simtree.costs.model import CostBundle
        return CostBundle.drafter(self, family)

    meta = {"model": "toy"}


ACC = drafter_preset("dspark", "gsm8k", topk=2)


def test_candidates_rank_by_throughput():
    rows = score_drafter_candidates(_Costs(), ACC, batch_size=4, context_len=512)
    assert {r["family"] for r in rows} == {"block", "tfm", "dspark"}
    tok = [r["predicted_tok_s"] for r in rows]
    assert tok == sorted(tok, reverse=True) and all(r["tokens_per_round"] >= 1.0 for r in rows)
    chain = [r for r in rows if r["family"] == "dspark" and r["params"]["threshold"] is None]
    assert chain and chain[0]["tokens_per_round"] == pytest.approx(6.17, rel=0.02)   # cheap verify: all 7 verified


def test_the_schedule_verifies_less_under_load():
    light = score_drafter_candidates(_Costs(per_token=1.0), ACC, batch_size=64, context_len=512,
                                     candidates=[("dspark", {"block_len": 7, "threshold": None})])[0]
    heavy = score_drafter_candidates(_Costs(per_token=300.0), ACC, batch_size=64, context_len=512,
                                     candidates=[("dspark", {"block_len": 7, "threshold": None})])[0]
    assert heavy["params"]["verified_per_seq"] < light["params"]["verified_per_seq"]
    assert heavy["params"]["threshold_used"] > light["params"]["threshold_used"]


def test_dspark_expects_the_levels_mixture_at_every_batch():
    """Each sequence draws its level every round: a fixed threshold's tokens per round are the
    levels' weighted mean at batch 1 as at 64 (not the likeliest level's at batch 1), and the
    bucket holds the longest prefix any level verifies."""
    import numpy as np

    from simtree.acceptance.model import get_workload
    acc = get_workload("gsm8k").acceptance
    surv = np.stack([np.cumprod(acc.table(i, 7)[:, 0]) for i in range(acc.num_levels)])
    lens = (surv >= 0.3).sum(1)
    want = 1 + acc.weights @ (surv * (np.arange(7)[None, :] < lens[:, None])).sum(1)
    assert lens.min() < lens.max() and acc.weights.max() < 1      # the levels differ: the mean is no level's
    for b in (1, 2, 64):
        row = score_drafter_candidates(_Costs(), acc, batch_size=b, context_len=512,
                                       candidates=[("dspark", {"block_len": 7, "threshold": 0.3})])[0]
        assert row["tokens_per_round"] == pytest.approx(want, rel=1e-12)
        assert row["nodes_per_seq"] == 1 + lens.max()
        assert row["params"]["verified_per_seq"] == pytest.approx(acc.weights @ lens, abs=1e-4)


@pytest.mark.parametrize("cand, costs, fragment", [
    (("tfm", {"budget": 8, "width": 2}), _Costs(families=("block",)), "no cost for drafter 'tfm'"),
    (("block", {"budget": 8, "block_len": 9}), _Costs(), "block length 9 is beyond the block drafter's 7"),
    (("dspark", {"block_len": 7, "threshold": 1.5}), _Costs(), "threshold 1.5 is outside [0, 1]"),
])
def test_bad_candidates_are_one_line(cand, costs, fragment):
    with pytest.raises(SimtreeError) as err:
        score_drafter_candidates(costs, ACC, batch_size=2, context_len=64, candidates=[cand])
    assert fragment in str(err.value) and "\n" not in str(err.value)
