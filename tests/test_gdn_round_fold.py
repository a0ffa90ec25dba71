"""The GDN commit deferred with no commit launch (``GDNPendingRound``): the next verify folds the
round before straight from that round's buffers.  Two rounds on random trees against the
float64 sequential references (Triton through the interpreter, and the torch form)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.gdn import gdn_fold_pending, gdn_tree_verify_folding, new_pending
from simtree.kernels.gdn import _launched_deferred as deferred
from simtree.kernels.gdn.deferred import gdn_fold_round
from simtree.kernels.gdn.pending import new_pending_round
from simtree.kernels.gdn.verify import gdn_tree_verify_folding_round
from simtree.kernels.gdn._launch import FoldLaunch, LaunchNotApplicable
from test_gdn_deferred import (H, HV, K, TRANSPOSED, V, deepest, random_trees, ref_commit,
                               ref_out, rel_err, round_inputs)
from test_gdn_deferred import verify as verify_folding


def verify(r, state, backend, pend, **switches):
    return verify_folding(r, state, backend, pend, fold="pending_round", **switches)


def armed_round(backend, seed=0):
    """Round 1 verified (nothing waiting) and armed with each tree's deepest node."""
    import numpy as np
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    trees = random_trees(rng, [9, 20, 1])
    r1 = round_inputs(trees, gen)
    S0 = torch.randn(len(trees), HV, K, V, generator=gen) * 0.3
    state, pend = S0.clone(), new_pending_round(len(trees), HV, V, "cpu")
    out1, cache = verify(r1, state, backend, pend)      # never armed: folds nothing
    acc = deepest(trees)
    pend.arm(r1["k"], cache, r1["cu_nodes"], acc)
    return dict(r1=r1, out1=out1, S0=S0, S1=ref_commit(r1, trees, S0, acc), state=state,
                pend=pend, gen=gen, rng=rng, trees=trees)


@pytest.mark.parametrize("backend, switches, registers, mode, path", [
    ("triton", {}, 64, 3, 0), ("triton", {}, 0, 4, 1), ("triton", TRANSPOSED, 64, 3, 1),
    ("triton", dict(block_v=16), 0, 4, 0), ("torch", {}, 64, 0, 0)])
def test_round_fold_equals_the_sequential_reference(backend, switches, registers, mode, path,
                                                    monkeypatch):
    """registers: the walk folds the tile in registers (FOLD 3) or in 8-row pieces through
    memory (FOLD 4); path: the accepted path gathered from its ancestor bits or nodes 0..a
    walked in stored order (the commit rule's choice, forced); every path, however long,
    folds (no row limit)."""
    monkeypatch.setattr(deferred, "FOLD_REGISTERS", registers)
    monkeypatch.setattr(deferred, "FOLD_BLOCK_K", 8)
    rule_commit = deferred.rule.commit_launch_config
    monkeypatch.setattr(deferred.rule, "commit_launch_config", lambda *a, **k: dataclasses.replace(
        rule_commit(*a, **k), path=path))
    t = armed_round(backend)
    assert rel_err(t["out1"], ref_out(t["r1"], t["S0"])) < 1e-4
    assert torch.equal(t["state"], t["S0"]) and t["pend"].on.all()
    trees2 = random_trees(t["rng"], [5, 12, 17])
    r2 = round_inputs(trees2, t["gen"])
    out2, cache2 = verify(r2, t["state"], backend, t["pend"], **switches)
    assert cache2.launch.get("fold", 0) == mode
    assert rel_err(out2, ref_out(r2, t["S1"])) < 1e-4
    assert rel_err(t["state"], t["S1"]) < 1e-5 and not t["pend"].on.any()
    acc2 = torch.tensor([3, 0, 16])
    t["pend"].arm(r2["k"], cache2, r2["cu_nodes"], acc2)
    gdn_fold_round(t["state"], t["pend"]) if backend == "torch" else \
        deferred.launched_fold_round(t["state"], t["pend"], launch=FoldLaunch(backend, block_k=8))
    assert rel_err(t["state"], ref_commit(r2, trees2, t["S1"], acc2)) < 1e-5
    assert not t["pend"].on.any()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_an_aborted_round_and_a_leaving_sequence(backend):
    """A verify whose round is never armed folds the round before once (verifying again sees
    the same state); a standalone fold of one leaving sequence folds only that one."""
    t = armed_round(backend, seed=1)
    leaving = torch.tensor([False, True, False])
    deferred.launched_fold_round(t["state"], t["pend"], leaving, launch=FoldLaunch(backend))
    want = torch.where(leaving[:, None, None, None], t["S1"], t["S0"].double())
    assert rel_err(t["state"], want) < 1e-5
    assert t["pend"].on.bool().any(dim=(1, 2)).tolist() == [True, False, True]
    r2 = round_inputs(random_trees(t["rng"], [6, 6, 6]), t["gen"])
    first, _ = verify(r2, t["state"], backend, t["pend"])      # aborted: never armed
    again, _ = verify(r2, t["state"], backend, t["pend"])
    deferred.launched_fold_round(t["state"], t["pend"], launch=FoldLaunch(backend))
    assert rel_err(first, ref_out(r2, t["S1"])) < 1e-4 and rel_err(again, first) < 1e-6
    assert rel_err(t["state"], t["S1"]) < 1e-5


def test_the_standalone_folds_and_the_deferred_commit_at_other_launches():
    """The launch knobs the floor benchmark's variants time (V block, state rows per piece)
    change no result: the path fold against its reference, the round fold against the
    commit's, the deferred commit's kept rows against the default launch's."""
    from simtree.kernels.gdn import gdn_fold_pending_ref, new_pending
    gen = torch.Generator().manual_seed(4)
    pend = new_pending(2, H, HV, K, V, 6, "cpu")
    for t in (pend.k, pend.u):
        t.normal_(generator=gen)
    pend.w.uniform_(generator=gen)
    pend.decay.uniform_(0.2, 1.0, generator=gen)
    pend.length.copy_(torch.tensor([6, 3], dtype=torch.int32))
    pend.on.fill_(1)
    state = torch.randn(2, HV, K, V, generator=gen)
    want = gdn_fold_pending_ref(state, pend)
    deferred.launched_fold_pending(state, pend, launch=FoldLaunch("triton", block_v=16, block_k=8,
                                                                  num_warps=2))
    assert rel_err(state, want) < 1e-5 and not pend.on.any()
    t = armed_round("triton", seed=2)
    deferred.launched_fold_round(t["state"], t["pend"],
                                 launch=FoldLaunch("triton", block_v=16, block_k=K, num_warps=2))
    assert rel_err(t["state"], t["S1"]) < 1e-5
    r1 = t["r1"]
    _, cache = verify(r1, t["S0"].clone(), "triton", None)
    kept = []
    for bv in (None, V):
        p = new_pending(3, H, HV, K, V, 32, "cpu")
        deferred.launched_defer_commit(t["S0"].clone(), p, r1["k"], cache, r1["parents"],
                                       r1["cu_nodes"], deepest(t["trees"]),
                                       launch=FoldLaunch("triton", block_v=bv))
        kept.append(p)
    assert all(torch.equal(getattr(kept[0], f), getattr(kept[1], f))
               for f in ("k", "w", "u", "decay", "length", "on"))


def test_each_form_goes_through_its_own_entries():
    """The default entries take a pending path only, the round form's a pending round only:
    the other form is refused in one line naming the right entries, before anything runs."""
    t = armed_round("torch", seed=3)
    path = new_pending(3, H, HV, K, V, 4, "cpu")
    r = t["r1"]
    math = [r[x] for x in ("q", "k", "v", "g", "beta")]
    calls = [(lambda: gdn_fold_pending(t["state"], t["pend"]), "gdn_fold_round"),
             (lambda: gdn_tree_verify_folding(*math, t["state"], t["pend"], r["parents"],
                                              r["cu_nodes"]), "gdn_tree_verify_folding_round"),
             (lambda: gdn_fold_round(t["state"], path), "gdn_fold_pending"),
             (lambda: gdn_tree_verify_folding_round(*math, t["state"], path, r["parents"],
                                                    r["cu_nodes"]), "gdn_tree_verify_folding,")]
    for call, entries in calls:
        with pytest.raises(SimtreeError, match=entries) as err:
            call()
        assert "\n" not in str(err.value)
    assert torch.equal(t["state"], t["S0"]) and t["pend"].on.all() and not path.on.any()


def test_the_deferred_commit_takes_no_state_piece():
    t = armed_round("torch", seed=4)
    _, cache = verify(t["r1"], t["S0"].clone(), "torch", None)
    with pytest.raises(LaunchNotApplicable, match="block_k is the standalone folds'"):
        deferred.launched_defer_commit(t["S0"].clone(), new_pending(3, H, HV, K, V, 4, "cpu"),
                                       t["r1"]["k"], cache, t["r1"]["parents"],
                                       t["r1"]["cu_nodes"], deepest(t["trees"]),
                                       launch=FoldLaunch("triton", block_k=32))


def test_arming_some_sequences_needs_the_others_folded():
    """``arm(sequences=...)`` replaces the whole batch's references: where another sequence
    still waits on the round before it is refused in one line naming it, nothing changed;
    once all are folded, only the chosen sequences wait."""
    t = armed_round("torch", seed=5)
    pend, r1 = t["pend"], t["r1"]
    before = (pend.k, pend.cache, pend.on.clone())
    first = torch.tensor([True, False, False])
    with pytest.raises(SimtreeError, match=r"sequences \[1, 2\] still wait") as err:
        pend.arm(r1["k"].clone(), pend.cache, r1["cu_nodes"], deepest(t["trees"]), first)
    assert "\n" not in str(err.value)
    assert pend.k is before[0] and pend.cache is before[1] and torch.equal(pend.on, before[2])
    gdn_fold_round(t["state"], pend)          # as the next verify of the batch folds them
    assert not pend.on.any()
    pend.arm(r1["k"], pend.cache, r1["cu_nodes"], deepest(t["trees"]), first)
    assert pend.on.bool().any(dim=(1, 2)).tolist() == [True, False, False]
