"""Block drafters built from the layers' ops (docs/drafters.md): a DFlash-style block drafter,
a TfM-style adapter over the block's top-K and a DSpark-style semi-autoregressive drafter.

    config.py     sizes from the public drafters, weights (specs)
    backbone.py   the block forward the three share (context rows, anchor + mask rows)
    block.py      per-position marginals; best-first trees from them on the device
    tfm.py        the adapter's best-first tree over its conditionals, w expansions a step
    dspark.py     the Markov head's chain, the confidence head, the verified prefix
    round.py      the draft part of a round after the backbone (the runtime's and the profiler's)
"""
from .backbone import BackboneState, backbone_forward, prepare
from .block import DeviceTree, block_marginals, tree_from_marginals
from .config import DRAFTER_FAMILIES, MAX_BLOCK_LEN, DrafterConfig, drafter_config, drafter_dims, drafter_specs
from .dspark import check_threshold, dspark_draft, survival, threshold_keep, verify_prefix_len
from .round import MARGINAL_TOPK, DraftedRound, DraftShape, draft_round, set_tree
from .tfm import tfm_candidates, tfm_steps, tfm_tree, tfm_tree_rescored

__all__ = ["BackboneState", "backbone_forward", "prepare", "DeviceTree", "block_marginals", "tree_from_marginals",
           "DRAFTER_FAMILIES", "MAX_BLOCK_LEN", "DrafterConfig", "drafter_config", "drafter_dims", "drafter_specs",
           "check_threshold", "dspark_draft", "survival", "threshold_keep", "verify_prefix_len", "tfm_candidates",
           "tfm_steps", "tfm_tree", "tfm_tree_rescored", "MARGINAL_TOPK", "DraftedRound", "DraftShape", "draft_round",
           "set_tree"]
