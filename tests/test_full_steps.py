"""The profiler's view of the full runtime: its own stages at a fixed (b, n, l) or (b, s, k, l)."""
import pytest

from simtree.runtime.full.steps import draft_step, tree_round_shape, verify_step

from full_helpers import FAMILIES, tiny_model


@pytest.mark.parametrize("name", FAMILIES)
def test_verify_step_replays_verify_and_commit_at_a_fixed_context(name):
    step = verify_step(tiny_model(name), batch_size=2, nodes=6, context_len=20)
    for _ in range(3):
        step.run()
        # each repetition starts at context 20 and commits the root path to depth 2 (+ bonus)
        assert step.engine.st.lengths.tolist() == [23, 23]
    d = step.describe()
    assert (d["stage"], d["batch_size"], d["nodes_per_seq"], d["context_len"]) == ("model_verify_step", 2, 6, 20)
    assert d["stages"] == ["verify", "commit"] and d["graphs"] is False
    assert int(step.engine.tree.valid.sum()) == 12     # the model's own drafts: 6 real nodes per sequence
    step.close()


def test_plain_verify_step_is_the_decode_step():
    step = verify_step(tiny_model("tiny-gdn"), batch_size=3, nodes=1, context_len=9)
    step.run()
    assert step.engine.st.lengths.tolist() == [10, 10, 10]
    assert step.describe()["stages"] == ["verify"]


@pytest.mark.parametrize("name", FAMILIES)
def test_draft_step_runs_the_drafting_and_the_catch_up(name):
    step = draft_step(tiny_model(name), batch_size=2, num_steps=3, topk=2, context_len=12)
    for _ in range(2):
        step.run()
        assert step.engine.ds.lengths.tolist() == [15, 15]   # the catch-up committed its path (depth 2 + 1)
        assert step.engine.st.lengths.tolist() == [12, 12]   # the target is not touched
        assert int(step.engine.tree.valid.sum()) == 14       # a tree of the budget, 7 nodes, per sequence
    assert step.describe()["budget"] == 7


def test_tree_round_shapes():
    assert tree_round_shape(1).plain
    assert (tree_round_shape(8).topk, tree_round_shape(8).budget) == (2, 8)
    rs = tree_round_shape(16)
    assert rs.candidates >= 15 and rs.num_steps == 5
    assert tree_round_shape(4, "linear").num_steps == 3
