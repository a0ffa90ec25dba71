"""The hand-written CUDA transposed walk (``cuda/walk.cu``): built with nvcc on first use,
cached by source and GPU architecture, called through ctypes on torch's current stream.

Where nvcc or a Hopper-or-newer CUDA device is missing it is not available and the Triton
walks run; the CPU tests cover that dispatch and the build, the GPU checks (``tune_gdn``,
``bench_gdn``, ``tests/test_gdn_cuda_walk.py``'s gpu test) compare its outputs with the
float64 references and the Triton walk's."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from simtree.errors import SimtreeError
from simtree.fileio import write_atomic

SOURCE = Path(__file__).with_name("cuda") / "walk.cu"
# the (block_v, m-tiles per warp) instances walk.cu compiles (warps per program: block_v / 16 / mt)
INSTANCES = ((128, 2), (128, 1), (64, 2), (64, 1), (32, 2))


def _cache_dir() -> Path:
    root = os.environ.get("SIMTREE_CUDA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "simtree", "cuda")
    return Path(root)


def nvcc() -> str | None:
    """The nvcc to build with: $CUDA_HOME/bin/nvcc, else the one on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


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
    dll.gdn_walk_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_int] * 9 + [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
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
            or os.environ.get("TRITON_INTERPRET") == "1" or nvcc() is None:
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


def _call(tensors, B: int, NC: int, H: int, HV: int, V: int, block_v: int, mt: int, pdl: bool,
          ordered: bool = False, blocks_per_sm: ctypes.c_int | None = None) -> None:
    dev = tensors[0].device
    dll = _device_library(dev.index)
    ptrs = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    with torch.cuda.device(dev):   # the launch and its shared-memory opt-in on that GPU
        stream = torch.cuda.current_stream(dev).cuda_stream
        err = dll.gdn_walk_launch(ptrs, B, NC, H, HV, V, block_v, mt, int(pdl), int(ordered),
                                  stream, None if blocks_per_sm is None
                                  else ctypes.byref(blocks_per_sm))
    if err:
        raise SimtreeError(f"CUDA walk (block_v {block_v}, {mt} m-tiles per warp): "
                           f"{dll.gdn_walk_error(err).decode()}")


def check_instance(block_v: int, mt: int) -> None:
    if (block_v, mt) not in INSTANCES:
        raise SimtreeError(f"the CUDA walk has (block_v, m-tiles per warp) in {INSTANCES}, "
                           f"got ({block_v}, {mt})")


def walk(qn, kn, v, beta, s0, cu, pairs, npairs, NC: int, o, u, G, diag, tiles, order, *,
         H: int, block_v: int, mt: int, pdl: bool) -> None:
    """Launch the CUDA walk: the arguments of ``_tree_verify_t_kernel`` (bf16 q/k/v/o/u/tiles,
    fp32 beta/S0/G, int64 cu, int32 pairs; ``order`` int32 [N], the flat row of each node in
    walk order, or None: the stored order), K = 128, 16-node sub-chunks; (block_v, mt) one
    of INSTANCES (``gdn_tree_verify`` checks it; walk.cu answers any other with an error)."""
    B, HV, V = cu.numel() - 1, v.shape[1], v.shape[2]
    _call([qn, kn, v, beta, s0, cu, pairs, npairs, o, u, G, diag, tiles,
           npairs if order is None else order], B, NC, H, HV, V, block_v, mt, pdl,
          ordered=order is not None)


def blocks_per_sm(device, NC: int, block_v: int, mt: int) -> int:
    """Programs of one (block_v, mt) instance resident per SM at NC sub-chunks (occupancy API)."""
    check_instance(block_v, mt)
    x = torch.empty(16, device=torch.device(device))
    n = ctypes.c_int(0)
    _call([x] * 14, 1, NC, 1, 1, 128, block_v, mt, False, blocks_per_sm=n)
    return n.value
