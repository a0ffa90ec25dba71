"""The block-drafter families and their public sizes: one source for the kernels that build
them, the fit that prices them and the planner that may choose them (docs/drafters.md).

    block    DFlash-style: one forward proposes a block of positions as independent marginals
    tfm      DFlash-TfM-style: a light autoregressive adapter over the block's top-K candidates
    dspark   DSpark-style: block backbone, sequential low-rank Markov head, confidence head

PUBLIC: deepseek-ai/DeepSpec's configs (config/dflash/*, config/dspark/* for Qwen3 4B / 8B / 14B
and Gemma-4 12B, all alike): block_size 7, 5 draft layers over 5 target layers' hidden states,
Markov rank 256.  TFM: ASSUMPTION (no public code): top-512 candidates per position (the number
the DFlash-TfM description gives), adapter width 256.
"""
from __future__ import annotations

__all__ = ["DRAFTER_FAMILIES", "PUBLIC", "TFM", "own_block_len", "ROUND_VARIANT", "LOOP_BUILDER_VARIANT",
           "MARGINAL_TOPK", "DRAFTER_ROPE_THETA"]

DRAFTER_FAMILIES = ("block", "tfm", "dspark")
PUBLIC = dict(block_len=7, layers=5, target_layers=5, markov_rank=256)
TFM = dict(cand_k=512, adapter_dim=256)
# Candidates the runtime keeps per drafted position (the MTP layer's marginal modes, block, DSpark):
# what a block round's C_d is priced at (DSpark's x axis) and what the profile stage of block times.
MARGINAL_TOPK = 4
# The block drafters' own RoPE base (DeepSpec's drafters take the target's config; angles only): the
# runtime's rounds, the profiler's stages and the CPU trainer build their tables with it.
DRAFTER_ROPE_THETA = 1e6
# How a drafter stage's row was timed (the profile table's ``variant``): ROUND_VARIANT rows time the
# runtime's own draft part (``kernels.layers.drafters.draft_round``: the block tree built
# sort-based); LOOP_BUILDER_VARIANT rows are older tables' (``draft_block`` built its tree with
# ``tree_from_marginals``, n - 1 sequential steps the runtime never ran: the fit takes them out).
ROUND_VARIANT = "round"
LOOP_BUILDER_VARIANT = "layers"


def own_block_len(family: str) -> int:
    """The positions a drafter of ``family`` drafts per forward (its trained block)."""
    return int(PUBLIC["block_len"])
