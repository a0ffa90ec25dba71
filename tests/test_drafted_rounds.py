"""The block drafters' out-of-sample rows: a round's expected accepted drafts from its tree and
marginals, the families keyed by drafter, the command's refusal of a drafter it cannot score."""
import numpy as np
import pandas as pd
import pytest

from simtree.acceptance.drafted_rounds import drafted_accepted_per_round, round_expected_accepted
from simtree.acceptance.fit import fit_calibration
from simtree.acceptance.out_of_sample import oos_summary
from simtree.acceptance.traces import parse_record
from simtree.errors import SimtreeError


def _record(parents, tokens, topk_tokens, topk_probs, target, accepted_path, **extra):
    return parse_record({"schema": "simtree.trace/2", "workload": "w", "batch_size": 1, "parents": parents,
                         "tokens": tokens, "log_probs": [0.0] * len(tokens), "accepted_path": accepted_path,
                         "accepted_node": accepted_path[-1], "num_accepted": len(accepted_path) - 1,
                         "target_tokens": target, "topk_tokens": topk_tokens, "topk_probs": topk_probs,
                         "drafter": "block", **extra}, "test")


class _Rows:
    """A calibration stub: a(d, r) from a fixed table, whatever q."""
    def __init__(self, table):
        self.table = np.asarray(table, np.float64)

    def __call__(self, depth, q, match=None):
        return self.table[np.asarray(depth) - 1][:, :q.shape[1]]


def test_a_rounds_tree_is_scored_along_its_paths_siblings_disjoint():
    # root 9; depth 1: tokens 5 (rank 0) and 6 (rank 1); depth 2 under 5: token 7 (rank 0); 8: not in the top-2
    rec = _record([-1, 0, 0, 1, 1], [9, 5, 6, 7, 8], [[5, 6], [7, 3]], [[0.5, 0.3], [0.6, 0.2]], [6, 1], [0, 2])
    cal = _Rows([[0.7, 0.5], [0.4, 0.2]])
    # rank 1 at depth 1 takes only what rank 0 leaves (0.3); token 8 is outside the marginal: never accepted
    assert round_expected_accepted(cal, rec) == pytest.approx(0.7 + 0.3 + 0.7 * 0.4)
    assert drafted_accepted_per_round(cal, [rec, rec]) == pytest.approx(1.0 + 0.7 + 0.3 + 0.28)


def test_an_independent_calibrated_drafter_is_predicted_from_a_fit_on_its_own_rounds():
    """Positions accepted independently with the drafter's own top-1 probability: the fit on the
    rounds' marginal ranks predicts chains of 2 and 4 within sampling error."""
    rng = np.random.default_rng(0)

    def rounds(length, n):
        out = []
        for _ in range(n):
            p = rng.uniform(0.5, 0.95, 4)
            probs = [[pi, (1 - pi) * 0.6] for pi in p]
            hit = rng.random(4) < p
            m = int(np.argmin(hit)) if not hit.all() else 4
            m = min(m, length)
            target = [10] * m + ([11] if m < 4 else [10])
            ranks = [0] * m + ([1] if m < 4 else [])
            out.append(_record(list(range(-1, length)), [0] + [10] * length, [[10, 11]] * 4, probs,
                               target[:m + 1], list(range(m + 1)), marginal_ranks=ranks[:m + 1]))
        return out
    cal = fit_calibration(rounds(4, 1500), context=False, topk=2)
    for length in (2, 4):
        test = rounds(length, 1500)
        measured = np.mean([r.num_accepted + 1 for r in test])
        assert drafted_accepted_per_round(cal, test) == pytest.approx(measured, rel=0.03)


def test_block_drafters_rows_are_families_of_their_own():
    rows = [("mtp", "policies", -0.02), ("mtp", "policies", 0.04), ("block", "policies", 0.2),
            ("block", "in_sample", 0.1), ("mtp", "in_sample", 0.01)]
    df = pd.DataFrame([{"drafter": d, "policy": f"{d}_{i}", "workload": "sharegpt", "split": s,
                        "measured_accepted": 2.0, "predicted_accepted": 2.0 * (1 + e), "rel_err": e,
                        "prompts": "fresh"} for i, (d, s, e) in enumerate(rows)])
    s = oos_summary(df)
    assert s["families"]["policies sharegpt"]["max_abs_rel_err"] == pytest.approx(0.04)
    assert s["families"]["policies sharegpt block"]["max_abs_rel_err"] == pytest.approx(0.2)
    assert s["in_sample"]["rows"] == 1 and s["in_sample_block_drafters"]["block"]["rows"] == 1


def test_the_command_refuses_a_drafter_without_marginal_ranks(capsys):
    from simtree.runtime.acceptance_oos_cli import main
    assert main(["--drafters", "mtp,tfm", "--reuse-traces", "/nonexistent"]) == 2
    assert "TfM traces carry no marginal ranks" in capsys.readouterr().err


def test_the_depth_shift_makes_the_calibrating_run_gain_what_it_measured():
    from simtree.acceptance.drafted_rounds import fit_depth_shift
    # chains of 2: depth 2 accepted only with depth 1, at a rate the per-position calibration
    # does not reproduce
    recs = []
    for i in range(200):
        m = (2, 0, 2, 1)[i % 4]
        target = [10] * m + ([11] if m < 2 else [10])
        recs.append(_record([-1, 0, 1], [0, 10, 10], [[10, 11]] * 3, [[0.6, 0.3]] * 3, target[:m + 1],
                            list(range(m + 1)), marginal_ranks=[0 if t == 10 else 1 for t in target[:m + 1]]))
    cal = fit_calibration(recs, context=False, topk=2)
    shift = fit_depth_shift(cal, recs)
    assert shift[0] == 0.0 and shift.shape == (2,)      # one entry per drafted depth
    measured = np.mean([r.num_accepted + 1 for r in recs])
    assert drafted_accepted_per_round(cal, recs, shift) == pytest.approx(measured, rel=1e-6)
    # without the shift the per-position product misses the run's gain, and the shift moves depth 2
    # the way that closes the gap
    unshifted = drafted_accepted_per_round(cal, recs, np.zeros(2))
    assert abs(unshifted - measured) > 0.005 and np.sign(shift[1]) == np.sign(measured - unshifted)


def test_the_block_drafters_test_prompts_are_labelled_by_range_and_never_overlap_calibration():
    from simtree.errors import SimtreeError
    from simtree.runtime.acceptance_oos_prompts import SEEN_DRAFTER, drafter_status
    assert drafter_status(SEEN_DRAFTER, 0, 96, 192) == "fresh"
    assert drafter_status(1251, 0, 48) == "seen"                 # the third test's range, read since
    assert drafter_status(1000, 0, 48) == "seen"                 # the first test's range, read since
    assert drafter_status(1200, 0, 48) == "seen"                 # the second test's (1200..1250), read since
    assert drafter_status(1260, 0, 48) == "seen"                 # inside the third test's, not the same run
    assert drafter_status(1400, 0, 48) == "seen"                 # the fifth MTP table's chat prompts
    assert drafter_status(1302, 0, 48) == "fresh"                # never decoded (1302..1399)
    with pytest.raises(SimtreeError, match="overlap their calibration prompts 0..47"):
        drafter_status(40, 0, 48)


def _chain_round(probs, accept, length, rng, conf=None):
    """A block drafter's round: marginals ``probs`` [P, 2] over tokens 10 (rank 0) and 11, its tree
    the chain of ``length`` top-1 tokens; each position's target token is 10 with chance
    ``accept`` (else 12, outside the marginal) until the first miss."""
    P = len(probs)
    hit = rng.random(P) < accept
    m = min(int(np.argmin(hit)) if not hit.all() else P, length)
    target = ([10] * m + [12])[:m + 1] if m < P else [10] * P + [10]
    extra = {} if conf is None else {"confidence": conf}
    return _record(list(range(-1, length)), [0] + [10] * length, [[10, 11]] * P, probs, target,
                   list(range(m + 1)), marginal_ranks=[0 if t == 10 else 2 for t in target[:min(m + 1, P)]], **extra)


def test_the_margin_carries_a_two_difficulty_mixture_the_product_of_marginals_misses():
    """Rounds of two kinds with the same top-1 probability 0.6: easy ones (runner-up 0.05) take the
    top-1 at every position with chance 0.95, hard ones (runner-up 0.35) with 0.25.  Calibrated on
    chains of 3, a policy that drafts the chain of 3 only in easy rounds (1 in hard ones) gains
    1 + (0.95 + 0.95^2 + 0.95^3 + 0.25) / 2; per-position acceptances by draft probability and
    depth (the rounds' kind unseen, the survivors of a depth the easy kind) miss it far, the model
    with the margin feature recovers it."""
    from simtree.acceptance.drafted_rounds import fit_drafted_model
    rng = np.random.default_rng(1)
    easy, hard = [[0.6, 0.05]] * 3, [[0.6, 0.35]] * 3
    calib = [_chain_round(*(easy, 0.95) if i % 2 else (hard, 0.25), 3, rng) for i in range(3000)]
    test = [_chain_round(easy, 0.95, 3, rng) if i % 2 else _chain_round(hard, 0.25, 1, rng) for i in range(400)]
    truth = 1 + (0.95 + 0.95 ** 2 + 0.95 ** 3 + 0.25) / 2
    model = fit_drafted_model(calib)
    assert model.features == ("margin",)                          # no confidence head in these records
    assert drafted_accepted_per_round(model, test) == pytest.approx(truth, rel=0.03)
    assert drafted_accepted_per_round(model, calib) == pytest.approx(np.mean([r.num_accepted + 1 for r in calib]),
                                                                     rel=1e-4)    # the shift's in-sample equation
    product = fit_drafted_model(calib, parent_states=False, features=())
    assert drafted_accepted_per_round(product, test) < truth * 0.85


def test_a_node_under_a_runner_up_parent_has_a_calibration_of_its_own():
    """The target takes the next position's top-1 with chance 0.8 after the drafter's top-1 and
    never after its runner-up (the marginal's top-1 continues the likelier text).  Calibrated on a
    tree holding both branches, the chain of top-1 tokens gains 1 + 0.55 + 0.55 * 0.8 with the
    parent state's curve; pooled over parents, depth 2 takes the mixed rate."""
    from simtree.acceptance.drafted_rounds import fit_drafted_model
    rng = np.random.default_rng(2)

    def round_(parents, tokens):
        first = 10 if rng.random() < 0.55 else 11 if rng.random() < 0.8 else 12
        second = 10 if first == 10 and rng.random() < 0.8 else 13
        path = [0] + [i for i in range(1, len(tokens)) if parents[i] == 0 and tokens[i] == first][:1]
        if len(path) == 2 and second == 10:
            path += [i for i in range(1, len(tokens)) if parents[i] == path[1] and tokens[i] == 10][:1]
        target = [first, second, 99][:len(path)]
        return _record(parents, tokens, [[10, 11]] * 2, [[0.5, 0.4], [0.7, 0.2]], target, path,
                       marginal_ranks=[{10: 0, 11: 1}.get(t, 2) for t in target[:2]])
    calib = [round_([-1, 0, 0, 1, 2], [0, 10, 11, 10, 10]) for _ in range(3000)]   # a top-1 child under each
    chain = [round_([-1, 0, 1], [0, 10, 10]) for _ in range(50)]
    truth = 1 + 0.55 + 0.55 * 0.8
    model = fit_drafted_model(calib, features=(), shift=False)
    pooled = fit_drafted_model(calib, parent_states=False, features=(), shift=False)
    assert drafted_accepted_per_round(model, chain) == pytest.approx(truth, rel=0.02)
    assert drafted_accepted_per_round(pooled, chain) < truth * 0.95
