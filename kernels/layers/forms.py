"""Which form the layers' ops run in, set by the callers that choose (never read from the
environment): the profiler's check of the fused ops against their torch forms, a GPU session
that falls back to the torch tree attention when the kernel fails its check.

    fused           "auto": the fused Triton ops (``ops.py``) on CUDA for 16/32-bit floats;
                    "torch": their torch forms everywhere (debugging, the profiler's check)
    tree_attention  "auto": the Triton kernel on CUDA, the torch form elsewhere; "triton"
                    (the interpreter on CPU) or "torch"
    fp8_gemm        the FP8 experts' GEMM on an FP8 GPU (``fp8.py``): "auto" (the Triton kernel),
                    "scaled_mm" (cuBLAS block-scaled, Triton where it cannot), "triton" or "ref"
                    (the dequantised weight)

V4 layer verify (a block of its own; kernels/v4/verify.py FUSIONS, docs/math/v4_compression.md):

    v4_topk         the CSA indexer's top-k + attention list: "fused" (one Triton launch,
                    score rows up to _topk_kernel.MAX_ROW), "sort" (torch.topk + the list
                    kernel); "auto": V4_AUTO's choice
    v4_hc           the hyper-connections (mhc.py) of every V4 block: "fused" (hc_pre in three
                    launches: mix partials, weights, collapse; hc_post in one merge; hc_head in
                    two), "torch" (~10 / ~5 small torch ops); "auto": V4_AUTO's choice.  The
                    fused ops run their Triton kernels on CUDA for 16/32-bit floats, their torch
                    forms (one op each, as counted) on the CPU; float64 keeps the "torch" path
    v4_comp         the compressors' projections (wkv, wgate) as a V4 model is built (weights,
                    loaded checkpoints, the registry's weight bytes): "model" - at the model's
                    dtype, as the checkpoint ships them (bf16), multiplied into fp32 on the tensor
                    cores (kernels/v4/compressor.matmul_t); "fp32" - an fp32 copy (cuBLAS SGEMM);
                    "auto": V4_AUTO's choice.  Read when the weights are made: set it before
                    building the model (and keep it while the registry counts its bytes)
    v4_pool         the compressors' pooling of the windows completing in a round
                    (kernels/v4/_pool_kernel.py): "whole" (a program per row of the plan, its
                    padding rows included), "live" (padding rows skip their slot loop), "split"
                    ("live", and HCA's 128-slot windows over (window, channels) programs);
                    "auto": V4_AUTO's choice.  Triton path only (the torch attention path pools
                    the plan's rows with torch)
    v4_proj         the attention's linears of a V4 shape whose checkpoint stores them in FP8
                    (``v4.attn_proj_dtype`` fp8): "fp8" - kept so, FP8 GEMMs (fp8.linear); "bf16" -
                    dequantised when the weights are made or loaded (cuBLAS bf16 GEMMs, twice the
                    bytes); "auto": V4_AUTO's choice (fp8).  Read when the weights are made, like v4_comp

    set_forms(tree_attention="torch")       # from here on
    set_forms(fp8_gemm="scaled_mm")
    with forms(fused="torch"): ...          # inside the block only

GDN commit (``gdn_commit``): "standalone" - each round's commit reads and writes the GDN state
the verify read already (three passes over it); "deferred" - the commit keeps the accepted
path's token rows and the next round's verify folds them into the state as it reads it (two
passes; ``simtree.kernels.gdn.deferred``, docs/math/gdn_tree_solve.md).  The default stays
"standalone" until ``profiler/bench/gdn_floor.py`` has measured both on the GPU.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

from simtree.errors import SimtreeError
from simtree.quant import V4_AUTO, set_attn_proj_storage, set_comp_proj_storage

__all__ = ["LayerForms", "current", "set_forms", "forms", "v4_fusions", "v4_form", "V4_AUTO"]

_CHOICES = {"fused": ("auto", "torch"), "tree_attention": ("auto", "triton", "torch"),
            "fp8_gemm": ("auto", "scaled_mm", "triton", "ref")}
_CHOICES.update(gdn_commit=("standalone", "deferred"))

# ---- V4 layer verify fusions ----------------------------------------------------------------
_CHOICES.update(v4_topk=("auto", "fused", "sort"), v4_hc=("auto", "fused", "torch"), v4_comp=("auto", "fp32", "model"),
                v4_pool=("auto", "whole", "live", "split"), v4_proj=("auto", "fp8", "bf16"))
# what "auto" runs: simtree/quant.py's V4_AUTO, every fused form (measured faster on the H100:
# profiler/bench/v4_floor.py's summary names the faster form of each switch, docs/math/v4_compression.md;
# v4_breakdown.py --forms torch,fused times the block's pre / post under each v4_hc) and the FP8 linears
# form -> {its value: tree_verify's name of the launch it runs} (the forms: the module docstring)
_V4_FUSION = {"v4_topk": {"fused": "topk"}, "v4_pool": {"live": "pool_live", "split": "pool_split"}}


@dataclass(frozen=True)
class LayerForms:
    fused: str = "auto"
    tree_attention: str = "auto"
    fp8_gemm: str = "auto"
    gdn_commit: str = "standalone"
    v4_topk: str = "auto"
    v4_hc: str = "auto"
    v4_comp: str = "auto"
    v4_pool: str = "auto"
    v4_proj: str = "auto"

    def __post_init__(self):
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise SimtreeError(f"{name} form {getattr(self, name)!r}: use "
                                   + ", ".join(allowed))


_current = LayerForms()


def current() -> LayerForms:
    """The forms the ops run in now."""
    return _current


def set_forms(**changes: str) -> LayerForms:
    """Set forms (``fused``, ``tree_attention``, ``fp8_gemm``, ``gdn_commit``, ``v4_topk``, ``v4_hc``, ``v4_comp``,
    ``v4_pool``, ``v4_proj``)
    from here on; returns the ones replaced."""
    global _current
    old, _current = _current, replace(_current, **changes)
    set_comp_proj_storage(v4_form("v4_comp"))     # the storage the core's byte counts and loader read
    set_attn_proj_storage(v4_form("v4_proj"))
    return old


@contextmanager
def forms(**changes: str):
    """The forms changed inside the block, restored after it."""
    old = set_forms(**changes)
    try:
        yield _current
    finally:
        set_forms(**{name: getattr(old, name) for name in _CHOICES})


def v4_form(name: str, f: LayerForms | None = None) -> str:
    """The V4 form ``name`` runs under forms ``f`` (default: now), "auto" resolved through V4_AUTO."""
    value = getattr(f or _current, name)
    return V4_AUTO[name] if value == "auto" else value


def v4_fusions(f: LayerForms | None = None) -> tuple[str, ...]:
    """The fused launches a V4 layer's tree verify runs under forms ``f`` (default: now)."""
    return tuple(by_value[v4_form(form, f)] for form, by_value in _V4_FUSION.items() if v4_form(form, f) in by_value)


set_comp_proj_storage(v4_form("v4_comp"))
set_attn_proj_storage(v4_form("v4_proj"))
