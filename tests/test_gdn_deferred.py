"""The GDN commit deferred into the next verify: two rounds on random trees against the float64
sequential references (Triton through the interpreter, and the torch form)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.gdn import (gdn_accepted_paths_ref, gdn_fold_pending, gdn_fold_pending_ref,
                                 gdn_tree_verify_ref, new_pending)
from simtree.kernels.gdn import _launched_deferred as deferred
from simtree.kernels.gdn._launched_deferred import launched_defer_commit, launched_fold_pending
from simtree.kernels.gdn._launch import FoldLaunch, VerifyLaunch
from simtree.kernels.gdn._launched import launched_verify
from simtree.trees.tree import DraftTree, TreeBatch

H, HV, K, V = 2, 4, 16, 32
ROWS = 4          # pending path rows: deeper accepted paths are committed at once


def random_trees(rng, sizes, reach=3):
    return [DraftTree([-1] + [int(rng.integers(max(0, i - reach), i)) for i in range(1, n)])
            for n in sizes]


def round_inputs(trees, gen, key_dim=K):
    tb = TreeBatch(trees)
    md = tb.to_torch()
    N = tb.total_nodes
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=rnd(N, H, key_dim), k=rnd(N, H, key_dim), v=rnd(N, HV, V),
                g=-torch.rand(N, HV, generator=gen) * 0.5, beta=torch.rand(N, HV, generator=gen),
                parents=md["parents"], cu_nodes=md["cu_nodes"])


def deepest(trees):
    """Each tree's deepest node (ties: the last), so some paths pass ROWS and some do not."""
    return torch.tensor([int(np.flatnonzero(t.depth == t.depth.max())[-1]) for t in trees])


# the two Triton walks that fold: the rule's (untransposed at these shapes) and the transposed one
TRANSPOSED = dict(kside=1, prenorm=1, g_prologue=1, transposed=1)


def verify(r, state, backend, pending, fold="pending", **switches):
    """The verify folding ``pending`` (``fold``: "pending" a path, "pending_round" a round)."""
    return launched_verify(r["q"], r["k"], r["v"], r["g"], r["beta"], state, r["parents"],
                           r["cu_nodes"], launch=VerifyLaunch(backend=backend, **switches),
                           **{fold: pending})


def ref_out(r, state, qk_l2norm=True):
    return gdn_tree_verify_ref(r["q"].double(), r["k"].double(), r["v"].double(), r["g"].double(),
                               r["beta"].double(), state.double(), r["parents"], r["cu_nodes"],
                               qk_l2norm=qk_l2norm)


def ref_commit(r, trees, state, accepted, qk_l2norm=True):
    return gdn_accepted_paths_ref(r["q"].double(), r["k"].double(), r["v"].double(),
                                  r["g"].double(), r["beta"].double(), state.double(), trees,
                                  r["cu_nodes"], accepted, qk_l2norm=qk_l2norm)


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def two_rounds(backend, seed=0):
    """Round 1 verified and its commit deferred; the state and references after it."""
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    trees = random_trees(rng, [9, 20, 1])
    r1 = round_inputs(trees, gen)
    S0 = torch.randn(len(trees), HV, K, V, generator=gen) * 0.3
    state, pend = S0.clone(), new_pending(len(trees), H, HV, K, V, ROWS, "cpu")
    out1, cache = verify(r1, state, backend, pend)
    acc = deepest(trees)
    launched_defer_commit(state, pend, r1["k"], cache, r1["parents"], r1["cu_nodes"], acc,
                          launch=FoldLaunch(backend))
    S1 = ref_commit(r1, trees, S0, acc)
    return dict(r1=r1, out1=out1, S0=S0, S1=S1, state=state, pend=pend, gen=gen, rng=rng,
                trees=trees, acc=acc)


@pytest.mark.parametrize("backend, switches, registers", [
    ("triton", {}, 64), ("triton", {}, 0), ("triton", TRANSPOSED, 64), ("triton", TRANSPOSED, 0),
    ("torch", {}, 64)])
def test_deferred_rounds_equal_the_sequential_reference(backend, switches, registers, monkeypatch):
    """registers: the walk folds the tile in registers (64: these tiles fit) or in memory (0)."""
    monkeypatch.setattr(deferred, "FOLD_REGISTERS", registers)
    t = two_rounds(backend)
    assert rel_err(t["out1"], ref_out(t["r1"], t["S0"])) < 1e-4
    long = torch.tensor([int(t["trees"][b].depth[a]) + 1 > ROWS for b, a in enumerate(t["acc"])])
    assert long.any() and (~long).any()
    # a path longer than the pending rows is in the state already; the others wait
    want = torch.where(long[:, None, None, None], t["S1"], t["S0"].double())
    assert rel_err(t["state"], want) < 1e-5
    assert t["pend"].on.bool().any(dim=(1, 2)).tolist() == (~long).tolist()
    trees2 = random_trees(t["rng"], [5, 12, 17])
    r2 = round_inputs(trees2, t["gen"])
    out2, cache2 = verify(r2, t["state"], backend, t["pend"], **switches)
    assert cache2.launch.get("transposed", 0) == switches.get("transposed", 0)
    assert cache2.launch.get("fold", 0) == (0 if backend == "torch" else 2 if registers else 1)
    assert rel_err(out2, ref_out(r2, t["S1"])) < 1e-4
    assert rel_err(t["state"], t["S1"]) < 1e-5 and not t["pend"].on.any()
    acc2 = torch.tensor([3, 0, 16])
    launched_defer_commit(t["state"], t["pend"], r2["k"], cache2, r2["parents"], r2["cu_nodes"], acc2,
                          launch=FoldLaunch(backend))
    launched_fold_pending(t["state"], t["pend"], launch=FoldLaunch(backend))          # the last round
    assert rel_err(t["state"], ref_commit(r2, trees2, t["S1"], acc2)) < 1e-5


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_an_aborted_round_leaves_the_committed_state(backend):
    """A verify whose round is never committed folds the path before it once: verifying again
    sees the same state, and so does a standalone fold after it."""
    t = two_rounds(backend, seed=1)
    trees2 = random_trees(t["rng"], [6, 6, 6])
    r2 = round_inputs(trees2, t["gen"])
    first, _ = verify(r2, t["state"], backend, t["pend"])     # aborted: no commit follows
    again, _ = verify(r2, t["state"], backend, t["pend"])
    launched_fold_pending(t["state"], t["pend"], launch=FoldLaunch(backend))
    assert rel_err(first, ref_out(r2, t["S1"])) < 1e-4
    assert rel_err(again, first) < 1e-6
    assert rel_err(t["state"], t["S1"]) < 1e-5


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_standalone_fold_of_chosen_sequences(backend):
    """The commit of a sequence leaving the batch: only its path folds; the others still wait
    and the next verify folds them."""
    t = two_rounds(backend, seed=2)
    waiting = t["pend"].on.bool().any(dim=(1, 2))
    leaving = torch.tensor([True, False, False])
    launched_fold_pending(t["state"], t["pend"], leaving, launch=FoldLaunch(backend))
    folded = leaving | ~waiting
    want = torch.where(folded[:, None, None, None], t["S1"], t["S0"].double())
    assert rel_err(t["state"], want) < 1e-5
    assert t["pend"].on.bool().any(dim=(1, 2)).tolist() == (waiting & ~leaving).tolist()
    launched_fold_pending(t["state"], t["pend"], launch=FoldLaunch(backend))
    assert rel_err(t["state"], t["S1"]) < 1e-5


def test_fold_kernel_matches_its_reference():
    gen = torch.Generator().manual_seed(3)
    B = 3
    pend = new_pending(B, H, HV, K, V, 20, "cpu")
    pend.k.normal_(generator=gen)
    pend.w.uniform_(generator=gen)
    pend.u.normal_(generator=gen)
    pend.decay.uniform_(0.2, 1.0, generator=gen)
    pend.length.copy_(torch.tensor([20, 17, 1], dtype=torch.int32))
    pend.on.fill_(1)
    state = torch.randn(B, HV, K, V, generator=gen)
    want = gdn_fold_pending_ref(state, pend)
    launched_fold_pending(state, pend, launch=FoldLaunch("triton"))
    assert rel_err(state, want) < 1e-5 and not pend.on.any()


def test_a_pending_path_of_another_shape_is_refused():
    pend = new_pending(2, H, HV, K, V, ROWS, "cpu")
    with pytest.raises(SimtreeError, match="does not fit"):
        gdn_fold_pending(torch.zeros(3, HV, K, V), pend)
    with pytest.raises(SimtreeError, match="fp32"):
        gdn_fold_pending(torch.zeros(2, HV, K, V, dtype=torch.float64), pend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("walk", [dict(cuda_walk=2), dict(cuda_walk=1, block_v=64),
                                  dict(cuda_walk=2, walk_kside=1), dict(cuda_walk=2, kside_cuda=2),
                                  dict(transposed=1), dict()])
def test_every_walk_folds_on_the_gpu(walk):
    """bf16 inputs at K = V = 128 (the CUDA walk's): round 2's verify folds round 1's deferred
    path - in the CUDA walk (fold 3) or a Triton walk - to the float64 sequential state, and
    its outputs are those of a verify on today's committed state."""
    from simtree.kernels.gdn import _cuda_walk as cuda_walk
    from simtree.kernels.gdn import tree_meta
    from simtree.profiler.bench.gdn_util import random_gdn_inputs
    if walk.get("cuda_walk") and not cuda_walk.available("cuda"):
        pytest.skip("the CUDA walk does not run on this GPU")
    rng = np.random.default_rng(5)
    trees = [t.depth_first() for t in random_trees(rng, rng.integers(65, 129, size=5), reach=5)]
    r1, r2 = (random_gdn_inputs(trees, H=4, HV=12, K=128, V=128, seed=s) for s in (1, 2))
    meta = tree_meta(r1["parents"], r1["cu_nodes"], depth_first=True)
    launch = VerifyLaunch(backend="triton", kside=1, prenorm=1, g_pass=1, solve_bf16=1, u_bf16=1,
                          u_cache_bf16=1, block_t=16, l2_prefetch=0, **walk)
    acc = torch.as_tensor(r1["tb"].deepest_nodes, device="cuda")
    pend = new_pending(5, 4, 12, 128, 128, 64, "cuda", torch.bfloat16)

    def run(r, state, pending):
        return launched_verify(*(r[k] for k in ("q", "k", "v", "g", "beta")), state, r["parents"],
                               r["cu_nodes"], meta=meta, launch=launch, pending=pending)

    state = r1["state"].clone()
    _, cache = run(r1, state, pend)
    launched_defer_commit(state, pend, r1["k"], cache, r1["parents"], r1["cu_nodes"], acc)
    assert pend.on.any()
    out2, cache2 = run(r2, state, pend)
    assert cache2.launch["fold"] in ((3,) if walk.get("cuda_walk") else (1, 2))
    truth = ref_commit(r1, trees, r1["state"], acc)
    today, _ = run(r2, truth.float(), None)
    assert rel_err(state, truth) < 1e-2 and not pend.on.any()
    assert rel_err(out2, today) < 2e-2
