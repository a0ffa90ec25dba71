"""GDN (gated delta rule) tree verification: rollback-free verify + accepted-path commit.

    out, cache = gdn_tree_verify(q, k, v, g, beta, state, parents, cu_nodes)
    gdn_tree_commit(state, k, cache, parents, cu_nodes, accepted)     # in place
    # or deferred into the next verify (one state read + one write per round, ``deferred.py``):
    gdn_defer_commit(state, pend, k, cache, parents, cu_nodes, accepted)
    out, cache = gdn_tree_verify_folding(q, k, v, g, beta, state, pend, parents, cu_nodes);  gdn_fold_pending(state, pend)

Shapes: q, k [N, H, K]; v [N, HV, V]; g (log-decay <= 0), beta [N, HV] fp32;
state [B, HV, K, V] fp32; parents int64 [N] local (-1 root, topological); cu_nodes [B+1].
The entries take the math only; how a call is launched is the rule's (``_launch.py``, private:
``VerifyLaunch`` / ``CommitLaunch`` / ``FoldLaunch`` and the rule that picks them), and launches
of one's own (benchmarks, tuning, tests) go through ``_launched.py`` and
``_launched_deferred.py``.  The recurrent decode step of a model: ``simtree.kernels.gdn.ops``.
Kernel bodies: ``_tree_kernels.py`` (Triton verify, K-side and commit), ``_recurrent_kernel.py``
(the per-branch baseline), ``_cuda_walk.py`` (CUDA).  The launch-free form of the deferred
commit (``GDNPendingRound``: ``pending.py``, ``deferred.py``, ``verify.py``) is no runtime's and
not exported here: the GDN floor benchmark (``profiler/bench/gdn_floor.py``) times it.
"""
from .cache import GDNTreeCache
from .commit import gdn_tree_commit
from .deferred import GDNPendingPath, gdn_defer_commit, gdn_fold_pending, new_pending
from ._launch import depth_first_pays
from .meta import TreeMeta, tree_meta, tree_meta_host
from .reference import (gdn_accepted_paths_ref, gdn_fold_pending_ref, gdn_sequential_ref,
                        gdn_tree_verify_dense_batched, gdn_tree_verify_dense_ref, gdn_tree_verify_ref,
                        tree_causal_conv_ref)
from .round_meta import verify_round_meta, verify_round_meta_host, walk_tables
from .verify import gdn_tree_verify, gdn_tree_verify_folding, gdn_tree_verify_recurrent

__all__ = ["gdn_tree_verify", "gdn_tree_verify_folding", "gdn_tree_commit", "gdn_tree_verify_recurrent",
           "depth_first_pays", "GDNPendingPath", "new_pending", "gdn_defer_commit", "gdn_fold_pending",
           "gdn_fold_pending_ref",
           "GDNTreeCache", "TreeMeta", "tree_meta", "tree_meta_host", "walk_tables",
           "verify_round_meta", "verify_round_meta_host", "gdn_tree_verify_ref",
           "gdn_tree_verify_dense_ref", "gdn_tree_verify_dense_batched", "gdn_sequential_ref",
           "gdn_accepted_paths_ref", "tree_causal_conv_ref"]
