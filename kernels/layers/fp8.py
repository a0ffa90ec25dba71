"""Block-scaled FP8 weights (DeepSeek's checkpoint format) and the GEMMs over them.

A weight [.., N, K] is ``float8_e4m3fn`` with float32 block scales ``scale_inv`` [.., ceil(N/128),
ceil(K/128)]: the real weight is ``w * scale_inv`` block by block (:func:`dequantize_weight`).
At run time the activations are quantised per token and 128 input channels (1 x 128 groups,
scale = amax / 448), so a GEMM sums, per 128-channel step, the FP8 product times the row's and
the block's scales:

    linear(x, Fp8Weight(w, s))              the dispatch: on a CUDA GPU with FP8 (sm89+) and a
                                            16-bit x, the Triton kernel (one launch, x quantised
                                            in it) or torch._scaled_mm with 1x128 / 128x128
                                            block scales (cuBLAS; x quantised by torch ops first);
                                            elsewhere linear_ref
    grouped_linear(x, Fp8Weight, offs)      the routed experts' grouped GEMM (Triton on the GPU,
                                            one linear_ref per expert elsewhere)
    linear_ref(x, w)                        the dequantised weight, x not quantised: what the CPU
                                            runs (and what transformers computes on a CPU)
    linear_emulated(x, w)                   the FP8 GEMM's exact math in float32 (x quantised,
                                            both operands dequantised): the kernels' test oracle

The layer form ``fp8_gemm`` (:mod:`.forms`, set by the caller: ``set_forms(fp8_gemm=...)``) =
auto | scaled_mm | triton | ref picks the GPU path (auto: the Triton kernel, whose one launch beats the quantising ops plus cuBLAS at decoding sizes;
scripts/fp8_gpu.sh times both; scaled_mm falls back to Triton where cuBLAS lacks block scales).  A model keeps its weights as flat tensors,
``name`` and ``name_scale_inv``; :func:`weight` views them as one :class:`Fp8Weight`.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from simtree.checkpoints.quantized import (FP8_DTYPE, FP8_MAX, SCALE_EPS, SCALE_SUFFIX, Fp8Weight, dequantize_weight,
                                           fp4_to_fp8, from_checkpoint, pow2_up, quantize_weight)
from simtree.quant import FP8_BLOCK

from .forms import current
from .opcount import kernel_core

__all__ = ["FP8_DTYPE", "FP8_MAX", "SCALE_SUFFIX", "Fp8Weight", "weight", "from_checkpoint", "fp4_to_fp8",
           "quantize_weight", "dequantize_weight", "quantize_act", "linear_ref", "linear_emulated", "linear", "grouped_linear", "gpu_fp8", "gemm_choice"]

def weight(w: dict, name: str):
    """``w[name]``, as an :class:`Fp8Weight` where the dict holds its scales too."""
    s = w.get(name + SCALE_SUFFIX)
    return w[name] if s is None else Fp8Weight(w[name], s)


def quantize_act(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] per row and 128 channels -> (float8_e4m3fn [M, K], float32 scales
    [M, ceil(K/128)]), scale = max(amax, 1e-10) / 448."""
    M, K = x.shape
    kb = -(-K // FP8_BLOCK)
    xf = F.pad(x.float(), (0, kb * FP8_BLOCK - K)).view(M, kb, FP8_BLOCK)
    s = xf.abs().amax(-1).clamp_min(SCALE_EPS) / FP8_MAX
    if pow2:
        s = pow2_up(s)
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, kb * FP8_BLOCK)[:, :K].contiguous(), s.contiguous()


def linear_ref(x: torch.Tensor, w) -> torch.Tensor:
    """x [.., K] times the dequantised weight [N, K]^T (a plain tensor: F.linear)."""
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w)
    return F.linear(x, dequantize_weight(w, x.dtype))


def linear_emulated(x: torch.Tensor, w: Fp8Weight, pow2: bool = False) -> torch.Tensor:
    """The FP8 GEMM's math in float32: x quantised per 1 x 128 group, both operands dequantised,
    one float32 matmul, rounded to x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    q, s = quantize_act(x2, pow2)
    xd = q.float() * s.repeat_interleave(FP8_BLOCK, -1)[:, :x2.shape[-1]]
    y = xd @ dequantize_weight(w, torch.float32).transpose(-2, -1)
    return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


# ---- dispatch ---------------------------------------------------------------------------------
def gemm_choice() -> str:
    """The FP8 GEMM's form on the GPU (``forms.current().fp8_gemm``, checked where it is set)."""
    return current().fp8_gemm


def gpu_fp8(x: torch.Tensor) -> bool:
    """Whether x's GEMMs run as FP8 kernels: a CUDA GPU with FP8 tensor cores (sm89+), x in 16
    bits (float32 / float64 models run the dequantised reference)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and gemm_choice() != "ref"
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


_SCALED_MM = {"ok": hasattr(torch, "_scaled_mm")}    # off after its first failure on this device


def _scaled_mm(x2: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """cuBLAS block-scaled GEMM: activations 1 x 128 (scales outer-dim major; rows padded to a
    multiple of 4 with zeros, as cuBLAS's scale layout wants), weight 128 x 128."""
    M = x2.shape[0]
    q, s = quantize_act(F.pad(x2, (0, 0, 0, -M % 4)) if M % 4 else x2)
    y = torch._scaled_mm(q, w.weight.t(), scale_a=s.t().contiguous().t(), scale_b=w.scale_inv.t(),
                         out_dtype=x2.dtype)
    return y[:M]


def _scaled_mm_fits(x2: torch.Tensor, w: Fp8Weight) -> bool:
    N, K = w.shape
    return _SCALED_MM["ok"] and K % FP8_BLOCK == 0 and N % FP8_BLOCK == 0 and w.weight.dim() == 2


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [.., K] times a weight [N, K]^T: a plain tensor by F.linear, an :class:`Fp8Weight` by the
    FP8 GEMM on a GPU that has one (see the module's doc), by :func:`linear_ref` elsewhere."""
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w)
    with kernel_core("fp8_gemm"):
        if not gpu_fp8(x):
            return linear_ref(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        choice = gemm_choice()
        if choice == "scaled_mm" and _scaled_mm_fits(x2, w):
            try:
                return _scaled_mm(x2, w).view(*x.shape[:-1], w.shape[0])
            except RuntimeError as exc:   # a build without block-scaled cuBLAS: the Triton kernel
                _SCALED_MM["ok"] = False
                warnings.warn(f"torch._scaled_mm with block scales failed ({' '.join(str(exc).split())[:160]}): "
                              "FP8 linears run the Triton kernel", RuntimeWarning, stacklevel=2)
        from .fp8_kernel import grouped_fp8_gemm
        offs = torch.full((1,), x2.shape[0], dtype=torch.int32, device=x.device)
        return grouped_fp8_gemm(x2, w.weight[None], w.scale_inv[None], offs).view(*x.shape[:-1], w.shape[0])


def grouped_linear(x: torch.Tensor, w: Fp8Weight, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of x [M, K] times expert e's weight [N, K]^T -> [M, N]: the Triton
    grouped kernel on an FP8 GPU, else one dequantised linear per expert (a host loop)."""
    if gpu_fp8(x):
        from .fp8_kernel import grouped_fp8_gemm
        return grouped_fp8_gemm(x, w.weight, w.scale_inv, offs.to(torch.int32))
    out = x.new_zeros(x.shape[0], w.shape[-2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = linear_ref(x[start:end], Fp8Weight(w.weight[e], w.scale_inv[e]))
        start = end
    return out
