"""Routed experts without a host sync: softmax routing to the top-k of the local experts, the
(token, expert) pairs sorted by expert and run as one grouped GEMM per projection.

``routed_experts`` sums every token's experts in (token, slot) order whatever the batch;
``torch._grouped_mm`` runs where it can (CUDA, bf16); elsewhere (the CPU, float64) one GEMM per
expert in a host loop stands in (:func:`grouped_mm_capturable` says which a model gets).
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from . import fp8, ops
from .opcount import kernel_core

__all__ = ["route_topk", "routed_experts", "grouped_mm_capturable"]


def route_topk(x: torch.Tensor, w_router: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax gate over the experts (fp32), the top ``topk`` renormalised: (ids [T, k], weights [T, k])."""
    probs = torch.softmax(F.linear(x, w_router).float(), -1)
    w, ids = probs.topk(topk, -1)
    return ids, w / w.sum(-1, keepdim=True)


_GROUPED_MM = {"ok": hasattr(torch, "_grouped_mm")}   # off after the first failure on this device


def grouped_mm_capturable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether routed experts run as ``torch._grouped_mm`` (no host sync) here."""
    return torch.device(device).type == "cuda" and dtype == torch.bfloat16 and _GROUPED_MM["ok"]


def _grouped_linear(x: torch.Tensor, w, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of x [M, in] times w[e] [out, in]^T -> [M, out] (an FP8 ``w``:
    :func:`fp8.grouped_linear`)."""
    if isinstance(w, fp8.Fp8Weight):
        return fp8.grouped_linear(x, w, offs)
    if grouped_mm_capturable(x.device, x.dtype):
        try:
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        except RuntimeError as exc:    # a build without the kernel for this GPU: the loop below
            _GROUPED_MM["ok"] = False
            warnings.warn(f"torch._grouped_mm failed ({' '.join(str(exc).split())[:160]}): routed experts "
                          "run one GEMM per expert, with a host sync", RuntimeWarning, stacklevel=2)
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):     # host loop: CPU / float64 reference path
        if end > start:
            out[start:end] = F.linear(x[start:end], w[e])
        start = end
    return out


@functools.lru_cache(maxsize=16)
def _experts(E: int, device: torch.device) -> torch.Tensor:
    return torch.arange(E, dtype=torch.int64, device=device)


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, h]; experts' w_gate_up
    [E, 2I, h], w_down [E, h, I].  The T*k pairs are sorted by expert (stable), each expert's
    rows end at offs[e] (a search of the sorted ids), run as one grouped GEMM per projection
    and put back in (token, slot) order before the weighted sum."""
    T, k = ids.shape
    E = w_gate_up.shape[0]
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_ids, _experts(E, x.device), right=True).to(torch.int32)
    xs = x.index_select(0, order // k)
    with kernel_core("grouped_mm"):
        gu = _grouped_linear(xs, w_gate_up, offs)
    act = ops.silu_mul(gu)
    with kernel_core("grouped_mm"):
        y = _grouped_linear(act, w_down, offs)
    back = torch.empty_like(y).index_copy_(0, order, y)
    return (back.view(T, k, -1) * weights.to(y.dtype)[..., None]).sum(1)
