"""What the kernels ask of the Triton they run on, read from Triton's own runtime state (its
knobs), never from the environment: whether it interprets the kernels on the CPU."""
from __future__ import annotations

__all__ = ["interpreting"]


def interpreting() -> bool:
    """Whether Triton runs the kernels through its CPU interpreter (``triton.knobs.runtime
    .interpret``: TRITON_INTERPRET=1 as Triton reads it, or set by a caller).  Its bf16 dots
    are wrong, so the bf16 paths keep fp32 operands there and compiled-only features (PDL,
    register caps, the CUDA kernels) stay off."""
    from triton import knobs
    return bool(knobs.runtime.interpret)
