"""Build a full-scale model from the registry, after checking that its weights fit.

    model = build_model("qwen3.6-27b", device="cuda")            # QwenModel, bf16
    model = build_model("deepseek-v4-flash", device="cuda")      # V4Rank (one EP rank)
    weight_bytes(get_model("qwen3.6-27b"))                       # what the runtime allocates

``weight_bytes`` sizes the same parameter lists the models allocate (``param_specs``), so a
planner asking whether a deployment fits and the runtime cannot disagree.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from simtree.checkpoints import open_checkpoint
from simtree.errors import SimtreeError
from simtree.machine.metadata import require_device
from simtree.models import ModelShape, get_model

from . import qwen, v4_rank
from simtree.kernels.layers.weights import spec_bytes

__all__ = ["build_model", "weight_bytes", "check_fits", "device_memory_bytes", "DTYPES", "dtype_name"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    """The name DTYPES gives ``dtype`` (bf16, fp32, fp64): profile rows and lossless checks."""
    return next(name for name, d in DTYPES.items() if d == dtype)
FIT_MARGIN = 0.08   # share of the device kept free for caches, activations and graph pools


def _family(shape: ModelShape):
    if shape.family == "gdn_hybrid":
        return qwen
    if shape.family == "v4":
        return v4_rank
    raise SimtreeError(f"model {shape.name!r}: family {shape.family!r} has no full-scale runtime "
                       "(gdn_hybrid, v4)")


def weight_bytes(shape: ModelShape, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the weights the full runtime allocates for ``shape`` (target + MTP layer; for V4
    one expert-parallel rank)."""
    module = _family(shape)
    specs = module.param_specs(shape) if module is qwen else module.param_specs(shape, dtype=dtype)
    return spec_bytes(specs, dtype)


def device_memory_bytes(device) -> int:
    """Free memory of a CUDA device, or the host's physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_fits(shape: ModelShape, device="cuda", dtype: torch.dtype = torch.bfloat16,
               available_bytes: int | None = None) -> int:
    """``weight_bytes`` if they fit the device with FIT_MARGIN to spare, else a one-line error."""
    need = weight_bytes(shape, dtype)
    have = device_memory_bytes(device) if available_bytes is None else int(available_bytes)
    if need > have * (1 - FIT_MARGIN):
        raise SimtreeError(f"model {shape.name} needs {need / 1e9:.1f} GB of weights, more than the "
                           f"{have * (1 - FIT_MARGIN) / 1e9:.1f} GB usable of {have / 1e9:.1f} GB on {device}: "
                           f"{(need - have * (1 - FIT_MARGIN)) / 1e9:.1f} GB short")
    return need


MTP_NOTE = ("{name} has no MTP weights: the speculative modes draft with a randomly initialised MTP layer "
            "(acceptance means nothing; the output stays lossless)")


def _checkpoint_folder(model, shape: ModelShape) -> Path | None:
    """The checkpoint folder whose weights ``build_model`` reads: a folder given by path, or a
    shipped one that holds weights (the tiny default, ``runtime-tiny``); None: random weights."""
    if not isinstance(model, str) or not shape.source.endswith("config.json"):
        return None
    folder = Path(shape.source).parent
    given = folder == Path(model).expanduser()
    return folder if given or (folder / "model.safetensors").is_file() else None


def build_model(model, device="cuda", dtype: torch.dtype | None = None, seed: int = 0):
    """A QwenModel or V4Rank for a registry name or shape (random weights made on ``device``),
    or a checkpoint folder or a shipped one with weights, e.g. ``runtime-tiny`` (its weights;
    see simtree.checkpoints); dtype: bf16 on CUDA, fp32
    elsewhere unless given.  ``model.load_notes``: one line per thing worth saying (a
    checkpoint without MTP weights); ``model.weights_from``: the checkpoint folder read, or "random";
    ``model.drafters_dir``: a checkpoint folder's ``drafters/``
    (trained block drafters, :func:`.block_engine.trained_drafter`), None for random weights."""
    shape = get_model(model) if isinstance(model, str) else model
    dtype = dtype or (torch.bfloat16 if require_device(device).type == "cuda" else torch.float32)
    check_fits(shape, device, dtype)
    module = _family(shape)
    cls = qwen.QwenModel if module is qwen else v4_rank.V4Rank
    folder = _checkpoint_folder(model, shape)
    if folder is None:
        built = cls(shape, device=device, dtype=dtype, seed=seed)
        built.load_notes, built.drafters_dir, built.weights_from = [], None, "random"
        return built
    weights, absent = open_checkpoint(folder).load(shape, dtype, device)   # absent: the MTP layer, if so
    built = cls(shape, device=device, dtype=dtype, seed=seed, weights=weights)
    built.load_notes = [MTP_NOTE.format(name=shape.name)] if absent else []
    built.drafters_dir = folder / "drafters"     # trained block drafters, where present (block_engine)
    built.weights_from = str(folder)
    return built
