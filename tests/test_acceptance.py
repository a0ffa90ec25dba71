"""Acceptance models: calibration, trace fitting, trace validation, positional EAGLE trees from a model's numbers."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from simtree.acceptance.model import (PUBLISHED_V4_FLASH_MTP, AcceptanceModel, calibrate_linear, fit_marginals,
                                fit_positional, from_marginals, get_workload, read_traces)
from simtree.trees.builders import eagle_tree_positional
from simtree.errors import SimtreeError
from simtree.acceptance.phi import expected_accepted_positional, sibling_rank
from simtree.trees.tree import DraftTree


@pytest.mark.parametrize("name", sorted(PUBLISHED_V4_FLASH_MTP))
def test_presets_reproduce_the_published_flat_linear_number(name):
    acc = get_workload(name).acceptance
    for budget in (5, 6, 7, 8):   # the published chain is flat over D = 5-8
        assert 1.0 + acc.linear_accepted(budget) == pytest.approx(PUBLISHED_V4_FLASH_MTP[name], abs=0.05)
        # the same number through a real chain tree and the shared Phi
        chain = eagle_tree_positional(acc.draft_table(0, budget - 1), budget - 1, 1, budget)
        phi = sum(w * expected_accepted_positional(chain, acc.table(i)) for i, w in enumerate(acc.weights))
        assert phi == pytest.approx(acc.linear_accepted(budget), abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(mean=st.floats(1.05, 3.5), budget=st.integers(4, 8), spread=st.floats(0.0, 0.5))
def test_calibration_hits_any_reachable_target(mean, budget, spread):
    acc = calibrate_linear(mean, budget, spread=spread)
    assert 1.0 + acc.linear_accepted(budget) == pytest.approx(mean, abs=1e-7)
    assert np.all(np.diff(acc.tables, axis=2) <= 1e-12)  # rank-decay: siblings never beat rank 0


def test_calibration_rejects_impossible_numbers():
    with pytest.raises(SimtreeError, match="must lie in"):
        calibrate_linear(4.5, 4)
    with pytest.raises(SimtreeError, match="must lie in"):
        calibrate_linear(float("nan"), 4)


def test_positional_eagle_with_topk_1_gives_the_chain():
    acc = get_workload("mbpp").acceptance
    tree = eagle_tree_positional(acc.draft_table(1, 5), 5, 1, 6)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]


def _sample_record(rng, table, workload="w", batch=4):
    """Random EAGLE-like tree + the accepted node walked under the positional model ``table``."""
    n = int(rng.integers(2, 12))
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    logp = [0.0] + (-rng.exponential(1.0, n - 1)).tolist()
    tree = DraftTree(parents, None, logp)
    rank = sibling_rank(tree)
    node = 0
    while True:
        kids = np.flatnonzero(tree.parents == node)
        d = int(tree.depth[node])
        probs = [table[d, rank[k]] if d < table.shape[0] and rank[k] < table.shape[1] else 0.0 for k in kids]
        u, acc = rng.random(), 0.0
        nxt = None
        for k, p in zip(kids, probs):
            acc += p
            if u < acc:
                nxt = int(k)
                break
        if nxt is None:
            break
        node = nxt
    return {"workload": workload, "batch_size": batch, "parents": parents, "log_probs": logp,
            "accepted_node": node, "num_accepted": int(tree.depth[node])}


def test_positional_fit_recovers_the_generating_table(tmp_path):
    rng = np.random.default_rng(0)
    truth = np.array([[0.7, 0.15, 0.05, 0.02]] * 3 + [[0.55, 0.2, 0.05, 0.02]] * 13)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(_sample_record(rng, truth)) for _ in range(1500)))
    fitted = fit_positional(read_traces(path))
    # compare cells with many trials (shallow depths, first two ranks)
    assert np.allclose(fitted.tables[0, :3, :2], truth[:3, :2], atol=0.05)
    assert fitted.meta["records"] == 1500


@pytest.mark.parametrize("line, fragment", [
    ("{not json", "not valid JSON"),
    ('{"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": [0, -1]}', "lacks the field 'accepted_node'"),
    ('{"workload": "w", "batch_size": 1, "parents": [-1, 1], "log_probs": [0, -1], "accepted_node": 0}', "invalid parent"),
    ('{"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": [0, -1], "accepted_node": 5}',
     "accepted_node (a node of the 2-node tree) must be an integer in [0, 1], got 5"),
    *[('{"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": [0, -1], '
       f'"accepted_node": {node}}}', f"accepted_node (a node of the 2-node tree) must be an integer in [0, 1], "
                                      f"got {got}")
      for node, got in (("-1", "-1"), ("true", "True"), ("2.5", "2.5"), ("NaN", "nan"), ('"1"', "'1'"))],
    ('{"workload": "w", "batch_size": 0, "parents": [-1, 0], "log_probs": [0, -1], "accepted_node": 1}', "batch_size"),
    ('{"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": [0, -1], "accepted_node": 1, '
     '"num_accepted": 3}', "num_accepted 3"),
    ('{"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": [0, NaN], "accepted_node": 1}', "log-prob"),
    ('{"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": null, "accepted_node": 1}',
     "log_probs must be a list"),
    ('{"workload": 7, "batch_size": 1, "parents": [-1, 0], "log_probs": [0, -1], "accepted_node": 1}',
     "workload 7 must be a non-empty string"),
    *[('{"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": [0, -1], "accepted_node": 1, '
       f'"context_len": {ctx}}}', "context_len") for ctx in ("-50", "0", '"abc"', "[1]", "1e400", "true", "2.5",
                                                            "4194304")],
])
def test_malformed_trace_is_one_line_error_with_line_number(tmp_path, line, fragment):
    path = tmp_path / "bad.jsonl"
    good = '{"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": [0, -1], "accepted_node": 1}'
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(SimtreeError) as err:
        read_traces(path)
    msg = str(err.value)
    assert fragment in msg and f"{path}:2" in msg and "\n" not in msg


def test_marginal_levels_from_traces(tmp_path):
    rng = np.random.default_rng(1)
    recs = []
    for i in range(10):
        m = rng.dirichlet(np.ones(5), size=3)[:, :4]
        recs.append({"workload": "w", "batch_size": 2, "parents": [-1, 0], "log_probs": [0, -0.5],
                     "accepted_node": int(i % 2), "marginal_probs": m.tolist()})
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    acc = fit_marginals(read_traces(path))
    assert acc.num_levels == 10 and acc.weights.sum() == pytest.approx(1.0)
    assert np.all(np.diff(acc.tables, axis=2) <= 0)  # sorted per position
    one = from_marginals(np.array(recs[0]["marginal_probs"]))
    assert one.num_levels == 1


def test_bad_model_and_unknown_workload_are_errors():
    with pytest.raises(SimtreeError, match="must sum to <= 1"):
        AcceptanceModel("x", np.array([[0.8, 0.5]]), np.ones(1))
    with pytest.raises(SimtreeError, match="unknown workload"):
        get_workload("nope")


def test_trace_file_as_workload(tmp_path):
    rng = np.random.default_rng(2)
    truth = np.array([[0.6, 0.2, 0.05, 0.0]] * 16)
    recs = [_sample_record(rng, truth, workload=("a" if i % 2 else "b")) | {"context_len": 900} for i in range(200)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    with pytest.raises(SimtreeError, match="pick one"):
        get_workload(str(path))
    wl = get_workload(f"{path}#a", output_len=64)
    assert wl.name == "a" and wl.output_len == 64 and abs(wl.mean_prompt_len - 900) < 60
    assert 0.4 < wl.acceptance.tables[0, 0, 0] < 0.8


def test_non_utf8_trace_file_is_one_line_error(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"workload": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(SimtreeError, match="not a UTF-8 text file") as err:
        read_traces(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("depth", [4, 15])
def test_traces_that_accept_every_draft_never_fit_certain_acceptance(tmp_path, depth):
    # every chain fully accepted: the fit caps each depth at 0.98 (as calibrate_linear caps
    # alpha) and says so; 20 records also draw the too-few-records warning
    rec = {"workload": "all", "batch_size": 1, "parents": list(range(-1, depth)),
           "log_probs": [0.0] + [-0.1] * depth, "accepted_node": depth}
    path = tmp_path / "all.jsonl"
    path.write_text("\n".join(json.dumps(rec | {"round": i, "context_len": 300}) for i in range(20)))
    with pytest.warns(RuntimeWarning) as caught:
        wl = get_workload(str(path))
    messages = " ".join(str(w.message) for w in caught)
    assert "only 20 trace records" in messages and "capped at 0.98" in messages
    tables = wl.acceptance.tables
    # the drafted rank is capped at 0.98; never-drafted ranks share what it leaves (rank decay)
    assert tables[0, :, 0].max() == pytest.approx(0.98) and tables.sum(2).max() < 1 - 1e-3
    assert wl.acceptance.meta["capped_depths"][:depth] == list(range(1, depth + 1))
    assert 1.0 + wl.acceptance.linear_accepted(16) < 16 * 0.95   # no 16 tokens per round


def test_enough_ordinary_traces_fit_without_warnings(tmp_path):
    import warnings
    rng = np.random.default_rng(4)
    truth = np.array([[0.6, 0.2, 0.05, 0.0]] * 16)
    path = tmp_path / "ok.jsonl"
    path.write_text("\n".join(json.dumps(_sample_record(rng, truth)) for _ in range(150)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wl = get_workload(str(path))
    assert wl.acceptance.meta["capped_depths"] == []


@pytest.mark.parametrize("kw, fragment", [({"prompt_len": 1e12}, "prompt length must be in [1, 1048576]"),
                                          ({"prompt_len": float("nan")}, "prompt length"),
                                          ({"output_len": 10 ** 8}, "output length must be an integer in [1, 1048576]"),
                                          ({"output_len": 0}, "output length")])
def test_workload_lengths_are_bounded(kw, fragment):
    with pytest.raises(SimtreeError) as err:
        get_workload("gsm8k", **kw)
    assert fragment in str(err.value)


def _trace_field_outcome(path, field, value):
    """(accepted int, None) or (None, error message) for a one-record trace with ``field`` = value."""
    rec = {"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": [0, -1], "accepted_node": 1}
    path.write_text(json.dumps(rec | {field: value}) + "\n")
    try:
        got = read_traces(path)[0]
    except SimtreeError as err:
        return None, str(err)
    return getattr(got, field), None


# integer-like values both fields hold in range (batch_size >= 1, context_len in [1, 2^20])
_INTEGER_LIKE = st.one_of(
    st.integers(-3, 1 << 20), st.integers(-3, 1 << 20).map(float),
    st.floats(-3, 1 << 20, allow_nan=False), st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    st.booleans(), st.text(max_size=3), st.integers(1, 9).map(str), st.lists(st.integers(1, 9), max_size=2),
)


@pytest.mark.parametrize("value, ok", [(4, True), (4.0, True), (1.0, True), (2.5, False), (0, False), (0.0, False),
                                       (-4.0, False), (True, False), ("4", False), (float("nan"), False)])
def test_trace_batch_size_and_context_len_take_the_same_integers(tmp_path, value, ok):
    # a JSON trace written by another tool may hold 4.0 for 4: both fields take it, neither takes 2.5
    for field in ("batch_size", "context_len"):
        got, err = _trace_field_outcome(tmp_path / "t.jsonl", field, value)
        if ok:
            assert got == int(value) and type(got) is int and err is None
        else:
            assert got is None and field in err and "must be an integer" in err and "\n" not in err


@settings(max_examples=200, deadline=None)
@given(value=_INTEGER_LIKE)
def test_trace_batch_size_and_context_len_accept_and_reject_alike(tmp_path_factory, value):
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    (batch, batch_err), (ctx, ctx_err) = (_trace_field_outcome(path, f, value) for f in ("batch_size", "context_len"))
    assert (batch_err is None) == (ctx_err is None), (value, batch_err, ctx_err)
    assert batch == ctx and (batch is None or type(batch) is int)
    for field, err in (("batch_size", batch_err), ("context_len", ctx_err)):
        if err is not None:
            assert f"{path}:1: {field}" in err and "\n" not in err


def test_every_integer_field_of_a_trace_takes_a_whole_float(tmp_path):
    # one rule for the record's integers: 1.0 and 3.0 as another tool's JSON may write them
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"workload": "w", "batch_size": 2.0, "parents": [-1, 0], "log_probs": [0, -1],
                                "accepted_node": 1.0, "round": 3.0, "context_len": 64.0}) + "\n")
    rec = read_traces(path)[0]
    assert (rec.accepted_node, rec.batch_size, rec.round_index, rec.context_len) == (1, 2, 3, 64)
    assert all(type(x) is int for x in (rec.accepted_node, rec.batch_size, rec.round_index, rec.context_len))
    path.write_text(json.dumps({"workload": "w", "batch_size": 1, "parents": [-1, 0], "log_probs": [0, -1],
                                "accepted_node": 1, "round": 0.5}) + "\n")
    with pytest.raises(SimtreeError, match="round must be an integer"):
        read_traces(path)
