"""The GDN tree verify's entry points: ``gdn_tree_verify`` (one pass, no state written) and the
per-branch recurrent baseline ``gdn_tree_verify_recurrent``.

Shapes: q, k [N, H, K]; v [N, HV, V]; g (log-decay <= 0), beta [N, HV] fp32;
state [B, HV, K, V] fp32; parents int64 [N] local (-1 root, topological); cu_nodes [B+1].
The entries take the math only: the backend goes by the device (Triton on CUDA, the batched
torch solve elsewhere) and every launch switch by the rule (``_launch.py``).  The math is
stated by the plain torch references beside the kernels (``reference.py``); launches of
one's own (benchmarks, tuning, tests) go through ``_launched.py``.
"""
from __future__ import annotations

from ._launched import check_verify_inputs, launched_recurrent, launched_verify
from .meta import TreeMeta

__all__ = ["gdn_tree_verify", "gdn_tree_verify_folding", "gdn_tree_verify_folding_round",
           "gdn_tree_verify_recurrent", "check_verify_inputs"]


def gdn_tree_verify(q, k, v, g, beta, state, parents, cu_nodes, *, scale=None,
                    meta: TreeMeta | None = None):
    """Every node's output as if the recurrence ran along its own root path only.

    Args: q, k [N, H, K] (L2-normalised here, as Qwen3.5/3.6's GDN does); v [N, HV, V];
    g, beta [N, HV]; state [B, HV, K, V] fp32 (not modified); parents, cu_nodes: the flat
    trees.  ``scale`` (K^-1/2 if None) multiplies q.  ``meta``: the round's ``TreeMeta``,
    built by the caller from these trees; the inputs are then taken as checked and the call is
    free of host syncs (CUDA graphs).  Without it the inputs are checked (one-line
    ``SimtreeError``) and the meta is built here.  A deferred commit's verify:
    :func:`gdn_tree_verify_folding`.

    Returns (out [N, HV, V] in q's dtype, ``GDNTreeCache`` for ``gdn_tree_commit``).  The
    Triton path computes in fp32 (fp64 inputs too).
    """
    return launched_verify(q, k, v, g, beta, state, parents, cu_nodes, scale=scale, meta=meta,
                           check=meta is None)


def gdn_tree_verify_folding(q, k, v, g, beta, state, pending, parents, cu_nodes, *,
                            meta: TreeMeta | None = None):
    """:func:`gdn_tree_verify` after a deferred commit (``deferred.py``): ``pending``'s waiting
    paths (a ``GDNPendingPath``) are folded into ``state`` first, in the same kernel (the state
    is written once), and the trees are verified on the folded state.  q is scaled by K^-1/2
    (Qwen3.5/3.6's GDN).  Returns (out, ``GDNTreeCache``) as :func:`gdn_tree_verify`."""
    return launched_verify(q, k, v, g, beta, state, parents, cu_nodes, meta=meta, check=meta is None,
                           pending=pending)


def gdn_tree_verify_folding_round(q, k, v, g, beta, state, pending, parents, cu_nodes, *,
                                  meta: TreeMeta | None = None):
    """:func:`gdn_tree_verify_folding` for the launch-free form: the round a ``GDNPendingRound``
    holds (``pending``, armed after the round before's acceptance) is folded from that round's
    own buffers (the Triton walks only; the rule's CUDA walk gives way to them)."""
    return launched_verify(q, k, v, g, beta, state, parents, cu_nodes, meta=meta, check=meta is None,
                           pending_round=pending)


def gdn_tree_verify_recurrent(q, k, v, g, beta, state, parents, cu_nodes, *, scale=None,
                              node_states=None):
    """Per-branch recurrent baseline (Triton, as serving engines verify trees today): every
    node's state computed from its parent's, reloaded from memory; q and k L2-normalised,
    the inputs checked first.

    Returns (out [N, HV, V], node states [N, HV, K, V]).  ``node_states`` may be ``state``
    itself for one-node trees (a decode step: each program reads its state block before it
    writes the new one there; contiguous fp32 state)."""
    return launched_recurrent(q, k, v, g, beta, state, parents, cu_nodes, scale=scale,
                              node_states=node_states)
