"""Random weights of the full-scale models, made on the target device from a list of specs.

A model module lists its parameters as :class:`Spec` (name, shape, how to initialise, dtype);
:func:`make_weights` allocates them on the device, each tensor seeded from (seed, name) so its
values do not depend on the order of creation, and :func:`spec_bytes` sizes the same list, so
the planner's weight bytes and what the runtime allocates cannot drift apart.

Linear weights are stored [out, in] (``F.linear``) with std in^-1/2, so activations stay O(1);
output projections that feed the residual stream get a further 1/sqrt(2 layers), so the
stream's scale does not grow with depth.  An FP8 weight (:func:`expert_linear` at ``fp8``) is
N(0, 1) values in float8_e4m3fn with every 128 x 128 block scaled by that std: the same
real weight's statistics, at the checkpoint's bytes.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from simtree.quant import scale_blocks

__all__ = ["Spec", "linear", "expert_linear", "make_weights", "weights_from", "spec_bytes", "dtype_bytes",
           "residual_gain", "ends_specs", "mtp_specs"]


@dataclass(frozen=True)
class Spec:
    """One parameter: ``init`` "normal" (std ``scale``), "const" (every entry ``scale``),
    "log_uniform" (log of U(1, ``scale``): GDN's A_log) or "randint" (integers in [0, ``scale``):
    V4's hash-routing table); ``dtype`` None: the model's dtype."""

    name: str
    shape: tuple
    init: str = "normal"
    scale: float = 1.0
    dtype: torch.dtype | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def linear(name: str, out_features: int, in_features: int, gain: float = 1.0, groups: int | None = None,
           dtype=None) -> Spec:
    """A linear weight [out, in] (or [groups, out, in]) with std gain / sqrt(in)."""
    shape = (out_features, in_features) if groups is None else (groups, out_features, in_features)
    return Spec(name, shape, "normal", gain / math.sqrt(in_features), dtype)


def expert_linear(name: str, out_features: int, in_features: int, dtype: str, gain: float = 1.0,
                  groups: int | None = None) -> list[Spec]:
    """An expert's weight as the model stores it (``dtype``: bf16 or fp8, :mod:`simtree.quant`):
    :func:`linear`, or an FP8 weight and its float32 block scales ``name + "_scale_inv"``."""
    if dtype == "bf16":
        return [linear(name, out_features, in_features, gain, groups)]
    lead = () if groups is None else (groups,)
    std = gain / math.sqrt(in_features)
    return [Spec(name, (*lead, out_features, in_features), "normal", 1.0, torch.float8_e4m3fn),
            Spec(name + "_scale_inv", (*lead, *scale_blocks(out_features, in_features)), "const", std, torch.float32)]


def residual_gain(num_layers: int) -> float:
    """Std gain of the projections that write into the residual stream: the stream's variance
    stays about 1 over 2 * num_layers residual branches."""
    return 1.0 / math.sqrt(2 * num_layers)


def ends_specs(vocab: int, h: int) -> list[Spec]:
    """The model's two ends, shared by both families: token embedding, LM head, final norm."""
    return [Spec("embed", (vocab, h)), linear("lm_head", vocab, h), Spec("norm", (h,), "const", 1.0)]


def mtp_specs(h: int, block: list[Spec]) -> list[Spec]:
    """The MTP draft layer around its block (``block``: the layer's specs, prefixed "mtp."):
    the token and hidden norms, the fuse projection [h, 2h] and the output norm."""
    return [Spec("mtp.enorm", (h,), "const", 1.0), Spec("mtp.hnorm", (h,), "const", 1.0),
            linear("mtp.fc", h, 2 * h), *block, Spec("mtp.norm", (h,), "const", 1.0)]


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def spec_bytes(specs: list[Spec], dtype: torch.dtype) -> int:
    """Bytes the specs take with ``dtype`` as the model's dtype."""
    return sum(s.numel * dtype_bytes(s.dtype or dtype) for s in specs)


_FP8_CHUNK = 1 << 26


def _generator(device: torch.device, seed: int, name: str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
    return gen


@torch.no_grad()
def make_weights(specs: list[Spec], device, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """{name: tensor} on ``device``; random values drawn there (no host copy of the weights)."""
    device = torch.device(device)
    out = {}
    for s in specs:
        t = torch.empty(s.shape, dtype=s.dtype or dtype, device=device)
        if s.init == "normal" and t.dtype == torch.float8_e4m3fn:     # drawn in float32, a slice at a time
            gen, flat = _generator(device, seed, s.name), t.view(-1)
            for lo in range(0, flat.numel(), _FP8_CHUNK):
                part = flat[lo:lo + _FP8_CHUNK]
                part.copy_(torch.empty(part.shape, device=device).normal_(0.0, s.scale, generator=gen))
        elif s.init == "normal":
            t.normal_(0.0, s.scale, generator=_generator(device, seed, s.name))
        elif s.init == "const":
            t.fill_(s.scale)
        elif s.init == "randint":
            t.random_(0, int(s.scale), generator=_generator(device, seed, s.name))
        elif s.init == "log_uniform":
            t.uniform_(1.0, s.scale, generator=_generator(device, seed, s.name)).log_()
        else:
            raise ValueError(f"unknown init {s.init!r} of {s.name}")
        out[s.name] = t
    return out


@torch.no_grad()
def weights_from(specs: list[Spec], given: dict, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``given`` {name: tensor} (loaded weights) checked against ``specs`` - every name known,
    every shape the spec's - and moved to ``device`` at each spec's dtype (``dtype`` where the
    spec has none).  One line on the first mismatch."""
    from simtree.errors import SimtreeError
    by_name = {s.name: s for s in specs}
    out = {}
    for name, t in given.items():
        s = by_name.get(name)
        if s is None:
            raise SimtreeError(f"loaded weight {name!r} is not a parameter of this model")
        if tuple(t.shape) != tuple(s.shape):
            raise SimtreeError(f"loaded weight {name!r} has shape {list(t.shape)}, the model needs {list(s.shape)}")
        out[name] = t.to(device=device, dtype=s.dtype or dtype).contiguous()
    return out
