"""The accepted-path commit: the state of each tree's accepted node folded in once, from what
the verify cached (no rollback, no per-node states).

    S* = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T     (m over a's root path)
"""
from __future__ import annotations

from ._launched import launched_commit
from .cache import GDNTreeCache

__all__ = ["gdn_tree_commit"]


def gdn_tree_commit(state, k, cache: GDNTreeCache, parents, cu_nodes, accepted, *,
                    check: bool = True) -> None:
    """In place: state[b] <- S* = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T.

    Args: state [B, HV, K, V] contiguous fp32 (the verify's S0, rewritten); k [N, H, K] the
    verify's keys; ``cache`` its ``GDNTreeCache``; accepted int64 [B]: LOCAL index of each
    tree's last accepted node (0 = only the root, which is still folded in: every node, the
    root included, is a real token).  ``check``: accepted nodes inside their trees (a host
    sync).  The backend goes by the device (Triton on CUDA, torch elsewhere), the launch by
    the rule (``_launch.commit_launch_config``).
    """
    launched_commit(state, k, cache, parents, cu_nodes, accepted, check=check)
