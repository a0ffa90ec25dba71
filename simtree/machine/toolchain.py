"""Where this machine keeps what the hand-written CUDA kernels need: the nvcc to build them
with and the folder their built libraries are cached in.  The environment is read here, so
the kernels (``simtree.kernels``) read none.

    SIMTREE_CUDA_CACHE   the cache folder (default $XDG_CACHE_HOME/simtree/cuda, else
                         ~/.cache/simtree/cuda)
    CUDA_HOME, CUDA_PATH the CUDA toolkit whose bin/nvcc builds them (else nvcc on PATH)
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["cuda_cache_dir", "nvcc_path"]


def cuda_cache_dir() -> Path:
    """The folder the built CUDA kernels are cached in (read at each call)."""
    root = os.environ.get("SIMTREE_CUDA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "simtree", "cuda")
    return Path(root)


def nvcc_path() -> str | None:
    """The nvcc to build with: $CUDA_HOME/bin/nvcc (or $CUDA_PATH's), else the one on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")
