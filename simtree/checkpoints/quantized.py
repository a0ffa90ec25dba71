"""Block-scaled FP8 weights as DeepSeek's checkpoints store them, and the conversions the
checkpoint loader and the FP8 GEMMs share (plain torch; the GEMMs are
``simtree.kernels.layers.fp8``, which re-exports these names).

A weight [.., N, K] is ``float8_e4m3fn`` with float32 block scales ``scale_inv`` [..,
ceil(N/128), ceil(K/128)]: the real weight is ``w * scale_inv`` block by block.

    Fp8Weight(weight, scale_inv)            checked: dtype and the scales' shape
    from_checkpoint(key, weight, scale)     a checkpoint's FP8 weight (float / bf16 / UE8M0 scales)
    fp4_to_fp8(key, packed, scales)         an MXFP4 weight as block-scaled FP8
    quantize_weight(w) / dequantize_weight(w)
    quantised_reader(read)                  a checkpoint reader joining 1-byte weights to their scales
    cat_rows / stack / as_format            experts assembled and put in the format a model runs
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from simtree.errors import SimtreeError
from simtree.quant import FP8_BLOCK

__all__ = ["FP8_DTYPE", "FP8_MAX", "SCALE_SUFFIX", "SCALE_EPS", "FP4_GROUP", "Fp8Weight", "from_checkpoint", "fp4_to_fp8",
           "quantize_weight", "dequantize_weight", "expand_scales", "pow2_up",
           "CHECKPOINT_SCALE_SUFFIXES", "cat_rows", "stack", "quantised_reader", "as_format"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
SCALE_EPS = 1e-10


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


def expand_scales(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block scales [.., nb, kb] -> one per element [.., rows, cols]."""
    return s.repeat_interleave(FP8_BLOCK, -2)[..., :rows, :].repeat_interleave(FP8_BLOCK, -1)[..., :cols]


def pow2_up(s: torch.Tensor) -> torch.Tensor:
    """Scales rounded up to powers of two (UE8M0)."""
    return torch.exp2(torch.ceil(torch.log2(s)))


def quantize_weight(w: torch.Tensor, pow2: bool = False) -> Fp8Weight:
    """A weight [.., N, K] in 128 x 128 blocks: scale = block amax / 448 (a power of two, rounded
    up, when ``pow2``: UE8M0 scales), values w / scale in float8_e4m3fn."""
    *lead, N, K = w.shape
    nb, kb = -(-N // FP8_BLOCK), -(-K // FP8_BLOCK)
    wf = F.pad(w.float(), (0, kb * FP8_BLOCK - K, 0, nb * FP8_BLOCK - N))
    blocks = wf.view(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    s = blocks.abs().amax(dim=(-3, -1)).clamp_min(SCALE_EPS) / FP8_MAX
    if pow2:
        s = pow2_up(s)
    q = (wf / expand_scales(s, nb * FP8_BLOCK, kb * FP8_BLOCK)).clamp(-FP8_MAX, FP8_MAX)
    return Fp8Weight(q[..., :N, :K].to(FP8_DTYPE).contiguous(), s.contiguous())


def dequantize_weight(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real weight [.., N, K]: FP8 values times their block's scale, computed in float32
    (float64 for a float64 ``dtype``), returned as ``dtype``."""
    N, K = w.weight.shape[-2:]
    dt = _compute(dtype)
    return (w.weight.to(dt) * expand_scales(w.scale_inv.to(dt), N, K)).to(dtype)


CHECKPOINT_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")     # a weight's block scales: released, transformers
def cat_rows(parts: list):
    """Weights stacked along their rows: FP8 blocks kept where every part's rows are whole
    blocks, else the parts dequantised (float32) first."""
    if all(isinstance(t, Fp8Weight) for t in parts) and all(t.shape[-2] % FP8_BLOCK == 0 for t in parts[:-1]):
        return Fp8Weight(torch.cat([t.weight for t in parts]), torch.cat([t.scale_inv for t in parts]))
    return torch.cat([dequantize_weight(t) if isinstance(t, Fp8Weight) else t for t in parts])


def stack(parts: list):
    if all(isinstance(t, Fp8Weight) for t in parts):
        return Fp8Weight(torch.stack([t.weight for t in parts]), torch.stack([t.scale_inv for t in parts]))
    return torch.stack([dequantize_weight(t) if isinstance(t, Fp8Weight) else t for t in parts])


def quantised_reader(read):
    """``read`` with every 1-byte weight joined to its block scales: ``reader(key)`` dequantised
    (float32), ``reader.expert(key)`` an :class:`Fp8Weight` (FP4 converted)."""
    def scales(key: str):
        base = key[:-len(".weight")] if key.endswith(".weight") else key
        for suffix in CHECKPOINT_SCALE_SUFFIXES:
            try:
                return read(base + suffix)
            except KeyError:
                continue
        raise SimtreeError(f"checkpoint: {key} is {read(key).dtype} without block scales "
                           f"({base}.scale or {base}.weight_scale_inv)")

    def expert(key: str):
        t = read(key)
        if t.dtype in (torch.int8, torch.uint8) or str(t.dtype) == "torch.float4_e2m1fn_x2":
            return fp4_to_fp8(key, t, scales(key))
        if t.is_floating_point() and t.element_size() == 1:
            return from_checkpoint(key, t, scales(key))
        return t

    def dense(key: str):
        t = expert(key)
        return dequantize_weight(t) if isinstance(t, Fp8Weight) else t
    dense.expert = expert
    return dense


def as_format(t, want: str, dtype) -> dict:
    """{"": weight, "_scale_inv": scales} of an expert weight at the shape's format ``want``."""
    if want == "fp8":
        q = t if isinstance(t, Fp8Weight) else quantize_weight(t)
        return {"": q.weight, SCALE_SUFFIX: q.scale_inv}
    return {"": dequantize_weight(t, dtype) if isinstance(t, Fp8Weight) else t}
