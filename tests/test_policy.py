"""Policy file (contract 3): round trip, lookup, and one-line errors on malformed files."""
import json
import subprocess
import sys

import numpy as np
import pytest

from simtree.errors import SimtreeError
from simtree.planning.modes import (BatchAllocParams, BestFirstParams, CostAwareParams, EagleParams, LinearParams,
                                    NoneParams, PolicySpec)
from simtree.planning.policy_file import SCHEMA, Policy, PolicyEntry


def _entry(**kw):
    base = dict(workload="sharegpt", batch_min=1, batch_max=4, mode="eagle",
                params={"num_steps": 3, "topk": 2, "budget": 6}, tree_on=True, predicted_tok_s=812.5,
                gain_vs_linear=1.07, gain_vs_none=2.3)
    base.update(kw)
    return base


def _write(tmp_path, entries, **top):
    obj = {"schema": SCHEMA, "model": "m", "device": "d", "created": "2026-11-30T14:00:00+00:00",
           "source": {"synthetic": True}, "entries": entries, **top}
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(obj))
    return path


def test_round_trip_and_lookup(tmp_path):
    path = _write(tmp_path, [_entry(), _entry(batch_min=5, batch_max=64, mode="linear", params={"budget": 3},
                                               tree_on=False)])
    pol = Policy.load(path)
    again = Policy.load(pol.save(tmp_path / "copy.json"))
    assert again.to_dict() == pol.to_dict()
    assert pol.lookup("sharegpt", 3).mode == "eagle"
    assert pol.lookup("sharegpt", 64).params == LinearParams(budget=3)
    assert pol.lookup("sharegpt", 500).batch_max == 64  # clamped to the nearest range
    with pytest.raises(SimtreeError, match="at batch size 500"):
        pol.lookup("sharegpt", 500, clamp=False)
    with pytest.raises(SimtreeError, match="no entry for workload 'gsm8k'"):
        pol.lookup("gsm8k", 1)


@pytest.mark.parametrize("mutate, fragment", [
    (lambda p: p.write_text("{oops"), "not valid JSON"),
    (lambda p: p.write_text(json.dumps({"schema": "other/9"})), "is not 'simtree.policy/1'"),
    (lambda p: p.write_text(json.dumps({"schema": SCHEMA, "model": "m", "device": "d", "entries": []})), "non-empty"),
    (lambda p: _write(p.parent, [{k: v for k, v in _entry().items() if k != "tree_on"}]), "lacks 'tree_on'"),
    (lambda p: _write(p.parent, [_entry(mode="tree")]), "unknown mode 'tree'"),
    (lambda p: _write(p.parent, [_entry(params={"num_steps": 3, "topk": 2})]), "needs the parameter 'budget'"),
    (lambda p: _write(p.parent, [_entry(params={"num_steps": 3, "topk": 2, "budget": -1})]), "integer >= 1"),
    (lambda p: _write(p.parent, [_entry(batch_min=8, batch_max=2)]), "batch_min 8 > batch_max 2"),
    (lambda p: _write(p.parent, [_entry(predicted_tok_s=float("nan"))]), "predicted_tok_s"),
    (lambda p: _write(p.parent, [_entry(), _entry(batch_min=3, batch_max=9)]), "overlapping batch ranges"),
    (lambda p: _write(p.parent, [_entry(mode="linear", params={"budget": 4}, tree_on=True)]),
     "tree_on is true but mode 'linear' verifies no tree"),
    (lambda p: _write(p.parent, [_entry(tree_on=False)]), "tree_on is false but mode 'eagle' verifies a tree"),
    (lambda p: _write(p.parent, [_entry(params={"num_steps": 3, "topk": 2, "budget": 6, "draft_depth": 2})]),
     "mode 'eagle' has no parameter 'draft_depth'"),
    (lambda p: _write(p.parent, [_entry(mode="linear", params={"budget": 4, "bugdet": 5}, tree_on=False)]),
     "has no parameter 'bugdet'"),
    (lambda p: _write(p.parent, [_entry(within_model_error="yes")]), "within_model_error must be true or false"),
])
def test_malformed_policy_is_one_line_error(tmp_path, mutate, fragment):
    path = tmp_path / "policy.json"
    mutate(path)
    with pytest.raises(SimtreeError) as err:
        Policy.load(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_missing_policy_through_the_cli_is_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "simtree", "simulate", "--policy", str(tmp_path / "nope.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: policy file") and proc.stderr.count("\n") == 1


def test_entry_dataclass_accepts_contract_fields():
    e = PolicyEntry.from_dict(_entry(mode="cost_aware", params={"max_budget": 16}, tree_on=True), "x")
    assert e.params == CostAwareParams(max_budget=16, draft_depth=3) and e.tree_on and e.mode == "cost_aware"


def test_entry_params_must_be_typed():
    with pytest.raises(SimtreeError, match="params must be a PolicySpec"):
        PolicyEntry("w", 1, 2, {"budget": 3}, 1.0, 1.0, 1.0)


def test_saved_params_keep_the_file_format(tmp_path):
    # the in-memory policy is typed; the file keeps contract 3's params objects (keys sorted)
    specs = [NoneParams(), LinearParams(4), EagleParams(num_steps=3, topk=2, budget=6),
             BestFirstParams(budget=8, draft_depth=3, width=2), CostAwareParams(max_budget=16, draft_depth=4),
             BatchAllocParams(max_budget_per_seq=12, draft_depth=2)]
    pol = Policy("m", "d", [PolicyEntry("w", b, b, spec, 10.0 + b, 1.0, 1.0) for b, spec in enumerate(specs, 1)])
    saved = json.loads(pol.save(tmp_path / "p.json").read_text())["entries"]
    assert [(e["mode"], e["params"], e["tree_on"]) for e in saved] == [
        ("none", {}, False), ("linear", {"budget": 4}, False), ("eagle", {"budget": 6, "num_steps": 3, "topk": 2}, True),
        ("best_first", {"budget": 8, "draft_depth": 3, "width": 2}, True),
        ("cost_aware", {"draft_depth": 4, "max_budget": 16}, True),
        ("batch_alloc", {"draft_depth": 2, "max_budget_per_seq": 12}, True)]
    assert [e.params for e in Policy.load(tmp_path / "p.json").entries] == specs


def test_within_model_error_round_trips_and_defaults_to_false(tmp_path):
    pol = Policy.load(_write(tmp_path, [_entry(within_model_error=True), _entry(batch_min=5, batch_max=8)]))
    assert [e.within_model_error for e in pol.entries] == [True, False]
    again = Policy.load(pol.save(tmp_path / "copy.json"))
    assert [e.within_model_error for e in again.entries] == [True, False]


def test_resolve_notes_only_outside_every_planned_range(tmp_path):
    pol = Policy.load(_write(tmp_path, [_entry(batch_min=2, batch_max=4), _entry(batch_min=5, batch_max=64)]))
    for b in list(range(1, 70)) + [1000]:
        entry, note = pol.resolve("sharegpt", b)
        assert entry == pol.lookup("sharegpt", b)   # the lookup's entry, clamped or not
        assert (note is None) == (2 <= b <= 64), b
    assert "largest planned batch size 64" in pol.resolve("sharegpt", 1000)[1]
    assert "smallest planned batch size 2" in pol.resolve("sharegpt", 1)[1]
    with pytest.raises(SimtreeError):   # a workload the policy lacks: the lookup's error
        pol.resolve("gsm8k", 3)


def test_params_are_counts_from_json_or_numpy():
    # JSON may write a count as 4.0; a planner may hand numpy integers: both normalise to int
    spec = PolicySpec.from_dict("eagle", {"num_steps": np.int64(3), "topk": 2.0, "budget": 4})
    assert spec == EagleParams(3, 2, 4) and all(type(v) is int for v in spec.to_dict().values())
    for bad in (2.5, float("nan"), True, "4"):
        with pytest.raises(SimtreeError, match="parameter budget of mode 'linear' must be an integer >= 1, got"):
            PolicySpec.from_dict("linear", {"budget": bad})
        with pytest.raises(SimtreeError, match="parameter budget of mode 'linear' must be an integer >= 1, got"):
            LinearParams(bad)


@pytest.mark.parametrize("mode, params, name, draft_shape", [
    ("none", {}, "none", (0, 0)),
    ("linear", {"budget": 5}, "linear_d5", (4, 1)),
    ("eagle", {"num_steps": 4, "topk": 2, "budget": 5}, "eagle_s4_k2_d5", (4, 2)),
    ("best_first", {"budget": 8}, "best_first_d8_w1_p3", (3, 1)),
    ("best_first", {"budget": 2, "width": 2}, "best_first_d2_w2_p1", (1, 1)),
    ("cost_aware", {"max_budget": 16, "draft_depth": 6}, "cost_aware_max16_p6", (6, 1)),
    ("batch_alloc", {"max_budget_per_seq": 3}, "batch_alloc_max3_p2", (2, 1)),
])
def test_each_mode_names_its_shape(mode, params, name, draft_shape):
    # draft_depth left out defaults to min(3, budget - 1): what the cost model is asked for
    spec = PolicySpec.from_dict(mode, params)
    assert (spec.mode, spec.name, spec.draft_shape()) == (mode, name, draft_shape)
    assert PolicySpec.from_dict(mode, spec.to_dict()) == spec


def test_the_abstract_spec_is_refused():
    with pytest.raises(SimtreeError, match="abstract"):
        PolicySpec()
