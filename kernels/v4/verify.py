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

Host side (once per round, shared by all layers of a kind): :func:`plan_verify`, or the same
plan built on the device: device_plan.plan_verify_device.
Device side (graph-capturable): :func:`tree_verify`.  Its default "triton" path is a handful
of launches per layer: SWA 1-2 (attention [+ split merge]); HCA + the compressor GEMMs and
one pooling kernel (the list is static, built by the plan); CSA + the indexer's GEMMs,
pooling, one indexer-scan kernel (persistent and scratch keys), torch.topk and one
list-building kernel (``fusions``: the top-k and list in one, _topk_kernel).  "torch" is the plain float64-capable form the tests
check against;
"flashmla" swaps the attention core for FlashMLA's FP8 V4 sparse decode.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from simtree.errors import SimtreeError
from simtree.trees.tree import DraftTree, TreeBatch

from .attention import gather_rows, sparse_attention, sparse_attention_torch
from .cache import V4Cache
from .compressor import CompressorParams, matmul_t, pool_window, proj_dtype
from ._indexer_kernels import indexer_scores, indexer_scores_torch, selection_to_list
from ._pool_kernel import pool_windows
from ._topk_kernel import MAX_ROW as TOPK_MAX_ROW, topk_to_list
from .reference import V4Inputs, V4LayerWeights

__all__ = ["VerifyPlan", "VerifyScratch", "plan_verify", "attention_lists", "tree_verify", "random_tree", "FUSIONS",
           "project_stacked", "layer_input"]

FUSIONS = ("topk", "pool_live", "pool_split")     # tree_verify's optional launches (_tree_verify)
POOL_SPLIT_RATIO = 64   # "pool_split" where the windows have this many slots or more (HCA's 128; CSA's 8 stay whole)


@dataclass
class VerifyPlan:
    """Index metadata of one round (device tensors unless noted). N nodes, B trees, M windows
    completing inside the trees, S compressor slots per window.

    node_seq [N]; win_idx [N, window]: rows of [window pool | node latents];
    comp_entry [M]; comp_src [M, S]: rows of [buffers B*S | node proj N];
    scratch_vis [N, Smax]: scratch entries on the node's path (-1 pad); comp_cos/comp_sin
    [M, rope_dim/2] (float32): RoPE of the scratch entries, computed in float64 on the host;
    pos_mod [N] = pos % ratio; attn_idx int32 [N, window (+ Emax + Smax)]: the whole attention
    list where it is static (SWA, HCA; rows of [window pool | nodes | comp pool | scratch]);
    persist_comp_rows, persist_idx_rows [B, Emax]; pad_nodes [B, nmax] (CSA).
    Host (numpy): lens [B]; comp_nodes_host [M]; depth_host [N]; ancestors_host [N, Dmax + 1]:
    flat id of each node's k-th ancestor (k = 0 the node itself, -1 above its root), so node
    j's root path is ancestors_host[j, depth_host[j]::-1].

    A plan built on the device (device_plan.plan_verify_device) has no host fields (batch,
    lens and the *_host tables are None); it carries their device twins instead, padded to
    its ``bounds`` (device_plan.PlanBounds): lens_device [B], cu_nodes [B + 1], depth [N]
    (-1 on padding rows), ancestors [N, max_nodes], comp_nodes [M] (-1 pad).
    """

    batch: TreeBatch
    lens: np.ndarray
    node_seq: torch.Tensor
    win_idx: torch.Tensor
    comp_entry: torch.Tensor | None = None
    comp_src: torch.Tensor | None = None
    comp_nodes_host: np.ndarray | None = None
    scratch_vis: torch.Tensor | None = None
    persist_comp_rows: torch.Tensor | None = None
    persist_idx_rows: torch.Tensor | None = None
    pad_nodes: torch.Tensor | None = None
    pos_mod: torch.Tensor | None = None
    attn_idx: torch.Tensor | None = None
    comp_cos: torch.Tensor | None = None
    comp_sin: torch.Tensor | None = None
    flashmla_sched: object = None
    ancestors_host: np.ndarray | None = None
    depth_host: np.ndarray | None = None
    lens_device: torch.Tensor | None = None
    cu_nodes: torch.Tensor | None = None
    depth: torch.Tensor | None = None
    ancestors: torch.Tensor | None = None
    comp_nodes: torch.Tensor | None = None
    bounds: object = None


@dataclass
class VerifyScratch:
    """Per-round scratch: node latents [N, D]; compressor projections [N, C]; entries [M, *]."""

    node_kv: torch.Tensor
    comp_proj: tuple[torch.Tensor, torch.Tensor] | None = None
    idx_proj: tuple[torch.Tensor, torch.Tensor] | None = None
    comp_entries: torch.Tensor | None = None
    idx_entries: torch.Tensor | None = None
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


def _ancestors(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(anc [N, Dmax + 1], depth [N]) from flat parents (-1 at roots): anc[j, k] = flat id of
    node j's k-th ancestor (k = 0: j itself), -1 above its root.  Pointer doubling over the
    whole batch: about log2(Dmax) numpy passes, no per-tree or per-level Python loop."""
    N = parents.shape[0]
    anc = np.full((N + 1, 1), -1, np.int64)   # row N (index -1): above a root
    anc[:N, 0] = np.arange(N)
    hop = np.append(parents, -1)               # the m-th ancestor, m = anc.shape[1]
    while hop.max() >= 0:
        anc = np.concatenate([anc, anc[hop]], axis=1)   # columns m..2m-1 = columns 0..m-1 of hop's row
        hop = anc[hop, anc.shape[1] // 2]              # the 2m-th ancestor: column m of hop's row
    depth = (anc[:N] >= 0).sum(1) - 1
    return anc[:N, :int(depth.max()) + 1], depth


def _window_rows(win_all: np.ndarray, seq: np.ndarray, pos: np.ndarray, anc: np.ndarray, Pw: int) -> np.ndarray:
    """[N, W] rows of [window pool | node latents] for positions p-W+1 .. p: the ring row of
    position q where q < lens (a rotation of the sequence's ring by (p+1) % W), the path node
    at q plus Pw where q >= lens (the k-th ancestor sits in column W-1-k), -1 where q < 0."""
    B, W = win_all.shape
    ring2 = np.concatenate([win_all, win_all], 1)
    st = ring2.strides
    ring = np.lib.stride_tricks.as_strided(ring2, (B, W + 1, W), (st[0], st[1], st[1]), writeable=False)
    win = ring[seq, (pos + 1) % W]                     # [N, W]: one gather of contiguous rows
    K = min(anc.shape[1], W)
    np.copyto(win[:, W - K:][:, ::-1], anc[:, :K] + Pw, where=anc[:, :K] >= 0)
    early = np.flatnonzero(pos < W - 1)                # windows reaching before position 0
    if early.size:
        sub = win[early]
        sub[np.arange(W)[None, :] < (W - 1 - pos[early])[:, None]] = -1
        win[early] = sub
    return win


def _slot_sources(lens: np.ndarray, entry: np.ndarray, seq: np.ndarray, nodes: np.ndarray, anc: np.ndarray,
                  depth: np.ndarray, ratio: int, overlap: bool, num_slots: int, node_offset: int) -> np.ndarray:
    """Virtual rows [M, S] of the completing windows: buffer row seq*S + slot row, or
    node_offset + the path node at that position (-1: the slot precedes position 0)."""
    # slot s holds position (entry - overlap) * r + s: with overlap (S = 2r) the previous window, then this one
    q = (entry[:, None] - int(overlap)) * ratio + np.arange(num_slots)[None, :]
    L = lens[seq][:, None]
    buf_row = np.where(q // ratio == L // ratio, (ratio if overlap else 0) + q % ratio, q % ratio)
    # position q >= L is the completing node's ancestor depth_node - (q - L) levels up
    up = np.clip(depth[nodes][:, None] - (q - L), 0, anc.shape[1] - 1)
    tree_rows = anc[nodes[:, None], up] + node_offset
    out = np.where(q >= L, tree_rows, seq[:, None] * num_slots + buf_row)
    return np.where(q < 0, -1, out)


def _scratch_visible(lens: np.ndarray, seq: np.ndarray, depth: np.ndarray, anc: np.ndarray, m_of: np.ndarray,
                     ratio: int) -> np.ndarray:
    """[N, Smax] scratch entries on each node's path, root first, -1 pad (Smax >= 1).  The
    windows completing on a path sit at the periodic depths d0, d0 + r, ... <= depth_j with
    d0 = (r - 1 - lens) % r, so this is one gather (no per-row sort)."""
    d0 = (ratio - 1 - lens[seq]) % ratio
    cnt = np.where(depth >= d0, (depth - d0) // ratio + 1, 0)
    d = d0[:, None] + ratio * np.arange(max(1, int(cnt.max())))[None, :]
    up = depth[:, None] - d
    ok = up >= 0
    return np.where(ok, m_of[anc[np.arange(len(seq))[:, None], np.maximum(up, 0)]], -1)


def _entry_rows(pool, lens: np.ndarray, ratio: int) -> np.ndarray:
    """[B, Emax] flat pool rows of each sequence's persistent entries (-1 pad): one copy of the
    block-table rows, then -1 past the end of the (usually few) shorter sequences."""
    n = lens // ratio
    emax = int(n.max()) if n.size else 0
    out = pool.all_rows()[:, :emax].copy()
    short = np.flatnonzero(n < emax)
    if short.size:
        sub = out[short]
        sub[np.arange(emax)[None, :] >= n[short][:, None]] = -1
        out[short] = sub
    return out


def _entry_rows_torch(rows: torch.Tensor, n: np.ndarray) -> torch.Tensor:
    """_entry_rows from the pool's block rows already on the device (rows [B, capacity])."""
    emax = int(n.max()) if n.size else 0
    keep = torch.arange(emax, device=rows.device)[None, :] < torch.as_tensor(n, device=rows.device)[:, None]
    return torch.where(keep, rows[:, :emax], -1)


# Building the CSA persistent rows on the device (from the pool's block rows, uploaded once)
# pays off once the [B, Emax] array is large: H200, reports/h200/v4/plan_switches.csv, a
# round's host planning at batch 64 / 128K tokens 9.4 -> 1.7 ms, batch 4 / 128K 1.5 -> 1.2 ms,
# but 0.1-0.2 ms slower at 4K tokens with batch <= 16.  Packing a plan's small arrays into one
# upload per dtype measured within +-0.1 ms of one copy per array there (slower for HCA), so
# it stays off; tests switch it on to check it is exact.
DEVICE_PERSIST_MIN_ENTRIES = 1 << 16
PACK_UPLOADS = False


def _persist_on_device(dev: torch.device, batch: int, emax: int) -> bool:
    return dev.type != "cpu" and batch * emax >= DEVICE_PERSIST_MIN_ENTRIES


def _persist_rows(pool, lens: np.ndarray, ratio: int, device) -> torch.Tensor:
    """The CSA plan's [B, Emax] persistent rows as a tensor on ``device``: the numpy form
    uploaded, or (accelerators, at least DEVICE_PERSIST_MIN_ENTRIES entries) built there from
    the pool's block rows, so a round neither fills nor uploads a [B, Emax] host array (two
    of 16 MiB each at batch 64, 128K tokens)."""
    dev = torch.device("cpu" if device is None else device)
    n = lens // ratio
    if not _persist_on_device(dev, n.size, int(n.max()) if n.size else 0):
        return torch.as_tensor(_entry_rows(pool, lens, ratio), device=dev)
    return _entry_rows_torch(pool.all_rows_on(dev), n)

_PACK_MAX_BYTES = 1 << 18            # larger arrays go alone (staging them would add a host copy)


def upload(arrays: dict, device) -> dict:
    """Host numpy arrays -> tensors on ``device``, same values, dtypes and shapes (on the CPU
    zero-copy, torch.as_tensor).  With PACK_UPLOADS every small array of one dtype is staged
    into one buffer (segments 128-byte aligned) and sent in a single host->device copy, whose
    contiguous views the tensors are — one synchronous copy per dtype and round instead of one
    per array (a plan has 10-15 of them)."""
    dev = torch.device("cpu" if device is None else device)
    pack = PACK_UPLOADS
    out, groups = {}, {}
    for k, a in arrays.items():
        a = np.ascontiguousarray(a)
        if not pack or a.nbytes > _PACK_MAX_BYTES:
            out[k] = torch.as_tensor(a, device=dev)
        else:
            groups.setdefault(a.dtype, []).append((k, a))
    for dt, items in groups.items():
        align = max(1, 128 // dt.itemsize)
        offs, n = [], 0
        for _, a in items:
            offs.append(n)
            n += -(-a.size // align) * align
        buf = np.zeros(max(n, 1), dt)
        for (_, a), o in zip(items, offs):
            buf[o:o + a.size] = a.reshape(-1)
        dbuf = torch.as_tensor(buf, device=dev)
        for (k, a), o in zip(items, offs):
            out[k] = dbuf[o:o + a.size].view(a.shape)
    return out


def plan_verify(cache: V4Cache, batch: TreeBatch | DraftTree, w: V4LayerWeights, device=None) -> VerifyPlan:
    """Build the index lists of one round on the host (see the module docstring); numpy over
    all nodes at once (no per-node, per-tree or per-slot Python loop), uploaded by
    :func:`upload`."""
    if isinstance(batch, DraftTree):
        batch = TreeBatch((batch,))
    if batch.batch_size != cache.batch:
        raise SimtreeError(f"{batch.batch_size} trees for a cache of {cache.batch} sequences")
    W, r = cache.cfg.window, cache.ratio
    lens = cache.lens.copy()
    N, Pw = batch.total_nodes, cache.window.num_rows
    cu = batch.cu_nodes
    seq = np.repeat(np.arange(batch.batch_size, dtype=np.int64), np.diff(cu))
    anc, depth = _ancestors(batch.parents_global)
    if np.any(lens + np.maximum.reduceat(depth, cu[:-1]) >= cache.max_len):
        raise SimtreeError(f"tree runs past the cache capacity of {cache.max_len} tokens")
    pos = lens[seq] + depth
    win = _window_rows(cache.window.all_rows(), seq, pos, anc, Pw)
    plan = VerifyPlan(batch, lens, None, None, ancestors_host=anc, depth_host=depth)
    host = {"node_seq": seq, "win_idx": win}
    if not r:
        host["attn_idx"] = win.astype(np.int32)
        return _finish(plan, host, device)
    comp_nodes = np.flatnonzero((pos + 1) % r == 0)
    comp_entry = (pos[comp_nodes] + 1) // r - 1
    M = len(comp_nodes)
    S = w.comp.num_slots
    plan.comp_nodes_host = comp_nodes
    host.update(pos_mod=pos % r, comp_entry=comp_entry)
    host["comp_src"] = _slot_sources(lens, comp_entry, seq[comp_nodes], comp_nodes, anc, depth, r, w.comp.overlap, S,
                                     cache.batch * S).reshape(M, S)
    freqs = w.comp.inv_freq()
    ang = (comp_entry.astype(np.float64) * r)[:, None] * freqs
    host["comp_cos"], host["comp_sin"] = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    m_of = np.full(N + 1, -1, np.int64)   # [N] = -1: above a root
    m_of[comp_nodes] = np.arange(M)
    vis = _scratch_visible(lens, seq, depth, anc, m_of, r)
    host["scratch_vis"] = vis
    if w.indexer is None:  # HCA: every visible entry
        persist = _entry_rows(cache.comp, lens, r)
        Pc, E, Sv = cache.comp.num_rows, persist.shape[1], vis.shape[1]
        base = Pw + N
        # per-sequence rows once ([B, E]), then one gather (not per node x entry)
        ext32 = np.zeros((cache.batch, W + E + Sv), np.int32)
        ext32[:, W:W + E] = np.where(persist >= 0, persist + base, -1)
        attn = ext32[seq]
        attn[:, :W] = win
        attn[:, W + E:] = np.where(vis >= 0, vis + (Pc + base), -1)
        host["attn_idx"] = attn
    else:
        nmax = batch.max_nodes
        local = np.arange(N) - cu[:-1][seq]
        pad = np.full((cache.batch, nmax), -1, np.int64)
        pad[seq, local] = np.arange(N)
        host["pad_nodes"] = pad
        plan.persist_comp_rows = _persist_rows(cache.comp, lens, r, device)
        plan.persist_idx_rows = _persist_rows(cache.idx, lens, r, device)
    return _finish(plan, host, device)


def _finish(plan: VerifyPlan, host: dict, device) -> VerifyPlan:
    for k, v in upload(host, device).items():
        setattr(plan, k, v)
    return plan


def project_stacked(p: CompressorParams, x: torch.Tensor, pos_mod: torch.Tensor) -> torch.Tensor:
    """compressor.project into one [2, N, C] tensor (kv, score); pos_mod = pos % ratio."""
    dt = proj_dtype(p)
    if p.wkv.dtype == dt:                               # fp32 (float64) weights: today's two GEMMs
        x = x.to(dt)
        out = x.new_empty(2, x.shape[0], p.wkv.shape[0])
        torch.matmul(x, p.wkv.T, out=out[0])
        torch.addmm(p.ape[pos_mod], x, p.wgate.T, out=out[1])
        return out
    out = torch.empty((2, x.shape[0], p.wkv.shape[0]), dtype=dt, device=x.device)
    matmul_t(x, p.wkv, dt, out=out[0])
    matmul_t(x, p.wgate, dt, out=out[1], bias=p.ape[pos_mod])
    return out


def _scratch_entries(p: CompressorParams, state_kv, state_score, proj, plan: VerifyPlan,
                     use_triton: bool = False, out_dtype=torch.float32, fusions: tuple = ()) -> torch.Tensor:
    """Pool every window completing inside the trees: [M, dim] (the batched compressor form;
    the Triton form stores out_dtype = the pool's dtype, as the commit would; ``fusions``
    "pool_live": padding rows skipped; "pool_split": that, and windows of POOL_SPLIT_RATIO or
    more slots pooled over (window, channels) programs)."""
    if use_triton:
        return pool_windows(p, state_kv, state_score, proj, plan.comp_src, plan.comp_cos, plan.comp_sin, out_dtype,
                            split="pool_split" in fusions and p.ratio >= POOL_SPLIT_RATIO,
                            skip_padding=bool({"pool_live", "pool_split"} & set(fusions)))
    if plan.comp_src.shape[0] == 0:
        return proj[0].new_zeros(0, p.dim)
    sources_kv = [state_kv.reshape(-1, state_kv.shape[-1]), proj[0].to(state_kv.dtype)]
    sources_s = [state_score.reshape(-1, state_score.shape[-1]), proj[1].to(state_kv.dtype)]
    kv, valid = gather_rows(plan.comp_src, sources_kv)
    score, _ = gather_rows(plan.comp_src, sources_s)
    score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    # a padding row of a device plan has no slot at all: zeros, as the Triton kernel gives,
    # instead of the NaN of a softmax over nothing (every real window has its last slot)
    return torch.where(valid.any(1, keepdim=True), pool_window(p, kv, score, plan.comp_entry), 0.0)


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
                     topk: int, base: int, fused_topk: bool = False) -> torch.Tensor:
    """CSA selection + final index list: scores (persistent and scratch keys, fp32), then
    torch.topk and the list kernel, or (``fused_topk``, rows of at most _topk_kernel.MAX_ROW)
    the one-launch selection of _topk_kernel.  Returns int32 [N, window + k]."""
    N = inp.iq.shape[0]
    emax = plan.persist_idx_rows.shape[1]
    vis = plan.scratch_vis
    scores = torch.empty(N, emax + vis.shape[1], dtype=torch.float32, device=inp.iq.device)
    indexer_scores(inp.iq, inp.iw, cache.idx.pool, plan.persist_idx_rows, plan.pad_nodes, scores,
                   scratch_keys, vis)
    k = min(topk, scores.shape[1])
    if fused_topk and 0 < k and scores.shape[1] <= TOPK_MAX_ROW:
        return topk_to_list(scores, k, plan.win_idx, plan.persist_comp_rows, vis, plan.node_seq,
                            cache.comp.num_rows, base)
    val, sel = torch.topk(scores, k, dim=1)
    return selection_to_list(sel, val, plan.win_idx, plan.persist_comp_rows, vis, plan.node_seq,
                             cache.comp.num_rows, base)


def _projections(w: V4LayerWeights, inp: V4Inputs, plan: VerifyPlan) -> list[torch.Tensor]:
    """[2, N, C] of every compressor of the layer (KV, then the indexer's): two GEMMs each."""
    comps = [p for p in (w.comp, w.indexer) if p is not None]
    return [project_stacked(p, layer_input(w, inp), plan.pos_mod) for p in comps]


def layer_input(w: V4LayerWeights, inp: V4Inputs) -> torch.Tensor:
    """The compressors' input: cast once a layer to their weights' dtype where they are the
    projections' own (fp32 copies), as it comes (bf16) where matmul_t meets it at the weights'."""
    dt = proj_dtype(w.comp)
    return inp.x.to(dt) if w.comp.wkv.dtype == dt else inp.x


def attention_lists(cache: V4Cache, w: V4LayerWeights, inp: V4Inputs, plan: VerifyPlan,
                    use_triton: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], VerifyScratch]:
    """Everything before the attention core: scratch compression, CSA top-k, and the final
    per-node index list idx [N, window + K] into sources [window pool | node latents
    (| compressed pool | scratch entries)].  use_triton: fused pooling / indexer / list
    kernels (False: plain torch, any dtype — the float64 test path)."""
    return _attention_lists(cache, w, inp, plan, use_triton, ())


def _attention_lists(cache, w, inp, plan, use_triton: bool, fusions: tuple):
    """attention_lists with ``fusions`` (Triton path only: "topk" the CSA top-k and list in one
    launch; "pool_live" / "pool_split" the compressors' pooling: kernels/layers/forms.py, v4_pool),
    which only ``_tree_verify`` (the private fused entry, kernels/v4/_launched.py) passes."""
    cfg = cache.cfg
    sc = VerifyScratch(node_kv=inp.kv.to(cache.window.pool.dtype))
    sources = [cache.window.pool, sc.node_kv]
    if not cache.ratio:
        return plan.attn_idx, sources, sc
    projs = _projections(w, inp, plan)
    sc.comp_proj_stacked = projs[0]
    sc.comp_proj = (sc.comp_proj_stacked[0], sc.comp_proj_stacked[1])
    sc.comp_entries = _scratch_entries(w.comp, cache.comp_kv, cache.comp_score, sc.comp_proj, plan, use_triton,
                                       cache.comp.pool.dtype, fusions)
    sources += [cache.comp.pool, sc.comp_entries.to(cache.comp.pool.dtype)]
    base = cache.window.num_rows + sc.node_kv.shape[0]
    if w.indexer is None:  # HCA: the list is fixed by the plan
        return plan.attn_idx, sources, sc
    sc.idx_proj_stacked = projs[1]
    sc.idx_proj = (sc.idx_proj_stacked[0], sc.idx_proj_stacked[1])
    sc.idx_entries = _scratch_entries(w.indexer, cache.idx_kv, cache.idx_score, sc.idx_proj, plan, use_triton,
                                      cache.idx.pool.dtype, fusions)
    if use_triton:
        return (_csa_list_triton(cache, inp, sc.idx_entries, plan, cfg.topk, base, "topk" in fusions),
                sources, sc)
    comp_list = _indexer_topk(cache, inp, sc.idx_entries.to(cache.idx.pool.dtype), plan, cfg.topk)
    idx = torch.cat([plan.win_idx, torch.where(comp_list >= 0, comp_list + base, -1)], dim=1)
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

    inp: per-node inputs (N rows in flat tree order: plan.batch.total_nodes, or a device
    plan's bounds.node_rows, padding rows included).
    Returns (o [N, H, D], scratch); never writes the persistent cache.
    attention: "triton" (fused Triton kernels, default), "torch" (plain torch, any dtype),
    "flashmla" (CUDA + sgl-flash-mla, head_dim 512: FP8 attention core, Triton elsewhere).
    The optional fused launches (FUSIONS) are the layer forms' and the benchmark's to choose:
    ``simtree.kernels.v4._launched.tree_verify_fused``.
    """
    return _tree_verify(cache, w, inp, plan, attention, ())


def _tree_verify(cache, w, inp, plan, attention: str, fusions: tuple):
    """tree_verify with ``fusions`` (of FUSIONS) run where they apply (docs/math/v4_compression.md)."""
    if attention not in ("triton", "torch", "flashmla"):
        raise SimtreeError(f"unknown attention {attention!r}; expected triton, torch or flashmla")
    bad = set(fusions) - set(FUSIONS)
    if bad:
        raise SimtreeError(f"unknown V4 verify fusion(s) {sorted(bad)}; expected of {', '.join(FUSIONS)}")
    idx, sources, sc = _attention_lists(cache, w, inp, plan, attention != "torch", tuple(fusions))
    if attention == "flashmla":
        return _flashmla_core(cache, w, inp, plan, sc, idx), sc
    if attention == "triton":
        return sparse_attention(inp.q, idx, sources, w.sink, cache.cfg.scale), sc
    return sparse_attention_torch(inp.q.to(sources[0].dtype), idx.long(), sources, w.sink, cache.cfg.scale), sc
