"""How much memory a training step needs, checked before anything is allocated or written.

    need = training_bytes(hf_config("cpu", 2048), batch_size=16, seq_len=128)
    check_training_memory(config, 16, 128)   # SimtreeError, one line, if short

A step holds the weights, their gradients and AdamW's two moments (4 x the fp32 parameters)
and what autograd keeps for the backward pass.  The latter is measured, not modelled: the
loss of one window of ``seq_len`` tokens is computed under ``saved_tensors_hooks``, which count
the storages autograd saves (each once, parameters left out); a batch keeps ``batch_size``
times that.  ``BACKWARD_MARGIN`` covers the backward's transient gradients.
"""
from __future__ import annotations

import os

import torch

from simtree.errors import SimtreeError

from .target_model import TargetWithMTP

__all__ = ["training_bytes", "saved_bytes_per_window", "available_bytes", "check_training_memory",
           "BACKWARD_MARGIN"]

BACKWARD_MARGIN = 1.5   # peak during backward / the saved activations (gradients of the largest ones)


def saved_bytes_per_window(model: TargetWithMTP, seq_len: int) -> int:
    """Bytes autograd saves for the training loss of one window of ``seq_len`` tokens."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # the probe's notices (a kernel's torch fallback) are not the user's
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.loss(torch.zeros(1, seq_len + 1, dtype=torch.long))
    finally:
        hf_logging.set_verbosity(level)
    return sum(storages.values())


_PER_WINDOW: dict = {}   # (config, seq_len) -> (weight bytes, saved bytes per window): measured once a process


def training_bytes(config, batch_size: int, seq_len: int) -> int:
    """Estimated peak bytes of one training step of a ``TargetWithMTP(config)`` on
    ``batch_size`` windows of ``seq_len`` tokens (module docstring)."""
    key = (config.to_json_string(), int(seq_len))
    if key not in _PER_WINDOW:
        rng = torch.random.get_rng_state()   # the probe's model leaves the caller's random stream as it was
        model = TargetWithMTP(config)
        torch.random.set_rng_state(rng)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        _PER_WINDOW[key] = weights, saved_bytes_per_window(model, seq_len)
    weights, per_window = _PER_WINDOW[key]
    return int(4 * weights + BACKWARD_MARGIN * batch_size * per_window)


def available_bytes(device: str = "cpu") -> int:
    """Memory the device can give now: a GPU's free memory, else the host's MemAvailable
    (/proc/meminfo), else its physical memory."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_training_memory(config, batch_size: int, seq_len: int, have: int | None = None,
                          device: str = "cpu") -> int:
    """Bytes needed when the step fits ``have`` bytes (default: what ``device`` has available
    now), else a one-line SimtreeError naming the need against what there is."""
    have = available_bytes(device) if have is None else int(have)
    need = training_bytes(config, batch_size, seq_len)
    if need > have:
        raise SimtreeError(f"--batch-size {batch_size} x --seq-len {seq_len}: training the target needs about "
                           f"{need / 1e9:.1f} GB of memory, {have / 1e9:.1f} GB are available: lower "
                           "--batch-size or --seq-len")
    return need
