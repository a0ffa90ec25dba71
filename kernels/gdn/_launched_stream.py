"""``VerifyLaunch(stream=1)``: the K-streamed verify of single-sub-chunk trees
(``_stream_kernel.py``), with or without a pending round folded in.  Off in the rule
(``verify_launch_config`` sets stream = 0); the floor benchmark's ``stream`` variants time it.

    verify_stream   the launch, or ``LaunchNotApplicable`` (one line) where it cannot run
"""
from __future__ import annotations

import torch

from simtree.errors import SimtreeError

from . import _launch as rule
from ._launch import LaunchNotApplicable, VerifyLaunch
from .cache import GDNTreeCache
from .meta import TreeMeta

__all__ = ["verify_stream", "STREAM_BLOCK_K", "STREAM_BLOCK_V"]

STREAM_BLOCK_K = 32   # state rows per streamed piece
STREAM_BLOCK_V = 64   # V columns per program unless the launch says
# switches of the other walks: the streamed verify takes none of them (asked for, they are
# refused, not ignored)
_OTHER_WALKS = ("kside", "transposed", "cuda_walk", "walk_kside", "kside_cuda", "l2_prefetch",
                "prenorm", "heavy_first", "prefetch", "g_pass", "early", "kside_registers",
                "kside_heads", "solve_bf16", "g_prologue", "u_bf16", "pdl")


def stream_block_t(ask: VerifyLaunch, max_nodes: int, round_nodes: int = 0) -> int:
    """The streamed verify's sub-chunk: the launch's block_t, else the smallest of 16 / 32
    that holds every tree and the pending round's (``round_nodes``: its largest tree, 0
    none; its path is gathered in one sub-chunk); ``LaunchNotApplicable`` where none does."""
    BT = ask.block_t or (16 if max(max_nodes, round_nodes) <= 16 else 32)
    if BT not in (16, 32) or max_nodes > BT:
        raise LaunchNotApplicable(f"stream verifies trees of one sub-chunk (block_t 16 or 32, at "
                                  f"most block_t nodes): got {max_nodes} nodes at block_t {BT}")
    if round_nodes > BT:
        raise LaunchNotApplicable(f"stream folds a round of trees of at most block_t = {BT} nodes "
                                  f"(one path gather), the round before has {round_nodes}")
    return BT


def verify_stream(q, k, v, g, beta, state, cu_nodes, meta: TreeMeta, scale: float,
                  qk_l2norm: bool, ask: VerifyLaunch, pending=None, pending_round=None):
    """(out, ``GDNTreeCache``) of the streamed verify; ``pending_round`` folded into the state
    as it streams (FOLD 3 / 4's semantics).  Inputs checked by ``launched_verify``."""
    import triton.language as tl

    from ._launched_deferred import round_dot16, round_fold_args
    from ._stream_kernel import _tree_verify_stream_kernel
    if rule.pick_backend(ask.backend, q.device) != "triton":
        raise LaunchNotApplicable("stream is a Triton kernel: it needs the triton backend "
                                  "(or auto on a CUDA device)")
    if pending is not None:
        raise LaunchNotApplicable("stream folds a pending round (GDNPendingRound), not a pending "
                                  "path")
    other = [name for name in _OTHER_WALKS if getattr(ask, name)]
    if other:
        raise LaunchNotApplicable(f"stream is a walk of its own: it takes none of "
                                  f"{', '.join(other)}")
    if pending_round is not None and not pending_round.armed:
        pending_round = None   # nothing was ever armed: nothing can wait
    # an armed round's size counts whether or not its flags were cleared (reading them syncs)
    BT = stream_block_t(ask, meta.max_nodes,
                        pending_round.cache.meta.max_nodes if pending_round is not None else 0)
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = cu_nodes.numel() - 1
    BV = min(V, ask.block_v or STREAM_BLOCK_V)
    # one program per BV columns: V // BV of them cover V only where V is a power of two
    if K < 16 or K & (K - 1) or V < 16 or V & (V - 1) or BV < 16 or BV & (BV - 1):
        raise SimtreeError(f"stream needs K and V powers of two >= 16 and block_v a power of "
                           f"two >= 16, got K={K}, V={V}, block_v={BV}")
    prec = "tf32" if q.dtype in (torch.bfloat16, torch.float16) else "ieee"
    DT = tl.bfloat16 if prec == "tf32" and not rule.INTERPRET else tl.float32
    ucache16 = ask.u_cache_bf16 != 0 and prec == "tf32"   # the rule's u buffer (None: bf16)
    qc, kc = q.contiguous(), k.contiguous()
    if qc.dtype == torch.float64:
        qc, kc = qc.float(), kc.float()
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    u = torch.empty((N, HV, V), dtype=torch.bfloat16 if ucache16 else torch.float32,
                    device=q.device)
    G = torch.empty((N, HV), dtype=torch.float32, device=q.device)
    fold, ran = {}, dict(stream=1)
    if pending_round is not None:
        args = round_fold_args(pending_round)
        fold = dict(FOLD=True, FOLD_DOT16=round_dot16(pending_round),
                    **{key: args[key] for key in ("rk_ptr", "ru_ptr", "rG_ptr", "rbits_ptr",
                                                  "rcu_ptr", "racc_ptr", "pon_ptr", "RW",
                                                  "RL2NORM")})
        ran["fold"] = 5
    _tree_verify_stream_kernel[(V // BV, B * HV)](
        qc, kc, v.contiguous(), g.float().contiguous(), beta.float().contiguous(),
        state.float().contiguous(), meta.bits, meta.bits.view(torch.int32),
        cu_nodes.to(q.device, torch.int64), out, u, G, scale,
        H=H, HV=HV, K=K, V=V, W=meta.words, BT=BT, BV=BV, BK=min(K, STREAM_BLOCK_K),
        LOG_BT=BT.bit_length() - 1, L2NORM=qk_l2norm, PREC=prec, DT=DT,
        STAGES=ask.num_stages or 2, num_warps=ask.num_warps or 4, **fold,
        **rule.register_cap(ask.max_registers or 0))
    return out, GDNTreeCache(u, G, meta, qk_l2norm, ran)
