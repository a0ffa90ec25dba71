"""The K-streamed verify of single-sub-chunk trees (``VerifyLaunch(stream=1)``,
``_stream_kernel.py``) against the default verify, the round form's fold (FOLD 3 / 4) and the
float64 references (Triton through the interpreter; K = 64: two 32-row state pieces)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.gdn import new_pending
from simtree.kernels.gdn._launch import LaunchNotApplicable, VerifyLaunch
from simtree.kernels.gdn._launched import launched_verify
from simtree.kernels.gdn.pending import new_pending_round
from simtree.trees.tree import DraftTree
from test_gdn_deferred import (H, HV, V, deepest, random_trees, ref_commit, ref_out, rel_err,
                               round_inputs)

K = 64


def chain(n):
    return DraftTree([-1] + list(range(n - 1)))


def fork(n):
    return DraftTree([-1] + [0] * (n - 1))


def run(r, state, pending_round=None, qk_l2norm=True, **switches):
    return launched_verify(r["q"], r["k"], r["v"], r["g"], r["beta"], state, r["parents"],
                           r["cu_nodes"], qk_l2norm=qk_l2norm, pending_round=pending_round,
                           launch=VerifyLaunch("triton", **switches))


@pytest.mark.parametrize("trees, switches, l2norm", [
    (lambda rng: [chain(16), DraftTree([-1]), fork(7)], dict(block_v=32), True),
    (lambda rng: random_trees(rng, [5, 16, 2]), dict(block_v=16), False),
    (lambda rng: [fork(32)] + random_trees(rng, [20, 31], reach=5), dict(block_t=32), True)])
def test_stream_verify_equals_the_default_verify(trees, switches, l2norm):
    """o, u and G as the default verify's (float rounding), o as the float64 reference's, the
    state untouched, at 16- and 32-node sub-chunks, V blocks of 16 and 32."""
    rng, gen = np.random.default_rng(3), torch.Generator().manual_seed(3)
    tr = trees(rng)
    r = round_inputs(tr, gen, K)
    S0 = torch.randn(len(tr), HV, K, V, generator=gen) * 0.3
    state = S0.clone()
    o, cache = run(r, state, qk_l2norm=l2norm, stream=1, **switches)
    want, want_cache = run(r, S0.clone(), qk_l2norm=l2norm)
    assert cache.launch == {"stream": 1} and torch.equal(state, S0)
    assert rel_err(o, want) < 1e-5 and rel_err(cache.u, want_cache.u) < 1e-5
    assert rel_err(cache.G, want_cache.G) < 1e-6
    if l2norm:   # the float64 reference normalises q and k
        assert rel_err(o, ref_out(r, S0)) < 1e-5


def rounds(stream, seed=0, trees1=None, sizes2=(3, 16, 9), qk_l2norm=True, armed=None,
           waiting=None, **switches):
    """Round 1 verified and armed (each tree's deepest node: a 16-row path in the chain),
    round 2 verified folding it: (the state after round 2's verify, its out, round 2's inputs,
    round 2's trees, the round, the folded state's float64 reference, round 2's cache).
    ``armed``: the sequences armed ([B] bool; the others hold accepted node 10**9, which
    ``arm`` does not read; None all); ``waiting``: the columns of ``on`` left waiting after
    the arm ([B, HV, V] bool; None all); without ``qk_l2norm`` q and k are scaled by K^-1/2
    (|k| about 1, as normalised keys)."""
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    trees1 = trees1 or [chain(16), fork(5), DraftTree([-1])]
    r1 = round_inputs(trees1, gen, K)
    S0 = torch.randn(3, HV, K, V, generator=gen) * 0.3
    sw = dict(switches, stream=1) if stream else {}
    state, pr = S0.clone(), new_pending_round(3, HV, V, "cpu")
    trees2 = random_trees(rng, sizes2)
    r2 = round_inputs(trees2, gen, K)
    if not qk_l2norm:
        for r in (r1, r2):
            r["q"], r["k"] = r["q"] * K ** -0.5, r["k"] * K ** -0.5
    _, cache1 = run(r1, state, pr, qk_l2norm, **sw)          # never armed: folds nothing
    assert torch.equal(state, S0)
    acc = deepest(trees1)
    S1 = ref_commit(r1, trees1, S0, acc, qk_l2norm)
    if armed is None:
        pr.arm(r1["k"], cache1, r1["cu_nodes"], acc)
    else:
        pr.arm(r1["k"], cache1, r1["cu_nodes"], torch.where(armed, acc, 10 ** 9), armed)
        S1 = torch.where(armed[:, None, None, None], S1, S0.double())
    if waiting is not None:
        pr.on.masked_fill_(~waiting, 0)
        S1 = torch.where(waiting[:, :, None, :], S1, S0.double())
    out2, cache2 = run(r2, state, pr, qk_l2norm, **sw)
    return dict(state=state, out2=out2, r2=r2, trees2=trees2, pr=pr, S1=S1, l2norm=qk_l2norm,
                cache2=cache2, sw=sw, rng=rng, gen=gen)


# every third column of each tile and all of (sequence 0, value head 1) not waiting
SOME_COLUMNS = (torch.arange(V) % 3 != 0).expand(3, HV, V).clone()
SOME_COLUMNS[0, 1] = False


@pytest.mark.parametrize("case", [
    dict(),
    dict(block_v=16),                                                # two V blocks a head
    dict(waiting=SOME_COLUMNS),
    dict(armed=torch.tensor([False, True, True])),
    dict(trees1=[chain(32), fork(20), DraftTree([-1])], sizes2=(3, 30, 9), block_t=32),
    dict(trees1=[chain(17), fork(3), DraftTree([-1])]),    # trees of <= 16 after 17-32
    dict(qk_l2norm=False)],
    ids=["one_block", "block_v16", "some_columns", "not_armed_any_accepted", "block_t32",
         "round_before_larger", "no_l2norm"])
def test_stream_fold_equals_the_round_fold(case):
    """The streamed verify folding a round: o and the folded state as the round form's walk
    (FOLD 3) and the float64 references; the flags cleared; a second verify with the same
    round folds nothing twice (same state, same outputs).  Over V blocks of 16, some columns
    waiting, a sequence not armed (any accepted node: none of its rows is read), 32-node
    sub-chunks, a round before larger than the trees now (block_t 32 picked) and raw q / k."""
    s, t = rounds(True, **case), rounds(False, **case)
    assert s["cache2"].launch == {"stream": 1, "fold": 5} and t["cache2"].launch["fold"] in (3, 4)
    assert rel_err(s["state"], t["state"]) < 1e-6 and rel_err(s["out2"], t["out2"]) < 1e-5
    assert rel_err(s["state"], s["S1"]) < 1e-5
    assert rel_err(s["out2"], ref_out(s["r2"], s["S1"], s["l2norm"])) < 1e-5
    assert not s["pr"].on.any()
    folded = s["state"].clone()
    again, _ = run(s["r2"], s["state"], s["pr"], s["l2norm"], **s["sw"])
    assert torch.equal(s["state"], folded) and rel_err(again, s["out2"]) < 1e-6


def test_stream_fold_of_some_sequences_and_an_aborted_round():
    """A round armed for some sequences only: the streamed verify folds those (the others'
    tiles stream through unfolded); a round verified and never armed (aborted) leaves the
    state the round form's walk leaves, folded once."""
    got = {}
    for stream in (True, False):
        t = rounds(stream, seed=1)
        some = torch.tensor([True, False, True])
        acc2 = torch.tensor([2, 0, 8])
        t["pr"].arm(t["r2"]["k"], t["cache2"], t["r2"]["cu_nodes"], acc2, some)
        S2 = torch.where(some[:, None, None, None],
                         ref_commit(t["r2"], t["trees2"], t["state"], acc2), t["state"].double())
        r3 = round_inputs([fork(4), chain(12), DraftTree([-1])], t["gen"], K)
        out3, _ = run(r3, t["state"], t["pr"], **t["sw"])        # aborted: never armed
        assert rel_err(t["state"], S2) < 1e-5 and not t["pr"].on.any()
        assert rel_err(out3, ref_out(r3, S2)) < 1e-5
        again, _ = run(r3, t["state"], t["pr"], **t["sw"])
        assert rel_err(t["state"], S2) < 1e-5 and rel_err(again, out3) < 1e-6
        got[stream] = (t["state"], out3)
    assert rel_err(got[True][0], got[False][0]) < 1e-6
    assert rel_err(got[True][1], got[False][1]) < 1e-5


def test_the_switch_is_refused_where_it_cannot_run():
    """One line each: trees larger than the sub-chunk, a pending path, the torch backend,
    another walk's switch (the walk's own g_prologue, u_bf16, pdl too: none applies), a round
    before of trees larger than the sub-chunk asked for."""
    gen = torch.Generator().manual_seed(5)
    big = round_inputs([chain(17), fork(3)], gen, K)
    small = round_inputs([fork(3), chain(9)], gen, K)
    state = torch.zeros(2, HV, K, V)
    pr = new_pending_round(2, HV, V, "cpu")
    _, cache = run(big, state)
    pr.arm(big["k"], cache, big["cu_nodes"], torch.tensor([16, 2]))
    cases = [
        (lambda: run(big, state, stream=1, block_t=16), "17 nodes at block_t 16"),
        (lambda: run(round_inputs([chain(33)], gen, K), state[:1], stream=1), "33 nodes"),
        (lambda: launched_verify(small["q"], small["k"], small["v"], small["g"], small["beta"],
                                 state, small["parents"], small["cu_nodes"],
                                 pending=new_pending(2, H, HV, K, V, 4, "cpu"),
                                 launch=VerifyLaunch("triton", stream=1)), "pending path"),
        (lambda: launched_verify(small["q"], small["k"], small["v"], small["g"], small["beta"],
                                 state, small["parents"], small["cu_nodes"],
                                 launch=VerifyLaunch("torch", stream=1)), "triton backend"),
        (lambda: run(small, state, stream=1, transposed=1), "transposed"),
        (lambda: run(small, state, stream=1, g_prologue=1), "none of g_prologue$"),
        (lambda: run(small, state, stream=1, u_bf16=1, pdl=1), "none of u_bf16, pdl$"),
        (lambda: run(small, state, pr, stream=1, block_t=16), "has 17")]
    for call, text in cases:
        with pytest.raises(LaunchNotApplicable, match=text) as e:
            call()
        assert "\n" not in str(e.value)
    assert pr.on.all() and torch.equal(state, torch.zeros_like(state))   # nothing ran


def test_v_not_a_power_of_two_is_refused():
    """V = 96 at the default block_v 64: one line, not a launch that leaves columns 64-95
    unwritten and their flags set (as the default verify, V a power of two >= 16)."""
    gen = torch.Generator().manual_seed(6)
    r = round_inputs([fork(3)], gen, K)
    r["v"] = torch.randn(3, HV, 96, generator=gen)
    with pytest.raises(SimtreeError, match="V=96") as e:
        run(r, torch.zeros(1, HV, K, 96), stream=1)
    assert "\n" not in str(e.value)
