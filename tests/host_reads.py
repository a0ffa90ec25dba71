"""What a piece of device code asks of the host: every torch call made inside ``TorchCalls`` by
name; ``HOST_READS`` the ones that copy a device value to the host (a sync on a GPU)."""
from __future__ import annotations

import torch

HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__index__", "__float__"}


class TorchCalls(torch.overrides.TorchFunctionMode):
    """Every torch call made inside, by name (``names``)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))

    def host_reads(self) -> set:
        return HOST_READS & set(self.names)
