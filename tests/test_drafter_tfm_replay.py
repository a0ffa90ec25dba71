"""A TfM replay shapes the adapter's tree by the acceptance model (runtime/full/acceptance.py
``DraftScores.rescore_at``): the tree each sequence drafts is the planner's best-first tree for
its round's level (``drafter_candidates`` scores a tfm candidate by it), so the replayed
accepted tokens per round are the predicted ones within the replay's sampling error."""
import numpy as np
import pytest
import torch

from simtree.acceptance.model import get_workload
from simtree.planning.drafter_candidates import score_spec
from simtree.planning.modes import PolicySpec
from simtree.runtime.full.acceptance import LOG_ZERO, ModelReplay, StratifiedReplay, joint_depth_pmf
from simtree.runtime.full.block_engine import make_engine
from simtree.runtime.full.drafting import round_shape
from simtree.trees.builders import batched_best_first_tree

from full_helpers import FAMILIES, drafter_costs, tiny_model

TINY = {"sizes": {"layers": 1, "cand_k": 32, "adapter_dim": 16}}
SPEC = PolicySpec.from_dict("tfm", {"budget": 16, "width": 4, "block_len": 7})    # the H100 runs' shape
ACC = get_workload("gsm8k").acceptance
COSTS = drafter_costs()


def _engine(name, source, batch):
    rs = round_shape(SPEC)
    engine = make_engine(tiny_model(name, dtype=torch.float32), rs, batch, 256, source, costs=COSTS, **TINY)
    engine.fill_context(16, seed=0)
    return engine


def _rank_paths(parents, ranks, keep) -> set:
    out = set()
    for j in np.flatnonzero(keep):
        path, cur = [], int(j)
        while cur > 0:
            path.append(int(ranks[cur]))
            cur = int(parents[cur])
        out.add(tuple(reversed(path)))
    return out


def test_a_tfm_replay_drafts_the_planners_tree_at_each_sequences_level():
    """Every sequence's tree holds the best-first tree (width 4) over its level's draft table
    that the prediction scores: the same rank paths, wherever the path's probability is not 0
    (those nodes are never accepted, and their order among themselves is a tie)."""
    rs = round_shape(SPEC)
    engine = _engine("tiny-gdn", ModelReplay(ACC, rs, "cpu", seed=2, batch_size=6), 6)
    engine._draft()
    t, levels = engine.tree, engine.source.scores.level.tolist()
    assert len(set(levels)) > 1             # the draw spreads the batch over levels
    for b, lv in enumerate(levels):
        toks, probs = ACC.draft_marginals(lv, SPEC.block_len)
        want, _ = batched_best_first_tree(toks, probs, SPEC.budget, SPEC.width)
        table = ACC.draft_table(lv, SPEC.block_len)
        prefix = np.ones(want.num_nodes)
        for j in range(1, want.num_nodes):
            prefix[j] = prefix[want.parents[j]] * table[want.depth[j] - 1, want.tokens[j]]
        got = _rank_paths(t.parents[b].numpy(), t.rank[b].numpy(),
                          t.valid[b].numpy() & (t.score[b].numpy() > LOG_ZERO / 2))
        assert got == _rank_paths(want.parents, want.tokens, prefix > 0), lv


@pytest.mark.parametrize("name", FAMILIES)
def test_tfm_replays_accept_the_predicted_tokens_per_round(name):
    """float32, 40 rounds of batch 8 (n = 320 sequence-rounds).  The prediction is the
    planner's (``score_spec``: tokens per round, bonus included).  Independent draws
    (ModelReplay): each sequence-round's accepted depth is one draw of the predicted
    distribution, whose standard deviation sd is the model's (``joint_depth_pmf``), so the mean
    of n is within 4 sd / sqrt(n) (a 4-sigma bound: 0.14 tokens, 4% of 3.43 here) unless the trees are
    not the ones predicted (the adapter's own random-weight trees gave 2.3-3.0).  Stratified
    draws (the GPU runs' default): within (deepest depth) / n."""
    rs = round_shape(SPEC)
    B, rounds = 8, 40
    n = B * rounds
    predicted = score_spec(COSTS, ACC, SPEC, B, 64)["tokens_per_round"]
    joint = joint_depth_pmf(ACC, rs).sum(1)
    depths = np.arange(joint.size)
    assert np.isclose(1.0 + joint @ depths, predicted)          # the replay draws what the plan scores
    sd = float(np.sqrt(joint @ (depths - joint @ depths) ** 2))
    iid = _engine(name, ModelReplay(ACC, rs, "cpu", seed=1, batch_size=B), B).run(rounds=rounds)
    err = abs(iid.accepted_tokens_per_round - predicted) / predicted
    assert err <= 4 * sd / np.sqrt(n) / predicted, (iid.accepted_tokens_per_round, predicted, sd)
    src = StratifiedReplay(ACC, rs, "cpu", batch_size=B, rows=rounds, seed=1)
    strat = _engine(name, src, B).run(rounds=rounds)
    assert np.array_equal(strat.accepted, src.table.numpy())    # every tree was deep enough
    assert abs(strat.accepted_tokens_per_round - predicted) <= rs.max_depth / n + 1e-9
