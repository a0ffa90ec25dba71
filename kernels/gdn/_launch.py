"""How the GDN tree kernels are launched: the typed launch configs and the rule that picks them.
Private to the package: the entries (``verify.py``, ``commit.py``) take the math only and run
the rule's launch; benchmarks, tuning and tests run launches of their own through
``_launched.py``.

    VerifyLaunch, CommitLaunch      frozen configs; a field left None is the rule's to pick
    FoldLaunch                      the deferred commit's launches (its defaults are constants)
    verify_launch_config            the verify's rule (sub-chunk, V block, warps, kernel switches)
    commit_launch_config            the commit's rule (path walk, V block, warps)
    depth_first_pays                whether a round's trees are worth renumbering on the host
    cuda_walk_blockers              why the CUDA walk cannot take a launch ([] = it can)

The rule reads the shape only: R = B * HV (sequence, value head) rows, the largest tree's
nodes n, the trees' stored order, the input precision and the GPU's SM count (132, an H200's,
where none is visible).  At Qwen3.6-27B's 48 value heads:

| rows R (sequences) | nodes n | verify launch                                                     |
|--------------------|---------|-------------------------------------------------------------------|
| <= 48 (1)          | < 32    | 16-node sub-chunks, block_v 64, 4 warps, one stage                |
| <= 48 (1)          | 32-64   | 32-node sub-chunks, 8 warps; the q/k + G pre-pass from 33 nodes   |
| <= 48 (1)          | > 64    | 32-node, 4 warps, pre-pass; stored depth-first 16-node, prefetch  |
| <= 192 (4)         | any     | block_v = V, 4 warps; rows prefetched from 32, pre-pass from 64   |
| <= 768 (16)        | >= 32   | 4 warps; from 33 the K-side kernel (bf16 tiles), register caps    |
| > 768 (more)       | any     | 2 warps, pre-pass; K-side kernel from 16, transposed walk 33-256  |
| >= 480 (10)        | 64-128  | CUDA K-side kernel + CUDA walk, L2 prefetches (Hopper, bf16)      |
| > 192, fp32 / fp64 | any     | the untransposed Triton walk at 8 warps                           |

Trees of 65-256 nodes stored breadth-first are walked heavy-first (16-node sub-chunks).
docs/kernels/gdn_launch.md holds the measurement behind every choice, one table.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch

from simtree.errors import SimtreeError
from simtree.kernels._triton import interpreting

from . import _cuda_walk as cuda_walk
from .meta import HEAVY_FIRST_MAX_NODES

__all__ = ["VerifyLaunch", "CommitLaunch", "FoldLaunch", "LaunchNotApplicable", "verify_launch_config",
           "commit_launch_config", "commit_dot16", "depth_first_pays", "heavy_first_default",
           "cuda_walk_blockers", "pick_backend", "G_PROLOGUE_MAX_NODES", "G_TILE", "H200_SMS"]

BACKENDS = ("auto", "triton", "torch")
# trees up to this size get every node's G in one unrolled round of loads ([NT, 32] tiles)
G_PROLOGUE_MAX_NODES = 256
# the pre-pass's G programs: G_TILE nodes x G_TILE value heads each (``tree_verify._G_tile``)
G_TILE = 16
# where the rule takes the CUDA walk: (sequence, value head) rows and tree sizes measured
CUDA_WALK_MIN_ROWS, CUDA_WALK_NODES = 10 * 48, (64, 128)
H200_SMS = 132   # streaming multiprocessors where no CUDA device is visible (the tuned GPU)
# Triton's interpreter multiplies bf16 dot operands wrongly, so under it the bf16 paths keep
# fp32 dot operands; the GPU benchmark checks real bf16.  Read once, as Triton decides per
# kernel when it is decorated.
INTERPRET = interpreting()


class LaunchNotApplicable(SimtreeError):
    """A launch switch asked for where the other switches or the trees rule it out (the
    transposed walk without the K-side kernel or the pre-normalised q/k)."""


class _Switches:
    """What the launch configs share: the switches a config sets."""

    def switches(self) -> dict:
        """The launch switches set here (not None), in field order, without the backend."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "backend" and getattr(self, f.name) is not None}


@dataclass(frozen=True)
class VerifyLaunch(_Switches):
    """How ``gdn_tree_verify`` runs; every switch left None is ``verify_launch_config``'s.

    backend: "auto" (Triton on CUDA, torch elsewhere), "triton" (the interpreter on CPU) or
    "torch" (the batched dense solve, ``gdn_tree_verify_dense_batched``).  The switches are
    the Triton backend's:

    block_t: nodes per sub-chunk (16, 32 or 64); block_v: V columns per program (a power of
    two >= 16); num_warps, num_stages; max_registers: the walk's register cap (0 none).
    g_prologue: every node's cumulative decay G in one round of loads first (trees of at most
    G_PROLOGUE_MAX_NODES).  u_bf16: bf16 operands for the dots on earlier sub-chunks' u
    (16-bit inputs).  prefetch: each sub-chunk's rows loaded while the one before is solved.
    heavy_first: the kernel walks each tree depth-first, larger subtree first
    (``TreeMeta.heavy_first``; outputs and cache stay in the stored order).  prenorm: q and k
    normalised and scaled once by a pre-pass kernel.  g_pass: with g_prologue, the pre-pass
    also writes G, as one product of the ancestor mask and g per tree.
    kside: warps of the K-side kernel (1, 2, 4 or 8; 0 none), which computes the products that
    need no V column (each sub-chunk's inverse and diagonal block, each pair's masked k.k and
    q.k blocks) so the walk keeps only the dots on V; needs g_prologue.  kside_heads: value
    heads per K-side program (a divisor of a key head's; 0 all).  solve_bf16: with kside,
    16-bit inputs, the diagonal tiles stored in bf16.  u_cache_bf16: the u buffer (the walk's
    re-reads, the commit's input) in bf16, 16-bit inputs.  pdl: programmatic dependent launch
    of each kernel on the one before (CUDA on Hopper or later; ignored elsewhere).  early:
    with kside, each sub-chunk's diagonal tiles loaded at the top of its step.
    kside_registers: the K-side kernel's register cap (0 none).  transposed: with kside and
    prenorm, the walk with value rows as the products' M dimension (``_tree_verify_t_kernel``).
    cuda_walk: with kside and prenorm, the transposed walk by the hand-written CUDA kernel
    (``cuda_walk.py``) with that many 16-row m-tiles per warp (bf16 inputs, K = 128, 16-node
    sub-chunks, Hopper or newer; the rule takes it only where it runs).  walk_kside: with
    cuda_walk, the CUDA walk computes the K-side tiles itself.  kside_cuda: with cuda_walk and
    without walk_kside, the CUDA K-side kernel writes the tiles, G and each row's q / k
    multipliers (1: 8 warps a program, 2: 12), so neither the pre-pass nor the Triton K-side
    kernel runs.  l2_prefetch (with cuda_walk), bits: 1 each walk program prefetches into L2
    the state of the program that takes its place, 2 the CUDA K-side kernel prefetches the
    states of the walk's first resident set, 4 the walk stores o and u evict-first, 8 the walk
    prefetches each sub-chunk's v rows two sub-chunks ahead, 16 with 1: that prefetch two
    sub-chunks before the program's end rather than at its start.
    stream: 1 the K-streamed verify of trees of one sub-chunk (``_stream_kernel.py``: block_t
    16 or 32, no tree larger, unset the smaller that holds the trees and an armed pending
    round's; block_v 64, 4 warps, num_stages 2 unless set; K and V powers of two; the state
    read in 32-row pieces, a pending round of trees no larger folded piece by piece;
    ``GDNTreeCache.launch`` records stream 1 and fold 5).  Of the other switches it takes
    max_registers and u_cache_bf16 only (any other set raises ``LaunchNotApplicable``); the
    rule leaves it off (not measured yet).

    A switch asked for where the others rule it out raises ``LaunchNotApplicable``; the
    rule's own choices give way there instead (e.g. the Triton walk where the CUDA one
    cannot run).  ``GDNTreeCache.launch`` records what ran.
    """
    backend: str = "auto"
    block_t: int | None = None
    block_v: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_registers: int | None = None
    g_prologue: int | None = None
    u_bf16: int | None = None
    prefetch: int | None = None
    heavy_first: int | None = None
    prenorm: int | None = None
    kside: int | None = None
    kside_heads: int | None = None
    solve_bf16: int | None = None
    u_cache_bf16: int | None = None
    pdl: int | None = None
    kside_registers: int | None = None
    transposed: int | None = None
    cuda_walk: int | None = None
    walk_kside: int | None = None
    kside_cuda: int | None = None
    l2_prefetch: int | None = None
    g_pass: int | None = None
    early: int | None = None
    stream: int | None = None

    def __post_init__(self):
        _check_backend(self.backend)
        if self.kside is not None and self.kside not in (0, 1, 2, 4, 8):
            raise SimtreeError(f"kside is the K-side kernel's warps (1, 2, 4 or 8) or 0 for none, "
                               f"got {self.kside}")
        if self.kside_cuda is not None and self.kside_cuda not in (0, 1, 2):
            raise SimtreeError(f"kside_cuda is 0 (off), 1 (8 warps a program) or 2 (12), "
                               f"got {self.kside_cuda}")
        if self.stream is not None and self.stream not in (0, 1):
            raise SimtreeError(f"stream is 0 (off) or 1 (the K-streamed verify), got {self.stream}")
        if self.l2_prefetch is not None and not 0 <= self.l2_prefetch <= 31:
            raise SimtreeError(f"l2_prefetch is a sum of the bits 1, 2, 4, 8 and 16 (0-31), "
                               f"got {self.l2_prefetch}")

    def pick(self, name: str, rule: VerifyLaunch):
        """This config's ``name`` where set, else the rule's."""
        value = getattr(self, name)
        return getattr(rule, name) if value is None else value


@dataclass(frozen=True)
class CommitLaunch(_Switches):
    """How ``gdn_tree_commit`` runs; every field left None is ``commit_launch_config``'s.

    backend: as ``VerifyLaunch.backend``.  block_t (16, 32 or 64): nodes per step of the
    Triton walk over nodes 0..a, path nodes masked in (a wider step walks fewer steps for
    deep accepted nodes, at more masked-off work per step).  path: 1 gathers the accepted
    path's nodes, block_t at a time, 0 walks nodes 0..a in stored order.  block_v, num_warps.
    dot16: u folded in with bf16 operands and fp32 accumulation (None: where the verify
    stored u in bf16, ``commit_dot16``).
    """
    backend: str = "auto"
    block_t: int | None = None
    path: int | None = None
    block_v: int | None = None
    num_warps: int | None = None
    dot16: int | None = None

    def __post_init__(self):
        _check_backend(self.backend)
        if self.block_t is not None and self.block_t not in (16, 32, 64):
            raise SimtreeError(f"commit block_t must be 16, 32 or 64, got {self.block_t}")


@dataclass(frozen=True)
class FoldLaunch(_Switches):
    """How the deferred commit's own launches run (``gdn_defer_commit``, ``gdn_fold_pending``,
    ``gdn_fold_round``; the folds inside a verify take the verify's launch).

    backend: as ``VerifyLaunch.backend``.  block_v: V columns per program (None: 64, or V
    where smaller).  block_k: state rows per [block_k, block_v] piece of a standalone fold
    (None: all K rows for a pending path, 32 for a pending round; the deferred commit reads
    no state in pieces and takes none).  num_warps (None: 4).
    """
    backend: str = "auto"
    block_v: int | None = None
    block_k: int | None = None
    num_warps: int | None = None

    def __post_init__(self):
        _check_backend(self.backend)
        for name in ("block_v", "block_k", "num_warps"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise SimtreeError(f"fold {name} must be a power of two, got {value}")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise SimtreeError(f"unknown backend {backend!r}: use 'auto', 'triton' or 'torch'")


def pick_backend(backend: str, device: torch.device) -> str:
    """"triton" or "torch": "auto" is Triton on CUDA devices (the interpreter is for tests,
    which ask for "triton" explicitly)."""
    _check_backend(backend)
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


# ------------------------------------------------------------------------------ the machine
@functools.lru_cache(maxsize=None)
def has_maxnreg() -> bool:
    """Whether this Triton's CUDA backend takes a register cap (``maxnreg``)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        return "maxnreg" in CUDAOptions.__dataclass_fields__
    except Exception:  # noqa: BLE001 - another backend / Triton: no register cap
        return False


def register_cap(n: int) -> dict:
    """The launch keywords of a register cap of ``n`` (0: none; none where Triton takes none)."""
    return {"maxnreg": n} if n and not INTERPRET and has_maxnreg() else {}


def pdl_ok(device) -> bool:
    """Programmatic dependent launch: compiled CUDA kernels on Hopper (sm_90) or later."""
    dev = torch.device(device)
    return not INTERPRET and dev.type == "cuda" and _sm_major(dev.index) >= 9


@functools.lru_cache(maxsize=None)
def _sm_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0] if torch.cuda.is_available() else 0


def sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (H200_SMS where no CUDA device is visible)."""
    return _sm_count_of(str(device))


@functools.lru_cache(maxsize=None)
def _sm_count_of(device: str) -> int:   # the rule runs once per GDN layer and step: all cached
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return H200_SMS
    return torch.cuda.get_device_properties(
        torch.cuda.current_device() if dev.index is None else dev.index).multi_processor_count


# ------------------------------------------------------------------------------ the rules
def depth_first_pays(max_nodes: int, batch_size: int) -> bool:
    """Whether renumbering a round's trees depth-first on the host (``TreeBatch.depth_first``,
    once per round) costs less than it saves the GDN tree kernel over a Qwen3.6-27B verify
    (48 GDN layers): at one sequence of more than 64 nodes.  Up to 32 nodes every order gives
    the kernel the same sub-chunk pairs.  An engine that builds its trees on the GPU can emit
    this order for free."""
    return max_nodes > 64 and batch_size == 1


def verify_launch_config(B: int, HV: int, V: int, device: torch.device | str = "cuda",
                         max_nodes: int = 128, depth_first: bool = False,
                         H: int | None = None, ieee: bool = False) -> VerifyLaunch:
    """The default Triton launch of the tree verify, every switch set (``VerifyLaunch``).

    Args: B sequences, HV value heads, V value dim, the device (its SM count), the largest
    tree's nodes, ``depth_first`` (the trees are stored in their heavy-first depth-first
    order, ``TreeMeta.depth_first``), H key heads (HV // 3 when not given), ``ieee`` (fp32 /
    fp64 inputs: exact fp32 dots).  The thresholds are where the measurements in
    docs/kernels/gdn_launch.md changed sides.
    """
    rows = B * HV
    cfg = dict(block_t=16, block_v=V, num_warps=2, num_stages=2, max_registers=0, g_prologue=1,
               u_bf16=1, prefetch=0, heavy_first=0, prenorm=1, kside=0, kside_heads=0, solve_bf16=0,
               u_cache_bf16=1, pdl=1, kside_registers=0, transposed=0, cuda_walk=0,
               walk_kside=0, kside_cuda=0, l2_prefetch=0, stream=0,
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
        # the V-free products by their own kernel
        cfg.update(kside=1, solve_bf16=1, g_pass=1)
        if rows <= 16 * 48 and max_nodes > 64:
            cfg["max_registers"] = 168
        # capped at 128 registers where that makes all its one-warp programs resident at once
        # (more than the 12 per SM its 158 registers allow, at most the 16 the cap allows)
        programs = -(-max_nodes // cfg["block_t"]) * B * (H or HV // 3)
        sms = sm_count(device)
        if rows <= 16 * 48 and 12 < programs / sms <= 16:
            cfg["kside_registers"] = 128
        # the transposed walk on the K-side tiles; and at two warps where its programs fit in
        # one wave and the untransposed walk's do not (3 programs per SM at its 168-register
        # cap, 5 of the transposed one's)
        one_wave = 3 * sms < rows <= 5 * sms and 64 < max_nodes <= G_PROLOGUE_MAX_NODES
        cfg["transposed"] = int(rows > 16 * 48 and 32 < max_nodes <= G_PROLOGUE_MAX_NODES
                                or one_wave)
        if one_wave:
            cfg["num_warps"] = 2
        # the CUDA walk (cuda/walk.cu) where it was measured faster, wherever it can run
        # (``cuda_walk_blockers``: else the Triton walk above), after the CUDA K-side kernel at
        # 12 warps (8 below 512 rows of more than 96 nodes); beyond 64 nodes each walk program
        # also prefetches the next one's state, late
        if rows >= CUDA_WALK_MIN_ROWS and CUDA_WALK_NODES[0] <= max_nodes <= CUDA_WALK_NODES[1]:
            cfg.update(cuda_walk=2, kside_cuda=1 if rows < 512 and max_nodes > 96 else 2,
                       l2_prefetch=19 if max_nodes > 64 else 2)
    if ieee and rows > 4 * 48:   # fp32 / fp64 inputs: two-warp fp32 walks spill
        cfg.update(num_warps=8, transposed=0, cuda_walk=0, kside_cuda=0, l2_prefetch=0)
    cfg["heavy_first"] = heavy_first_default(cfg["block_t"], max_nodes, depth_first)
    cfg["early"] = int(max_nodes > cfg["block_t"])   # one sub-chunk: no pairs to hide behind
    return VerifyLaunch(backend="triton", **cfg)


def heavy_first_default(block_t: int, max_nodes: int, depth_first: bool = False) -> int:
    """Depth-first walk where it was measured to pay: 16-node sub-chunks, trees > 64 nodes,
    up to HEAVY_FIRST_MAX_NODES (its order is built from dense [nodes, max_nodes] tables,
    which grow with the square of the tree size).  Never for trees stored depth-first already
    (the stored order is that walk)."""
    return int(not depth_first and block_t == 16 and 64 < max_nodes <= HEAVY_FIRST_MAX_NODES)


def commit_launch_config(B: int, HV: int, V: int, max_nodes: int = 128,
                         dot16: bool = False) -> CommitLaunch:
    """The default Triton launch of the commit (``CommitLaunch``, every field set): 16-node
    steps, 64-wide V blocks, 4 warps; the gathered path from 32 nodes (from 64 at one
    sequence), the stored-order walk below; with bf16 products (``dot16``) the stored-order
    walk but at one sequence of more than 64 nodes (docs/kernels/gdn_launch.md)."""
    if dot16:
        path = int(max_nodes > 64 and B * HV <= 48)
    else:
        path = int(max_nodes > (32 if B * HV <= 48 else 16))
    return CommitLaunch(backend="triton", block_t=16, path=path, block_v=min(V, 64),
                        num_warps=4, dot16=int(dot16))


def commit_dot16(cache, dot16: int | None = None) -> bool:
    """Whether the Triton commit folds u in with bf16 products: asked for (``dot16``), else
    where the verify stored u in bf16 (``cache``: its ``GDNTreeCache``); never through the
    interpreter (fp32 dots there)."""
    return bool(cache.u.dtype == torch.bfloat16 if dot16 is None else dot16) and not INTERPRET


def cuda_walk_blockers(*, kside: int, ready: bool, BT: int, K: int, BV: int, mt: int, dtypes,
                       bf16_buffers: bool, tensors, device, mode: int = 0) -> list[str]:
    """Why the CUDA walk (``cuda_walk.py``; ``mode`` 1: the one computing the K-side tiles
    itself, 2: the one after the CUDA K-side kernel) cannot take a verify launch ([] = it
    can)."""
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
    if not pdl_ok(device) or not cuda_walk.available(device):
        why.append("a CUDA GPU of compute capability >= 9.0 and nvcc to build it")
    return why

