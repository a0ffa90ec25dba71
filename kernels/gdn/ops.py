"""Layer-level GDN op: ``recurrent_step``, one token of the delta rule for a batch (plain
greedy decoding, the lossless reference); S_t = a_t S_{t-1} + k_t u_t^T,
u_t = b_t (v_t - a_t S_{t-1}^T k_t), o_t = S_t^T q_t (docs/math/gdn_tree_solve.md; q, k
L2-normalised, q scaled by K^-1/2).  The state is stored in fp32 (the kernels' contract, as
serving engines keep it); with float64 inputs the step runs in float64 apart from that stored
state.  The tree verify, commit and conv a model runs are the layers' (``simtree.kernels.layers``).
"""
from __future__ import annotations

import functools

import torch

from .reference import delta_rule_step, prep_qk
from ._launched import launched_recurrent

__all__ = ["recurrent_step"]


@functools.lru_cache(maxsize=16)
def _one_node_trees(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, cu_nodes) of batch_size one-node trees on device: built once, not per layer
    and step of a decode loop."""
    return (torch.full((batch_size,), -1, dtype=torch.int64, device=device),
            torch.arange(batch_size + 1, dtype=torch.int64, device=device))


def recurrent_step(q, k, v, g, beta, state, backend: str = "auto"):
    """q, k [B, H, K]; v [B, HV, V]; g, beta [B, HV]; state [B, HV, K, V] fp32 (updated in place).

    Returns o [B, HV, V] in v's dtype; computes in float64 if v is float64. The delta-rule step
    is the references' one (``delta_rule_step``), so decode and the references cannot drift apart.
    ``backend`` "triton" ("auto" on CUDA, fp32/16-bit inputs): the per-node recurrent kernel on
    one-node trees, writing the new state over the old one (each program reads its state block
    before it writes it back): the state read and written once, as the profile's
    ``gdn_decode_step`` times it.
    """
    fused = state.dtype == torch.float32 and state.is_contiguous()   # written over in place
    if fused and (backend == "triton" or (backend == "auto" and v.is_cuda and v.dtype != torch.float64)):
        parents, cu = _one_node_trees(v.shape[0], v.device)
        out, _ = launched_recurrent(q, k, v, g.float(), beta.float(), state, parents, cu,
                                    node_states=state, check=False)
        return out
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    qh, kh = prep_qk(q, k, v.shape[-2], None, True, dt)
    S, o = delta_rule_step(state.to(dt), qh, kh, v.to(dt), g.to(dt), beta.to(dt))
    state.copy_(S)
    return o.to(v.dtype)
