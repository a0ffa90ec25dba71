"""GDN (gated delta rule) tree verification: rollback-free verify + accepted-path commit.

    out, cache = gdn_tree_verify(q, k, v, g, beta, state, parents, cu_nodes)
    gdn_tree_commit(state, k, cache, parents, cu_nodes, accepted)     # in place

Shapes: q, k [N, H, K]; v [N, HV, V]; g (log-decay <= 0), beta [N, HV] fp32;
state [B, HV, K, V] fp32; parents int64 [N] local (-1 root, topological); cu_nodes [B+1].
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from simtree.errors import SimtreeError

from .conv import conv_state_commit, tree_causal_conv
from .meta import HEAVY_FIRST_MAX_NODES, TreeMeta, tree_meta, tree_meta_host
from .reference import (_l2norm, gdn_accepted_paths_ref, gdn_sequential_ref,
                        gdn_tree_verify_dense_batched, gdn_tree_verify_dense_ref,
                        gdn_tree_verify_ref, tree_causal_conv_ref)

__all__ = ["gdn_tree_verify", "gdn_tree_commit", "gdn_tree_verify_recurrent", "tree_causal_conv",
           "conv_state_commit", "gdn_tree_verify_ref", "gdn_tree_verify_dense_ref",
           "gdn_tree_verify_dense_batched",
           "gdn_sequential_ref", "gdn_accepted_paths_ref", "tree_causal_conv_ref", "tree_meta",
           "TreeMeta", "GDNTreeCache", "verify_launch_config", "walk_tables", "verify_round_meta",
           "verify_round_meta_host", "tree_meta_host",
           "commit_launch_config", "commit_dot16", "depth_first_pays", "LaunchNotApplicable"]


class LaunchNotApplicable(SimtreeError):
    """A launch switch asked for where the other switches or the trees rule it out (the
    transposed walk without the K-side kernel or the pre-normalised q/k)."""


@dataclass
class GDNTreeCache:
    """What the commit needs: u [N, HV, V] (fp32, or bf16 where the verify ran with
    ``u_cache_bf16``), cumulative log-decay G [N, HV] fp32.  ``launch``: the switches the
    Triton backend's launch took where its dispatch can change what the rule or the caller
    asked for (``kside``, ``g_pass``, ``transposed`` - the Triton transposed walk -,
    ``cuda_walk``, ``walk_kside``, ``kside_cuda``, ``l2_prefetch``: what ran, e.g. the Triton
    kernels where the CUDA ones cannot); empty for the torch backend."""
    u: torch.Tensor
    G: torch.Tensor
    meta: TreeMeta
    qk_l2norm: bool
    launch: dict = field(default_factory=dict)


def _check_inputs(q, k, v, g, beta, state, parents, cu_nodes):
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


def _pick_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise SimtreeError(f"unknown backend {backend!r}: use 'auto', 'triton' or 'torch'")
    if backend == "auto":   # the interpreter is for tests, which ask for "triton" explicitly
        return "triton" if device.type == "cuda" else "torch"
    return backend


# Triton 3.9's interpreter multiplies bf16 dot operands wrongly (garbage), so under
# TRITON_INTERPRET=1 the bf16 path keeps fp32 dot operands; the GPU bench checks real bf16.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _has_maxnreg() -> bool:
    """Whether this Triton's CUDA backend takes a register cap (``maxnreg``)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        return "maxnreg" in CUDAOptions.__dataclass_fields__
    except Exception:  # noqa: BLE001 - another backend / Triton: no register cap
        return False


def _pdl_ok(device) -> bool:
    """Programmatic dependent launch: compiled CUDA kernels on Hopper (sm_90) or later."""
    dev = torch.device(device)
    return not _INTERPRET and dev.type == "cuda" and _sm_major(dev.index) >= 9


@functools.lru_cache(maxsize=None)
def _sm_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0] if torch.cuda.is_available() else 0


H200_SMS = 132   # streaming multiprocessors where no CUDA device is visible (the tuned GPU)


def _sm_count(device) -> int:
    return _sm_count_of(str(device))


@functools.lru_cache(maxsize=None)
def _sm_count_of(device: str) -> int:   # the rule runs once per GDN layer and step: all cached
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return H200_SMS
    return torch.cuda.get_device_properties(
        torch.cuda.current_device() if dev.index is None else dev.index).multi_processor_count


def _maxnreg(n: int) -> dict:
    return {"maxnreg": n} if n and not _INTERPRET and _has_maxnreg() else {}


# trees up to this size get every node's G in one unrolled round of loads ([NT, 32] tiles)
G_PROLOGUE_MAX_NODES = 256
# the pre-pass's G programs: G_TILE nodes x G_TILE value heads each (``tree_verify._G_tile``)
G_TILE = 16
# the CUDA walk's default reach, as measured (runs 90-91): (sequence, value head) rows from 10
# Qwen3.6-27B sequences, trees of 64-128 nodes (its shared memory grows with the sub-chunks)
CUDA_WALK_MIN_ROWS, CUDA_WALK_NODES = 10 * 48, (64, 128)


def depth_first_pays(max_nodes: int, batch_size: int) -> bool:
    """Whether renumbering a round's trees depth-first on the host (``TreeBatch.depth_first``,
    Python, once per round) costs less than it saves the GDN tree kernel over a Qwen3.6-27B
    verify (48 GDN layers).  Up to 32 nodes every order gives the kernel the same sub-chunk
    pairs (sub-chunks of >= 16 nodes; the root, in the first, is everyone's ancestor).
    reports/cpu_host/tree_renumber.csv sets the host time (this repository's CPU machine)
    beside the kernel's saving per round (48 x breadth-first - depth-first, reports/h200/gdn):
    it pays at one sequence of 128 nodes (236 us saved for 99-165 us of host time in two
    measurements).  Four sequences of 128 nodes sit inside the host's run-to-run spread (469 us
    saved against 367 us in the second measurement, 458 against 617 in the first) and stay
    off.  An engine that builds its trees on the GPU can emit this order for free."""
    return max_nodes > 64 and batch_size == 1


def verify_launch_config(B: int, HV: int, V: int, device: torch.device | str = "cuda",
                         max_nodes: int = 128, depth_first: bool = False,
                         H: int | None = None, ieee: bool = False) -> dict:
    """Default launch of the tree kernel: block_t (node sub-chunk), block_v, num_warps,
    num_stages, max_registers, and the kernel switches g_prologue / u_bf16 / prefetch /
    heavy_first / prenorm / g_pass / kside (the K-side kernel's warps, 0 = none) /
    kside_heads / solve_bf16 / u_cache_bf16 / pdl / early / kside_registers / transposed /
    cuda_walk (``ieee``: fp32 / fp64 inputs).

    Picked from the launch sweeps on the H200 (reports/h200/gdn/tuning/, runs 8, 10, 11 and
    17-20; Qwen3.6-27B shapes, ``B * HV`` = (sequence, value head) programs at block_v = V;
    prenorm as it is now, q/k norms and G in the pre-pass, is run 20's ``q2``):
    - <= 48 (one sequence): block_v 64 (two programs per head fill more SMs); trees of 32-64
      nodes take 32-node sub-chunks with 8 warps (b1 n64: 19.1 us), larger trees the pre-pass
      and 4 warps (b1 n128: 42.6 us; 8 warps without it 49.0).
    - <= 4 sequences: block_v = V, 16-node sub-chunks, 4 warps; rows prefetched from 32 nodes
      (b4 n32 16.8 vs 18.3 us; at n <= 16 prefetch costs 2-3%); the pre-pass from 64 nodes
      (b4 n128 69.3 vs 72.9; at n32 17.2 without it, 17.8 with).
    - <= 16 sequences, trees of >= 32 nodes: 4 warps and the pre-pass; rows prefetched up to
      64 nodes (b16 n32 45.1 us, n64 90.2; one stage at 168 registers 47.7 and 98.6), larger
      trees capped at 168 registers instead (three programs per SM: b16 n128 186.6 us with
      run 17's q/k-only pre-pass, 191.8 prefetched).
    - otherwise 2 warps, the pre-pass from 16 nodes (b64 n16 99.6 vs 109.1 without; b64 n128
      556.4 vs 698.3; b16 n16 30.6 vs 33.7; at 8 nodes the q/k-only pre-pass was slower at
      b16, 31.2 vs 29.0).
    Every launch takes G in one prologue (b64 n128: 871.4 vs 951.3 us without, run 8) and bf16
    operands for the dots on earlier sub-chunks' u (16-bit inputs only; b16 n64 108.7 vs 115.5).
    Trees of 65-256 nodes in 16-node sub-chunks are walked depth-first, larger subtree
    first (``TreeMeta.heavy_first``): about half the sub-chunk pairs hold ancestors then (tuning/pairs.md)
    (b64 n128 688.9 vs 840.9 us, b16 193.1 vs 230.8, b4 72.8 vs 82.3; at n <= 64 it is 1-5%
    slower, run 11).  ``device`` stays in the signature for shape-dependent choices on other
    GPUs.

    ``depth_first`` (trees stored in their heavy-first depth-first order, ``TreeMeta``): the
    kernel walks the stored order, so fewer pairs hold ancestors with no order table to read
    through (run 29, the benchmark's trees renumbered): one sequence with > 64 nodes takes
    16-node sub-chunks, rows prefetched (b1 n128 36.8 vs 40.0 us at the rule above, 42.2 in
    the breadth-first order); <= 16 sequences with 33-64 nodes one stage at 168 registers
    (b16 n64 85.9 vs 93.2 in that sweep; run 32: 93.7, against 97.4 on the breadth-first trees
    at their rule), with > 64 nodes rows prefetched, no register cap (b16 n128 179.4 vs
    195.4).  Elsewhere the rule above, minus the depth-first walk (b4 n128 58.9 vs 68.9 us
    walking breadth-first trees depth-first, b64 n128 528.7 vs 553.6).

    In either order (runs 30-31; the order hardly matters up to 64 nodes): one pipeline stage
    for trees of <= 32 nodes, and up to 64 at <= 4 sequences (b4 n32 15.3 vs 17.2 us, b64 n16
    93.5 vs 100.0, b1 n32 11.2 vs 11.4; b4 n64 32.1 vs 33.3); 16 sequences with 17-32 nodes
    then capped at 168 registers (b16 n32 45.0 vs 46.3 at one stage, 50.7 at two).

    G in the pre-pass (``g_pass``, run 40, depth-first trees): the pre-pass writes G as one
    product of the ancestor mask and g per tree (16 nodes x 16 value heads a program) instead
    of one ancestor walk per (sequence, value head): the pre-pass of the b64 n128 verify took
    86.2 us with those walks, 49.6 now, 37.1 of it the q/k rows (runs 37, 38 and 40,
    ``scripts/gdn_kernel_times.py``).  With it the pre-pass pays at one sequence from 33
    nodes (b1 n64 18.4 vs 19.3 us) and at > 4 sequences for every tree size (b64 n8 85.0 vs
    91.2, n4 81.5 vs 84.1); the G part of it from 17 nodes at 16 sequences and from 33 at
    more (b16 n32 44.5 vs 47.9 with G in each verify program, b16 n64 88.9 vs 95.7, b64 n64
    273.1 vs 278.7), not below (b16 n16 28.9 vs 30.0, b64 n32 145.3 vs 148.1).

    The V-free products by their own kernel (``kside``, runs 55-57, depth-first trees): each
    sub-chunk's inverse and diagonal block and each pair's masked k.k / q.k blocks computed
    by ``_tree_kside_kernel`` (one warp, the three value heads of a key head per program) and
    read by the verify, whose walk then keeps only the dots on V; with the diagonal tiles in
    bf16 (``solve_bf16``, as fla stores its solved inverse).  It pays at 16 sequences from 33
    nodes (b16 n64 75.9 vs 90.3 us, n128 145.4 vs 165.1 with the verify capped at 168
    registers, 173.2 without) and at 64 sequences from 32 (b64 n32 140.4 vs 146.6, n64 245.1
    vs 274.8, n128 452.9 vs 494.6); not at <= 4 sequences (b4 n64 35.5 vs 29.8, n128 about
    equal; b1 n64 26.8 vs 18.1) nor at 16 sequences of 32 nodes (45.5 vs 44.8): the extra
    launch and the tiles' round trip through memory cost more than the walk saves.

    The u buffer in bf16 (``u_cache_bf16``) and the launches programmatically dependent
    (``pdl``), runs 61-63 (``reports/h200/gdn/tuning/run61``-``run63``, depth-first trees):
    bf16 u halves the walk's largest stream (the u it writes and re-reads for later
    sub-chunks; b16 n128 134.6 vs 144.0 us, b64 n128 410.5 vs 446.9, b16 n64 68.6 vs 75.7);
    with PDL on top every measured shape gains (b16 n128 131.6, b64 n128 407.2, b16 n64 63.1,
    b64 n64 222.3, b4 n128 49.1 vs 54.7, b1 n64 16.8 vs 18.5 us, run 62).  The K-side kernel
    then pays at 64 sequences of 16 nodes too (76.7 vs 89.0).  Measured and not kept: one
    K-side program per tile (run 61: b64 n128 480.0 vs 446.9) and per-sub-chunk ready flags
    letting the walk overlap the K-side kernel (run 62: within 2% either way).

    With the K-side kernel each sub-chunk's diagonal tiles are loaded at the top of its step
    (``early``), not after its pairs: run 71, b64 n64 214.1 vs 218.0 us, b64 n128 393.0 vs
    398.2, b16 n128 124.5 vs 125.1, b16 n64 equal; run 72's benchmark 1.1-1.3% faster at all
    four (b16 n64 62.2 vs 62.9, b64 n128 397.6 vs 403.0).  Loading each pair's operands one
    pair ahead as well gained nothing (run 71: 218.1 / 398.7 / 126.3).  Off for trees of one
    sub-chunk, which have no pairs for the loads to hide behind (b64 n16: 75.3 us either way,
    run 72). Measured and not kept (runs 67 and 70): a verify with no
    sequential walk (the whole tree's inverse from a kernel of its own, four products per
    head: slower everywhere) and register caps from 96 to 200.

    The K-side kernel capped at 128 registers (``kside_registers``, runs 73-75) where that
    makes all its programs resident at once: 16 of its one-warp programs per SM instead of
    the 12 its 158 registers allow, so the cap is taken at <= 16 sequences when the programs
    (sub-chunks x sequences x key heads; ``H`` key heads, HV // 3 when not given) are more
    than 12 and at most 16 per SM.  Measured at 16 sequences of 128 nodes (2048 programs on
    132 SMs: 121.1 / 118.3 / 119.3 us against 125.9 / 122.5 / 123.9 in three runs); slower
    where they fit either way (b16 n64, 1024 programs: 70.1 vs 62.2) and where they do not
    fit either way (b64 n128, 8192: 406.0 vs 397.1).  Measured and not kept: every
    node's S0 products before the walk, 16-128 rows per product, read back from the u and o
    rows (run 73: slower at every shape with the K-side kernel, b16 n128 140-248 us); the pair
    with the sub-chunk just solved taking its u from registers instead of the u buffer (run
    74: within 1% at 16 sequences, 1.6-2.4% slower at 64); two warps at 16 sequences (run
    75: b16 n128 187-225 us); the pair table read once into registers instead of per
    sub-chunk and pair (run 77: b16 n128 126.0 vs 119.0, b64 n128 411.0 vs 390.5).

    The transposed walk (``transposed``, ``_tree_verify_t_kernel``: value rows as every
    product's M dimension, the K-side tiles read transposed) is taken at more than 16 * 48
    (sequence, value head) rows of 33-256 nodes (> 16 sequences at Qwen3.6-27B's 48 value
    heads; trees above ``G_PROLOGUE_MAX_NODES`` have no K-side kernel to walk on): faster at 64 sequences of 64 and 128 nodes (runs 78-79, two warps, three
    measurements: b64 n64 205.3 / 205.3 / 204.7 vs 214.3 / 215.3 / 213.5 us, n128 382.4 /
    385.3 / 381.2 vs 392.5 / 394.1 / 393.4), slower at b64 n32 (124.0 vs 120.1) and at 16
    sequences (b16 n128 124.9 vs 119.9, n64 66.3 vs 62.2), as it was before the K-side kernel
    existed (runs 42-43, every product in the walk: 255 registers, 1.4-2x slower).  Its bf16
    results on the GPU equal the untransposed walk's at 16 x 128 and 64 x 72 (run 80,
    ``KSIDE_CASES``: 6.19e-3 and 7.09e-3 relative error against the float64 reference).
    Where the transposed walk's two-warp programs fit in one wave and the untransposed walk's
    do not, it is taken at two warps for trees of 65-256 nodes: more than 3 and at most 5
    (sequence, value head) rows per SM (the untransposed walk holds three programs per SM at
    its 168-register cap, the transposed one five: 44 KB of shared memory each). Runs 86-87
    (depth-first trees): Qwen3.6-27B at 10, 12 and 13 sequences of 128 nodes 83.8 / 86.7 /
    90.9 us vs 98.5 / 105.0 / 111.8 (96 nodes 64.8 / 71.7 / 72.3 vs 72.4 / 82.7 / 83.8),
    Qwen3-Next (HV = 32) at 16 and 20 sequences 85.2 / 98.5 vs 106.1 / 117.3; slower where
    both fit in one wave (Qwen3.6-27B b8 n128 74.9 vs 63.0, Qwen3-Next b12 75.6 vs 65.6) or
    neither does (b16 n128 131.2 vs 120.9, b15 122.8 vs 116.7, b14 117.0 vs 113.8, Qwen3-Next
    b22 122.9 vs 121.2), equal at 64 nodes
    (Qwen3-Next b16 52.1 vs 52.0). The rest of the transposed rule counts rows too: at
    Qwen3-Next's 32 value heads it switches at 25 sequences; run 86 measured it there at
    24-64 sequences of 64 and 128 nodes, within 2.5% of the best other launch everywhere.
    ``ieee`` (fp32 or fp64 inputs: every dot in exact fp32, no tensor cores): the untransposed
    walk at eight warps beyond 4 sequences' rows. Run 88 (Qwen3.6-27B heads, depth-first trees,
    fp32 inputs): at two warps the fp32 walks compile to 32 registers with 2,900-3,800 spilled,
    15-19x slower than eight warps at 64 sequences (b64 n128 54.4 ms vs 2.85, n32 9.17 vs 0.60,
    n16 4.83 vs 0.31; four warps 6.7 / 1.33 / 0.81 ms); at 12 sequences eight warps beat the
    rule's four and its transposed walk too (n32 0.27 vs 0.46 ms, n128 0.80 vs 2.68, four warps
    untransposed 0.89), and at 16 sequences (n64 0.43 vs 0.73 ms, n128 0.98 vs 1.04).
    Measured and not kept: the K-side kernel normalising q and k itself and storing the rows
    for the verify, the pre-pass then writing G only (run 80: slower at every shape, b16 n64
    67.9 vs 61.5 us, b64 n128 441.8 vs 392.5; each pair's k rows normalised again), and the
    pre-pass writing each q / k row's normalising factor instead of the rows, the K-side
    kernel and the walk scaling their products by them (run 83: within 1.2% at every K-side
    shape, b64 n128 376.9 vs 381.2 us, b16 n128 120.4 vs 119.6), and the batch in chunks of
    sequences, each chunk's K-side kernel (and pre-pass) on a second stream beside the walk of
    the chunk before (run 84: slower at every shape, b64 n128 402.5 vs 384.4 us with two
    chunks, b16 n128 135.9 vs 119.7), and each step's loads (rows, diagonal tiles) issued one
    step ahead in either walk (run 85: b64 n128 384.7 either way, b16 n128 117.8 vs 120.8).

    The CUDA walk (``cuda_walk``, ``cuda/walk.cu``: the transposed walk hand-written, S0^T
    held in registers as mma fragments, u^T's fragments kept in shared memory for later
    sub-chunks, each sub-chunk's rows and tiles copied one sub-chunk ahead) replaces the
    Triton walks from 10 sequences' rows (480) with 64-128 nodes, on Hopper or newer.  Run 91 (Qwen3.6-27B,
    depth-first trees), the whole verify against the rule without it: faster at every shape
    measured, 10-64 sequences of 64, 96 and 128 nodes (b10 n128 73.6 vs 82.3 us,
    b13 n96 68.0 vs 71.5, b16 n128 92.3 vs 119.5, b64 n128 334.4 vs 383.6).  Below 10
    sequences, below 64 and beyond 128 nodes it was not measured; at Qwen3-Next's 32 value
    heads (taken from 15 sequences, by rows) neither timed nor checked on the GPU.
    There it runs after the CUDA K-side kernel (``kside_cuda``, runs 94-99): one program per
    (sequence, key head) writes the tiles, G and each row's q / k multipliers, so neither the
    pre-pass nor the Triton K-side kernel runs and the walk reads raw q / k.  Against the
    rule before (the walk on the Triton K-side kernel's tiles), depth-first trees, run 99:
    b16 n128 84.8 vs 92.3 us, b64 n128 301.6 vs 332.9, b16 n64 51.7 vs 57.1, b10 n96 56.5
    vs 58.2; faster at all 12 shapes of 10-64 sequences x 64-128 nodes, and on
    breadth-first trees (b16 n128 88.1 vs 96.4, b64 n128 315.1 vs 344.8).  The walk that
    computes the K-side tiles itself (``walk_kside``) was faster than it at three of those
    shapes by at most 1.7%, 5-7% slower at 16-64 sequences of 96 nodes and 15-23% slower at
    16-64 sequences of 128 (its k and u histories in shared memory grow with the
    sub-chunks), so the rule leaves it off.  The CUDA K-side kernel runs at 12 warps a
    program and prefetches the walk's first states into L2 (``kside_cuda=2, l2_prefetch=2``,
    runs 100-103): b16 n128 79.9 vs 84.7 us, b64 n64 171.0 vs 177.9, best or within 0.5% at 7
    of 8 shapes of 10-64 sequences x 64 / 128 nodes; at b10 n128, the exception, 8 warps
    with the prefetch (65.9 vs 68.9), which the rule keeps below 512 rows of more than 96
    nodes (Qwen3-Next's 32 value heads, run 107: 12 warps faster at 16 sequences of 128
    nodes, 64.5 vs 69.6 us; the CUDA kernels 1.2-1.4x faster than the Triton walk at 16-64
    sequences of 64 and 128 nodes).  Beyond 64 nodes each walk program also prefetches the state of the one
    that takes its place, two sub-chunks before its end (``l2_prefetch=19``, runs 104-106:
    b16 n128 78.2-79.1 us over 8 tree sets vs 79.5-80.6, b64 n128 292.4 vs 296.8).  The
    benchmark (run 105): b16 n128 81.4 us, 2.95x the memory floor (80.3 with
    ``l2_prefetch=2`` in the same call), b64 n128 292.9, 2.65x.
    """
    rows = B * HV
    cfg = dict(block_t=16, block_v=V, num_warps=2, num_stages=2, max_registers=0, g_prologue=1,
               u_bf16=1, prefetch=0, heavy_first=0, prenorm=1, kside=0, kside_heads=0, solve_bf16=0,
               u_cache_bf16=1, pdl=1, kside_registers=0, transposed=0, cuda_walk=0,
               walk_kside=0, kside_cuda=0, l2_prefetch=0,
               g_pass=int(max_nodes > (16 if rows <= 16 * 48 else 32)))
    if rows <= 48:
        big, huge = max_nodes >= 32, max_nodes > 64
        cfg.update(block_t=32 if big else 16, block_v=min(V, 64),
                   num_warps=4 if huge or not big else 8, prenorm=int(max_nodes > 32))
    elif rows <= 4 * 48:
        cfg.update(num_warps=4, prefetch=int(max_nodes >= 32), prenorm=int(max_nodes >= 64))
    elif rows <= 16 * 48 and max_nodes >= 32:
        small = max_nodes <= 64
        cfg.update(num_warps=4, prefetch=int(small), max_registers=0 if small else 168)
    if depth_first:
        if rows <= 48 and max_nodes > 64:
            cfg.update(block_t=16, prefetch=1)
        elif 4 * 48 < rows <= 16 * 48 and max_nodes > 64:
            cfg.update(prefetch=1, max_registers=0)
        elif 4 * 48 < rows <= 16 * 48 and max_nodes > 32:
            cfg.update(prefetch=0, num_stages=1, max_registers=168)
    if max_nodes <= 32 or (48 < rows <= 4 * 48 and max_nodes <= 64):
        cfg["num_stages"] = 1
        if 4 * 48 < rows <= 16 * 48 and max_nodes > 16:
            cfg["max_registers"] = 168
    if rows <= 4 * 48:
        cfg["g_pass"] = cfg["prenorm"]
    elif max_nodes >= (33 if rows <= 16 * 48 else 16):
        # the V-free products by their own kernel (runs 55-57; 64 sequences of 16: run 62)
        cfg.update(kside=1, solve_bf16=1, g_pass=1)
        if rows <= 16 * 48 and max_nodes > 64:
            cfg["max_registers"] = 168
        programs = -(-max_nodes // cfg["block_t"]) * B * (H or HV // 3)
        sms = _sm_count(device)
        if rows <= 16 * 48 and 12 < programs / sms <= 16:
            cfg["kside_registers"] = 128
        # the transposed walk on the K-side tiles (runs 78-81); and at two warps where its
        # programs fit in one wave and the untransposed walk's do not (runs 86-87)
        one_wave = 3 * sms < rows <= 5 * sms and 64 < max_nodes <= G_PROLOGUE_MAX_NODES
        cfg["transposed"] = int(rows > 16 * 48 and 32 < max_nodes <= G_PROLOGUE_MAX_NODES
                                or one_wave)
        if one_wave:
            cfg["num_warps"] = 2
        # the CUDA walk (cuda/walk.cu, runs 90-91) on the K-side tiles where it was measured
        # faster (>= 10 sequences' rows at 48 value heads, 64-128 nodes), wherever it can run
        # (``_cuda_walk_blockers``: else the Triton walk above)
        if rows >= CUDA_WALK_MIN_ROWS and CUDA_WALK_NODES[0] <= max_nodes <= CUDA_WALK_NODES[1]:
            # with the CUDA K-side kernel (tuning runs 94-99): no pre-pass, raw q / k rows; at
            # 12 warps a program, prefetching the walk's first states into L2 (runs 100-102),
            # but at 8 warps below 512 rows of more than 96 nodes (Qwen3.6-27B b10 n128, 480
            # rows: 8 warps 65.9 / 66.4 us, 12 warps 68.9 / 68.8, runs 102 and 105; 12 warps
            # faster at b10 n96, 50.8 vs 51.6, and at Qwen3-Next b16 n128, 512 rows, 64.5 vs
            # 69.6, run 107); beyond 64 nodes each walk program also prefetches the state of
            # the program after it, two sub-chunks before its end (runs 104-107: faster at 11
            # of 12 shapes of 10-64 sequences x 96 / 128 nodes, both head shapes, level at
            # the twelfth; slower at 64 sequences of 64 nodes)
            cfg.update(cuda_walk=2, kside_cuda=1 if rows < 512 and max_nodes > 96 else 2,
                       l2_prefetch=19 if max_nodes > 64 else 2)
    if ieee and rows > 4 * 48:   # fp32 / fp64 inputs (run 88)
        cfg.update(num_warps=8, transposed=0, cuda_walk=0, kside_cuda=0, l2_prefetch=0)
    cfg["heavy_first"] = _heavy_first_default(cfg["block_t"], max_nodes, depth_first)
    cfg["early"] = int(max_nodes > cfg["block_t"])   # one sub-chunk: no pairs to hide behind
    return cfg


def _heavy_first_default(block_t: int, max_nodes: int, depth_first: bool = False) -> int:
    """Depth-first walk where it was measured to pay: 16-node sub-chunks, trees > 64 nodes
    (measured at 128), up to HEAVY_FIRST_MAX_NODES (its order is built from dense
    [nodes, max_nodes] tables, which grow with the square of the tree size).  Never for
    trees stored depth-first already (the stored order is that walk)."""
    return int(not depth_first and block_t == 16 and 64 < max_nodes <= HEAVY_FIRST_MAX_NODES)


def walk_tables(meta: TreeMeta, cu_nodes: torch.Tensor, block_t: int,
                heavy_first: int | None = None):
    """What the tree kernel walks for sub-chunks of ``block_t``: (order or None, the TreeMeta
    of that numbering, (pairs, counts, C)).  ``heavy_first`` None: the default for this
    sub-chunk and tree size.  Cached in ``meta``: built once per round, shared by the layers."""
    order, walk = None, meta
    if (_heavy_first_default(block_t, meta.max_nodes, meta.depth_first) if heavy_first is None
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
    walk_tables(meta, cu_nodes, cfg["block_t"], cfg["heavy_first"])
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
    heavy = cfg["heavy_first"]
    meta = tree_meta_host(parents, cu, max_nodes, device, depth_first,
                          pair_blocks=() if heavy else (cfg["block_t"],))
    if heavy:
        walk_tables(meta, torch.as_tensor(cu, device=device), cfg["block_t"], heavy)
    return meta


def _cuda_walk_blockers(*, kside: int, ready: bool, BT: int, K: int, BV: int, mt: int, dtypes,
                        bf16_buffers: bool, tensors, device, mode: int = 0) -> list[str]:
    """Why the CUDA walk (``cuda_walk.py``; ``mode`` 1: the one computing the K-side tiles
    itself, 2: the one after the CUDA K-side kernel) cannot take a verify launch ([] = it
    can)."""
    from . import cuda_walk
    why = []
    if not (kside and ready):
        why.append("the K-side tiles and pre-normalised q/k (kside > 0, prenorm = 1)")
    if BT != 16 or K != 128:
        why.append(f"16-node sub-chunks and K = 128 (block_t {BT}, K {K})")
    if any(dt != torch.bfloat16 for dt in dtypes):
        why.append("bf16 q/k/v")
    if not bf16_buffers:
        why.append("bf16 u, tiles and solve (u_cache_bf16, u_bf16, solve_bf16)")
    if (BV, mt) not in cuda_walk.instances(mode):
        why.append(f"(block_v, m-tiles per warp) in {cuda_walk.instances(mode)}, "
                   f"got ({BV}, {mt})")
    if any(t.data_ptr() % 16 for t in tensors):
        why.append("16-byte aligned state and v, and q / k for the CUDA K-side kernel (its "
                   "16-byte copies)")
    if not _pdl_ok(device) or not cuda_walk.available(device):
        why.append("a CUDA GPU of compute capability >= 9.0 and nvcc to build it")
    return why


def gdn_tree_verify(q, k, v, g, beta, state, parents, cu_nodes, *, scale=None, qk_l2norm=True,
                    backend="auto", meta: TreeMeta | None = None, check: bool = True,
                    block_v: int | None = None, block_t: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    max_registers: int | None = None, g_prologue: int | None = None,
                    u_bf16: int | None = None, prefetch: int | None = None,
                    heavy_first: int | None = None, prenorm: int | None = None,
                    g_pass: int | None = None, kside: int | None = None,
                    kside_heads: int | None = None, solve_bf16: int | None = None,
                    u_cache_bf16: int | None = None, pdl: int | None = None,
                    early: int | None = None, kside_registers: int | None = None,
                    transposed: int | None = None, cuda_walk: int | None = None,
                    walk_kside: int | None = None, kside_cuda: int | None = None,
                    l2_prefetch: int | None = None):
    """Every node's output as if the recurrence ran along its own root path only.

    One pass, ``state`` is not modified.  Returns (out [N, HV, V] in q's dtype, GDNTreeCache).
    Pass a prebuilt ``meta`` (``tree_meta``, once per round) and ``check=False`` to stay
    free of host syncs (CUDA graphs).  The Triton path computes in fp32 (fp64 inputs too).
    ``block_v`` / ``block_t`` (node sub-chunk 16, 32 or 64) / ``num_warps`` / ``num_stages`` /
    ``max_registers`` (0: unbounded) / ``g_prologue`` (1: every node's cumulative decay in
    one round of loads first; trees of at most ``G_PROLOGUE_MAX_NODES`` nodes) / ``u_bf16``
    (1: bf16 operands for the dots on earlier sub-chunks' u, 16-bit inputs only) /
    ``prefetch`` (1: each sub-chunk's rows loaded while the one before is solved) /
    ``heavy_first`` (1: the kernel walks each tree depth-first, larger subtree first,
    ``TreeMeta.heavy_first``; outputs and cache stay in the stored order) / ``prenorm`` (1:
    q and k normalised and scaled once, by a small kernel before the verify, instead of in
    every sub-chunk and every pair) / ``g_pass`` (with g_prologue, 1: that kernel also
    writes every node's G, once per layer instead of once per V block, as one product of
    the ancestor mask and g per tree) / ``kside`` (> 0, with g_prologue: the products that
    need no V column - each sub-chunk's inverse and diagonal block, each sub-chunk pair's
    masked k.k and q.k blocks - by a kernel of that many warps between the pre-pass, which
    then writes G, and the verify, whose sequential walk keeps only the dots on V) /
    ``kside_heads`` (value heads per program of that kernel, sharing its k.k and q.k dots: a
    divisor of a key head's value heads, 0 for all of them) / ``solve_bf16`` (with kside, 16-bit inputs: each
    sub-chunk's inverse and diagonal block stored in bf16 and multiplied with bf16 right-hand
    sides, as fla stores its solved inverse; else fp32 / tf32) /
    ``u_cache_bf16`` (16-bit inputs, 1: the u buffer - the walk's re-reads and the commit's
    input - in bf16, as fla stores v_new and folds it into the state; the walk's dots on it
    take bf16 operands anyway) / ``pdl`` (1, CUDA on Hopper or later: the K-side kernel and
    the verify launched programmatically dependent on the kernel before, so each starts -
    the verify loading its S0 tile - while the one before finishes; ignored elsewhere) /
    ``early`` (with kside, 1: each sub-chunk's diagonal tiles loaded at the top of its step
    rather than after its pairs) / ``kside_registers`` (the K-side kernel's register cap, 0
    none) / ``transposed`` (with kside, 1: ``_tree_verify_t_kernel``, the walk with value rows
    as the products' M dimension) / ``cuda_walk`` (with kside and prenorm, > 0: the transposed
    walk by the hand-written CUDA kernel, ``cuda_walk.py``, with that many 16-row m-tiles per
    warp, whatever ``transposed`` says; bf16 inputs, K = 128, 16-node sub-chunks, Hopper or
    newer; the default takes it only where it runs, else the Triton walk) / ``walk_kside``
    (with cuda_walk, 1: the CUDA walk computes the K-side tiles itself, from the ancestor
    bits and its staged q/k rows, instead of reading them from the K-side kernel, which is
    then not launched; block_v = V = 128) / ``kside_cuda`` (with cuda_walk and without
    walk_kside, 1: the CUDA K-side kernel, ``cuda_walk.kside``, writes the tiles, G and each
    row's q / k multipliers, so neither the pre-pass nor ``_tree_kside_kernel`` runs and the
    CUDA walk reads raw q / k; 2: the same kernel at 12 warps a program instead of 8) /
    ``l2_prefetch`` (with cuda_walk, bits: 1 each walk program
    prefetches into L2 the state of the program that takes its place once a resident set
    ends, 2 the CUDA K-side kernel prefetches the states of the walk's first resident set, 4
    the walk stores o and u streaming, evict-first, 8 the walk prefetches each sub-chunk's v
    rows into L2 two sub-chunks ahead, 16 with 1: each program's prefetch two sub-chunks
    before its end rather than at its start) override ``verify_launch_config``
    (benchmark tuning).
    """
    if check:
        _check_inputs(q, k, v, g, beta, state, parents, cu_nodes)
    meta = meta or tree_meta(parents.to(q.device), cu_nodes.to(q.device))
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = cu_nodes.numel() - 1
    scale = K ** -0.5 if scale is None else float(scale)
    if _pick_backend(backend, q.device) == "torch":
        out, aux = gdn_tree_verify_dense_batched(q, k, v, g, beta, state, parents, cu_nodes,
                                                 scale=scale, qk_l2norm=qk_l2norm,
                                                 return_aux=True, meta=meta)
        cache = GDNTreeCache(aux["u"].float(), aux["G"].float(), meta, qk_l2norm)
        return out.to(q.dtype), cache
    import triton
    import triton.language as tl

    from .tree_verify import (_qk_prenorm_kernel, _tree_kside_kernel, _tree_verify_kernel,
                              _tree_verify_t_kernel)
    if K < 16 or K & (K - 1) or V < 16 or V & (V - 1):
        raise SimtreeError(f"triton backend needs K and V powers of two >= 16, got K={K}, V={V}")
    # bf16/fp16 inputs: tf32 dots (their own rounding is coarser); fp32/fp64: exact fp32
    prec = "tf32" if q.dtype in (torch.bfloat16, torch.float16) else "ieee"
    cfg = verify_launch_config(B, HV, V, q.device, meta.max_nodes, meta.depth_first, H,
                               ieee=prec == "ieee")
    BT = block_t or cfg["block_t"]
    BV = min(V, block_v or cfg["block_v"])
    if BT not in (16, 32, 64) or BV < 16 or BV & (BV - 1):
        raise SimtreeError(f"block_t must be 16, 32 or 64 and block_v a power of two >= 16, "
                           f"got {BT}, {BV}")
    qc, kc = q.contiguous(), k.contiguous()
    if qc.dtype == torch.float64:
        qc, kc = qc.float(), kc.float()
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    ucache16 = bool(cfg["u_cache_bf16"] if u_cache_bf16 is None else u_cache_bf16) \
        and q.dtype in (torch.bfloat16, torch.float16)
    u = torch.empty((N, HV, V), dtype=torch.bfloat16 if ucache16 else torch.float32,
                    device=q.device)
    G = torch.empty((N, HV), dtype=torch.float32, device=q.device)
    pro = (cfg["g_prologue"] if g_prologue is None else g_prologue) \
        and meta.max_nodes <= G_PROLOGUE_MAX_NODES
    use_bf16 = (cfg["u_bf16"] if u_bf16 is None else u_bf16) and prec == "tf32" and not _INTERPRET
    DT = tl.bfloat16 if prec == "tf32" and not _INTERPRET else tl.float32
    sdt = bool(cfg["solve_bf16"] if solve_bf16 is None else solve_bf16) and DT == tl.bfloat16
    ready = bool(cfg["prenorm"] if prenorm is None else prenorm)
    NT = max(16, 1 << max(meta.max_nodes - 1, 1).bit_length()) if pro else 0
    kside = int(cfg["kside"] if kside is None else kside)
    if kside not in (0, 1, 2, 4, 8):
        raise SimtreeError(f"kside is the K-side kernel's warps (1, 2, 4 or 8) or 0 for none, got {kside}")
    kside = kside if NT > 0 else 0
    g_pass = bool((cfg["g_pass"] if g_pass is None else g_pass) or kside) and NT > 0
    cu = cu_nodes.to(q.device, torch.int64)
    # the rule's transposed walk gives way where other switches take away the K-side tiles or
    # the pre-normalised rows it walks on; asked for explicitly there, it is an error (before
    # any launch)
    if transposed and not (kside and ready):
        raise LaunchNotApplicable(
            "transposed walks the K-side kernel's tiles on pre-normalised q/k: it needs kside > 0, "
            f"prenorm = 1 and trees of at most {G_PROLOGUE_MAX_NODES} nodes with g_prologue")
    walk_t = bool(cfg["transposed"] if transposed is None else transposed) and bool(kside and ready)
    use_pdl = bool(cfg["pdl"] if pdl is None else pdl) and _pdl_ok(q.device)
    dep = {"launch_pdl": True} if use_pdl else {}
    # the numbering the kernel walks (as stored, or depth-first) and its sub-chunk pairs
    order, walk, (pairs, npairs, nc) = walk_tables(meta, cu_nodes, BT, heavy_first)
    order_t = order if order is not None else walk.bits
    # every input conversion before the first launch: with pdl the verify reads S0 before it
    # waits for the kernel before it, which must then be one of ours
    g32, bits32 = g.float().contiguous(), walk.bits.view(torch.int32)
    beta32, s0, vc = beta.float().contiguous(), state.float().contiguous(), v.contiguous()
    mt = int(cfg["cuda_walk"] if cuda_walk is None else cuda_walk)
    wks = bool(cfg["walk_kside"] if walk_kside is None else walk_kside)
    kcu = int(cfg["kside_cuda"] if kside_cuda is None else kside_cuda)
    if kcu not in (0, 1, 2):
        raise SimtreeError(f"kside_cuda is 0 (off), 1 (8 warps a program) or 2 (12), got {kcu}")
    l2pf = int(cfg["l2_prefetch"] if l2_prefetch is None else l2_prefetch)
    if not 0 <= l2pf <= 31:
        raise SimtreeError(f"l2_prefetch is a sum of the bits 1, 2, 4, 8 and 16 (0-31), got {l2pf}")
    if wks and not mt:
        if walk_kside:
            raise LaunchNotApplicable("walk_kside computes the K-side tiles in the CUDA walk: "
                                      "it needs cuda_walk > 0")
        wks = False
    if kcu and not (mt and not wks):
        if kside_cuda:
            raise LaunchNotApplicable("kside_cuda launches the CUDA K-side kernel for the CUDA "
                                      "walk: it needs cuda_walk > 0 (where it runs) and "
                                      "walk_kside = 0")
        kcu = 0
    if mt:   # the CUDA walk where it runs; the default falls back to the Triton walk elsewhere
        def blockers():
            return _cuda_walk_blockers(
                kside=kside, ready=ready, BT=BT, K=K, BV=BV, mt=mt, dtypes=(q.dtype, v.dtype),
                bf16_buffers=ucache16 and use_bf16 and sdt,
                tensors=(s0, vc) + ((qc, kc) if kcu else ()), device=q.device,
                mode=1 if wks else 2 if kcu else 0)
        why = blockers()
        if why and kcu and kside_cuda is None:   # the rule's K-side kernel: the walk without it
            kcu = 0
            why = blockers()
        if why and (cuda_walk or walk_kside or kside_cuda):
            raise LaunchNotApplicable("cuda_walk needs " + "; ".join(why))
        if why:
            mt, wks, kcu = 0, False, 0
    if l2pf and not mt or l2pf & 2 and not kcu:
        if l2_prefetch:
            raise LaunchNotApplicable("l2_prefetch is the CUDA walk's (bit 2: the CUDA K-side "
                                      "kernel's): it needs cuda_walk > 0 where it runs"
                                      + (" and kside_cuda > 0" if l2pf & 2 else ""))
        l2pf = l2pf & (31 if mt and kcu else 29 if mt else 0)
    pf_rows = 0
    if l2pf & 3:   # the rows resident at once: how far the prefetches reach
        from . import cuda_walk
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
        hvb = int(cfg["kside_heads"] if kside_heads is None else kside_heads) or HV // H
        if hvb < 0 or (HV // H) % hvb:
            raise SimtreeError(f"kside_heads must divide the {HV // H} value heads of a key head "
                               f"(or be 0 for all of them), got {hvb}")
    mults = None
    if kcu:
        from . import cuda_walk
        mults = torch.empty((N, H, 2), dtype=torch.float32, device=q.device)
        cuda_walk.kside(qc, kc, g32, beta32, walk.bits, cu, pairs, npairs, nc, G, mults,
                        diag, tiles, order, pdl=use_pdl, l2norm=qk_l2norm, scale=scale, s0=s0,
                        pf=pf_rows if l2pf & 2 else 0, warps=(8, 8, 12)[kcu])
    elif kside and not wks:
        _tree_kside_kernel[(nc, B * HV // hvb)](
            qc, kc, beta32, walk.bits, order_t, cu, pairs, npairs, nc, G, diag, tiles, scale,
            H=H, HV=HV, K=K, W=meta.words, BT=BT, LOG_BT=BT.bit_length() - 1,
            L2NORM=qk_l2norm, PREC=prec, DT=DT, ORDER=order is not None, READY=ready,
            HVB=hvb, PDL=use_pdl, num_warps=kside, **dep, **_maxnreg(
                cfg["kside_registers"] if kside_registers is None else kside_registers))
    launch = dict(num_warps=num_warps or cfg["num_warps"],
                  num_stages=num_stages or cfg["num_stages"], **_maxnreg(
                      cfg["max_registers"] if max_registers is None else max_registers))
    ran = dict(kside=kside, g_pass=int(g_pass), transposed=int(walk_t and not mt), cuda_walk=mt,
               walk_kside=int(wks), kside_cuda=kcu, l2_prefetch=l2pf)
    if mt:
        from . import cuda_walk
        cuda_walk.walk(qc, kc, vc, beta32, s0, cu, pairs, npairs, nc, out, u, G, diag, tiles,
                       order, H=H, block_v=BV, mt=mt, pdl=use_pdl,
                       bits=walk.bits if wks else None, mults=mults,
                       pf=pf_rows if l2pf & 1 else 0, cs=bool(l2pf & 4), pfv=bool(l2pf & 8),
                       pf_late=bool(l2pf & 16))
        return out, GDNTreeCache(u, G, meta, qk_l2norm, ran)
    if walk_t:
        _tree_verify_t_kernel[(V // BV, B * HV)](
            qc, kc, vc, beta32, s0, order_t, cu, pairs, npairs, nc, out, u, G, diag, tiles,
            H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=prec, DT=DT,
            UDT=tl.bfloat16 if use_bf16 else tl.float32, SDT=tl.bfloat16 if sdt else tl.float32,
            ORDER=order is not None, PDL=2 if use_pdl else 0, **dep, **launch)
        return out, GDNTreeCache(u, G, meta, qk_l2norm, ran)
    _tree_verify_kernel[(V // BV, B * HV)](
        qc, kc, vc, g32, beta32, s0, walk.bits, bits32, order_t, cu, pairs,
        npairs, nc, out, u, G, scale,
        H=H, HV=HV, K=K, V=V, W=meta.words, BT=BT, BV=BV, LOG_BT=BT.bit_length() - 1,
        L2NORM=qk_l2norm, PREC=prec, DT=DT, QK_READY=ready, G_READY=g_pass, NT=NT,
        UDT=tl.bfloat16 if use_bf16 else tl.float32,
        PREFETCH=bool(cfg["prefetch"] if prefetch is None else prefetch), ORDER=order is not None,
        diag_ptr=diag, pair_ptr=tiles, KSIDE=kside > 0,
        SDT=tl.bfloat16 if kside and sdt else tl.float32,
        PDL=(2 if ready or g_pass else 1) if use_pdl else 0,
        EARLY=bool(cfg["early"] if early is None else early) and kside > 0, **dep, **launch)
    return out, GDNTreeCache(u, G, meta, qk_l2norm, ran)


def commit_launch_config(B: int, HV: int, V: int, max_nodes: int = 128,
                         dot16: bool = False) -> dict:
    """Default launch of the commit: the walk (path: 1 gathers the accepted path's nodes,
    0 walks nodes 0..a in stored order), block_v and num_warps; ``dot16``: u folded in with
    bf16 products (a bf16 u buffer, ``gdn_tree_commit``).

    From the commit sweep on the H200 (reports/h200/gdn/tuning/run26, Qwen3.6-27B shapes,
    each tree's last node accepted): 64-wide V blocks everywhere (stored-order walk, b64 n128
    371.6 vs 453.6 us at 32); the gathered path from 32 nodes, from 64 at one sequence
    (b64 n128 195.2 us, n64 133.1 vs 220.9; b1 n128 11.8 vs 16.3), the stored-order walk below
    (b16 n16 38.0 vs 39.9, b1 n32 7.9 vs 8.4): its one product on the accepted row's
    sub-chunk costs less than the path's bit selection when the tree is that small.
    With bf16 products (run 66, reports/h200/gdn/run66_n16up/) each step of the stored-order
    walk is one tensor-core product, cheaper than selecting the path's bits: it wins at every
    measured shape (b64 n128 139.3 vs 170.4 us, b16 n64 34.9 vs 41.2, b4 n128 14.2 vs 16.6,
    b1 n64 7.0 vs 7.6) but one sequence of 128 nodes (7.9 vs 7.6), where the path walk stays."""
    if dot16:
        path = int(max_nodes > 64 and B * HV <= 48)
    else:
        path = int(max_nodes > (32 if B * HV <= 48 else 16))
    return dict(path=path, block_v=min(V, 64), num_warps=4)


def commit_dot16(cache: GDNTreeCache, dot16: int | None = None) -> bool:
    """Whether the Triton commit folds u in with bf16 products: asked for (``dot16``), else
    where the verify stored u in bf16; never through the interpreter (fp32 dots there)."""
    return bool(cache.u.dtype == torch.bfloat16 if dot16 is None else dot16) and not _INTERPRET


def _check_accepted(accepted, cu_nodes, check):
    B = cu_nodes.numel() - 1
    if accepted.numel() != B:
        raise SimtreeError(f"accepted must have one node per tree ({B}), got {accepted.numel()}")
    if check:
        counts = (cu_nodes[1:] - cu_nodes[:-1]).to(accepted.device)
        bad = (accepted < 0) | (accepted >= counts)
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0])
            raise SimtreeError(f"accepted node {int(accepted[b])} of tree {b} is outside [0, {int(counts[b]) - 1}]")


def gdn_tree_commit(state, k, cache: GDNTreeCache, parents, cu_nodes, accepted, *,
                    backend="auto", check: bool = True, block_t: int = 16,
                    path: int | None = None, block_v: int | None = None,
                    num_warps: int | None = None, dot16: int | None = None) -> None:
    """In place: state[b] <- S* = e^{G_a} S0 + sum_{m <= a} e^{G_a - G_m} k_m u_m^T.

    accepted int64 [B]: LOCAL index of each tree's last accepted node (0 = only the root,
    which is still folded in: every node, the root included, is a real token).
    ``block_t`` (16, 32 or 64): nodes per step of the Triton kernel's walk over nodes 0..a,
    path nodes masked in (a wider step walks fewer steps for deep accepted nodes and loads
    only the path rows, at more masked-off work per step).  ``path`` (1: gather the accepted
    path's nodes, ``block_t`` at a time, instead of walking nodes 0..a) / ``block_v`` /
    ``num_warps`` override ``commit_launch_config`` (benchmark tuning); ``dot16`` (None: on
    where the verify stored u in bf16, ``u_cache_bf16``) folds u in with bf16 operands and
    fp32 accumulation instead of fp32 products.
    """
    if block_t not in (16, 32, 64):
        raise SimtreeError(f"commit block_t must be 16, 32 or 64, got {block_t}")
    _check_accepted(accepted, cu_nodes, check)
    B, HV, K, V = state.shape
    H = k.shape[1]
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise SimtreeError("state must be a contiguous fp32 tensor (it is updated in place)")
    if _pick_backend(backend, state.device) == "torch":
        # only the accepted root paths fold in: gather their rows, tree by tree (root first),
        # into [B, L, ...] (L the longest path) and fold with one batched product, in fp64
        dev = state.device
        cu = cu_nodes.to(dev, torch.int64)
        meta = cache.meta
        seq = meta.seq_ids.to(dev, torch.int64)
        local = torch.arange(seq.numel(), device=dev) - cu[seq]
        last = cu[:-1] + accepted.to(dev, torch.int64)                       # accepted row [B]
        on_path = ((meta.bits[last[seq], local // 64] >> (local % 64)) & 1).bool()  # [N]
        idx = torch.nonzero(on_path).squeeze(1)                             # path rows [P]
        ps = seq[idx]
        plen = meta.depth.to(dev, torch.int64)[last] + 1                    # path lengths [B]
        pos = torch.arange(idx.numel(), device=dev) - (torch.cumsum(plen, 0) - plen)[ps]
        L = int(plen.max())
        G = cache.G.double()
        w = torch.exp(G[last[ps]] - G[idx])                                 # e^{G_a - G_m} <= 1
        kn = _l2norm(k[idx].double(), cache.qk_l2norm).repeat_interleave(HV // H, dim=1)
        kw = torch.zeros((B, L, HV, K), dtype=torch.float64, device=dev)
        kw[ps, pos] = kn * w[..., None]
        up = torch.zeros((B, L, HV, V), dtype=torch.float64, device=dev)
        up[ps, pos] = cache.u[idx].double()
        fold = kw.permute(0, 2, 3, 1) @ up.transpose(1, 2)                  # [B, HV, K, V]
        decay = torch.exp(G[last])                                          # [B, HV]
        state.copy_((decay[:, :, None, None] * state.double() + fold).float())
        return
    from .tree_verify import _tree_commit_kernel
    dot = commit_dot16(cache, dot16)
    cfg = commit_launch_config(B, HV, V, cache.meta.max_nodes, dot)
    BV = min(V, block_v or cfg["block_v"])
    if BV < 16 or BV & (BV - 1):
        raise SimtreeError(f"commit block_v must be a power of two >= 16, got {BV}")
    _tree_commit_kernel[(V // BV, B * HV)](
        state, k.contiguous().float() if k.dtype == torch.float64 else k.contiguous(),
        cache.u, cache.G, cache.meta.bits, cu_nodes.to(state.device, torch.int64),
        accepted.to(state.device, torch.int64),
        H=H, HV=HV, K=K, V=V, W=cache.meta.words, BT=block_t, BV=BV,
        L2NORM=cache.qk_l2norm, PREC="ieee", PATH=bool(cfg["path"] if path is None else path),
        DOT16=dot,
        num_warps=num_warps or cfg["num_warps"])


def gdn_tree_verify_recurrent(q, k, v, g, beta, state, parents, cu_nodes, *, scale=None,
                              qk_l2norm=True, node_states=None, check: bool = True):
    """Per-branch recurrent baseline (Triton): returns (out [N, HV, V], node states [N, HV, K, V]).

    ``node_states`` may be ``state`` itself for one-node trees (a decode step: each program
    reads its state block before it writes the new one there; contiguous fp32 state)."""
    if check:
        _check_inputs(q, k, v, g, beta, state, parents, cu_nodes)
    from .recurrent import _recurrent_tree_kernel
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
