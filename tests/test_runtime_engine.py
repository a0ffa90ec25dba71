"""The speculative engine is lossless: for every mode, batch size and tree shape its output
equals plain greedy decoding of the target token for token.

Float64 models (see test_runtime_model.py for why): tree verify computes in a different order
than sequential decoding, and float64 makes near-tie argmax flips impossible in practice.
"""
import numpy as np
import pytest

from runtime_helpers import perturbed, random_prompts, tiny_model
from simtree.acceptance.model import fit_positional, read_traces
from simtree.errors import SimtreeError
from simtree.runtime.engine import SpecEngine, greedy_decode
from simtree.planning.modes import (BatchAllocParams, BestFirstParams, CostAwareParams, EagleParams, LinearParams,
                                    NoneParams, PolicySpec)
from simtree.runtime.trace import TraceWriter


class LinearCosts:
    """Analytic cost models (``simtree.costs.model.Costs``): verify grows linearly in batch
    tokens, flat enough that the adaptive modes really build trees (asserted below)."""

    class verify:
        convex_in_n, valid_range, heldout_median_error = True, {}, None

        @staticmethod
        def predict(nodes_per_seq, context_len, batch_size):
            return 200.0 + 1.0 * np.asarray(nodes_per_seq, np.float64) * batch_size

    class draft:
        valid_range = {}

        @staticmethod
        def predict(num_steps, topk, batch_size):
            return 30.0 * num_steps

    meta = {"synthetic": True}


SPECS = [NoneParams(), LinearParams(budget=4),
         EagleParams(num_steps=3, topk=2, budget=6),
         EagleParams(num_steps=2, topk=3, budget=9),
         BestFirstParams(budget=7, width=1, draft_depth=3),
         BestFirstParams(budget=8, width=3, draft_depth=4),
         CostAwareParams(max_budget=8, draft_depth=3),
         BatchAllocParams(max_budget_per_seq=6, draft_depth=3)]
MAX_NEW = 12


@pytest.fixture(scope="module")
def models():
    target = tiny_model(10)
    return target, perturbed(target, 0.15)


@pytest.fixture(scope="module")
def references(models):
    rng = np.random.default_rng(11)
    prompts = {1: random_prompts(rng, [7]), 3: random_prompts(rng, [4, 11, 6])}
    refs = {b: [greedy_decode(models[0], p, MAX_NEW) for p in ps] for b, ps in prompts.items()}
    assert all(len(set(r)) > MAX_NEW // 2 for rs in refs.values() for r in rs)  # not a degenerate repeat
    return prompts, refs


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_speculative_output_equals_plain_greedy(models, references, spec, batch_size):
    prompts, refs = references
    result = SpecEngine(*models, costs=LinearCosts).generate(prompts[batch_size], MAX_NEW, spec)
    assert result.outputs == refs[batch_size]
    assert result.tokens_produced >= batch_size * (MAX_NEW - 1)
    if spec.mode != "none":  # the tree path is exercised, not only plain decoding
        assert np.mean([n for r in result.rounds for n in r.nodes]) > 1.5


def test_some_drafts_are_accepted_and_some_rejected(models, references):
    """The perturbed draft exercises both commit of deep paths and rejected branches."""
    prompts, _ = references
    res = SpecEngine(*models).generate(prompts[3], MAX_NEW, EagleParams(num_steps=3, topk=2, budget=6))
    accepted = [a for r in res.rounds for a in r.accepted]
    assert min(accepted) == 0 and max(accepted) >= 2


def test_identical_draft_accepts_every_linear_token():
    target = tiny_model(12)
    prompts = random_prompts(np.random.default_rng(12), [5, 8])
    res = SpecEngine(target, target).generate(prompts, 13, LinearParams(budget=5))
    assert all(a == 4 for r in res.rounds for a in r.accepted)
    assert res.outputs == [greedy_decode(target, p, 13) for p in prompts]


def test_traces_are_read_by_the_acceptance_fitter(models, references, tmp_path):
    prompts, _ = references
    path = tmp_path / "traces.jsonl"
    with TraceWriter(path) as trace:
        spec = EagleParams(num_steps=2, topk=2, budget=5)
        res = SpecEngine(*models).generate(prompts[3], MAX_NEW, spec, workload="unit", trace=trace)
    records = read_traces(path)
    assert len(records) == 3 * len(res.rounds)
    assert [int(r.tree.depth[r.accepted_node]) for r in records[:3]] == res.rounds[0].accepted
    model = fit_positional(records)
    assert model.summary()  # a fitted positional table


def test_adaptive_modes_need_a_cost_model(models, references):
    prompts, _ = references
    with pytest.raises(SimtreeError, match="cost model"):
        SpecEngine(*models).generate(prompts[1], 4, PolicySpec.from_dict("cost_aware", {"max_budget": 6}))


@pytest.mark.parametrize("spec, fragment", [(lambda: PolicySpec.from_dict("tree", {}), "unknown"),
                                            (lambda: PolicySpec.from_dict("eagle", {"num_steps": 2, "topk": 2}), "budget"),
                                            (lambda: LinearParams(budget=0), "budget"),
                                            (lambda: {"mode": "linear", "params": {"budget": 4}}, "PolicySpec")])
def test_bad_policy_entries_are_refused(models, references, spec, fragment):
    prompts, _ = references
    with pytest.raises(SimtreeError, match=fragment):
        SpecEngine(*models).generate(prompts[1], 4, spec())


def test_batched_eagle_drafting_builds_the_per_sequence_trees(models, references):
    """The lockstep-batched EAGLE drafter gives the trees eagle_tree builds one sequence at a time."""
    from simtree.trees.builders import eagle_tree
    from simtree.runtime.drafter import Drafter

    prompts, _ = references
    drafter = Drafter(models[1], 3, 64)
    drafter.prefill(prompts[3])
    roots = [p[-1] for p in prompts[3]]
    batched = drafter.eagle_trees(roots, 3, 2, 6)
    for b, tree in enumerate(batched):
        single = eagle_tree(drafter.propose_fn(b, 2), 3, 2, 6, roots[b])
        assert np.array_equal(tree.parents, single.parents) and np.array_equal(tree.tokens, single.tokens)
        np.testing.assert_allclose(tree.log_probs, single.log_probs, atol=1e-9)
    with pytest.raises(SimtreeError, match="budget"):
        drafter.eagle_trees(roots, 2, 2, 99)


@pytest.mark.parametrize("spec", [EagleParams(num_steps=5, topk=4, budget=68),
                                  BestFirstParams(budget=70, width=3, draft_depth=20)],
                         ids=["eagle-5-4-68", "best_first-70-3-20"])
def test_large_trees_stored_depth_first_stay_lossless(models, references, spec, monkeypatch):
    # a GDN target's single trees of > 64 nodes are renumbered depth-first before the verify
    # (the GDN tree kernel's fastest order, kernels.gdn.depth_first_pays): the output is still
    # plain greedy decoding
    from simtree.trees.tree import TreeBatch
    seen, real = [], TreeBatch.depth_first
    monkeypatch.setattr(TreeBatch, "depth_first", lambda self: seen.append(self.max_nodes) or real(self))
    prompts, refs = references
    assert "linear_attention" in models[0].config.layer_types
    result = SpecEngine(*models).generate(prompts[1], MAX_NEW, spec)
    assert result.outputs == refs[1]
    assert seen and min(seen) > 64     # only large trees are renumbered, and some were


@pytest.mark.parametrize("spec", [EagleParams(num_steps=80, topk=1, budget=4),
                                  BestFirstParams(budget=4, draft_depth=80),
                                  CostAwareParams(max_budget=3, draft_depth=80)],
                         ids=["eagle-deep", "best_first-deep", "cost_aware-deep"])
def test_drafts_deeper_than_the_budget_fit_the_cache_and_stay_lossless(models, references, spec):
    """The drafter's cache holds the round's deepest drafted position on top of the target's
    (sized from the budget alone, 80 draft steps did not fit: 'tree does not fit the cache')."""
    prompts, refs = references
    result = SpecEngine(*models, costs=LinearCosts).generate(prompts[3], MAX_NEW, spec)
    assert result.outputs == refs[3]


def test_policies_the_draft_cannot_run_are_one_line_errors(models, references):
    prompts, _ = references
    engine = SpecEngine(*models)
    vocab = models[1].config.vocab_size
    with pytest.raises(SimtreeError, match=f"topk {vocab + 1} exceeds the draft model's vocabulary \\({vocab} "):
        engine.generate(prompts[1], 4, EagleParams(num_steps=1, topk=vocab + 1, budget=4))
    with pytest.raises(SimtreeError, match="drafts 19621 nodes per sequence per round, more than the 8192"):
        engine.generate(prompts[1], 4, EagleParams(num_steps=50, topk=20, budget=4))
    with pytest.raises(SimtreeError, match="drafts 9001 nodes .* lower its draft depth"):
        engine.generate(prompts[1], 4, BestFirstParams(budget=4, draft_depth=9000))


@pytest.mark.parametrize("vocab", [32, 100])
def test_draft_and_target_vocabularies_must_agree(vocab):
    import dataclasses

    from runtime_helpers import tiny_config
    from simtree.runtime.model import HybridLM

    target = tiny_model(3)
    draft = HybridLM(dataclasses.replace(tiny_config(), vocab_size=vocab))
    with pytest.raises(SimtreeError, match=f"draft vocab_size {vocab} != target vocab_size 64"):
        SpecEngine(target, draft)


def test_cost_aware_prices_each_round_at_the_runs_rate(models, references, monkeypatch):
    """The engine's cost_aware is the simulator's rule (simtree.planning.allocation.allocate_round):
    the first round at its own best rate, later rounds at the price the rounds before set -
    their gained tokens over their predicted time (C_d + C_v of the trees verified)."""
    from simtree.planning import allocation
    from simtree.runtime import engine as engine_module
    prompts, refs = references
    seen = []

    def spy(survival, verify_cost, draft_us, batch_size, price):
        extra = allocation.allocate_round(survival, verify_cost, draft_us, batch_size, price)
        seen.append((price.value, extra))
        return extra

    class SteepCosts(LinearCosts):   # nodes cost enough that budgets differ by sequence and round
        class verify(LinearCosts.verify):
            @staticmethod
            def predict(nodes_per_seq, context_len, batch_size):
                return 200.0 + 4.0 * np.asarray(nodes_per_seq, np.float64) * batch_size

    monkeypatch.setattr(engine_module, "allocate_round", spy)
    spec = CostAwareParams(max_budget=8, draft_depth=3)
    res = SpecEngine(*models, costs=SteepCosts).generate(prompts[3], MAX_NEW, spec)
    assert res.outputs == refs[3]
    assert len(seen) == len(res.rounds) > 2
    replay = allocation.RunningPrice()
    for (price, extra), r in zip(seen, res.rounds):
        assert price == (None if replay.value is None else pytest.approx(replay.value, rel=1e-12))
        assert r.nodes == (1 + extra).tolist()
        time_us = SteepCosts.draft.predict(3, 1, 3) + SteepCosts.verify.predict(np.mean(r.nodes), 0, 3)
        replay.update(sum(r.accepted) + 3, time_us)
    assert len({n for r in res.rounds for n in r.nodes}) > 1   # budgets differ by sequence or round


def test_rounds_record_live_sequences(models, references):
    """Recomputed from the accepted counts: a sequence is live in a round when it began short
    of max_new_tokens, and the rounds stop once every sequence has its tokens."""
    prompts, refs = references
    res = SpecEngine(*models).generate(prompts[3], MAX_NEW, EagleParams(num_steps=3, topk=2, budget=6))
    lens = np.ones(3, np.int64)   # the prefill's token
    for r in res.rounds:
        assert r.live == int((lens < MAX_NEW).sum())
        lens = lens + np.asarray(r.accepted) + 1
    assert res.rounds[-1].live >= 1 and lens.min() >= MAX_NEW


def test_draft_extent_follows_the_cost_models_draft_shape():
    # the engine drafts as deep as the planner costs (the cost model's draft steps) and every
    # node of a linear / eagle tree it verifies: properties over every planner candidate, and
    # values pinned for one spec of each mode
    from simtree.planning.planner import candidate_specs
    from simtree.runtime.engine import draft_extent
    fixed, adaptive = candidate_specs()
    for spec in fixed + adaptive:
        nodes, depth = draft_extent(spec)
        assert nodes > depth or spec.mode == "none", spec.name   # the root is verified too
        if spec.mode in ("linear", "eagle"):
            assert nodes >= spec.budget, spec.name
    pinned = {("linear", (("budget", 1),)): (1, 0), ("linear", (("budget", 16),)): (16, 15),
              ("eagle", (("budget", 5), ("num_steps", 2), ("topk", 2))): (7, 2),
              ("best_first", (("budget", 16), ("draft_depth", 15), ("width", 1))): (16, 15),
              ("cost_aware", (("draft_depth", 3), ("max_budget", 16))): (4, 3),
              ("batch_alloc", (("draft_depth", 1), ("max_budget_per_seq", 16))): (2, 1),
              ("none", ()): (0, 0)}
    for (mode, params), extent in pinned.items():
        assert draft_extent(PolicySpec.from_dict(mode, dict(params))) == extent, (mode, params)


@pytest.mark.parametrize("bad, got", [(True, "True"), (2.5, "2.5"), (float("nan"), "nan"), (0, "0"), (-3, "-3")])
def test_max_new_tokens_must_be_a_positive_integer(models, references, bad, got):
    prompts, _ = references
    with pytest.raises(SimtreeError) as err:
        SpecEngine(*models).generate(prompts[1], bad, NoneParams())
    assert str(err.value) == f"max_new_tokens must be an integer >= 1, got {got}"
    if bad != 0:   # greedy_decode takes 0 (no tokens), nothing below it
        with pytest.raises(SimtreeError, match=f"max_new_tokens must be an integer >= 0, got {got}"):
            greedy_decode(models[0], prompts[1][0], bad)
    assert greedy_decode(models[0], prompts[1][0], 0) == []
