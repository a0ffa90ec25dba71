"""The runtime's one engine decoding given prompts live (``generate``) is lossless: for every mode
it builds, batch size and tree shape its output equals plain greedy decoding of the target token
for token, on the shipped tiny default (a Qwen3.5 checkpoint, GDN and attention layers; the
V4 family: tests/test_full_lossless.py).  Float64 (tree verify sums in another order than the
decode step: float64 makes near-tie argmax flips impossible in practice).  Also: its rounds'
statistics and traces, per-round tiers of an online controller, one-line refusals, and that the
runtime has exactly one engine class."""
import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from simtree.acceptance.fit import fit_confidence, has_topk
from simtree.acceptance.model import fit_positional, read_traces
from simtree.errors import SimtreeError
from simtree.planning.modes import (BatchAllocParams, BestFirstParams, CostAwareParams, EagleParams, LinearParams,
                                    NoneParams, PolicySpec)
from simtree.runtime.full.build import build_model
from simtree.runtime.full.generate import generate, greedy_decode
from simtree.runtime.trace import TraceWriter

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


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


SPECS = [NoneParams(), LinearParams(budget=4), EagleParams(num_steps=3, topk=2, budget=6),
         EagleParams(num_steps=2, topk=3, budget=9), BestFirstParams(budget=7, width=1, draft_depth=3),
         CostAwareParams(max_budget=8, draft_depth=3), BatchAllocParams(max_budget_per_seq=6, draft_depth=3)]
MAX_NEW = 12
PROMPTS = {1: [list(b"def add(a, b):")], 3: [list(b"The cat"), list(b"Once upon a time, "), list(b"42")]}


@pytest.fixture(scope="module")
def model():
    return build_model("runtime-tiny", device="cpu", dtype=torch.float64)


@pytest.fixture(scope="module")
def references(model):
    refs = {b: greedy_decode(model, ps, MAX_NEW) for b, ps in PROMPTS.items()}
    assert all(len(set(r)) > MAX_NEW // 3 for rs in refs.values() for r in rs)   # not a degenerate repeat
    return refs


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_speculative_output_equals_plain_greedy(model, references, spec, batch_size):
    result = generate(model, PROMPTS[batch_size], MAX_NEW, spec, costs=LinearCosts)
    assert result.outputs == references[batch_size]
    assert result.tokens_produced >= batch_size * (MAX_NEW - 1)
    if spec.mode != "none":  # the tree path is exercised, not only plain decoding
        assert np.mean([n for r in result.rounds for n in r.nodes]) > 1.5
        accepted = [a for r in result.rounds for a in r.accepted]
        assert max(accepted) >= 1   # drafts were accepted (and, below, rejected)
    assert all(r.round_ms > 0 for r in result.rounds)


def test_some_drafts_are_accepted_and_some_rejected(model):
    res = generate(model, PROMPTS[3], MAX_NEW, EagleParams(num_steps=3, topk=2, budget=6))
    accepted = [a for r in res.rounds for a in r.accepted]
    assert min(accepted) == 0 and max(accepted) >= 2


def test_a_draft_that_agrees_accepts_every_linear_token(tmp_path):
    """Residual branches silent: the target is a bigram model of the token and the MTP layer
    drafts exactly its tokens."""
    pytest.importorskip("transformers")
    from simtree.runtime.full.tiny import write_tiny_checkpoint
    exact = build_model(str(write_tiny_checkpoint(tmp_path, layer_gain=0.0)), device="cpu", dtype=torch.float64)
    res = generate(exact, PROMPTS[3][:2], 13, LinearParams(budget=5))
    assert all(a == 4 for r in res.rounds for a in r.accepted)
    assert res.outputs == greedy_decode(exact, PROMPTS[3][:2], 13)


@pytest.mark.parametrize("spec", [EagleParams(num_steps=2, topk=2, budget=5), LinearParams(budget=4),
                                  BestFirstParams(budget=6, draft_depth=3)], ids=lambda s: s.mode)
def test_traces_are_the_rounds_and_read_by_the_acceptance_fitters(model, spec, tmp_path):
    path = tmp_path / "traces.jsonl"
    with TraceWriter(path) as trace:
        res = generate(model, PROMPTS[3], MAX_NEW, spec, workload="unit", trace=trace)
    records = read_traces(path)
    assert len(records) == 3 * len(res.rounds)
    for i, r in enumerate(res.rounds):
        rows = records[3 * i:3 * i + 3]
        assert [int(x.tree.depth[x.accepted_node]) for x in rows] == r.accepted
        assert [x.tree.num_nodes for x in rows] == r.nodes
    assert fit_positional(records).summary()
    if spec.mode != "eagle":   # linear and marginal rounds log the drafter's top-K along its chain
        assert has_topk(records) and fit_confidence(records, "unit").summary()


def test_traced_and_untraced_linear_runs_draft_the_same_chains(model, tmp_path):
    with TraceWriter(tmp_path / "t.jsonl") as trace:
        traced = generate(model, PROMPTS[3], MAX_NEW, LinearParams(budget=4), trace=trace)
    plain = generate(model, PROMPTS[3], MAX_NEW, LinearParams(budget=4))
    assert [r.accepted for r in traced.rounds] == [r.accepted for r in plain.rounds]


def test_rounds_record_live_sequences(model):
    """Recomputed from the accepted counts: a sequence is live in a round when it began short
    of max_new_tokens, and the rounds stop once every sequence has its tokens."""
    res = generate(model, PROMPTS[3], MAX_NEW, EagleParams(num_steps=3, topk=2, budget=6))
    lens = np.ones(3, np.int64)   # the prefill's token
    for r in res.rounds:
        assert r.live == int((lens < MAX_NEW).sum())
        lens = lens + np.asarray(r.accepted) + 1
    assert res.rounds[-1].live >= 1 and lens.min() >= MAX_NEW


class Cycling:
    """A controller that runs every tier in turn (``simtree.control.Controller``'s interface)."""

    def __init__(self):
        from simtree.acceptance.model import get_workload
        from simtree.control import Controller
        from simtree.costs.synthetic import synthetic_costs
        self.tiers = Controller(synthetic_costs(), get_workload("sharegpt").acceptance).tiers
        self.i, self.seen = 0, []

    def choose(self, batch_size, context_lens, rounds_done=None):
        tier = self.tiers[self.i % len(self.tiers)]
        self.i += 1
        return tier

    def observe(self, tier, accepted):
        self.seen.append((tier.name, len(accepted)))


def test_lossless_while_the_controller_switches_tiers_every_round(model, references):
    """Plain, linear and EAGLE rounds in turn: the MTP layer catches up in the plain rounds too."""
    ctl = Cycling()
    res = generate(model, PROMPTS[3], 30, LinearParams(2), controller=ctl)
    assert res.outputs == greedy_decode(model, PROMPTS[3], 30)
    assert {name for name, _ in ctl.seen} == {t.name for t in ctl.tiers} and len(ctl.seen) == len(res.rounds)


def test_adaptive_modes_need_a_cost_model(model):
    with pytest.raises(SimtreeError, match="cost model"):
        generate(model, PROMPTS[1], 4, PolicySpec.from_dict("cost_aware", {"max_budget": 6}))


@pytest.mark.parametrize("spec, fragment", [
    (lambda: PolicySpec.from_dict("tree", {}), "unknown"),
    (lambda: PolicySpec.from_dict("eagle", {"num_steps": 2, "topk": 2}), "budget"),
    (lambda: LinearParams(budget=0), "budget"),
    (lambda: {"mode": "linear", "params": {"budget": 4}}, "PolicySpec"),
    (lambda: BestFirstParams(budget=8, width=3, draft_depth=4), "width 1"),
    (lambda: EagleParams(num_steps=1, topk=261, budget=4), r"topk 261 exceeds the model's vocabulary \(260 tokens\)")])
def test_bad_policies_are_one_line_errors(model, spec, fragment):
    with pytest.raises(SimtreeError, match=fragment) as err:
        generate(model, PROMPTS[1], 4, spec())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("bad, got", [(True, "True"), (2.5, "2.5"), (0, "0"), (-3, "-3"), (5000, "5000")])
def test_max_new_tokens_must_be_a_positive_integer(model, bad, got):
    with pytest.raises(SimtreeError) as err:
        generate(model, PROMPTS[1], bad, NoneParams())
    assert str(err.value) == f"max_new_tokens must be an integer in [1, 4096], got {got}"


def test_prompts_are_checked(model):
    with pytest.raises(SimtreeError, match="at least one token"):
        generate(model, [[1, 2], []], 4, NoneParams())
    with pytest.raises(SimtreeError, match=r"token 300 outside the model's vocabulary \[0, 260\)"):
        generate(model, [[1, 300]], 4, NoneParams())


def _engine_classes() -> list[str]:
    """Classes under runtime/ that run decode rounds: a ``run`` or ``generate`` method beside a
    ``prefill`` (what an engine is: prompts in, rounds of draft / verify / commit out); the round
    loop may come from a base class that has no ``prefill`` of its own (a mixin such as
    runtime/full/rounds.py's)."""
    classes, by_name = [], {}
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                classes.append((f"{path.relative_to(ROOT)}:{node.name}", methods, bases))
                by_name.setdefault(node.name, []).append(methods)
    found = []
    for where, methods, bases in classes:
        mixed = set().union(*[m for b in bases for m in by_name.get(b, []) if "prefill" not in m])
        if "prefill" in methods and (methods | mixed) & {"run", "generate"}:
            found.append(where)
    return found


def test_the_runtime_has_one_engine_class():
    assert _engine_classes() == ["runtime/full/engine.py:FullEngine"]
