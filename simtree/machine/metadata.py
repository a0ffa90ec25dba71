"""Machine facts recorded beside every profile table (``<table>.meta.json``).

``collect_metadata(device)`` returns a flat dict: device name (the value written into the
table's ``device`` column), GPU driver, clocks and memory (from nvidia-smi when present),
torch / CUDA / triton / fla / flash_mla versions, python, host.
"""
from __future__ import annotations

import platform
import shutil
import subprocess
from datetime import datetime, timezone

__all__ = ["collect_metadata", "device_label", "package_version"]

_SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm",
               "clocks.max.mem", "power.limit", "memory.total", "pstate", "temperature.gpu")


def package_version(module: str) -> str:
    """Version of an importable module, "" if absent (never raises)."""
    try:
        from importlib.metadata import version
        dist = {"fla": "fla-core", "flash_mla": "sgl-flash-mla"}.get(module, module)
        return version(dist)
    except Exception:
        try:
            mod = __import__(module)
            return str(getattr(mod, "__version__", "present"))
        except Exception:
            return ""


def require_device(device):
    """``torch.device(device)``, or a one-line error where it is not ``cpu`` / ``cuda`` /
    ``cuda:N`` or torch sees no such GPU here."""
    import torch

    from simtree.errors import SimtreeError

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or str(device) != str(device).lower():
        raise SimtreeError(f"unknown device {device!r}: use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SimtreeError(f"device {device} is not available here: torch sees no CUDA GPU (use --device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SimtreeError(f"device {device}: torch sees {torch.cuda.device_count()} CUDA GPU(s) here")
    return dev


def device_label(device: str) -> str:
    """What goes in the table's ``device`` column: the GPU's name, or "cpu"."""
    if not str(device).startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def _nvidia_smi(index: int) -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, f"--id={index}", f"--query-gpu={','.join(_SMI_FIELDS)}",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0 or not out.stdout.strip():
        return {}
    values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    return {f"smi_{k.replace('.', '_')}": v for k, v in zip(_SMI_FIELDS, values)}


def collect_metadata(device: str = "cpu") -> dict:
    """Facts about this machine and software stack for the meta.json sidecar."""
    import torch

    meta = {
        "device": device_label(device),
        "device_type": "cuda" if str(device).startswith("cuda") else "cpu",
        "torch_version": torch.__version__,
        "torch_cuda": str(torch.version.cuda or ""),
        "triton_version": package_version("triton"),
        "fla_version": package_version("fla"),
        "flash_mla_version": package_version("flash_mla"),
        "numpy_version": package_version("numpy"),
        "python": platform.python_version(),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_count": __import__("os").cpu_count(),
        "collected": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if meta["device_type"] == "cuda":
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        meta.update({
            "gpu_name": props.name,
            "gpu_capability": f"{props.major}.{props.minor}",
            "gpu_memory_bytes": int(props.total_memory),
            "gpu_sm_count": int(props.multi_processor_count),
            "gpu_l2_bytes": int(getattr(props, "L2_cache_size", 0) or 0),
        })
        meta.update(_nvidia_smi(dev.index or 0))
        meta["driver"] = meta.get("smi_driver_version", "")
    else:
        meta["cpu"] = platform.processor() or platform.machine()
        meta["torch_threads"] = torch.get_num_threads()
    return meta
