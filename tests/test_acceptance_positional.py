"""fit_positional on chain traces: ranks never drafted must not take mass from observed ones."""
import json

import numpy as np

from simtree.acceptance.model import fit_positional, read_traces


def _chain_records(rng, alphas, budget, n):
    """Chain traces of `budget` nodes; depth d's token is accepted with alphas[d] given its parent."""
    recs = []
    for i in range(n):
        accepted = 0
        while accepted < budget - 1 and rng.random() < alphas[accepted]:
            accepted += 1
        recs.append({"workload": "chain", "batch_size": 4, "round": i // 4, "seq": i % 4,
                     "context_len": 100 + i, "parents": list(range(-1, budget - 1)),
                     "log_probs": [0.0] + [-0.2] * (budget - 1), "accepted_node": accepted,
                     "num_accepted": accepted})
    return recs


def _write(tmp_path, recs):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    return read_traces(path)


def test_chain_fit_recovers_the_chain_acceptance(tmp_path):
    rng = np.random.default_rng(3)
    alphas = np.array([0.85, 0.8, 0.75, 0.7, 0.65])
    records = _write(tmp_path, _chain_records(rng, alphas, 6, 3000))
    fitted = fit_positional(records)                       # default topk=4: ranks 1..3 never drafted
    measured = np.mean([r.accepted_node for r in records])
    assert np.allclose(fitted.tables[0, :5, 0], alphas, atol=0.04)
    assert abs(fitted.linear_accepted(6) - measured) < 0.05 * measured
    assert fitted.meta["imputed_ranks"] == [1, 2, 3]


def test_imputed_ranks_only_fill_the_free_mass(tmp_path):
    rng = np.random.default_rng(4)
    records = _write(tmp_path, _chain_records(rng, np.full(5, 0.9), 6, 500))
    t = fit_positional(records, topk=4).tables[0]
    free = 1.0 - t[:, 0]
    assert np.all(t.sum(1) <= 1 + 1e-12)
    assert np.all(t[:, 1] <= 0.35 * free + 1e-12) and np.all(np.diff(t, axis=1) <= 1e-12)


def test_observed_ranks_do_not_depend_on_the_table_width(tmp_path):
    rng = np.random.default_rng(5)
    recs = []
    for i in range(800):   # root with two children, the first more likely accepted
        u = rng.random()
        node = 1 if u < 0.6 else (2 if u < 0.8 else 0)
        recs.append({"workload": "w", "batch_size": 1, "parents": [-1, 0, 0], "log_probs": [0.0, -0.3, -1.5],
                     "accepted_node": node})
    records = _write(tmp_path, recs)
    narrow, wide = fit_positional(records, topk=2), fit_positional(records, topk=4)
    assert np.allclose(wide.tables[0, 0, :2], narrow.tables[0, 0, :2])
    assert np.allclose(wide.tables[0, 0, :2], [0.6, 0.2], atol=0.05)
