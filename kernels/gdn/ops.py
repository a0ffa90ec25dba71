"""Layer-level GDN ops: the GDN pieces a model (the runtime's, the profiler's stages) needs.

* ``recurrent_step``: one token of the delta rule for a batch (plain greedy decoding, the
  lossless reference); S_t = a_t S_{t-1} + k_t u_t^T, u_t = b_t (v_t - a_t S_{t-1}^T k_t),
  o_t = S_t^T q_t (docs/math/gdn_tree_solve.md; q, k L2-normalised, q scaled by K^-1/2).
* ``chain_gdn``: training sequences from a zero state, through the dense masked solve on
  chains (differentiable torch, ~2x faster on CPU than a token loop).
* ``round_meta``: the per-round tree metadata every GDN layer shares.
* ``tree_conv`` / ``tree_verify`` / ``tree_commit`` / ``conv_commit``: thin adapters over the
  tree causal conv, the rollback-free tree verify and the accepted-path commit, taking the
  round's metadata dict.  A model never solves the tree itself.

The recurrent state is stored in fp32 (the kernels' contract, as serving engines keep it);
with a float64 model the GDN computations run in float64 apart from that stored state and
the kernels' fp32 commit cache (u, G).

Prefill goes through the same verify + commit as chains of at most ``PREFILL_CHUNK``
tokens (the kernels are built for decode-verify tree sizes, tested up to 256 nodes).
"""
from __future__ import annotations

import functools

import torch

from .commit import gdn_tree_commit
from .conv import conv_state_commit, tree_causal_conv
from ._launch import depth_first_pays
from .reference import delta_rule_step, gdn_tree_verify_dense_batched, prep_qk
from .round_meta import verify_round_meta_host
from ._launched import launched_recurrent
from .verify import gdn_tree_verify

PREFILL_CHUNK = 64

__all__ = ["depth_first_pays", "PREFILL_CHUNK", "recurrent_step", "chain_gdn", "round_meta", "tree_conv",
           "tree_verify", "tree_commit", "conv_commit"]


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


def chain_gdn(q, k, v, g, beta):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] -> o [B, T, HV, V] (zero state)."""
    B, T, HV, V = v.shape
    parents = torch.arange(-1, T - 1, device=v.device).repeat(B)
    cu = torch.arange(0, B * T + 1, T, device=v.device)
    state = v.new_zeros(B, HV, k.shape[-1], V)
    o = gdn_tree_verify_dense_batched(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), g.flatten(0, 1),
                                      beta.flatten(0, 1), state, parents, cu)
    return o.to(v.dtype).view(B, T, HV, V)


def round_meta(meta: dict, batch, value_heads: int, value_dim: int) -> dict:
    """Add the GDN kernels' per-round tree metadata (built once, shared by every GDN layer),
    from the drafted ``TreeBatch`` on the host (``verify_round_meta_host``: numpy and one
    copy to the device, with the default verify launch's sub-chunk pairs).

    The trees were validated as DraftTrees, so no validation is repeated here; they count as
    stored depth-first where the batch already knows it (``TreeBatch.known_depth_first``)."""
    meta["gdn"] = verify_round_meta_host(batch.parents, batch.cu_nodes, batch.max_nodes,
                                         value_heads, value_dim, meta["parents"].device,
                                         batch.known_depth_first)
    return meta


def tree_conv(x, conv_state, weight, meta):
    """x [N, D] pre-conv inputs of all tree nodes -> SiLU(conv over each node's ancestors) [N, D]."""
    return tree_causal_conv(x, conv_state, weight, meta["parents"], meta["cu_nodes"],
                            activation="silu", meta=meta["gdn"]).to(x.dtype)


def tree_verify(q, k, v, g, beta, state, meta):
    """Every node's GDN output along its own root path; ``state`` is not modified."""
    if v.dtype != torch.float64:  # gates in fp32 (the kernels' contract); float64 models keep float64
        g, beta = g.float(), beta.float()
    out, cache = gdn_tree_verify(q, k, v, g, beta, state, meta["parents"], meta["cu_nodes"],
                                 meta=meta["gdn"])
    return out.to(v.dtype), cache


def tree_commit(state, k, cache, meta, accepted):
    gdn_tree_commit(state, k, cache, meta["parents"], meta["cu_nodes"], accepted, check=False)


def conv_commit(conv_state, x, meta, accepted):
    conv_state_commit(conv_state, x, meta["parents"], meta["cu_nodes"], accepted, meta=meta["gdn"])
