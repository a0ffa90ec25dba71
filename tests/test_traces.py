"""Trace format v2: what the runtime writes, what the reader checks, and the acceptance trials
a linear run with the drafter's top-K yields (what a tree would have accepted)."""
import json

import numpy as np
import pytest

import torch

from simtree.acceptance.traces import chain_trials, read_traces, tree_trials
from simtree.errors import SimtreeError
from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.build import build_model
from simtree.runtime.full.generate import TRACE_TOPK, generate
from simtree.runtime.trace import TRACE_SCHEMA, TraceWriter

NEW = 24


@pytest.fixture(scope="module")
def models():
    """The shipped tiny default (float64): its MTP layer drafts."""
    torch.set_num_threads(1)
    return build_model("runtime-tiny", device="cpu", dtype=torch.float64)


def random_prompts(rng, lengths):
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def _run(models, tmp_path, spec, prompts):
    path = tmp_path / f"{spec.mode}.jsonl"
    with TraceWriter(path) as trace:
        res = generate(models, prompts, NEW, spec, workload="unit", trace=trace)
    return res, read_traces(path), [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("spec", [PolicySpec.from_dict("linear", {"budget": 6}),
                                  PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
                                  PolicySpec.from_dict("best_first", {"budget": 7, "width": 1, "draft_depth": 3})])
def test_target_tokens_spell_the_greedy_output(models, tmp_path, spec):
    prompts = random_prompts(np.random.default_rng(7), [5, 9, 3])
    res, records, raw = _run(models, tmp_path, spec, prompts)
    assert {r["schema"] for r in raw} == {TRACE_SCHEMA} and all(r.version == 2 for r in records)
    for b, out in enumerate(res.outputs):
        mine = sorted((r for r in records if r.seq == b), key=lambda r: r.round_index)
        # the prefill makes the first token; every round then adds its target tokens
        spelled = [out[0]] + [int(t) for r in mine for t in r.target_tokens]
        assert spelled[:NEW] == out
        for r in mine:   # the accepted draft tokens are the target's tokens along the path
            assert r.tree.tokens[r.tree.path_to(r.accepted_node)[1:]].tolist() == r.target_tokens[:-1].tolist()


def test_linear_records_carry_the_drafters_top_k(models, tmp_path):
    prompts = random_prompts(np.random.default_rng(8), [6, 4])
    _, records, _ = _run(models, tmp_path, PolicySpec.from_dict("linear", {"budget": 5}), prompts)
    for r in records:
        assert r.topk_tokens.shape == (4, TRACE_TOPK) and r.topk_probs.shape == (4, TRACE_TOPK)
        assert np.array_equal(r.topk_tokens[:, 0], r.tree.tokens[1:])   # the chain is the top-1
        assert np.allclose(np.log(r.topk_probs[:, 0]), r.tree.log_probs[1:], atol=1e-4)
    trials = chain_trials(records, 4)
    # rank 0 at depth d is a hit exactly when the chain's d-th token was accepted
    hits0 = trials.hit[trials.rank == 0]
    depth0, rid0 = trials.depth[trials.rank == 0], trials.round_id[trials.rank == 0]
    assert np.array_equal(hits0, [records[i].num_accepted >= d for i, d in zip(rid0, depth0)])
    # every depth up to the first mismatch is observed, no deeper one
    for i, r in enumerate(records):
        assert sorted(set(depth0[rid0 == i])) == list(range(1, min(r.num_accepted + 1, 4) + 1))


def _v2(**over):
    rec = {"schema": "simtree.trace/2", "workload": "w", "batch_size": 1, "round": 0, "seq": 0, "mode": "linear",
           "parents": [-1, 0, 1, 2], "tokens": [9, 5, 6, 7], "log_probs": [0, -0.2, -0.3, -0.1],
           "ranks": [0, 0, 0, 0], "accepted_path": [0, 1], "accepted_node": 1, "num_accepted": 1,
           "target_tokens": [5, 3],
           "topk_tokens": [[5, 1, 2], [6, 3, 4], [7, 8, 1]],
           "topk_probs": [[0.8, 0.1, 0.05], [0.7, 0.2, 0.05], [0.9, 0.05, 0.01]]}
    rec.update(over)
    return rec


def test_chain_trials_stop_at_the_first_mismatch(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_v2()) + "\n")
    t = chain_trials(read_traces(path), 3)
    # depth 1: the target took rank 0; depth 2: rank 1 (token 3) - a top-2 tree accepts it; no depth 3
    assert t.depth.tolist() == [1, 1, 1, 2, 2, 2]
    assert t.rank.tolist() == [0, 1, 2, 0, 1, 2]
    assert t.hit.tolist() == [True, False, False, False, True, False]
    assert np.allclose(t.draft_prob, [0.8, 0.1, 0.05, 0.7, 0.2, 0.05])


def test_marginal_tree_off_the_chain_ends_the_observed_depths(tmp_path):
    # a best-first tree accepted the rank-1 candidate at depth 1: later top-K rows were drafted
    # after the chain's token, not the accepted one, so they say nothing
    rec = _v2(mode="best_first", parents=[-1, 0, 0, 1], tokens=[9, 5, 1, 6], log_probs=[0, -0.2, -2.3, -0.3],
              ranks=[0, 0, 1, 0], accepted_path=[0, 2], accepted_node=2, target_tokens=[1, 4])
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    records = read_traces(path)
    t = chain_trials(records, 3)
    assert t.depth.tolist() == [1, 1, 1] and t.hit.tolist() == [False, True, False]
    assert records[0].marginal_probs is not None   # the marginal modes' trees came from these
    tt = tree_trials(records, 3)   # the tree's own trials: both children of the root
    assert tt.depth.tolist() == [1, 1] and tt.hit.tolist() == [False, True]


def test_version_1_records_still_read(tmp_path):
    v1 = {"schema": "simtree.trace/1", "workload": "w", "batch_size": 2, "round": 3, "seq": 1,
          "parents": [-1, 0, 0], "log_probs": [0, -0.1, -2.0], "accepted_node": 1, "num_accepted": 1,
          "accepted_path": [0, 1], "marginal_probs": [[0.9, 0.05]]}
    path = tmp_path / "v1.jsonl"
    path.write_text(json.dumps(v1) + "\n" + json.dumps({k: v for k, v in v1.items() if k != "schema"}) + "\n")
    records = read_traces(path)
    assert [r.version for r in records] == [1, 1]
    assert records[0].target_tokens is None and records[0].topk_tokens is None
    assert records[0].marginal_probs.shape == (1, 2)
    assert chain_trials(records, 4).size == 0 and tree_trials(records, 4).size == 4   # 2 children x 2 records


@pytest.mark.parametrize("over, fragment", [
    ({"target_tokens": [5]}, "target_tokens has 1 entries, expected num_accepted + 1 = 2"),
    ({"target_tokens": [4, 3]}, "target_tokens disagree with the accepted draft tokens"),
    ({"tokens": [9, 5, 6]}, "3 tokens for a 4-node tree"),
    ({"tokens": [9, -5, 6, 7]}, "tokens holds -5"),
    ({"accepted_path": [0, 2]}, "accepted_path [0, 2] is not the tree path"),
    ({"topk_probs": [[0.1, 0.8, 0.05], [0.7, 0.2, 0.05], [0.9, 0.05, 0.01]]}, "sorted in descending order"),
    ({"topk_probs": [[0.8, 0.3, 0.05], [0.7, 0.2, 0.05], [0.9, 0.05, 0.01]]}, "sums to"),
    ({"topk_tokens": [[5, 1], [6, 3], [7, 8]]}, "differ in shape"),
    ({"topk_probs": None}, "topk_probs must be a non-empty [P][K] table"),
    ({"topk_probs": [["a"]]}, "topk_probs is not a [P][K] table"),
    ({"schema": "simtree.trace/3"}, "schema 'simtree.trace/3' is not one of"),
])
def test_malformed_v2_record_is_one_line_error(tmp_path, over, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_v2()) + "\n" + json.dumps(_v2(**over)) + "\n")
    with pytest.raises(SimtreeError) as err:
        read_traces(path)
    assert fragment in str(err.value) and f"{path}:2" in str(err.value) and "\n" not in str(err.value)


def test_top_k_without_probs_is_refused(tmp_path):
    rec = _v2()
    del rec["topk_probs"]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(SimtreeError, match="come together"):
        read_traces(path)
