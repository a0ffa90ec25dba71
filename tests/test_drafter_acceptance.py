"""Acceptance inputs of the block drafters: the trace carries the marginals' ranks and DSpark's
confidence (written by runtime/trace.py, read and checked by simtree.acceptance.traces); the
positional trials read the ranks; the confidence is calibrated and schedules the verify; the
published-seeded presets reproduce their published numbers."""
import json

import numpy as np
import pytest

from simtree.acceptance.confidence_head import calibrate_confidence, check_threshold
from simtree.acceptance.drafter_presets import PUBLISHED_BLOCK_TAU, chain_accept_rate, drafter_preset
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.traces import chain_trials, read_traces
from simtree.errors import SimtreeError
from simtree.planning.allocation import batch_allocation
from simtree.runtime.trace import TraceWriter, round_records
from simtree.trees.greedy import greedy_accept_batch
from simtree.trees.tree import DraftTree, TreeBatch

from test_traces import _v2


def test_writer_records_marginal_ranks_and_confidence(tmp_path):
    # a best-first tree from marginals: root 9; depth 1: 5 (rank 0), 1 (rank 1); depth 2 under 1: 6
    tree = DraftTree([-1, 0, 0, 2], [9, 5, 1, 6], [0.0, -0.2, -2.3, -0.3])
    batch = TreeBatch([tree])
    target_next = [[1, 4, 6, 3]]      # the target takes the rank-1 token 1, then wants 6: accepted 2
    acc = greedy_accept_batch(batch, np.asarray(target_next[0]))
    topk = (np.array([[[5, 1, 2], [6, 3, 4], [7, 8, 1]]]), np.array([[[0.8, 0.1, 0.05], [0.7, 0.2, 0.05],
                                                                    [0.9, 0.05, 0.01]]]))
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.write_records(round_records(batch, acc, workload="w", batch_size=1, round_index=0, mode="best_first",
                                      context_lens=[5], topk=topk, drafter="dspark",
                                      confidence=np.array([[0.9, 0.7, 0.4]]), verified_len=[3]))
    rec = json.loads(path.read_text())
    assert rec["target_tokens"] == [1, 6, 3] and rec["marginal_ranks"] == [1, 0, 3]   # 3 = not in the top-3
    r = read_traces(path)[0]
    assert r.drafter == "dspark" and r.marginal_ranks.tolist() == [1, 0, 3]
    assert r.confidence.tolist() == [0.9, 0.7, 0.4] and r.verified_len == 3
    # the ranks observe every position, though the path left the chain at depth 1
    t = chain_trials([r], 3)
    assert t.depth.tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert t.hit.tolist() == [False, True, False, True, False, False, False, False, False]


@pytest.mark.parametrize("over, fragment", [
    ({"drafter": "medusa"}, "drafter 'medusa' is not one of"),
    ({"drafter": "block", "marginal_ranks": [1, 1]}, "marginal_ranks disagree"),
    ({"drafter": "block", "marginal_ranks": [0, 1, 0]}, "3 marginal_ranks but the target's token is known at 2"),
    ({"confidence": [0.5, 1.2]}, "confidence must be a non-empty list of numbers in [0, 1]"),
    ({"confidence": [0.5, 0.2], "verified_len": 3}, "verified_len"),
])
def test_malformed_drafter_fields_are_one_line_errors(tmp_path, over, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_v2(**over)) + "\n")
    with pytest.raises(SimtreeError) as err:
        read_traces(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def _confidence_records(tmp_path, rng, n=400, P=6, truth=lambda c: c ** 2):
    lines = []
    for i in range(n):
        conf = rng.uniform(0.05, 0.99, P)
        acc = 0
        while acc < P and rng.random() < truth(conf[acc]):
            acc += 1
        parents = list(range(-1, P))
        lines.append(json.dumps({"schema": "simtree.trace/2", "workload": "w", "batch_size": 1, "parents": parents,
                                 "log_probs": [0.0] * (P + 1), "accepted_node": acc, "drafter": "dspark",
                                 "confidence": [round(float(c), 6) for c in conf], "verified_len": P}))
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return read_traces(path)


def test_confidence_calibration_recovers_a_known_map(tmp_path):
    cal = calibrate_confidence(_confidence_records(tmp_path, np.random.default_rng(0)), bins=8)
    assert np.all(np.diff(cal.rate) >= 0)
    for c in (0.3, 0.6, 0.9):
        assert float(cal.accept(c)) == pytest.approx(c ** 2, abs=0.08)
    with pytest.raises(SimtreeError, match="no trace record carries confidence"):
        calibrate_confidence(read_traces(_write(tmp_path, _v2())))


def _write(tmp_path, rec):
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    return path


def test_the_load_moving_threshold():
    """The confidence schedule is batch_allocation's rule (the planner's and the runtime's): where
    every verified token costs more, fewer positions are verified and the threshold (the least
    survival kept) rises; the surer sequences keep the longer prefixes."""
    surv = np.cumprod(np.tile([0.95, 0.8, 0.6, 0.4, 0.2], (4, 1)) ** np.arange(1, 5)[:, None], 1)
    B = surv.shape[0]

    def schedule(per_token_us):   # the round: a fixed cost plus the verified tokens' own (B n of them)
        lens = batch_allocation(list(surv), np.ones(B), lambda n: 1000.0 + per_token_us * B * n, 0.0, B)
        return lens, surv[np.arange(surv.shape[1])[None, :] < lens[:, None]].min()
    light, t_light = schedule(1.0)
    heavy, t_heavy = schedule(400.0)
    assert light.sum() >= 15 and 0 < heavy.sum() < light.sum() and t_heavy > t_light
    assert np.all(np.diff(heavy) <= 0)    # the surer sequences keep longer prefixes
    for bad in (-0.01, 1.01):
        with pytest.raises(SimtreeError, match="outside"):
            check_threshold(bad)


@pytest.mark.parametrize("key", sorted(PUBLISHED_BLOCK_TAU))
def test_published_presets_reproduce_their_number_and_say_so(key):
    fam, wl = key
    model = drafter_preset(fam, wl)
    assert model.meta["published"] and "Table 1" in model.meta["source"]
    assert accepted_per_round(model, "linear", {"budget": 8}) == pytest.approx(PUBLISHED_BLOCK_TAU[key], rel=1e-6)
    assert chain_accept_rate(8.0) == pytest.approx(1.0) and chain_accept_rate(1.0) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(SimtreeError, match="no published acceptance for drafter 'tfm'"):
        drafter_preset("tfm", wl)
