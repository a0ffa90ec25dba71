"""The GDN tree kernels run as a launch config asks: what the entry points (``verify.py``,
``commit.py``) call with the rule's launch, and what the benchmarks, the tuning code and the
tests call with launches of their own (``VerifyLaunch`` / ``CommitLaunch``, ``_launch.py``).

    launched_verify     the verify on a backend and switches (``_verify_triton``: the kernels)
    launched_recurrent  the per-branch recurrent baseline, checked or not, any qk_l2norm
    launched_commit     the accepted-path commit on a backend and switches
    check_verify_inputs the one-line errors for inputs the verify cannot take

Every switch a launch leaves None is the rule's (``_launch.verify_launch_config`` /
``commit_launch_config``); the backend "auto" is Triton on CUDA devices, torch elsewhere.
"""
from __future__ import annotations

import torch

from simtree.errors import SimtreeError

from . import _cuda_walk as cuda_walk
from . import _launch as rule
from ._launch import (G_PROLOGUE_MAX_NODES, G_TILE, CommitLaunch, FoldLaunch, LaunchNotApplicable,
                      VerifyLaunch)
from ._commit_torch import _check_accepted, _commit_torch
from ._launched_deferred import check_pending, launched_fold_pending, launched_fold_round
from .cache import GDNTreeCache
from .meta import TreeMeta, tree_meta
from .pending import GDNPendingPath, GDNPendingRound
from .reference import gdn_tree_verify_dense_batched
from .round_meta import walk_tables

__all__ = ["launched_verify", "launched_recurrent", "launched_commit", "check_verify_inputs"]


def check_verify_inputs(q, k, v, g, beta, state, parents, cu_nodes) -> None:
    """One-line ``SimtreeError`` for inputs the verify cannot take (shapes, non-finite or
    positive log-decay)."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3:
        raise SimtreeError(f"gdn shapes: q, k must be [N, H, K] and v [N, HV, V]; got q "
                           f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = cu_nodes.numel() - 1
    if v.shape[0] != N or tuple(g.shape) != (N, HV) or tuple(beta.shape) != (N, HV):
        raise SimtreeError(f"gdn shape mismatch: N={N}, HV={HV} from q/v but g {tuple(g.shape)}, "
                           f"beta {tuple(beta.shape)}, v {tuple(v.shape)}")
    if HV % H:
        raise SimtreeError(f"value heads HV={HV} must be a multiple of key heads H={H}")
    if tuple(state.shape) != (B, HV, K, V):
        raise SimtreeError(f"state must be [B, HV, K, V] = {(B, HV, K, V)}, got {tuple(state.shape)}")
    if parents.numel() != N:
        raise SimtreeError(f"{parents.numel()} parents for {N} nodes")
    for name, t in (("g", g), ("beta", beta)):
        if not bool(torch.isfinite(t).all()):
            raise SimtreeError(f"{name} has NaN/inf entries")
    if bool((g > 0).any()):
        raise SimtreeError("g is a log-decay and must be <= 0")


def launched_verify(q, k, v, g, beta, state, parents, cu_nodes, *, scale=None, qk_l2norm=True,
                    meta: TreeMeta | None = None, check: bool = True,
                    launch: VerifyLaunch | None = None, pending: GDNPendingPath | None = None,
                    pending_round: GDNPendingRound | None = None):
    """Every node's output as if the recurrence ran along its own root path only.

    Args: q, k [N, H, K]; v [N, HV, V]; g, beta [N, HV]; state [B, HV, K, V] fp32 (not
    modified); parents, cu_nodes: the flat trees.  ``scale`` (K^-1/2 if None) multiplies q;
    ``qk_l2norm``: q and k L2-normalised first.  ``meta``: the round's ``TreeMeta`` (built
    here if None); with it and ``check=False`` the call is free of host syncs (CUDA graphs).
    ``launch``: a ``VerifyLaunch`` (None: the backend by device, every switch by the rule).
    ``pending``: a ``GDNPendingPath`` (``deferred.py``): the paths waiting there are folded into
    ``state`` first (the walk's programs fold their own state tiles, so the state is read and
    written once) and the verify runs on the folded state.  ``pending_round``, instead: a
    ``GDNPendingRound``, the same from the round before's own buffers (the Triton walks only).

    Returns (out [N, HV, V] in q's dtype, ``GDNTreeCache`` for ``gdn_tree_commit``).  The
    Triton path computes in fp32 (fp64 inputs too).
    """
    if launch is not None and not isinstance(launch, VerifyLaunch):
        raise SimtreeError(f"launch must be a VerifyLaunch, got {type(launch).__name__}")
    ask = launch or VerifyLaunch()
    if check:
        check_verify_inputs(q, k, v, g, beta, state, parents, cu_nodes)
    meta = meta or tree_meta(parents.to(q.device), cu_nodes.to(q.device))
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if pending is not None and pending_round is not None:
        raise SimtreeError("a verify folds a pending path or a pending round, not both")
    if pending is not None:
        check_pending(pending, GDNPendingPath)
        pending.check_state(state)
    if pending_round is not None:
        check_pending(pending_round, GDNPendingRound)
        pending_round.check_state(state)
    if ask.stream:   # the K-streamed verify of single-sub-chunk trees (refused elsewhere)
        from ._launched_stream import verify_stream
        return verify_stream(q, k, v, g, beta, state, cu_nodes, meta, scale, qk_l2norm, ask,
                             pending, pending_round)
    if rule.pick_backend(ask.backend, q.device) == "torch":
        if pending is not None:
            launched_fold_pending(state, pending, launch=FoldLaunch("torch"))
        if pending_round is not None:
            launched_fold_round(state, pending_round, launch=FoldLaunch("torch"))
        out, aux = gdn_tree_verify_dense_batched(q, k, v, g, beta, state, parents, cu_nodes,
                                                 scale=scale, qk_l2norm=qk_l2norm,
                                                 return_aux=True, meta=meta)
        cache = GDNTreeCache(aux["u"].float(), aux["G"].float(), meta, qk_l2norm)
        return out.to(q.dtype), cache
    return _verify_triton(q, k, v, g, beta, state, cu_nodes, meta, scale, qk_l2norm, ask, pending,
                          pending_round)


def _verify_triton(q, k, v, g, beta, state, cu_nodes, meta: TreeMeta, scale: float,
                   qk_l2norm: bool, ask: VerifyLaunch, pending=None, pending_round=None):
    """The Triton (and, where the launch takes it, CUDA) kernels of one verify: the pre-pass,
    the K-side kernel and one of the walks, as ``ask`` over the rule's launch says; with
    ``pending`` the walk folds it into its state tiles first (the Triton walks' FOLD 1 / 2, the
    CUDA walk's flag 8, with bf16 pending u), with ``pending_round`` the round before (the
    Triton walks' FOLD 3 / 4)."""
    import triton
    import triton.language as tl

    from ._tree_kernels import (_qk_prenorm_kernel, _tree_kside_kernel, _tree_verify_kernel,
                              _tree_verify_t_kernel)
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = cu_nodes.numel() - 1
    if K < 16 or K & (K - 1) or V < 16 or V & (V - 1):
        raise SimtreeError(f"triton backend needs K and V powers of two >= 16, got K={K}, V={V}")
    # bf16/fp16 inputs: tf32 dots (their own rounding is coarser); fp32/fp64: exact fp32
    prec = "tf32" if q.dtype in (torch.bfloat16, torch.float16) else "ieee"
    cfg = rule.verify_launch_config(B, HV, V, q.device, meta.max_nodes, meta.depth_first, H,
                                    ieee=prec == "ieee")
    BT = ask.block_t or cfg.block_t
    BV = min(V, ask.block_v or cfg.block_v)
    if BT not in (16, 32, 64) or BV < 16 or BV & (BV - 1):
        raise SimtreeError(f"block_t must be 16, 32 or 64 and block_v a power of two >= 16, "
                           f"got {BT}, {BV}")
    qc, kc = q.contiguous(), k.contiguous()
    if qc.dtype == torch.float64:
        qc, kc = qc.float(), kc.float()
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    ucache16 = bool(ask.pick("u_cache_bf16", cfg)) and q.dtype in (torch.bfloat16, torch.float16)
    u = torch.empty((N, HV, V), dtype=torch.bfloat16 if ucache16 else torch.float32,
                    device=q.device)
    G = torch.empty((N, HV), dtype=torch.float32, device=q.device)
    pro = ask.pick("g_prologue", cfg) and meta.max_nodes <= G_PROLOGUE_MAX_NODES
    use_bf16 = ask.pick("u_bf16", cfg) and prec == "tf32" and not rule.INTERPRET
    DT = tl.bfloat16 if prec == "tf32" and not rule.INTERPRET else tl.float32
    sdt = bool(ask.pick("solve_bf16", cfg)) and DT == tl.bfloat16
    ready = bool(ask.pick("prenorm", cfg))
    NT = max(16, 1 << max(meta.max_nodes - 1, 1).bit_length()) if pro else 0
    kside = int(ask.pick("kside", cfg))
    kside = kside if NT > 0 else 0
    g_pass = bool(ask.pick("g_pass", cfg) or kside) and NT > 0
    cu = cu_nodes.to(q.device, torch.int64)
    # the rule's transposed walk gives way where other switches take away the K-side tiles or
    # the pre-normalised rows it walks on; asked for explicitly there, it is an error (before
    # any launch)
    if ask.transposed and not (kside and ready):
        raise LaunchNotApplicable(
            "transposed walks the K-side kernel's tiles on pre-normalised q/k: it needs kside > 0, "
            f"prenorm = 1 and trees of at most {G_PROLOGUE_MAX_NODES} nodes with g_prologue")
    walk_t = bool(ask.pick("transposed", cfg)) and bool(kside and ready)
    use_pdl = bool(ask.pick("pdl", cfg)) and rule.pdl_ok(q.device)
    dep = {"launch_pdl": True} if use_pdl else {}
    # the numbering the kernel walks (as stored, or depth-first) and its sub-chunk pairs
    order, walk, (pairs, npairs, nc) = walk_tables(meta, cu_nodes, BT, ask.heavy_first)
    order_t = order if order is not None else walk.bits
    # every input conversion before the first launch: with pdl the verify reads S0 before it
    # waits for the kernel before it, which must then be one of ours
    g32, bits32 = g.float().contiguous(), walk.bits.view(torch.int32)
    beta32, s0, vc = beta.float().contiguous(), state.float().contiguous(), v.contiguous()

    if pending_round is not None and not pending_round.armed:
        pending_round = None   # nothing was ever armed: nothing can wait

    def blockers(mt, wks, kcu):
        if pending_round is not None:
            return ["a pending round (the Triton walks fold it from its own buffers)"]
        if pending is not None and pending.u.dtype != torch.bfloat16:
            return ["a pending path with bf16 u (the CUDA walk folds that one)"]
        return rule.cuda_walk_blockers(
            kside=kside, ready=ready, BT=BT, K=K, BV=BV, mt=mt, dtypes=(q.dtype, v.dtype),
            bf16_buffers=ucache16 and use_bf16 and sdt,
            tensors=(s0, vc) + ((qc, kc) if kcu else ()), device=q.device,
            mode=1 if wks else 2 if kcu else 0)

    mt, wks, kcu, l2pf = _cuda_switches(ask, cfg, blockers)
    pf_rows = 0
    if l2pf & 3:   # the rows resident at once: how far the prefetches reach
        pf_rows = cuda_walk.resident_rows(q.device, nc, BV, mt, 1 if wks else 2 if kcu else 0, V)
    # the dot operands once: normalised, scaled, in DT; and/or G (the CUDA K-side kernel writes
    # G and the rows' multipliers itself: no pre-pass)
    if (ready or g_pass) and not kcu:
        qn = torch.empty(qc.shape, dtype=torch.bfloat16 if DT == tl.bfloat16 else torch.float32,
                         device=q.device) if ready else qc
        kn = torch.empty_like(qn) if ready else kc
        nr = triton.cdiv(N * H, 16) if ready else 0
        ntile = max(NT, G_TILE)
        ng = B * triton.cdiv(HV, G_TILE) * (ntile // G_TILE) if g_pass else 0
        _qk_prenorm_kernel[(nr + ng,)](
            qc, kc, qn, kn, N * H, scale, g32, bits32, order_t, cu, G, nr, K=K, BR=16,
            L2NORM=qk_l2norm, HV=HV, W=meta.words, NT=ntile, ORDER=order is not None,
            G_PASS=g_pass, HVB=G_TILE, RB=G_TILE, PDL=use_pdl, num_warps=4)
        qc, kc = qn, kn
    diag = tiles = None
    if kside and not wks:   # the V-free products, per (sub-chunk, sequence, key head)
        diag = torch.empty(B * HV * nc * 2 * BT * BT, device=q.device,
                           dtype=torch.bfloat16 if sdt else torch.float32)
        tiles = torch.empty(max(1, B * HV * (nc * (nc - 1) // 2) * 2 * BT * BT),
                            dtype=torch.bfloat16 if use_bf16 else torch.float32, device=q.device)
        hvb = int(ask.pick("kside_heads", cfg)) or HV // H
        if hvb < 0 or (HV // H) % hvb:
            raise SimtreeError(f"kside_heads must divide the {HV // H} value heads of a key head "
                               f"(or be 0 for all of them), got {hvb}")
    mults = None
    if kcu:
        mults = torch.empty((N, H, 2), dtype=torch.float32, device=q.device)
        cuda_walk.kside(qc, kc, g32, beta32, walk.bits, cu, pairs, npairs, nc, G, mults,
                        diag, tiles, order, pdl=use_pdl, l2norm=qk_l2norm, scale=scale, s0=s0,
                        pf=pf_rows if l2pf & 2 else 0, warps=(8, 8, 12)[kcu])
    elif kside and not wks:
        _tree_kside_kernel[(nc, B * HV // hvb)](
            qc, kc, beta32, walk.bits, order_t, cu, pairs, npairs, nc, G, diag, tiles, scale,
            H=H, HV=HV, K=K, W=meta.words, BT=BT, LOG_BT=BT.bit_length() - 1,
            L2NORM=qk_l2norm, PREC=prec, DT=DT, ORDER=order is not None, READY=ready,
            HVB=hvb, PDL=use_pdl, num_warps=kside, **dep,
            **rule.register_cap(ask.pick("kside_registers", cfg)))
    walk_launch = dict(num_warps=ask.num_warps or cfg.num_warps,
                       num_stages=ask.num_stages or cfg.num_stages,
                       **rule.register_cap(ask.pick("max_registers", cfg)))
    ran = dict(kside=kside, g_pass=int(g_pass), transposed=int(walk_t and not mt), cuda_walk=mt,
               walk_kside=int(wks), kside_cuda=kcu, l2_prefetch=l2pf)
    if mt:
        cuda_walk.walk(qc, kc, vc, beta32, s0, cu, pairs, npairs, nc, out, u, G, diag, tiles,
                       order, H=H, block_v=BV, mt=mt, pdl=use_pdl,
                       bits=walk.bits if wks else None, mults=mults,
                       pf=pf_rows if l2pf & 1 else 0, cs=bool(l2pf & 4), pfv=bool(l2pf & 8),
                       pf_late=bool(l2pf & 16), pending=pending)
        if pending is not None:
            ran["fold"] = 3
        return out, GDNTreeCache(u, G, meta, qk_l2norm, ran)
    fold = {}
    if pending_round is not None:   # FOLD 3 / 4: from the round before's buffers
        from ._launched_deferred import (FOLD_BLOCK_K, FOLD_BLOCK_P, fold_mode, round_dot16,
                                         round_fold_args)
        mode = 3 if fold_mode(K, BV, walk_launch["num_warps"]) == 2 else 4
        fold = dict(round_fold_args(pending_round), FOLD=mode, FOLD_BK=min(K, FOLD_BLOCK_K),
                    FOLD_BP=FOLD_BLOCK_P, FOLD_DOT16=round_dot16(pending_round))
        ran["fold"] = mode
    elif pending is not None:
        from ._launched_deferred import FOLD_BLOCK_K, FOLD_BLOCK_P, fold_args, fold_dot16, fold_mode
        pk, pw, pu, pdec, pon, plen, P = fold_args(pending)
        mode = fold_mode(K, BV, walk_launch["num_warps"])
        fold = dict(pk_ptr=pk, pw_ptr=pw, pu_ptr=pu, pdec_ptr=pdec, pon_ptr=pon, plen_ptr=plen,
                    P=P, FOLD=mode, FOLD_BK=min(K, FOLD_BLOCK_K), FOLD_BP=FOLD_BLOCK_P,
                    FOLD_DOT16=fold_dot16(pending))
        ran["fold"] = mode
    if walk_t:
        _tree_verify_t_kernel[(V // BV, B * HV)](
            qc, kc, vc, beta32, s0, order_t, cu, pairs, npairs, nc, out, u, G, diag, tiles,
            H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec, DT=DT,
            UDT=tl.bfloat16 if use_bf16 else tl.float32, SDT=tl.bfloat16 if sdt else tl.float32,
            ORDER=order is not None, PDL=2 if use_pdl else 0, **fold, **dep, **walk_launch)
        return out, GDNTreeCache(u, G, meta, qk_l2norm, ran)
    _tree_verify_kernel[(V // BV, B * HV)](
        qc, kc, vc, g32, beta32, s0, walk.bits, bits32, order_t, cu, pairs,
        npairs, nc, out, u, G, scale,
        H=H, HV=HV, K=K, V=V, W=meta.words, BT=BT, BV=BV, LOG_BT=BT.bit_length() - 1,
        L2NORM=qk_l2norm, PREC=prec, DT=DT, QK_READY=ready, G_READY=g_pass, NT=NT,
        UDT=tl.bfloat16 if use_bf16 else tl.float32,
        PREFETCH=bool(ask.pick("prefetch", cfg)), ORDER=order is not None,
        diag_ptr=diag, pair_ptr=tiles, KSIDE=kside > 0,
        SDT=tl.bfloat16 if kside and sdt else tl.float32,
        PDL=(2 if ready or g_pass else 1) if use_pdl else 0,
        EARLY=bool(ask.pick("early", cfg)) and kside > 0, **fold, **dep, **walk_launch)
    return out, GDNTreeCache(u, G, meta, qk_l2norm, ran)


def _cuda_switches(ask: VerifyLaunch, cfg: VerifyLaunch, blockers) -> tuple[int, bool, int, int]:
    """(cuda_walk m-tiles, walk_kside, kside_cuda, l2_prefetch bits) the launch takes: the
    CUDA kernels where they run (``blockers(mt, wks, kcu)`` names why not), the rule's choices
    giving way to the Triton kernels elsewhere; a CUDA switch asked for where it cannot run
    raises ``LaunchNotApplicable``."""
    mt = int(ask.pick("cuda_walk", cfg))
    wks = bool(ask.pick("walk_kside", cfg))
    kcu = int(ask.pick("kside_cuda", cfg))
    l2pf = int(ask.pick("l2_prefetch", cfg))
    if wks and not mt:
        if ask.walk_kside:
            raise LaunchNotApplicable("walk_kside computes the K-side tiles in the CUDA walk: "
                                      "it needs cuda_walk > 0")
        wks = False
    if kcu and not (mt and not wks):
        if ask.kside_cuda:
            raise LaunchNotApplicable("kside_cuda launches the CUDA K-side kernel for the CUDA "
                                      "walk: it needs cuda_walk > 0 (where it runs) and "
                                      "walk_kside = 0")
        kcu = 0
    if mt:   # the CUDA walk where it runs; the default falls back to the Triton walk elsewhere
        why = blockers(mt, wks, kcu)
        if why and kcu and ask.kside_cuda is None:   # the rule's K-side kernel: the walk without it
            kcu = 0
            why = blockers(mt, wks, kcu)
        if why and (ask.cuda_walk or ask.walk_kside or ask.kside_cuda):
            raise LaunchNotApplicable("cuda_walk needs " + "; ".join(why))
        if why:
            mt, wks, kcu = 0, False, 0
    if l2pf and not mt or l2pf & 2 and not kcu:
        if ask.l2_prefetch:
            raise LaunchNotApplicable("l2_prefetch is the CUDA walk's (bit 2: the CUDA K-side "
                                      "kernel's): it needs cuda_walk > 0 where it runs"
                                      + (" and kside_cuda > 0" if l2pf & 2 else ""))
        l2pf = l2pf & (31 if mt and kcu else 29 if mt else 0)
    return mt, wks, kcu, l2pf


def launched_recurrent(q, k, v, g, beta, state, parents, cu_nodes, *, scale=None,
                       qk_l2norm=True, node_states=None, check: bool = True):
    """Per-branch recurrent baseline (Triton, as serving engines verify trees today): every
    node's state computed from its parent's, reloaded from memory.

    Returns (out [N, HV, V], node states [N, HV, K, V]).  ``node_states`` may be ``state``
    itself for one-node trees (a decode step: each program reads its state block before it
    writes the new one there; contiguous fp32 state)."""
    if check:
        check_verify_inputs(q, k, v, g, beta, state, parents, cu_nodes)
    from ._recurrent_kernel import _recurrent_tree_kernel
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = cu_nodes.numel() - 1
    scale = K ** -0.5 if scale is None else float(scale)
    if node_states is None:
        node_states = torch.empty((N, HV, K, V), dtype=torch.float32, device=q.device)
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    BV = min(V, 32)
    _recurrent_tree_kernel[(V // BV, B * HV)](
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(),
        beta.float().contiguous(), state.float().contiguous(),
        parents.to(q.device, torch.int64).contiguous(), cu_nodes.to(q.device, torch.int64),
        out, node_states, scale, H=H, HV=HV, K=K, V=V, BV=BV, L2NORM=qk_l2norm,
        num_warps=4)
    return out, node_states


def launched_commit(state, k, cache: GDNTreeCache, parents, cu_nodes, accepted, *,
                    check: bool = True, launch: CommitLaunch | None = None) -> None:
    """In place: state[b] <- S* = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T.

    Args: state [B, HV, K, V] contiguous fp32 (the verify's S0, rewritten); k [N, H, K] the
    verify's keys; ``cache`` its ``GDNTreeCache``; accepted int64 [B]: LOCAL index of each
    tree's last accepted node (0 = only the root, which is still folded in: every node, the
    root included, is a real token).  ``check``: accepted nodes inside their trees (a host
    sync).  ``launch``: a ``CommitLaunch`` (None: the backend by device, the rest by
    ``commit_launch_config``).
    """
    if launch is not None and not isinstance(launch, CommitLaunch):
        raise SimtreeError(f"launch must be a CommitLaunch, got {type(launch).__name__}")
    ask = launch or CommitLaunch()
    _check_accepted(accepted, cu_nodes, check)
    B, HV, K, V = state.shape
    H = k.shape[1]
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise SimtreeError("state must be a contiguous fp32 tensor (it is updated in place)")
    if rule.pick_backend(ask.backend, state.device) == "torch":
        _commit_torch(state, k, cache, cu_nodes, accepted)
        return
    from ._tree_kernels import _tree_commit_kernel
    dot = rule.commit_dot16(cache, ask.dot16)
    cfg = rule.commit_launch_config(B, HV, V, cache.meta.max_nodes, dot)
    BV = min(V, ask.block_v or cfg.block_v)
    if BV < 16 or BV & (BV - 1):
        raise SimtreeError(f"commit block_v must be a power of two >= 16, got {BV}")
    _tree_commit_kernel[(V // BV, B * HV)](
        state, k.contiguous().float() if k.dtype == torch.float64 else k.contiguous(),
        cache.u, cache.G, cache.meta.bits, cu_nodes.to(state.device, torch.int64),
        accepted.to(state.device, torch.int64),
        H=H, HV=HV, K=K, V=V, W=cache.meta.words, BT=ask.block_t or cfg.block_t, BV=BV,
        L2NORM=cache.qk_l2norm, PREC="ieee", PATH=bool(cfg.path if ask.path is None else ask.path),
        DOT16=dot,
        num_warps=ask.num_warps or cfg.num_warps)
