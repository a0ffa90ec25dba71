"""Routed experts without a host sync: routing to the top-k experts (softmax, or DeepSeek-V4's
``sqrtsoftplus`` scores with a selection-only bias, or V4's hash table), the (token, expert)
pairs sorted by expert and run as one grouped GEMM per projection.

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

__all__ = ["route_topk", "route_v4", "swiglu", "routed_experts", "grouped_mm_capturable"]


def route_topk(x: torch.Tensor, w_router: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax gate over the experts (fp32), the top ``topk`` renormalised: (ids [T, k], weights [T, k])."""
    probs = torch.softmax(F.linear(x, w_router).float(), -1)
    w, ids = probs.topk(topk, -1)
    return ids, w / w.sum(-1, keepdim=True)


def route_v4(x: torch.Tensor, w_router: torch.Tensor, topk: int, scaling: float, bias: torch.Tensor | None = None,
             tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 routing (fp32): scores sqrt(softplus(x W^T)); the experts are the top ``topk``
    of scores + ``bias`` (the bias picks, never weighs) or, on a hash layer, ``tid2eid[token_ids]``;
    their scores renormalised to sum 1, times ``scaling``: (ids [T, k], weights [T, k])."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    scores = F.softplus(F.linear(x, w_router).to(dt)).sqrt()
    if tid2eid is not None:
        ids = tid2eid[token_ids.reshape(-1)]
    else:
        ids = (scores if bias is None else scores + bias.to(dt)).topk(topk, -1, sorted=False).indices
    w = scores.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * scaling


def swiglu(gu: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up of gu [T, 2I] = [gate | up]; ``limit``: gate clamped above at limit, up
    to [-limit, limit] first (V4's ``swiglu_limit``)."""
    return ops.swiglu(gu, float(limit)) if limit else ops.silu_mul(gu)


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
                   w_down: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, h]; experts' w_gate_up
    [E, 2I, h], w_down [E, h, I].  The T*k pairs are sorted by expert (stable), each expert's
    rows end at offs[e] (a search of the sorted ids), run as one grouped GEMM per projection
    and put back in (token, slot) order before the weighted sum.  ``limit``: :func:`swiglu`'s."""
    T, k = ids.shape
    E = w_gate_up.shape[0]
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_ids, _experts(E, x.device), right=True).to(torch.int32)
    xs = x.index_select(0, order // k)
    with kernel_core("grouped_mm"):
        gu = _grouped_linear(xs, w_gate_up, offs)
    act = swiglu(gu, limit)
    with kernel_core("grouped_mm"):
        y = _grouped_linear(act, w_down, offs)
    back = torch.empty_like(y).index_copy_(0, order, y)
    return (back.view(T, k, -1) * weights.to(y.dtype)[..., None]).sum(1)
