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
Device side (graph-capturable): :func:`tree_verify`.  Its default "triton" path is a handful
of launches per layer: SWA 1-2 (attention [+ split merge]); HCA + the compressor GEMMs and
one pooling kernel (the list is static, built by the plan); CSA + the indexer's GEMMs,
pooling, one indexer-scan kernel (persistent and scratch keys), torch.topk and one
list-building kernel.  "torch" is the plain float64-capable form the tests check against;
"flashmla" swaps the attention core for FlashMLA's FP8 V4 sparse decode.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from simtree.errors import SimtreeError
from simtree.tree import DraftTree, TreeBatch

from .attention import gather_rows, sparse_attention, sparse_attention_torch
from .cache import V4Cache
from .compressor import CompressorParams, pool_window
from .indexer import indexer_scores, indexer_scores_torch, selection_to_list
from .pool import pool_windows
from .reference import V4Inputs, V4LayerWeights

__all__ = ["VerifyPlan", "VerifyScratch", "plan_verify", "attention_lists", "tree_verify", "random_tree"]


@dataclass
class VerifyPlan:
    """Index metadata of one round (device tensors unless noted). N nodes, B trees, M windows
    completing inside the trees, S compressor slots per window.

    pos [N], node_seq [N]; win_idx [N, window]: rows of [window pool | node latents];
    comp_nodes, comp_entry, comp_seq [M]; comp_src [M, S]: rows of [buffers B*S | node proj N];
    scratch_vis [N, Smax]: scratch entries on the node's path (-1 pad); comp_cos/comp_sin
    [M, rope_dim/2] (float32): RoPE of the scratch entries, computed in float64 on the host;
    pos_mod [N] = pos % ratio; attn_idx int32 [N, window (+ Emax + Smax)]: the whole attention
    list where it is static (SWA, HCA; rows of [window pool | nodes | comp pool | scratch]);
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
    pos_mod: torch.Tensor | None = None
    attn_idx: torch.Tensor | None = None
    comp_cos: torch.Tensor | None = None
    comp_sin: torch.Tensor | None = None
    flashmla_sched: object = None


@dataclass
class VerifyScratch:
    """Per-round scratch: node latents [N, D]; compressor projections [N, C]; entries [M, *]."""

    node_kv: torch.Tensor
    comp_proj: tuple[torch.Tensor, torch.Tensor] | None = None
    idx_proj: tuple[torch.Tensor, torch.Tensor] | None = None
    comp_entries: torch.Tensor | None = None
    idx_entries: torch.Tensor | None = None
    comp_list: torch.Tensor | None = None
    comp_proj_stacked: torch.Tensor | None = None    # [2, N, C]: comp_proj's storage
    idx_proj_stacked: torch.Tensor | None = None


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


def _path_matrix(batch: TreeBatch, depth: np.ndarray) -> np.ndarray:
    """A [N, Dmax + 1]: flat id of node j's ancestor-or-self at depth d (root first), -1 past
    depth_j.  One pass per depth level (parents sit one level up)."""
    parents = np.concatenate([np.where(t.parents >= 0, t.parents + s, -1)
                              for t, s in zip(batch.trees, batch.cu_nodes[:-1])])
    A = np.full((batch.total_nodes, int(depth.max()) + 1), -1, np.int64)
    for d in range(A.shape[1]):
        nodes = np.flatnonzero(depth == d)
        if d:
            A[nodes] = A[parents[nodes]]
        A[nodes, d] = nodes
    return A


def _slot_sources(lens: np.ndarray, entry: np.ndarray, seq: np.ndarray, nodes: np.ndarray, A: np.ndarray,
                  ratio: int, overlap: bool, num_slots: int, node_offset: int) -> np.ndarray:
    """Virtual rows [M, S] of the completing windows: buffer row seq*S + slot row, or
    node_offset + the path node at that position (-1: the slot precedes position 0)."""
    s = np.arange(num_slots)[None, :]
    e = entry[:, None]
    q = ((e - 1) * ratio + s) if overlap else e * ratio + s
    if overlap:
        q = np.where(s < ratio, q, e * ratio + s - ratio)
    L = lens[seq][:, None]
    buf_row = np.where(q // ratio == L // ratio, (ratio if overlap else 0) + q % ratio, q % ratio)
    tree_rows = A[nodes[:, None], np.clip(q - L, 0, A.shape[1] - 1)] + node_offset
    out = np.where(q >= L, tree_rows, seq[:, None] * num_slots + buf_row)
    return np.where(q < 0, -1, out)


def _entry_rows(pool, lens: np.ndarray, ratio: int) -> np.ndarray:
    """[B, Emax] flat pool rows of each sequence's persistent entries (-1 pad)."""
    n = lens // ratio
    emax = int(n.max()) if n.size else 0
    return np.where(np.arange(emax)[None, :] < n[:, None], pool.all_rows()[:, :emax], -1)


def plan_verify(cache: V4Cache, batch: TreeBatch | DraftTree, w: V4LayerWeights, device=None) -> VerifyPlan:
    """Build the index lists of one round on the host (see the module docstring); numpy over
    all nodes at once (no per-node Python loop)."""
    if isinstance(batch, DraftTree):
        batch = TreeBatch((batch,))
    if batch.batch_size != cache.batch:
        raise SimtreeError(f"{batch.batch_size} trees for a cache of {cache.batch} sequences")
    W, r = cache.cfg.window, cache.ratio
    lens = cache.lens.copy()
    N, Pw = batch.total_nodes, cache.window.num_rows
    if np.any(lens + np.array([t.max_depth for t in batch.trees]) >= cache.max_len):
        raise SimtreeError(f"tree runs past the cache capacity of {cache.max_len} tokens")
    pos = np.asarray(batch.positions(lens), np.int64)
    seq = np.asarray(batch.seq_ids, np.int64)
    depth = np.concatenate([t.depth for t in batch.trees]).astype(np.int64)
    A = _path_matrix(batch, depth)
    # window: positions p-W+1 .. p; persistent below lens, else the path node at that depth
    L = lens[seq][:, None]
    qpos = pos[:, None] - W + 1 + np.arange(W)[None, :]
    pers = cache.window.flat_rows(seq[:, None], np.maximum(qpos, 0) % W)
    path = A[np.arange(N)[:, None], np.clip(qpos - L, 0, A.shape[1] - 1)] + Pw
    win = np.where(qpos >= L, path, np.where(qpos >= 0, pers, -1))
    comp_nodes = np.flatnonzero((pos + 1) % r == 0) if r else np.zeros(0, np.int64)
    comp_entry = (pos[comp_nodes] + 1) // r - 1 if r else comp_nodes
    comp_seq = seq[comp_nodes]
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=device)  # noqa: E731
    plan = VerifyPlan(batch, lens, t(pos), t(batch.seq_ids), t(win))
    if not r:
        plan.attn_idx = t(win.astype(np.int32))
        return plan
    plan.pos_mod = t(pos % r)
    M = len(comp_nodes)
    S = w.comp.num_slots
    plan.comp_nodes_host = comp_nodes
    plan.comp_nodes, plan.comp_entry, plan.comp_seq = t(comp_nodes), t(comp_entry), t(comp_seq)
    plan.comp_src = t(_slot_sources(lens, comp_entry, comp_seq, comp_nodes, A, r, w.comp.overlap, S,
                                    cache.batch * S).reshape(M, S))
    half = w.comp.rope_dim // 2
    freqs = w.comp.theta ** (-np.arange(half, dtype=np.float64) * 2.0 / w.comp.rope_dim)
    ang = (comp_entry.astype(np.float64) * r)[:, None] * freqs
    plan.comp_cos, plan.comp_sin = t(np.cos(ang).astype(np.float32)), t(np.sin(ang).astype(np.float32))
    # scratch entries on each node's path, root first, packed to the left
    m_of = np.full(N, -1, np.int64)
    m_of[comp_nodes] = np.arange(M)
    V = np.where(A >= 0, m_of[np.maximum(A, 0)], -1)
    V = np.take_along_axis(V, np.argsort(V < 0, axis=1, kind="stable"), axis=1)
    vis = V[:, :max(1, int((V >= 0).sum(1).max()))]
    plan.scratch_vis = t(vis)
    persist = _entry_rows(cache.comp, lens, r)
    if w.indexer is None:  # HCA: every visible entry
        Pc = cache.comp.num_rows
        comp_idx = np.concatenate([persist[seq], np.where(vis >= 0, vis + Pc, -1)], axis=1)
        plan.comp_idx = t(comp_idx)
        base = Pw + N
        plan.attn_idx = t(np.concatenate([win, np.where(comp_idx >= 0, comp_idx + base, -1)], 1).astype(np.int32))
    else:
        pidx = _entry_rows(cache.idx, lens, r)
        nmax = batch.max_nodes
        local = np.arange(N) - np.asarray(batch.cu_nodes[:-1], np.int64)[seq]
        pad = np.full((cache.batch, nmax), -1, np.int64)
        pad[seq, local] = np.arange(N)
        slot = seq * nmax + local
        plan.persist_comp_rows, plan.persist_idx_rows = t(persist), t(pidx)
        plan.pad_nodes, plan.node_slot = t(pad), t(slot)
    return plan


def _project_stacked(p: CompressorParams, x: torch.Tensor, pos_mod: torch.Tensor) -> torch.Tensor:
    """compressor.project into one [2, N, C] tensor (kv, score); pos_mod = pos % ratio."""
    x = x.to(p.wkv.dtype)
    out = x.new_empty(2, x.shape[0], p.wkv.shape[0])
    torch.matmul(x, p.wkv.T, out=out[0])
    torch.addmm(p.ape[pos_mod], x, p.wgate.T, out=out[1])
    return out


def _scratch_entries(p: CompressorParams, state_kv, state_score, proj, plan: VerifyPlan,
                     use_triton: bool = False, out_dtype=torch.float32) -> torch.Tensor:
    """Pool every window completing inside the trees: [M, dim] (the batched compressor form;
    the Triton form stores out_dtype = the pool's dtype, as the commit would)."""
    if use_triton:
        return pool_windows(p, state_kv, state_score, proj, plan.comp_src, plan.comp_cos, plan.comp_sin, out_dtype)
    if plan.comp_src.shape[0] == 0:
        return proj[0].new_zeros(0, p.dim)
    sources_kv = [state_kv.reshape(-1, state_kv.shape[-1]), proj[0].to(state_kv.dtype)]
    sources_s = [state_score.reshape(-1, state_score.shape[-1]), proj[1].to(state_kv.dtype)]
    kv, valid = gather_rows(plan.comp_src, sources_kv)
    score, _ = gather_rows(plan.comp_src, sources_s)
    score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    return pool_window(p, kv, score, plan.comp_entry)


def _indexer_topk(cache: V4Cache, inp: V4Inputs, scratch_keys: torch.Tensor, plan: VerifyPlan,
                  topk: int) -> torch.Tensor:
    """CSA selection in plain torch: [N, k] rows of [compressed pool | scratch], -1 where fewer
    are visible."""
    N, Hi, Di = inp.iq.shape
    cdt = inp.iq.dtype
    emax = plan.persist_idx_rows.shape[1]
    vis = plan.scratch_vis
    scores = torch.empty(N, emax + vis.shape[1], dtype=cdt, device=inp.iq.device)
    indexer_scores_torch(inp.iq, inp.iw, cache.idx.pool, plan.persist_idx_rows, plan.pad_nodes, scores)
    sk = scratch_keys.to(cdt)[vis.clamp(min=0)] if scratch_keys.shape[0] else inp.iq.new_zeros(N, vis.shape[1], Di)
    ss = (torch.relu(torch.einsum("nhd,nsd->nhs", inp.iq, sk)) * inp.iw.to(cdt).unsqueeze(-1)).sum(1)
    scores[:, emax:] = ss.masked_fill(vis < 0, float("-inf"))
    k = min(topk, scores.shape[1])
    val, sel = torch.topk(scores, k, dim=1)
    from_persist = sel < emax
    prow = plan.persist_comp_rows[plan.node_seq.unsqueeze(1), sel.clamp(max=max(emax - 1, 0))] if emax else sel
    srow = vis.gather(1, (sel - emax).clamp(min=0)) + cache.comp.num_rows
    out = torch.where(from_persist, prow, srow)
    return torch.where(torch.isneginf(val), torch.full_like(out, -1), out)


def _csa_list_triton(cache: V4Cache, inp: V4Inputs, scratch_keys: torch.Tensor, plan: VerifyPlan,
                     topk: int, base: int) -> torch.Tensor:
    """CSA selection + final index list in three launches: scores (persistent and scratch keys,
    fp32), torch.topk, and the list kernel.  Returns int32 [N, window + k]."""
    N = inp.iq.shape[0]
    emax = plan.persist_idx_rows.shape[1]
    vis = plan.scratch_vis
    scores = torch.empty(N, emax + vis.shape[1], dtype=torch.float32, device=inp.iq.device)
    indexer_scores(inp.iq, inp.iw, cache.idx.pool, plan.persist_idx_rows, plan.pad_nodes, scores,
                   scratch_keys, vis)
    val, sel = torch.topk(scores, min(topk, scores.shape[1]), dim=1)
    return selection_to_list(sel, val, plan.win_idx, plan.persist_comp_rows, vis, plan.node_seq,
                             cache.comp.num_rows, base)


def attention_lists(cache: V4Cache, w: V4LayerWeights, inp: V4Inputs, plan: VerifyPlan,
                    use_triton: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], VerifyScratch]:
    """Everything before the attention core: scratch compression, CSA top-k, and the final
    per-node index list idx [N, window + K] into sources [window pool | node latents
    (| compressed pool | scratch entries)].  use_triton: fused pooling / indexer / list
    kernels (False: plain torch, any dtype — the float64 test path)."""
    cfg = cache.cfg
    sc = VerifyScratch(node_kv=inp.kv.to(cache.window.pool.dtype))
    sources = [cache.window.pool, sc.node_kv]
    if not cache.ratio:
        return plan.attn_idx, sources, sc
    x = inp.x.to(w.comp.wkv.dtype)
    sc.comp_proj_stacked = _project_stacked(w.comp, x, plan.pos_mod)
    sc.comp_proj = (sc.comp_proj_stacked[0], sc.comp_proj_stacked[1])
    sc.comp_entries = _scratch_entries(w.comp, cache.comp_kv, cache.comp_score, sc.comp_proj, plan, use_triton,
                                       cache.comp.pool.dtype)
    sources += [cache.comp.pool, sc.comp_entries.to(cache.comp.pool.dtype)]
    base = cache.window.num_rows + sc.node_kv.shape[0]
    if w.indexer is None:  # HCA: the list is fixed by the plan
        sc.comp_list = plan.comp_idx
        return plan.attn_idx, sources, sc
    sc.idx_proj_stacked = _project_stacked(w.indexer, x, plan.pos_mod)
    sc.idx_proj = (sc.idx_proj_stacked[0], sc.idx_proj_stacked[1])
    sc.idx_entries = _scratch_entries(w.indexer, cache.idx_kv, cache.idx_score, sc.idx_proj, plan, use_triton,
                                      cache.idx.pool.dtype)
    if use_triton:
        return _csa_list_triton(cache, inp, sc.idx_entries, plan, cfg.topk, base), sources, sc
    sc.comp_list = _indexer_topk(cache, inp, sc.idx_entries.to(cache.idx.pool.dtype), plan, cfg.topk)
    idx = torch.cat([plan.win_idx, torch.where(sc.comp_list >= 0, sc.comp_list + base, -1)], dim=1)
    return idx, sources, sc


def _pad64(x: torch.Tensor) -> torch.Tensor:
    extra = -x.shape[1] % 64
    return torch.cat([x, x.new_full((x.shape[0], extra), -1)], 1) if extra else x


def _flashmla_lists(cache: V4Cache, fm: dict, idx: torch.Tensor, W: int, N: int):
    """idx (rows of [window pool | nodes | comp pool | scratch]) -> int32 lists into the FP8
    mirrors: window [N, 1, >=W] and extra [N, 1, K'] (None for SWA), padded to 64."""
    Pw = cache.window.num_rows
    win = idx[:, :W]
    win = _pad64(torch.where(win >= Pw, win - Pw + fm["window_base"], win).to(torch.int32)).view(N, 1, -1)
    if not cache.ratio:
        return win, None
    base, Pc = Pw + N, cache.comp.num_rows
    ext = idx[:, W:] if idx.shape[1] > W else idx.new_full((N, 64), -1)
    ext = torch.where(ext >= base + Pc, ext - base - Pc + fm["comp_base"], torch.where(ext >= 0, ext - base, -1))
    return win, _pad64(ext.to(torch.int32)).view(N, 1, -1)


def _flashmla_core(cache: V4Cache, w: V4LayerWeights, inp: V4Inputs, plan: VerifyPlan,
                   sc: VerifyScratch, idx: torch.Tensor) -> torch.Tensor:
    """The attention core through FlashMLA's V4 sparse decode (FP8 rows, cache.flashmla_mirror):
    the round's node latents and scratch entries are quantised into the mirrors' spare rows
    (one launch each), the lists are remapped onto the mirrors (once per plan where they are
    static: SWA, HCA), every node is one s_q = 1 query."""
    from . import flashmla as fmla
    N, H, D = inp.q.shape
    M = 0 if sc.comp_entries is None else sc.comp_entries.shape[0]
    fm = cache.flashmla_mirror(N, M)
    dev = inp.q.device
    cached = getattr(plan, "_flashmla_ids", None)
    if cached is None or cached[0] is not fm["window"]:  # spare-row ids: fixed per plan and mirror
        cached = (fm["window"], fm["window_base"] + torch.arange(N, device=dev),
                  fm.get("comp_base", 0) + torch.arange(M, device=dev))
        plan._flashmla_ids = cached
    fm["window"].write(cached[1], sc.node_kv)
    static = plan.attn_idx is not None and idx is plan.attn_idx
    lists = getattr(plan, "_flashmla_lists", None)
    if static and lists is not None and lists[0] is fm["window"]:
        win, ext = lists[1], lists[2]
    else:
        win, ext = _flashmla_lists(cache, fm, idx, plan.win_idx.shape[1], N)
        if static:
            plan._flashmla_lists = (fm["window"], win, ext)
    ext_cache = None
    if cache.ratio:
        fm["comp"].write(cached[2], sc.comp_entries)
        ext_cache = fm["comp"].k_cache
    out, plan.flashmla_sched = fmla.flashmla_sparse_attention(
        inp.q.to(torch.bfloat16).view(N, 1, H, D), win, fm["window"].k_cache, w.sink,
        cache.cfg.scale, ext, ext_cache, sched=plan.flashmla_sched)
    return out.view(N, H, D).to(inp.q.dtype)


def tree_verify(cache: V4Cache, w: V4LayerWeights, inp: V4Inputs, plan: VerifyPlan,
                attention: str = "triton") -> tuple[torch.Tensor, VerifyScratch]:
    """Verify every node of the round's trees against the persistent cache.

    inp: per-node inputs (N = plan.batch.total_nodes rows, flat tree order).
    Returns (o [N, H, D], scratch); never writes the persistent cache.
    attention: "triton" (fused Triton kernels, default), "torch" (plain torch, any dtype),
    "flashmla" (CUDA + sgl-flash-mla, head_dim 512: FP8 attention core, Triton elsewhere).
    """
    if attention not in ("triton", "torch", "flashmla"):
        raise SimtreeError(f"unknown attention {attention!r}; expected triton, torch or flashmla")
    idx, sources, sc = attention_lists(cache, w, inp, plan, use_triton=attention != "torch")
    if attention == "flashmla":
        return _flashmla_core(cache, w, inp, plan, sc, idx), sc
    if attention == "triton":
        return sparse_attention(inp.q, idx, sources, w.sink, cache.cfg.scale), sc
    return sparse_attention_torch(inp.q.to(sources[0].dtype), idx.long(), sources, w.sink, cache.cfg.scale), sc
