"""bootstrap_models: K acceptance models around a preset (within its calibration targets) or a
trace (sequences resampled, refitted)."""
import json

import numpy as np
import pytest

from simtree.acceptance.bootstrap import bootstrap_models, sequence_ids
from simtree.acceptance.calibrate import TARGETS, published_quantities
from simtree.acceptance.fit import fit_confidence
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.presets import preset_model
from simtree.acceptance.traces import read_traces
from simtree.errors import SimtreeError


def test_preset_models_stay_within_the_calibration_targets():
    base = published_quantities(preset_model("sharegpt"), 8)
    models = bootstrap_models("sharegpt", 6, seed=3)
    q = [published_quantities(m, 8) for m in models]
    lin = np.array([x["linear"] for x in q]) - base["linear"]
    gain = np.array([x["gain_pct"] for x in q]) - base["gain_pct"]
    assert np.all(np.abs(lin) <= TARGETS["linear_tokens"] + 0.005)
    assert np.all(np.abs(gain) <= TARGETS["gain_points"] + 0.05)
    assert lin.std() > 0.005 and gain.std() > 0.2          # a band, not six copies
    # the drawn shifts are what the models show
    assert np.allclose(lin, [m.meta["linear_shift_tokens"] for m in models], atol=0.005)
    again = bootstrap_models("sharegpt", 6, seed=3)
    assert all(np.array_equal(a.tables, b.tables) for a, b in zip(models, again))


def _linear_records(rng, sequences, rounds):
    recs = []
    for s in range(sequences):
        ease = rng.uniform(0.3, 0.9)   # sequences differ: the band must see it
        for i in range(rounds):
            q = np.array([[0.7, 0.2, 0.05, 0.02]] * 4)
            acc = 0
            while acc < 4 and rng.random() < ease:
                acc += 1
            topk = [[10 * d + r for r in range(4)] for d in range(4)]
            recs.append({"schema": "simtree.trace/2", "workload": "w", "batch_size": sequences, "round": i,
                         "seq": s, "mode": "linear", "parents": [-1, 0, 1, 2, 3],
                         "tokens": [1] + [t[0] for t in topk], "log_probs": [0.0] + np.log(q[:, 0]).tolist(),
                         "accepted_node": acc, "num_accepted": acc,
                         "target_tokens": [t[0] for t in topk[:acc]] + [99], "topk_tokens": topk,
                         "topk_probs": q.tolist()})
    return recs


def test_trace_models_resample_whole_sequences(tmp_path):
    rng = np.random.default_rng(5)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _linear_records(rng, 12, 30)))
    records = read_traces(path)
    ids = sequence_ids(records)
    assert len(np.unique(ids)) == 12 and all(np.all(np.diff(np.flatnonzero(ids == s)) == 1) for s in range(12))
    models = bootstrap_models(str(path), 8, seed=1)
    full = accepted_per_round(fit_confidence(records), "linear", {"budget": 5})
    boot = np.array([accepted_per_round(m, "linear", {"budget": 5}) for m in models])
    assert boot.std() > 0.02 and abs(boot.mean() - full) < 3 * boot.std()


def test_sequence_ids_split_batches_where_the_round_falls_back():
    class R:
        def __init__(self, r, s):
            self.round_index, self.seq, self.workload = r, s, "w"
    recs = [R(0, 0), R(0, 1), R(1, 0), R(1, 1), R(0, 0), R(0, 1), R(1, 0)]
    assert sequence_ids(recs).tolist() == [0, 1, 0, 1, 2, 3, 2]


def test_bad_sources_are_errors():
    with pytest.raises(SimtreeError, match="preset name, a trace file"):
        bootstrap_models([1, 2], 2)
    with pytest.raises(SimtreeError, match="bootstrap models"):
        bootstrap_models("gsm8k", 0)
