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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from simtree.errors import SimtreeError
from simtree.quant import FP8_BLOCK

from .forms import current
from .opcount import kernel_core

__all__ = ["FP8_DTYPE", "FP8_MAX", "SCALE_SUFFIX", "Fp8Weight", "weight", "from_checkpoint", "fp4_to_fp8", "quantize_weight", "dequantize_weight",
           "quantize_act", "linear_ref", "linear_emulated", "linear", "grouped_linear", "gpu_fp8", "gemm_choice"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
_ACT_EPS = 1e-10


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight [.., N, K] and its float32 block scales [.., ceil(N/128), ceil(K/128)]."""

    weight: torch.Tensor
    scale_inv: torch.Tensor

    def __post_init__(self):
        w, s = self.weight, self.scale_inv
        want = (*w.shape[:-2], -(-w.shape[-2] // FP8_BLOCK), -(-w.shape[-1] // FP8_BLOCK))
        if w.dtype != FP8_DTYPE or tuple(s.shape) != want:
            raise SimtreeError(f"FP8 weight {tuple(w.shape)} {w.dtype} with scales {tuple(s.shape)}: expected "
                               f"{FP8_DTYPE} and scales {want}")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def weight(w: dict, name: str):
    """``w[name]``, as an :class:`Fp8Weight` where the dict holds its scales too."""
    s = w.get(name + SCALE_SUFFIX)
    return w[name] if s is None else Fp8Weight(w[name], s)


def from_checkpoint(name: str, weight: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
    """A checkpoint's FP8 weight and its block scales (``weight_scale_inv`` / ``scale``: float32,
    bf16 or UE8M0 ``float8_e8m0fnu``, widened to float32 exactly); a wrong dtype or shape is one
    line naming ``name``."""
    if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16, getattr(torch, "float8_e8m0fnu", None)):
        raise SimtreeError(f"{name}: block scales of dtype {scale.dtype}: expected float32, bf16 or float8_e8m0fnu")
    try:
        return Fp8Weight(weight, scale.float().contiguous())
    except SimtreeError as exc:
        raise SimtreeError(f"{name}: {exc}") from None


_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_GROUP = 32


def fp4_to_fp8(name: str, packed: torch.Tensor, scales: torch.Tensor) -> Fp8Weight:
    """An MXFP4 checkpoint weight (``expert_dtype`` fp4: two e2m1 values per byte, the low nibble
    first, [.., N, K/2]; one scale per row and 32 input channels, [.., N, K/32], UE8M0 or float)
    as block-scaled FP8, the way SGLang runs FP4 experts on Hopper (dequantised, then FP8 with
    power-of-two block scales: exact wherever a block's values fit e4m3's range).  A wrong
    dtype or shape is one line naming ``name``."""
    if packed.dtype not in (torch.int8, torch.uint8) and str(packed.dtype) != "torch.float4_e2m1fn_x2":
        raise SimtreeError(f"{name}: MXFP4 weight of dtype {packed.dtype}: expected int8 / uint8 (two e2m1 per byte)")
    *lead, N, half = packed.shape
    if tuple(scales.shape) != (*lead, N, -(-2 * half // FP4_GROUP)):
        raise SimtreeError(f"{name}: MXFP4 weight {tuple(packed.shape)} with scales {tuple(scales.shape)}: expected "
                           f"scales {(*lead, N, -(-2 * half // FP4_GROUP))}")
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(_FP4_E2M1, dtype=torch.float32, device=packed.device)
    vals = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], -1).reshape(*lead, N, 2 * half)
    s = (scales.float() - 127.0).exp2() if scales.dtype == torch.uint8 else scales.float()
    return quantize_weight(vals * s.repeat_interleave(FP4_GROUP, -1)[..., :2 * half], pow2=True)


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block scales [.., nb, kb] -> one per element [.., rows, cols]."""
    return s.repeat_interleave(FP8_BLOCK, -2)[..., :rows, :].repeat_interleave(FP8_BLOCK, -1)[..., :cols]


def _pow2_up(s: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(s)))


def quantize_weight(w: torch.Tensor, pow2: bool = False) -> Fp8Weight:
    """A weight [.., N, K] in 128 x 128 blocks: scale = block amax / 448 (a power of two, rounded
    up, when ``pow2``: UE8M0 scales), values w / scale in float8_e4m3fn."""
    *lead, N, K = w.shape
    nb, kb = -(-N // FP8_BLOCK), -(-K // FP8_BLOCK)
    wf = F.pad(w.float(), (0, kb * FP8_BLOCK - K, 0, nb * FP8_BLOCK - N))
    blocks = wf.view(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    s = blocks.abs().amax(dim=(-3, -1)).clamp_min(_ACT_EPS) / FP8_MAX
    if pow2:
        s = _pow2_up(s)
    q = (wf / _expand(s, nb * FP8_BLOCK, kb * FP8_BLOCK)).clamp(-FP8_MAX, FP8_MAX)
    return Fp8Weight(q[..., :N, :K].to(FP8_DTYPE).contiguous(), s.contiguous())


def dequantize_weight(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real weight [.., N, K]: FP8 values times their block's scale, computed in float32
    (float64 for a float64 ``dtype``), returned as ``dtype``."""
    N, K = w.weight.shape[-2:]
    dt = _compute(dtype)
    return (w.weight.to(dt) * _expand(w.scale_inv.to(dt), N, K)).to(dtype)


def quantize_act(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] per row and 128 channels -> (float8_e4m3fn [M, K], float32 scales
    [M, ceil(K/128)]), scale = max(amax, 1e-10) / 448."""
    M, K = x.shape
    kb = -(-K // FP8_BLOCK)
    xf = F.pad(x.float(), (0, kb * FP8_BLOCK - K)).view(M, kb, FP8_BLOCK)
    s = xf.abs().amax(-1).clamp_min(_ACT_EPS) / FP8_MAX
    if pow2:
        s = _pow2_up(s)
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
