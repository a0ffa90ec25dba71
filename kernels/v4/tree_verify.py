"""Tree verify of one V4 attention layer: chain-isolated compression in scratch + index lists.

Node j of tree b sits at position p_j = lens[b] + depth_j (the root is the first token not yet
in the cache).  It sees, as FlashMLA-style index lists:

  window   persistent tokens q in (p_j - window, lens[b]) and its ancestors-or-self with
           p > p_j - window — rows of [window pool | node latents]
  compressed  all persistent entries i < lens[b] // r plus the scratch entries completed at
           its ancestors-or-self (HCA: all; CSA: the indexer's top-k among them) — rows of
           [compressed pool | scratch entries]

A compression window that completes inside the tree is fixed by the node where it completes
(its root path fixes every slot), so it is computed once per completing NODE (``M`` of them)
from a slot-source list into [persistent compressor buffers | node projections] — in scratch,
shared by every chain through that node and never written to the persistent pages.  No node
ever gathers a row of a sibling branch: its lists only name its own path.

Host side (once per round, shared by all layers of a kind): :func:`plan_verify`.
Device side (graph-capturable): :func:`tree_verify`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from simtree.errors import SimtreeError
from simtree.tree import DraftTree, TreeBatch

from .attention import gather_rows, sparse_attention, sparse_attention_torch
from .cache import V4Cache
from .compressor import CompressorParams, pool_window, project
from .reference import V4Inputs, V4LayerWeights

__all__ = ["VerifyPlan", "VerifyScratch", "plan_verify", "attention_lists", "tree_verify", "random_tree"]


@dataclass
class VerifyPlan:
    """Index metadata of one round (device tensors unless noted). N nodes, B trees, M windows
    completing inside the trees, S compressor slots per window.

    pos [N], node_seq [N]; win_idx [N, window]: rows of [window pool | node latents];
    comp_nodes, comp_entry, comp_seq [M]; comp_src [M, S]: rows of [buffers B*S | node proj N];
    scratch_vis [N, Smax]: scratch entries on the node's path (-1 pad);
    comp_idx [N, Emax + Smax] (HCA): rows of [compressed pool | scratch];
    persist_comp_rows, persist_idx_rows [B, Emax]; pad_nodes [B, nmax]; node_slot [N] (CSA).
    """

    batch: TreeBatch
    lens: np.ndarray
    pos: torch.Tensor
    node_seq: torch.Tensor
    win_idx: torch.Tensor
    comp_nodes: torch.Tensor | None = None
    comp_entry: torch.Tensor | None = None
    comp_seq: torch.Tensor | None = None
    comp_src: torch.Tensor | None = None
    comp_nodes_host: np.ndarray | None = None
    scratch_vis: torch.Tensor | None = None
    comp_idx: torch.Tensor | None = None
    persist_comp_rows: torch.Tensor | None = None
    persist_idx_rows: torch.Tensor | None = None
    pad_nodes: torch.Tensor | None = None
    node_slot: torch.Tensor | None = None


@dataclass
class VerifyScratch:
    """Per-round scratch: node latents [N, D]; compressor projections [N, C]; entries [M, *]."""

    node_kv: torch.Tensor
    comp_proj: tuple[torch.Tensor, torch.Tensor] | None = None
    idx_proj: tuple[torch.Tensor, torch.Tensor] | None = None
    comp_entries: torch.Tensor | None = None
    idx_entries: torch.Tensor | None = None
    comp_list: torch.Tensor | None = None


def random_tree(n: int, rng: np.random.Generator, max_children: int = 3) -> DraftTree:
    """A random tree of n nodes in topological order (parent drawn among earlier nodes)."""
    parents = [-1]
    kids = [0]
    for i in range(1, n):
        open_nodes = [j for j in range(i) if kids[j] < max_children]
        p = int(rng.choice(open_nodes[-4:]))  # prefer recent nodes: deep, EAGLE-like trees
        parents.append(p)
        kids[p] += 1
        kids.append(0)
    return DraftTree(np.array(parents))


def _slot_sources(lens_b: int, entry: int, ratio: int, overlap: bool, path_rows: np.ndarray,
                  seq: int, num_slots: int, node_offset: int) -> np.ndarray:
    """Virtual rows [S] of one completing window: buffer row seq*S + r, or node_offset + node."""
    s = np.arange(num_slots)
    q = ((entry - 1) * ratio + s) if overlap else entry * ratio + s
    if overlap:
        q = np.where(s < ratio, q, entry * ratio + s - ratio)
    cur_w = lens_b // ratio
    buf_row = np.where(q // ratio == cur_w, (ratio if overlap else 0) + q % ratio, q % ratio)
    from_tree = q >= lens_b
    tree_rows = path_rows[np.clip(q - lens_b, 0, len(path_rows) - 1)] + node_offset
    out = np.where(from_tree, tree_rows, seq * num_slots + buf_row)
    return np.where(q < 0, -1, out)


def plan_verify(cache: V4Cache, batch: TreeBatch | DraftTree, w: V4LayerWeights, device=None) -> VerifyPlan:
    """Build the index lists of one round on the host (see the module docstring)."""
    if isinstance(batch, DraftTree):
        batch = TreeBatch((batch,))
    if batch.batch_size != cache.batch:
        raise SimtreeError(f"{batch.batch_size} trees for a cache of {cache.batch} sequences")
    cfg, W, r = cache.cfg, cache.cfg.window, cache.ratio
    lens = cache.lens.copy()
    N, Pw = batch.total_nodes, cache.window.num_rows
    if np.any(lens + np.array([t.max_depth for t in batch.trees]) >= cache.max_len):
        raise SimtreeError(f"tree runs past the cache capacity of {cache.max_len} tokens")
    pos = batch.positions(lens)
    win = np.full((N, W), -1, np.int64)
    comp_nodes, comp_entry, comp_seq, comp_src = [], [], [], []
    vis_lists: list[list[int]] = [[] for _ in range(N)]
    for b, (tree, start) in enumerate(zip(batch.trees, batch.cu_nodes[:-1])):
        L = int(lens[b])
        anc = tree.ancestor_mask
        for j in range(tree.num_nodes):
            p = L + int(tree.depth[j])
            q = np.arange(max(0, p - W + 1), L)
            path = np.flatnonzero(anc[j])  # root first
            path = path[L + tree.depth[path] > p - W]
            rows = np.concatenate([cache.window.flat_rows(b, q % W), Pw + start + path])
            win[start + j, :rows.size] = rows
            if r and (p + 1) % r == 0:
                e = (p + 1) // r - 1
                full_path = np.flatnonzero(anc[j]) + start
                comp_src.append(_slot_sources(L, e, r, w.comp.overlap, full_path, b,
                                              w.comp.num_slots, cache.batch * w.comp.num_slots))
                comp_nodes.append(start + j)
                comp_entry.append(e)
                comp_seq.append(b)
        if r:
            ids = {int(n): m for m, n in enumerate(comp_nodes) if comp_seq[m] == b}
            for j in range(tree.num_nodes):
                vis_lists[start + j] = [ids[start + a] for a in np.flatnonzero(anc[j]) if start + a in ids]
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=device)  # noqa: E731
    plan = VerifyPlan(batch, lens, t(pos), t(batch.seq_ids), t(win))
    if not r:
        return plan
    M = len(comp_nodes)
    S = w.comp.num_slots
    plan.comp_nodes_host = np.array(comp_nodes, np.int64)
    plan.comp_nodes, plan.comp_entry, plan.comp_seq = t(plan.comp_nodes_host), t(np.array(comp_entry, np.int64)), t(np.array(comp_seq, np.int64))
    plan.comp_src = t(np.array(comp_src, np.int64).reshape(M, S))
    smax = max(1, max(len(v) for v in vis_lists))
    vis = np.full((N, smax), -1, np.int64)
    for j, v in enumerate(vis_lists):
        vis[j, :len(v)] = v
    plan.scratch_vis = t(vis)
    n_persist = lens // r
    emax = int(n_persist.max())
    persist = np.full((cache.batch, emax), -1, np.int64)
    for b in range(cache.batch):
        persist[b, :n_persist[b]] = cache.comp.flat_rows(b, np.arange(n_persist[b]))
    if w.indexer is None:  # HCA: every visible entry
        Pc = cache.comp.num_rows
        comp_idx = np.concatenate([persist[batch.seq_ids], np.where(vis >= 0, vis + Pc, -1)], axis=1)
        plan.comp_idx = t(comp_idx)
    else:
        pidx = np.full((cache.batch, emax), -1, np.int64)
        for b in range(cache.batch):
            pidx[b, :n_persist[b]] = cache.idx.flat_rows(b, np.arange(n_persist[b]))
        nmax = batch.max_nodes
        pad = np.full((cache.batch, nmax), -1, np.int64)
        slot = np.zeros(N, np.int64)
        for b, start in enumerate(batch.cu_nodes[:-1]):
            n_b = batch.trees[b].num_nodes
            pad[b, :n_b] = np.arange(start, start + n_b)
            slot[start:start + n_b] = b * nmax + np.arange(n_b)
        plan.persist_comp_rows, plan.persist_idx_rows = t(persist), t(pidx)
        plan.pad_nodes, plan.node_slot = t(pad), t(slot)
    return plan


def _scratch_entries(p: CompressorParams, state_kv, state_score, proj, plan: VerifyPlan) -> torch.Tensor:
    """Pool every window completing inside the trees: [M, dim] (the batched compressor form)."""
    sources_kv = [state_kv.reshape(-1, state_kv.shape[-1]), proj[0].to(state_kv.dtype)]
    sources_s = [state_score.reshape(-1, state_score.shape[-1]), proj[1].to(state_kv.dtype)]
    kv, valid = gather_rows(plan.comp_src, sources_kv)
    score, _ = gather_rows(plan.comp_src, sources_s)
    score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    return pool_window(p, kv, score, plan.comp_entry)


def _indexer_topk(cache: V4Cache, inp: V4Inputs, scratch_keys: torch.Tensor, plan: VerifyPlan,
                  topk: int, chunk: int = 2048) -> torch.Tensor:
    """CSA selection: [N, k] rows of [compressed pool | scratch], -1 where fewer are visible."""
    B, nmax = plan.pad_nodes.shape
    N, Hi, Di = inp.iq.shape
    cdt = inp.iq.dtype
    emax = plan.persist_idx_rows.shape[1]
    q_pad = inp.iq[plan.pad_nodes.clamp(min=0)].reshape(B, nmax * Hi, Di)
    w_pad = inp.iw[plan.pad_nodes.clamp(min=0)].to(cdt).reshape(B, nmax, Hi, 1)
    parts = []
    for c0 in range(0, emax, chunk):
        rows = plan.persist_idx_rows[:, c0:c0 + chunk]
        keys = cache.idx.pool[rows.clamp(min=0)].to(cdt)                      # [B, c, Di]
        s = torch.relu(torch.bmm(q_pad, keys.transpose(1, 2))).reshape(B, nmax, Hi, -1)
        s = (s * w_pad).sum(2).masked_fill((rows < 0).unsqueeze(1), float("-inf"))
        parts.append(s)
    persist = (torch.cat(parts, 2).reshape(B * nmax, emax)[plan.node_slot] if parts
               else inp.iq.new_zeros(N, 0))
    vis = plan.scratch_vis
    sk = scratch_keys.to(cdt)[vis.clamp(min=0)] if scratch_keys.shape[0] else inp.iq.new_zeros(N, vis.shape[1], Di)
    ss = (torch.relu(torch.einsum("nhd,nsd->nhs", inp.iq, sk)) * inp.iw.to(cdt).unsqueeze(-1)).sum(1)
    scores = torch.cat([persist, ss.masked_fill(vis < 0, float("-inf"))], dim=1)
    k = min(topk, scores.shape[1])
    val, sel = torch.topk(scores, k, dim=1)
    from_persist = sel < emax
    prow = plan.persist_comp_rows[plan.node_seq.unsqueeze(1), sel.clamp(max=max(emax - 1, 0))] if emax else sel
    srow = vis.gather(1, (sel - emax).clamp(min=0)) + cache.comp.num_rows
    out = torch.where(from_persist, prow, srow)
    return torch.where(torch.isneginf(val), torch.full_like(out, -1), out)


def attention_lists(cache: V4Cache, w: V4LayerWeights, inp: V4Inputs,
                    plan: VerifyPlan) -> tuple[torch.Tensor, list[torch.Tensor], VerifyScratch]:
    """Everything before the attention core: scratch compression, CSA top-k, and the final
    per-node index list idx [N, window + K] into sources [window pool | node latents
    (| compressed pool | scratch entries)]."""
    cfg = cache.cfg
    sc = VerifyScratch(node_kv=inp.kv.to(cache.window.pool.dtype))
    sources = [cache.window.pool, sc.node_kv]
    idx = plan.win_idx
    if cache.ratio:
        sc.comp_proj = project(w.comp, inp.x, plan.pos)
        sc.comp_entries = _scratch_entries(w.comp, cache.comp_kv, cache.comp_score, sc.comp_proj, plan)
        scratch_rows = sc.comp_entries.to(cache.comp.pool.dtype)
        if w.indexer is not None:
            sc.idx_proj = project(w.indexer, inp.x, plan.pos)
            sc.idx_entries = _scratch_entries(w.indexer, cache.idx_kv, cache.idx_score, sc.idx_proj, plan)
            sc.comp_list = _indexer_topk(cache, inp, sc.idx_entries.to(cache.idx.pool.dtype), plan, cfg.topk)
        else:
            sc.comp_list = plan.comp_idx
        base = cache.window.num_rows + sc.node_kv.shape[0]
        idx = torch.cat([idx, torch.where(sc.comp_list >= 0, sc.comp_list + base, -1)], dim=1)
        sources += [cache.comp.pool, scratch_rows]
    return idx, sources, sc


def tree_verify(cache: V4Cache, w: V4LayerWeights, inp: V4Inputs, plan: VerifyPlan,
                attention: str = "triton") -> tuple[torch.Tensor, VerifyScratch]:
    """Verify every node of the round's trees against the persistent cache.

    inp: per-node inputs (N = plan.batch.total_nodes rows, flat tree order).
    Returns (o [N, H, D], scratch); never writes the cache.  attention: "triton" | "torch".
    """
    idx, sources, sc = attention_lists(cache, w, inp, plan)
    if attention == "triton":
        return sparse_attention(inp.q, idx, sources, w.sink, cache.cfg.scale), sc
    return sparse_attention_torch(inp.q.to(sources[0].dtype), idx, sources, w.sink, cache.cfg.scale), sc
