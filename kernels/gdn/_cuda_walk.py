"""The hand-written CUDA kernels of the GDN tree verify (``cuda/walk.cu``): the transposed walk
(``walk``, in three modes: on the Triton K-side kernel's tiles, computing those tiles itself,
or on raw q / k after the CUDA K-side kernel) and the K-side kernel (``kside``: tiles, G and
the rows' q / k multipliers, one program per (sequence, key head)).  Built with nvcc on first
use, cached by source and GPU architecture, called through ctypes on torch's current stream.

Where nvcc or a Hopper-or-newer CUDA device is missing they are not available and the Triton
kernels run; the CPU tests cover that dispatch and the build, the GPU checks (``tune_gdn``,
``bench_gdn``, ``tests/test_gdn_cuda_walk.py``'s gpu test) compare their outputs with the
float64 references and the Triton walk's."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import subprocess
import warnings
from pathlib import Path

import torch

from simtree.errors import SimtreeError
from simtree.fileio import write_atomic
from simtree.kernels._triton import interpreting
from simtree.machine.toolchain import cuda_cache_dir, nvcc_path

SOURCE = Path(__file__).with_name("cuda") / "walk.cu"
# the (block_v, m-tiles per warp) instances walk.cu compiles (warps per program: block_v / 16 / mt)
INSTANCES = ((128, 2), (128, 1), (64, 2), (64, 1), (32, 2))
# the instances that also compute the K-side tiles in the walk (mode 1: one program per
# (sequence, value head), so the tiles are computed once per value head), and those walking
# raw q / k rows after the CUDA K-side kernel (mode 2)
KSIDE_INSTANCES = ((128, 2), (128, 1))
RAW_INSTANCES = ((128, 2), (128, 1), (64, 2))


def _cache_dir() -> Path:
    return cuda_cache_dir()


def nvcc() -> str | None:
    """The nvcc to build with (``simtree.machine.toolchain.nvcc_path``: $CUDA_HOME/bin/nvcc,
    else the one on PATH)."""
    return nvcc_path()


def arch_flag(major: int, minor: int) -> str:
    """nvcc's target for a compute capability: the architecture-specific one ('a') on Hopper,
    the target the kernel was built and measured with (its stmatrix, griddepcontrol and
    mma.sync need sm_90 only)."""
    cc = f"{major}{minor}" + ("a" if major == 9 else "")
    return f"-gencode=arch=compute_{cc},code=sm_{cc}"


def _flags(major: int, minor: int) -> list[str]:
    return ["-O3", arch_flag(major, minor), "-shared", "-Xcompiler", "-fPIC"]


def build(major: int, minor: int) -> Path:
    """The shared library of walk.cu for compute capability major.minor: built with nvcc into
    the cache (``fileio.write_atomic``) unless a build of this source, with these flags and
    this nvcc, is there already."""
    compiler = nvcc()
    if compiler is None:
        raise SimtreeError("the CUDA walk needs nvcc (set CUDA_HOME or put nvcc on PATH)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(_flags(major, minor)).encode()
                         + version.encode()).hexdigest()[:16]
    lib = _cache_dir() / f"gdn_walk_{key}.so"
    if not lib.exists():
        def compile_to(tmp: str) -> None:
            res = subprocess.run([compiler, *_flags(major, minor), "-o", tmp, str(SOURCE)],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                lines = (res.stderr or res.stdout).strip().splitlines() or ["no output"]
                first = next((x for x in lines if "error" in x.lower()), lines[-1])
                raise SimtreeError(f"nvcc failed building {SOURCE.name}: {first.strip()}")
        write_atomic(lib, compile_to)
    return lib


def _load(lib: Path) -> ctypes.CDLL:
    """The built library with its two entry points typed (walk.cu's extern "C" signatures)."""
    dll = ctypes.CDLL(str(lib))
    dll.gdn_walk_launch.restype = ctypes.c_int
    dll.gdn_walk_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_int] * 13 + [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    dll.gdn_kside_launch.restype = ctypes.c_int
    dll.gdn_kside_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_int] * 11 + [
        ctypes.c_float, ctypes.c_void_p]
    dll.gdn_walk_error.restype = ctypes.c_char_p
    dll.gdn_walk_error.argtypes = [ctypes.c_int]
    return dll


@functools.lru_cache(maxsize=None)
def _library(major: int, minor: int) -> ctypes.CDLL:
    return _load(build(major, minor))


def available(device) -> bool:
    """Whether the CUDA walk can run on ``device``: a CUDA GPU of compute capability >= 9.0
    (the kernel uses Hopper's stmatrix and programmatic-launch instructions), nvcc to build
    it, and the built library answering on that GPU (one query through the CUDA runtime it
    links, which also meets the driver).  Cached per device; a failure other than a missing
    nvcc or an older GPU warns once and leaves the Triton walks in place."""
    return _available(str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _available(device: str) -> bool:
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available() \
            or interpreting() or nvcc() is None:
        return False
    if torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    try:
        if blocks_per_sm(dev, 8, *INSTANCES[0]) < 1:
            raise SimtreeError("no program of it fits on one SM")
    except (SimtreeError, OSError) as exc:
        warnings.warn(f"CUDA walk unavailable, the Triton walk runs instead: {exc}", stacklevel=3)
        return False
    return True


@functools.lru_cache(maxsize=None)
def _device_library(index: int) -> ctypes.CDLL:
    return _library(*torch.cuda.get_device_capability(index))


def _launch(entry: str, what: str, tensors, *args, tail=()) -> None:
    """One of walk.cu's entry points (``entry``) on the first tensor's GPU: the tensors'
    device pointers, ``args``, torch's current stream, then ``tail``; a non-zero return is a
    one-line SimtreeError opening with ``what``."""
    dev = tensors[0].device
    dll = _device_library(dev.index)
    ptrs = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    with torch.cuda.device(dev):   # the launch and its shared-memory opt-in on that GPU
        err = getattr(dll, entry)(ptrs, *args, torch.cuda.current_stream(dev).cuda_stream, *tail)
    if err:
        raise SimtreeError(f"{what}: {dll.gdn_walk_error(err).decode()}")


def _call(tensors, B: int, NC: int, H: int, HV: int, V: int, block_v: int, mt: int, pdl: bool,
          ordered: bool = False, mode: int = 0, words: int = 0, pf: int = 0, flags: int = 0,
          blocks_per_sm: ctypes.c_int | None = None) -> None:
    _launch("gdn_walk_launch", f"CUDA walk (block_v {block_v}, {mt} m-tiles per warp"
            f"{('', ', K-side in the walk', ', raw q/k')[mode]})", tensors,
            B, NC, H, HV, V, block_v, mt, mode, words, int(pdl), int(ordered), int(pf), int(flags),
            tail=(None if blocks_per_sm is None else ctypes.byref(blocks_per_sm),))


def instances(mode: int = 0) -> tuple:
    """The (block_v, m-tiles per warp) of a walk mode: 0 on the K-side kernel's tiles and
    pre-normalised q / k, 1 computing the tiles itself, 2 after the CUDA K-side kernel."""
    return (INSTANCES, KSIDE_INSTANCES, RAW_INSTANCES)[mode]


def check_instance(block_v: int, mt: int, mode: int = 0) -> None:
    if (block_v, mt) not in instances(mode):
        raise SimtreeError(f"the CUDA walk (mode {mode}) has (block_v, m-tiles per warp) in "
                           f"{instances(mode)}, got ({block_v}, {mt})")


def walk(qn, kn, v, beta, s0, cu, pairs, npairs, NC: int, o, u, G, diag, tiles, order, *,
         H: int, block_v: int, mt: int, pdl: bool, bits=None, mults=None, pf: int = 0,
         cs: bool = False, pfv: bool = False, pf_late: bool = False, pending=None) -> None:
    """Launch the CUDA walk: the arguments of ``_tree_verify_t_kernel`` (bf16 q/k/v/o/u/tiles,
    fp32 beta/S0/G, int64 cu, int32 pairs; ``order`` int32 [N], the flat row of each node in
    walk order, or None: the stored order), K = 128, 16-node sub-chunks; (block_v, mt) one
    of INSTANCES (``gdn_tree_verify`` checks it; walk.cu answers any other with an error).
    ``bits`` (int64 [N, W], the ancestor bits in walk order): the walk computes the K-side
    tiles itself (``diag`` and ``tiles`` then None; (block_v, mt) in KSIDE_INSTANCES).
    ``mults`` (fp32 [N, H, 2], the CUDA K-side kernel's): ``qn`` / ``kn`` are the raw rows
    and these their multipliers ((block_v, mt) in RAW_INSTANCES).  ``pf`` > 0: one thread of
    each (sequence, value head)'s first program prefetches into L2 the state of the (sequence,
    value head) ``pf`` rows on, the one that runs when ``pf`` rows are resident at a time
    (``resident_rows``); ``pf_late``: that prefetch issued two sub-chunks before the program's
    end rather than at its start; ``cs``: o and u stored streaming (evict-first); ``pfv``:
    each sub-chunk's v rows prefetched into L2 two sub-chunks ahead of their use (one ahead of
    their copy into shared memory).  ``cs`` and ``pfv`` gained nothing where measured; the
    rule leaves them off (docs/kernels/gdn_launch.md).  ``pending`` (a ``GDNPendingPath`` with
    bf16 u): its waiting paths folded into each program's S0 tile first and written back to
    ``s0`` (walk.cu's ``fold_pending``; the deferred commit)."""
    B, HV, V = cu.numel() - 1, v.shape[1], v.shape[2]
    ks = bits is not None
    mode = 1 if ks else 2 if mults is not None else 0
    fold = ([pending.k, pending.w, pending.u, pending.decay, pending.on, pending.length]
            if pending is not None else [beta] * 6)
    _call([qn, kn, v, beta, s0, cu, pairs, npairs, o, u, G, u if ks else diag,
           u if ks else tiles, npairs if order is None else order, bits if ks else npairs,
           mults if mults is not None else beta, *fold],
          B, NC, H, HV, V, block_v, mt, pdl, ordered=order is not None, mode=mode,
          words=int(bits.shape[1]) if ks else 0, pf=pf,
          flags=int(cs) | int(pfv) << 1 | int(pf_late) << 2
          | (8 | pending.rows << 8 if pending is not None else 0))


def kside(q, k, g, beta, bits, cu, pairs, npairs, NC: int, G, mults, diag, tiles, order, *,
          pdl: bool, l2norm: bool, scale: float, s0=None, pf: int = 0, warps: int = 8) -> None:
    """Launch the CUDA K-side kernel (walk.cu's ``kside_kernel``): from the raw bf16 q / k
    [N, H, K], fp32 g and beta [N, HV], the int64 ancestor bits [N, W] in walk order and the
    sub-chunk pairs, it writes the tiles ``_tree_kside_kernel`` writes (bf16 ``diag`` and pair
    ``tiles``, the same slots), G [N, HV] as the pre-pass does, and each row's multipliers
    ``mults`` [N, H, 2] (scale / |q|, 1 / |k|; without ``l2norm`` scale and 1) for the walk
    on raw rows (``walk(..., mults=)``); ``order`` as ``walk``'s.  K = 128, 16-node
    sub-chunks.  It is the verify's first kernel (launched after everything it reads).
    ``pf`` > 0 (with ``s0``, the walk's fp32 state [B * HV, K, V]): the states of the first
    ``pf`` (sequence, value head) rows, those the walk's first resident programs load, are
    prefetched into L2 once each program has its own rows.  ``warps``: 8 or 12 a program."""
    B, H, HV = cu.numel() - 1, q.shape[1], beta.shape[1]
    if pf and s0 is None:
        raise SimtreeError("the K-side kernel's L2 prefetch (pf > 0) needs the state s0")
    _launch("gdn_kside_launch", "CUDA K-side kernel",
            [q, k, g, beta, bits, cu, pairs, npairs, npairs if order is None else order, G,
             mults, diag, tiles, G if s0 is None else s0],
            B, NC, H, HV, int(bits.shape[1]), 128 if s0 is None else int(s0.shape[-1]),
            int(pdl), int(order is not None), int(l2norm), int(pf), int(warps), float(scale))


def resident_rows(device, NC: int, block_v: int, mt: int, mode: int, V: int) -> int:
    """(Sequence, value head) rows whose walk programs are resident at once on ``device``
    (every SM full at NC sub-chunks, V / block_v programs a row): how far ahead the walk's
    L2 prefetch reaches, and how many rows' states the K-side kernel prefetches."""
    return _resident_rows(str(torch.device(device)), NC, block_v, mt, mode, V)


@functools.lru_cache(maxsize=None)
def _resident_rows(device: str, NC: int, block_v: int, mt: int, mode: int, V: int) -> int:
    dev = torch.device(device)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return blocks_per_sm(dev, NC, block_v, mt, mode) * sms // max(1, V // block_v)


def blocks_per_sm(device, NC: int, block_v: int, mt: int, mode: int = 0) -> int:
    """Programs of one (block_v, mt) instance of a walk mode (``instances``) resident per SM
    at NC sub-chunks (occupancy API)."""
    check_instance(block_v, mt, mode)
    x = torch.empty(16, device=torch.device(device))
    n = ctypes.c_int(0)
    _call([x] * 22, 1, NC, 1, 1, 128, block_v, mt, False, mode=mode, words=(NC + 3) // 4,
          blocks_per_sm=n)
    return n.value
