"""The marginal modes on the full runtime: best-first (DDTree) trees from the MTP layer's top-1
chain, cost_aware and batch_alloc budgets decided on the device by the planner's own rule -
lossless, the same trees and budgets as the planner's builders and allocation, replayable."""
import numpy as np
import pytest
import torch

from simtree.acceptance.model import get_workload
from simtree.costs.synthetic import synthetic_costs
from simtree.errors import SimtreeError
from simtree.planning.allocation import RunningPrice, allocate_round, batch_allocation
from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.acceptance import ModelReplay, StratifiedReplay
from simtree.runtime.full.allocation import DeviceAllocation
from simtree.runtime.full.best_first import best_first, marginal_candidates
from simtree.runtime.full.drafting import TreeBuffers, lay_out, round_shape
from simtree.runtime.full.engine import FullEngine
from simtree.runtime.full.lossless import check_lossless
from simtree.trees.builders import best_first_order

from full_helpers import FAMILIES, PROMPTS, tiny_model

# nodes cost verify time (no weight-bound floor): the budgets move from round to round
COSTLY = synthetic_costs(weights_us=0.0, per_token_us=10.0)
SPECS = [PolicySpec.from_dict("best_first", {"budget": 8, "draft_depth": 3}),
         PolicySpec.from_dict("cost_aware", {"max_budget": 10, "draft_depth": 3}),
         PolicySpec.from_dict("batch_alloc", {"max_budget_per_seq": 6, "draft_depth": 4})]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_marginal_modes_output_equals_plain_greedy(name, batch):
    """In float32: each mode's greedy output is plain greedy decoding's, token for token."""
    prompts = PROMPTS[:batch] if batch > 1 else PROMPTS[1:2]
    rows = check_lossless(tiny_model(name, dtype=torch.float32), prompts, SPECS, 20, costs=COSTLY)
    assert [r["policy"] for r in rows] == [s.name for s in SPECS]
    for r in rows:
        assert r["match"], r
        assert 1.2 < r["accepted_tokens_per_round"], r      # drafts were accepted, and (below 1 + depth) rejected
        assert r["accepted_tokens_per_round"] < 4.0, r


def _random_marginals(B, P, K, seed):
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(B, P, K, generator=g, dtype=torch.float64).sort(-1, descending=True).values
    probs = probs / probs.sum(-1, keepdim=True) * 0.9
    ids = torch.randint(0, 1000, (B, P, K), generator=g)
    return probs.log().float(), ids, probs


def _paths(parents, ranks, valid=None):
    """Each node as its root path of ranks (the tree's identity up to node order)."""
    out = set()
    for j in range(1, len(parents)):
        if valid is not None and not valid[j]:
            continue
        path, cur = [], j
        while cur > 0:
            path.append(int(ranks[cur]))
            cur = int(parents[cur])
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("budget, depth", [(8, 3), (16, 2), (12, 5), (16, 1)])
def test_device_best_first_tree_is_the_planners(budget, depth):
    """The device's tree of ``budget`` nodes is best_first_order's: the same nodes (rank paths),
    scored with the same prefix probabilities."""
    B, K = 3, 4
    lp, ids, probs = _random_marginals(B, depth, K, budget + depth)
    rs = round_shape(PolicySpec.from_dict("best_first", {"budget": budget, "draft_depth": depth}))
    cand = marginal_candidates(lp, ids, rs)
    out = TreeBuffers.empty(B, rs.nodes, "cpu")
    lay_out(out, torch.zeros(B, dtype=torch.int64), cand, best_first(cand, rs), rs.topk)
    for b in range(B):
        order = best_first_order(np.tile(np.arange(K), (depth, 1)), probs[b].numpy(), budget)
        want = _paths(order.parents, order.tokens)
        got = _paths(out.parents[b].tolist(), out.rank[b].tolist(), out.valid[b].tolist())
        assert got == want
        n = order.num_nodes
        assert sorted(out.score[b, 1:n].exp().tolist()) == pytest.approx(sorted(order.prefix_probs[1:].tolist()),
                                                                         rel=1e-5)
        assert not out.valid[b, n:].any()          # fewer candidates than the budget: padding


@pytest.mark.parametrize("mode", ["cost_aware", "batch_alloc"])
def test_device_allocation_is_the_planners_rule(mode):
    """Round after round (cost_aware's price moving with the tokens gained) the device's budgets
    are allocate_round's / batch_allocation's on the same survival lists."""
    B, budget, max_len = 4, 9, 640
    size = "max_budget" if mode == "cost_aware" else "max_budget_per_seq"
    rs = round_shape(PolicySpec.from_dict(mode, {size: budget, "draft_depth": 3}))
    alloc = DeviceAllocation(COSTLY, rs, B, max_len, "cpu")
    price, rng = RunningPrice(), np.random.default_rng(0)
    draft_us = float(COSTLY.draft.predict(3, 1, B))
    seen = set()
    for r in range(12):
        survival = np.sort(rng.random((B, budget - 1)) ** (1 + r % 3), axis=1)[:, ::-1].copy()
        ctx = 100.0 + 37 * r                      # C_v is linear in l: interpolation is exact
        cv = lambda n: COSTLY.verify.predict(n, ctx, B)  # noqa: E731
        lists = list(survival)
        want = (allocate_round(lists, cv, draft_us, B, price) if mode == "cost_aware"
                else batch_allocation(lists, np.ones(B), cv, draft_us, B))
        got = alloc.allocate(torch.as_tensor(survival), torch.tensor(ctx, dtype=torch.float64))
        assert got.tolist() == want.tolist()
        seen.add(int(want.sum()))
        gained = int(rng.integers(B, 3 * B))
        price.update(gained, draft_us + float(cv(1 + want.sum() / B)))
        alloc.update(torch.tensor(gained))
    assert len(seen) > 2                            # the budgets moved


def test_a_block_drafters_allocation_prices_its_draft_at_the_rounds_context():
    """A block drafter's C_d grows with the context it attends to: the device rule (DSpark's
    schedule, batch_alloc's) prices each round's draft at that round's context, as the planner's
    score does - not at the largest context timed - and keeps batch_allocation's budgets."""
    from simtree.costs.model import CostBundle, DrafterCostModel
    from simtree.drafters import MARGINAL_TOPK
    from simtree.planning.drafter_candidates import score_spec
    from simtree.runtime.full.allocation import draft_cost_us

    from full_helpers import _DrafterSurface
    B, L, max_len = 3, 7, 1024
    by = tuple((c, DrafterCostModel(_DrafterSurface(us), {"block_len": L}, "dspark"))
               for c, us in ((256, 0.5), (1024, 200.0)))     # C_d per unit 400x dearer at context 1024
    costs = CostBundle(COSTLY.verify, COSTLY.draft, {"model": "tiny", "device": "cpu"},
                       {"dspark": DrafterCostModel(by[-1][1].surface, {"block_len": L}, "dspark", by)})
    spec = PolicySpec.from_dict("dspark", {"block_len": L})
    rs = round_shape(spec)
    alloc = DeviceAllocation(costs, rs, B, max_len, "cpu")
    rng, acc, picked = np.random.default_rng(1), get_workload("gsm8k").acceptance, set()
    for ctx in (100.0, 256.0, 500.0, 640.0, 1024.0):
        want_cd = float(costs.drafter("dspark").predict(MARGINAL_TOPK, L, B, ctx))
        assert draft_cost_us(costs, rs, B, ctx) == pytest.approx(score_spec(costs, acc, spec, B, ctx)["draft_us"])
        assert draft_cost_us(costs, rs, B, ctx) == pytest.approx(want_cd, rel=1e-12)
        got_cd = float(alloc.draft_cost(torch.tensor(ctx, dtype=torch.float64)))
        assert got_cd == pytest.approx(want_cd, rel=1e-9)
        survival = np.cumprod(rng.uniform(0.3, 0.95, (B, L)), axis=1)
        want = batch_allocation(list(survival), np.ones(B), lambda n: COSTLY.verify.predict(n, ctx, B), want_cd, B)
        got = alloc.allocate(torch.as_tensor(survival), torch.tensor(ctx, dtype=torch.float64))
        assert got.tolist() == want.tolist()
        picked.add(int(want.sum()))
    cheap, dear = (float(alloc.draft_cost(torch.tensor(c, dtype=torch.float64))) for c in (256.0, 1024.0))
    assert dear > 10 * cheap and len(picked) > 1          # the context moves the price and the budget


def test_the_budget_moves_from_round_to_round_in_a_run():
    rs = round_shape(SPECS[1])
    engine = FullEngine(tiny_model("tiny-gdn"), rs, 3, 128, costs=COSTLY)
    engine.prefill(PROMPTS)
    counts = []
    for _ in range(6):
        engine.run(rounds=1)
        counts += engine.tree.valid.sum(1).tolist()
    assert min(counts) < rs.budget and max(counts) > 1 and len(set(counts)) > 1


def test_a_smaller_bucket_caps_the_budgets_and_stays_lossless():
    """cost_aware in a bucket of 4 nodes (below its max budget 10): trees of 4 rows, at most 4
    of them valid, and the output still plain greedy decoding's."""
    from simtree.runtime.full.lossless import _decode
    model = tiny_model("tiny-v4", dtype=torch.float32)
    rs = round_shape(SPECS[1], nodes=4)
    engine = FullEngine(model, rs, 3, 128, costs=COSTLY)
    engine.prefill(PROMPTS)
    engine.run(max_new_tokens=12)
    assert engine.tree.tokens.shape == (3, 4) and int(engine.tree.valid.sum(1).max()) <= 4
    plain = _decode(model, PROMPTS, PolicySpec.from_dict("none"), 12, 128)[0]
    assert [o[:12] for o in engine.outputs()] == plain
    with pytest.raises(SimtreeError, match="bucket of 1 nodes"):
        round_shape(SPECS[1], nodes=1)


@pytest.mark.parametrize("mode, params", [("best_first", {"budget": 8, "draft_depth": 3}),
                                          ("cost_aware", {"max_budget": 16, "draft_depth": 3})])
def test_stratified_replay_commits_its_table(mode, params):
    """A replay of a marginal mode commits each round's table depth (the deepest valid node
    where the tree is shallower), the trees shaped by the workload's drafter."""
    spec = PolicySpec.from_dict(mode, params)
    rs = round_shape(spec)
    acc = get_workload("gsm8k").acceptance
    src = StratifiedReplay(acc, rs, "cpu", 2, 4, costs=COSTLY, context_len=16)
    engine = FullEngine(tiny_model("tiny-v4"), rs, 2, 128, src, costs=COSTLY)
    engine.fill_context(16, seed=0)
    for r in range(4):
        got = engine.run(rounds=1).accepted[0]
        deepest = torch.where(engine.tree.valid, engine.tree.depth, 0).amax(1).numpy()
        assert got.tolist() == np.minimum(src.table[r].numpy(), deepest).tolist()


def test_model_replay_of_batch_alloc_runs():
    rs = round_shape(SPECS[2])
    src = ModelReplay(get_workload("sharegpt").acceptance, rs, "cpu", batch_size=2, costs=COSTLY, context_len=16)
    engine = FullEngine(tiny_model("tiny-gdn"), rs, 2, 128, src, costs=COSTLY)
    engine.fill_context(16, seed=0)
    stats = engine.run(rounds=6)
    assert stats.accepted.max() > 0 and stats.accepted.max() <= rs.max_depth


def test_what_the_runtime_cannot_build_is_refused_in_one_line():
    with pytest.raises(SimtreeError, match="width 1"):
        round_shape(PolicySpec.from_dict("best_first", {"budget": 8, "draft_depth": 3, "width": 2}))
    with pytest.raises(SimtreeError, match="needs a cost model"):
        FullEngine(tiny_model("tiny-gdn"), round_shape(SPECS[1]), 1, 64)
    with pytest.raises(SimtreeError, match="cost bundle"):
        StratifiedReplay(get_workload("gsm8k").acceptance, round_shape(SPECS[2]), "cpu", 2, 4)


def test_an_adaptive_run_takes_the_bucket_of_its_decision(tmp_path):
    """full_run verifies cost_aware's rounds in the bucket of the simulator's decision (not its
    max budget); the bucket is kept in summary.json, so a later prediction prices the same shape."""
    from simtree.runtime.full.acceptance import adaptive_bucket
    from simtree.runtime.full.measure import full_run, repredict
    spec = PolicySpec.from_dict("cost_aware", {"max_budget": 16, "draft_depth": 3})
    res = full_run(tiny_model("tiny-v4"), device="cpu", costs=COSTLY, batch_sizes=[2], acceptance="gsm8k",
                   context_len=16, rounds=2, warmup_rounds=0, extra=[("cost_aware", spec)], out=tmp_path)
    row = res["rows"][-1]
    bucket = adaptive_bucket(get_workload("gsm8k").acceptance, round_shape(spec), 2, COSTLY, 16)
    assert row["policy"] == "cost_aware:cost_aware_max16_p3" and f"bucket of {bucket} nodes" in row["note"]
    assert row["nodes"] == bucket and 2 <= bucket < 16
    again = repredict(tmp_path / "summary.json", COSTLY)["rows"][-1]
    assert again["nodes"] == bucket and again["predicted_round_ms"] == pytest.approx(row["predicted_round_ms"])


def test_a_trace_replay_of_cost_aware_commits_its_depths(tmp_path):
    """--replay: the trace's positional fit weighs the levels of cost_aware's decision."""
    import json
    from simtree.runtime.full.acceptance import TraceReplay
    depths = [1, 3, 0, 2, 2, 1]
    with open(tmp_path / "t.jsonl", "w") as fh:
        for i, d in enumerate(depths):
            fh.write(json.dumps({"workload": "w", "batch_size": 2, "round": i // 2, "seq": i % 2,
                                 "parents": [-1, 0, 1, 2, 3, 0], "log_probs": [0.0, -0.2, -0.3, -0.4, -0.5, -1.5],
                                 "accepted_node": d}) + "\n")
    rs = round_shape(SPECS[1])
    src = TraceReplay(tmp_path / "t.jsonl", 2, "cpu").score_trees(rs, "cpu", batch_size=2, costs=COSTLY,
                                                                   context_len=16)
    engine = FullEngine(tiny_model("tiny-gdn"), rs, 2, 128, src, costs=COSTLY)
    engine.fill_context(16, seed=0)
    for r in range(3):
        got = engine.run(rounds=1).accepted[0]
        deepest = torch.where(engine.tree.valid, engine.tree.depth, 0).amax(1).numpy()
        assert got.tolist() == np.minimum(depths[2 * r:2 * r + 2], deepest).tolist()
