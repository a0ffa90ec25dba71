"""How much memory a training step needs, checked before anything is allocated or written.

    need = training_bytes(target_config(), batch_size=16, seq_len=96)
    check_training_memory({"target": target_config()}, 16, 96)   # SimtreeError, one line, if short

A step holds the weights, their gradients and AdamW's two moments (4 x the fp32 parameters)
and what autograd keeps for the backward pass.  The latter is measured, not modelled: a
forward of one short window under ``saved_tensors_hooks`` counts the storages autograd saves
(each once, parameters left out).  They grow linearly with the batch and as a quadratic in
the window (attention scores are T x T), so three short windows (PROBE_LENS) give it
exactly at any ``seq_len`` without running one; ``BACKWARD_MARGIN`` covers the backward's
transient gradients.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch

from simtree.errors import SimtreeError
from simtree.runtime.model import HybridLM, ModelConfig

__all__ = ["training_bytes", "saved_bytes_per_window", "available_bytes", "check_training_memory", "BACKWARD_MARGIN",
           "PROBE_LENS"]

BACKWARD_MARGIN = 1.5   # peak during backward / the saved activations (gradients of the largest ones)
PROBE_LENS = (8, 16, 32)   # windows measured; the quadratic through them is exact (checked by a test)


def _saved_bytes_per_window(model: HybridLM, seq_len: int) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.zeros(1, seq_len, dtype=torch.long))
    return sum(storages.values())


def saved_bytes_per_window(model: HybridLM, seq_len: int) -> float:
    """Bytes autograd saves for one window of ``seq_len`` tokens: measured up to the longest
    of PROBE_LENS, beyond it the quadratic (Lagrange) through the three probes."""
    if seq_len <= PROBE_LENS[-1]:
        return float(_saved_bytes_per_window(model, seq_len))
    xs, ys = PROBE_LENS, [_saved_bytes_per_window(model, t) for t in PROBE_LENS]
    total = 0.0
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        weight = 1.0
        for j, xj in enumerate(xs):
            if j != i:
                weight *= (seq_len - xj) / (xi - xj)
        total += yi * weight
    return total


_PER_WINDOW: dict = {}   # (config, seq_len) -> (weight bytes, saved bytes per window): measured once a process


def training_bytes(config: ModelConfig, batch_size: int, seq_len: int) -> int:
    """Estimated peak bytes of one training step of a model of ``config`` on ``batch_size``
    windows of ``seq_len`` tokens (module docstring)."""
    key = (json.dumps(asdict(config), sort_keys=True), int(seq_len))
    if key not in _PER_WINDOW:
        rng = torch.random.get_rng_state()   # the probe's model leaves the caller's random stream as it was
        model = HybridLM(config)
        torch.random.set_rng_state(rng)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        _PER_WINDOW[key] = weights, saved_bytes_per_window(model, seq_len)
    weights, per_window = _PER_WINDOW[key]
    return int(4 * weights + BACKWARD_MARGIN * batch_size * per_window)


def available_bytes() -> int:
    """Memory the host can give now (MemAvailable of /proc/meminfo), else its physical memory."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_training_memory(configs: dict[str, ModelConfig], batch_size: int, seq_len: int,
                          have: int | None = None) -> dict[str, int]:
    """{name: bytes needed} when every model's step fits ``have`` bytes (default: what the host
    has available now), else a one-line SimtreeError naming the need against what there is."""
    have = available_bytes() if have is None else int(have)
    need = {name: training_bytes(cfg, batch_size, seq_len) for name, cfg in configs.items()}
    name = max(need, key=need.get)
    if need[name] > have:
        raise SimtreeError(f"--batch-size {batch_size} x --seq-len {seq_len}: training the {name} needs about "
                           f"{need[name] / 1e9:.1f} GB of memory, {have / 1e9:.1f} GB are available: lower "
                           "--batch-size or --seq-len")
    return need
