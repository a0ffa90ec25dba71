"""The machines deployments run on: GPU memory and the link between a node's GPUs.

    m = get_machine("h200")                  # or the device a profile recorded: "NVIDIA H200"
    m.usable_bytes                           # what a rank may allocate per GPU (weights, caches,
                                             # round buffers, the CUDA context: simtree.deploy.memory)
    m.comm_path                              # its default collectives model (simtree/data/comm/)

Shipped: ``simtree/data/machines.yaml``.  A user's own machines: a YAML file of the same form
named by ``SIMTREE_MACHINES`` (several separated by ":"), or ``load_machines(extra=[path])``;
their entries extend or replace the shipped ones (docs/deployments.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from simtree.data import data_path
from simtree.errors import SimtreeError
from simtree.fileio import read_yaml

__all__ = ["Machine", "load_machines", "get_machine", "machine_for_device", "gpu_machine", "MACHINES_ENV"]

MACHINES_ENV = "SIMTREE_MACHINES"


@dataclass(frozen=True)
class Machine:
    key: str
    devices: tuple[str, ...]
    memory_bytes: int         # per GPU: the capacity CUDA gives a process (torch's total_memory)
    usable_fraction: float    # share of it a rank's counted bytes may take: the rest is the margin for the
                              # caching allocator's fragmentation (reserved blocks no tensor fills)
    gpus_per_node: int
    link: str
    link_gb_s: float          # per GPU per direction
    comm: str                 # collectives model file (a name in simtree/data/comm/ or a path)
    where: str = ""           # the YAML file it came from
    context_bytes: int = 0    # the CUDA context and libraries' workspaces a process holds outside PyTorch

    @property
    def name(self) -> str:
        return self.devices[0] if self.devices else self.key

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / 1e9

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.usable_fraction)

    def describe(self) -> str:
        """'79.18 GiB x 0.95' (the capacity in the card's binary units, as CUDA reports it)."""
        return f"{self.memory_bytes / 2**30:.2f} GiB x {self.usable_fraction:g}"

    @property
    def comm_path(self) -> Path:
        path = Path(self.comm)
        if path.is_absolute() or path.exists():
            return path
        near = Path(self.where).parent / self.comm if self.where else None
        return near if near is not None and near.exists() else data_path("comm", self.comm)


def _number(entry: dict, key: str, where: str, low: float, high: float | None = None) -> float:
    value = entry.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > low
    if not ok or (high is not None and value > high):
        bound = f"in ({low}, {high}]" if high is not None else f"> {low}"
        raise SimtreeError(f"{where}: {key} must be a number {bound}, got {value!r}")
    return float(value)


def _memory_bytes(entry: dict, where: str) -> int:
    """The GPU's capacity: ``memory_bytes`` (what CUDA reports, torch's total_memory) or, for a
    table that gives it in decimal or binary units, ``memory_gb`` / ``memory_gib``: exactly one."""
    given = [k for k in ("memory_bytes", "memory_gib", "memory_gb") if k in entry]
    if len(given) != 1:
        raise SimtreeError(f"{where}: give the GPU's memory as exactly one of memory_bytes, memory_gib, memory_gb "
                           f"(got {', '.join(given) or 'none'})")
    scale = {"memory_bytes": 1, "memory_gib": 2**30, "memory_gb": 1e9}[given[0]]
    return int(_number(entry, given[0], where, 0) * scale)


def _parse(data, where: str) -> dict[str, Machine]:
    if not isinstance(data, dict):
        raise SimtreeError(f"{where}: expected a mapping of machine names to their facts")
    out = {}
    for key, entry in data.items():
        w = f"{where}: machine {key!r}"
        if not isinstance(entry, dict):
            raise SimtreeError(f"{w} must be a mapping")
        devices = entry.get("devices", [])
        if not isinstance(devices, list) or not all(isinstance(d, str) and d for d in devices):
            raise SimtreeError(f"{w}: devices must be a list of GPU names")
        gpus = entry.get("gpus_per_node", 8)
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise SimtreeError(f"{w}: gpus_per_node must be an integer >= 1, got {gpus!r}")
        context = entry.get("cuda_context_mib", 0)
        if isinstance(context, bool) or not isinstance(context, (int, float)) or context < 0:
            raise SimtreeError(f"{w}: cuda_context_mib must be a number >= 0, got {context!r}")
        out[str(key).lower()] = Machine(str(key).lower(), tuple(devices), _memory_bytes(entry, w),
                                        _number(entry, "usable_fraction", w, 0, 1), gpus, str(entry.get("link", "")),
                                        _number(entry, "link_gb_s", w, 0), str(entry.get("comm", "")), where,
                                        int(context * 2**20))
    return out


def load_machines(extra: Sequence[str | os.PathLike] = ()) -> dict[str, Machine]:
    """{key: Machine}: the shipped table, then the files of ``SIMTREE_MACHINES``, then ``extra``."""
    paths = [data_path("machines.yaml")]
    paths += [Path(p) for p in os.environ.get(MACHINES_ENV, "").split(os.pathsep) if p.strip()]
    paths += [Path(p) for p in extra]
    out: dict[str, Machine] = {}
    for path in paths:
        out.update(_parse(read_yaml(path, "machine table"), str(path)))
    return out


def machine_for_device(device: str, extra: Sequence[str | os.PathLike] = ()) -> Machine | None:
    """The machine whose key or one of whose device names is ``device`` (case-insensitive);
    None for a device no table describes (e.g. "cpu")."""
    want = str(device).strip().lower()
    for m in load_machines(extra).values():
        if want == m.key or want in (d.lower() for d in m.devices):
            return m
    return None


def gpu_machine(device) -> Machine | None:
    """The machine table of the GPU ``device`` (a torch device: "cuda", "cuda:1") names, by that
    GPU's own name; None on a CPU, where torch sees no CUDA GPU, or for a GPU no table describes."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    from .metadata import device_label
    return machine_for_device(device_label(device))


def get_machine(name: str, extra: Sequence[str | os.PathLike] = ()) -> Machine:
    """:func:`machine_for_device`, or a one-line error naming the known machines."""
    m = machine_for_device(name, extra)
    if m is None:
        known = ", ".join(sorted(load_machines(extra)))
        raise SimtreeError(f"unknown machine {name!r} (known: {known}; add yours with {MACHINES_ENV}, "
                           "docs/deployments.md)")
    return m
