"""DeepSeek-V4 compressed-attention tree verification (CSA / HCA / SWA layers).

Public API:
    V4AttnConfig                       shapes (``.flash()``, ``.tiny()``)
    V4LayerWeights, V4Inputs, SeqState random_layer_weights, random_inputs, empty_state
    decode_tokens                      float64 sequential reference (one sequence)
    V4Cache                            paged persistent state (``from_states``, ``random``)
    plan_verify, tree_verify           index lists (host) + verify (device)
    plan_commit, apply_commit, commit  accepted-path refresh
    plan_verify_device, plan_commit_device, PlanBounds, tree_tensors
                                       the same plans built on the device (CUDA graphs)
    sparse_attention(_torch)           Triton gather attention with a per-head sink
    random_tree
Fused kernels (private modules): _pool_kernel.pool_windows, _indexer_kernels.indexer_scores /
selection_to_list, _commit_kernel.fused_commit; flashmla.PackedRows (FP8 V4 layout).
"""
from .attention import sparse_attention, sparse_attention_torch
from .cache import PagedPool, V4Cache
from .commit import CommitPlan, apply_commit, commit, plan_commit
from .compressor import CompressorParams, online_step, pool_window, project
from .config import LAYER_KINDS, V4AttnConfig
from .device_plan import PlanBounds, plan_commit_device, plan_verify_device, tree_tensors
from .reference import (SeqState, V4Inputs, V4LayerWeights, decode_tokens, empty_state,
                        random_inputs, random_layer_weights)
from .verify import VerifyPlan, VerifyScratch, plan_verify, random_tree, tree_verify

__all__ = ["V4AttnConfig", "LAYER_KINDS", "V4LayerWeights", "V4Inputs", "SeqState",
           "random_layer_weights", "random_inputs", "empty_state", "decode_tokens", "V4Cache",
           "PagedPool", "plan_verify", "tree_verify", "VerifyPlan", "VerifyScratch", "plan_commit",
           "apply_commit", "commit", "CommitPlan", "sparse_attention", "sparse_attention_torch",
           "CompressorParams", "online_step", "pool_window", "project", "random_tree", "plan_verify_device",
           "plan_commit_device", "PlanBounds", "tree_tensors"]
