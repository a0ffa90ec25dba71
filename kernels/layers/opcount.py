"""A CPU proxy of a step's kernel launches: the torch ops it issues, counted by the dispatcher.

    with OpCounter() as ops:
        model.verify(state, tokens, parents)
    ops.launches                  # ops that launch work (views, allocations, metadata excluded)
    ops.cores                     # {"gdn_verify": 3, ...}: kernel cores, each counted once

A fused op of :mod:`.ops` is one op, so on the CPU the count stands for the launches the same
step makes on a GPU, where each op is one kernel (a GEMM one or two).  The layers wrap each
attention / recurrence core in :func:`kernel_core`: on the CPU those run as torch references of
many ops, on a GPU as a few kernels of their own, so a core counts once by name instead.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "kernel_core", "NO_LAUNCH"]

# ops that launch no kernel: allocations, metadata and views
NO_LAUNCH = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_to_copy_noop",
                       "lift_fresh", "detach", "alias", "_unsafe_view", "view", "reshape", "resolve_conj",
                       "resolve_neg", "size", "stride", "sym_size", "sym_stride", "is_same_size",
                       "_local_scalar_dense"})

_STATE = threading.local()


def _active() -> list:
    if not hasattr(_STATE, "counters"):
        _STATE.counters, _STATE.depth = [], 0
    return _STATE.counters


@contextlib.contextmanager
def kernel_core(name: str):
    """Marks a kernel core's call: counted as one core by an active counter, its ops not counted."""
    counters = _active()
    if not counters:
        yield
        return
    for c in counters:
        if _STATE.depth == 0:
            c.cores[name] += 1
    _STATE.depth += 1
    try:
        yield
    finally:
        _STATE.depth -= 1


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.cores: Counter = Counter()

    def __enter__(self):
        _active().append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active().remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(_STATE, "depth", 0) == 0:
            name = func.overloadpacket.__name__
            if not (getattr(func, "is_view", False) or name in NO_LAUNCH):
                self.ops[f"{func.namespace}.{name}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        """Launching ops outside the cores plus one per core call."""
        return sum(self.ops.values()) + sum(self.cores.values())
