"""What a round builds once for every GDN layer's verify: the tree metadata with the walk
tables (node order, sub-chunk pairs) of the launch the rule picks at the round's shapes."""
from __future__ import annotations

import numpy as np
import torch

from ._launch import heavy_first_default, verify_launch_config
from .meta import TreeMeta, tree_meta, tree_meta_host

__all__ = ["walk_tables", "verify_round_meta", "verify_round_meta_host"]


def walk_tables(meta: TreeMeta, cu_nodes: torch.Tensor, block_t: int,
                heavy_first: int | None = None):
    """What the tree kernel walks for sub-chunks of ``block_t``: (order or None, the TreeMeta
    of that numbering, (pairs, counts, C)).  ``heavy_first`` None: the default for this
    sub-chunk and tree size.  Cached in ``meta``: built once per round, shared by the layers."""
    order, walk = None, meta
    if (heavy_first_default(block_t, meta.max_nodes, meta.depth_first) if heavy_first is None
            else heavy_first):
        order, walk = meta.heavy_first(cu_nodes)
    return order, walk, walk.subchunk_pairs(cu_nodes, block_t)


def verify_round_meta(parents: torch.Tensor, cu_nodes: torch.Tensor, max_nodes: int, HV: int,
                      V: int, depth_first: bool = False) -> TreeMeta:
    """A round's metadata for the default verify launch at these shapes: the TreeMeta with the
    walk tables that launch reads already built (cached in it), i.e. everything a round
    builds once and every GDN layer shares.  Sync-free (no validation); ``depth_first``: the
    trees are stored in their heavy-first order (``TreeBatch.is_depth_first``)."""
    meta = tree_meta(parents, cu_nodes, max_nodes=max_nodes, validate=False,
                     depth_first=depth_first)
    cfg = verify_launch_config(cu_nodes.numel() - 1, HV, V, parents.device, max_nodes,
                               depth_first)
    walk_tables(meta, cu_nodes, cfg.block_t, cfg.heavy_first)
    return meta


def verify_round_meta_host(parents, cu_nodes, max_nodes: int, HV: int, V: int,
                           device: torch.device | str = "cpu",
                           depth_first: bool = False) -> TreeMeta:
    """``verify_round_meta`` from the trees on the host (numpy ``parents`` LOCAL and
    ``cu_nodes``, e.g. a drafted ``TreeBatch``'s): ``tree_meta_host`` with the default
    launch's sub-chunk pairs, all in one host-to-device copy, so a runtime that builds each
    round's metadata eagerly pays a few dozen numpy operations instead of a few dozen kernel
    launches.  Where that launch walks the trees heavy-first (several sequences of 65-256
    nodes stored breadth-first), that walk is still built on the device."""
    cu = np.asarray(cu_nodes, np.int64)
    cfg = verify_launch_config(cu.shape[0] - 1, HV, V, device, max_nodes, depth_first)
    heavy = cfg.heavy_first
    meta = tree_meta_host(parents, cu, max_nodes, device, depth_first,
                          pair_blocks=() if heavy else (cfg.block_t,))
    if heavy:
        walk_tables(meta, torch.as_tensor(cu, device=device), cfg.block_t, heavy)
    return meta
