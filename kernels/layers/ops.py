"""The layers' fused ops as torch custom ops (``torch.ops.simtree.*``): one op each, the Triton
kernel (fused.py; V4's hyper-connections: fused_mhc.py) on CUDA for 16/32-bit floats, the
torch form (reference.py) elsewhere.

Being one op to the dispatcher, each counts as one kernel where ops are counted
(:mod:`.opcount`, the CPU proxy of a step's launches), and replays as one node of a CUDA graph.
``forms.set_forms(fused="torch")`` runs the torch forms on CUDA too (debugging).
"""
from typing import Optional

import torch

from . import reference as ref
from .forms import current

__all__ = ["rms_norm", "gated_rms_norm", "silu_mul", "sigmoid_mul", "gdn_gates", "norm_rope", "norm_rope_into",
           "tree_conv", "gather_rows", "hc_weights", "swiglu", "hc_mix_partials", "hc_weights_partials",
           "hc_collapse", "hc_head", "hc_merge"]


def _triton(*tensors: torch.Tensor) -> bool:
    return current().fused == "auto" and all(t.dtype != torch.float64 for t in tensors)


def _fused():
    from . import fused
    return fused


def _fused_mhc():
    from . import fused_mhc
    return fused_mhc


@torch.library.custom_op("simtree::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return ref.rms_norm(x, weight, eps)


@rms_norm.register_kernel("cuda")
def _rms_norm_cuda(x, weight, eps):
    return _fused().rms_norm(x, weight, eps) if _triton(x) else ref.rms_norm(x, weight, eps)


@torch.library.custom_op("simtree::gated_rms_norm", mutates_args=())
def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return ref.gated_rms_norm(o, z, weight, eps)


@gated_rms_norm.register_kernel("cuda")
def _gated_rms_norm_cuda(o, z, weight, eps):
    return _fused().gated_rms_norm(o, z, weight, eps) if _triton(o) else ref.gated_rms_norm(o, z, weight, eps)


@torch.library.custom_op("simtree::silu_mul", mutates_args=())
def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    return ref.silu_mul(gu)


@silu_mul.register_kernel("cuda")
def _silu_mul_cuda(gu):
    return _fused().silu_mul(gu) if _triton(gu) else ref.silu_mul(gu)


@torch.library.custom_op("simtree::swiglu", mutates_args=())
def swiglu(gu: torch.Tensor, limit: float) -> torch.Tensor:
    return ref.swiglu(gu, limit)


@swiglu.register_kernel("cuda")
def _swiglu_cuda(gu, limit):
    return _fused().silu_mul(gu, limit) if _triton(gu) else ref.swiglu(gu, limit)


@torch.library.custom_op("simtree::sigmoid_mul", mutates_args=())
def sigmoid_mul(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return ref.sigmoid_mul(o, gate)


@sigmoid_mul.register_kernel("cuda")
def _sigmoid_mul_cuda(o, gate):
    return _fused().sigmoid_mul(o, gate) if _triton(o) else ref.sigmoid_mul(o, gate)


@torch.library.custom_op("simtree::gdn_gates", mutates_args=())
def gdn_gates(ba: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.gdn_gates(ba, neg_a, dt_bias)


@gdn_gates.register_kernel("cuda")
def _gdn_gates_cuda(ba, neg_a, dt_bias):
    return _fused().gdn_gates(ba, neg_a, dt_bias) if _triton(ba) else ref.gdn_gates(ba, neg_a, dt_bias)


@torch.library.custom_op("simtree::norm_rope", mutates_args=())
def norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], cs: torch.Tensor, lo: int, inverse: bool, eps: float,
              norm: bool) -> torch.Tensor:
    return ref.norm_rope(x, weight, cs, lo, inverse, eps, norm)


@norm_rope.register_kernel("cuda")
def _norm_rope_cuda(x, weight, cs, lo, inverse, eps, norm):
    if _triton(x):
        return _fused().norm_rope(x, weight, cs, lo, inverse, eps, norm)
    return ref.norm_rope(x, weight, cs, lo, inverse, eps, norm)


@torch.library.custom_op("simtree::norm_rope_into", mutates_args=("out",))
def norm_rope_into(x: torch.Tensor, weight: Optional[torch.Tensor], cs: torch.Tensor, lo: int, inverse: bool,
                   eps: float, norm: bool, out: torch.Tensor) -> None:
    out.copy_(ref.norm_rope(x, weight, cs, lo, inverse, eps, norm))


@norm_rope_into.register_kernel("cuda")
def _norm_rope_into_cuda(x, weight, cs, lo, inverse, eps, norm, out):
    if _triton(x):
        _fused().norm_rope(x, weight, cs, lo, inverse, eps, norm, out=out)
    else:
        out.copy_(ref.norm_rope(x, weight, cs, lo, inverse, eps, norm))


@torch.library.custom_op("simtree::tree_conv", mutates_args=())
def tree_conv(x: torch.Tensor, state: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, splits: list[int],
              silu: bool) -> torch.Tensor:
    return ref.tree_conv(x, state, idx, weight, (splits[0], splits[1]), silu)


@tree_conv.register_kernel("cuda")
def _tree_conv_cuda(x, state, idx, weight, splits, silu):
    if _triton(x):
        return _fused().tree_conv(x, state, idx, weight, splits, silu)
    return ref.tree_conv(x, state, idx, weight, (splits[0], splits[1]), silu)


@torch.library.custom_op("simtree::gather_rows", mutates_args=("state",))
def gather_rows(state: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> None:
    ref.gather_rows(state, x, idx)


@gather_rows.register_kernel("cuda")
def _gather_rows_cuda(state, x, idx):
    if _triton(x) and state.is_contiguous():
        _fused().gather_rows(state, x, idx)
    else:
        ref.gather_rows(state, x, idx)


@torch.library.custom_op("simtree::hc_weights", mutates_args=())
def hc_weights(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.contiguous() for t in ref.hc_weights(m, base, scale, iters, eps))


@hc_weights.register_kernel("cuda")
def _hc_weights_cuda(m, base, scale, iters, eps):
    if _triton(m):
        return _fused_mhc().hc_weights(m, base, scale, iters, eps)
    return tuple(t.contiguous() for t in ref.hc_weights(m, base, scale, iters, eps))


@hc_weights.register_fake
def _hc_weights_fake(m, base, scale, iters, eps):
    T, n = m.shape
    hc = int(round((-2 + (4 + 4 * n) ** 0.5) / 2))
    return m.new_empty(T, hc), m.new_empty(T, hc), m.new_empty(T, hc, hc)


# ---- V4 hyper-connections under the form v4_hc="fused" (kernels/layers/mhc.py) -------------

@torch.library.custom_op("simtree::hc_mix_partials", mutates_args=())
def hc_mix_partials(x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    return ref.hc_mix_partials(x, fn)


def _weights_of_partials(p, base, scale, iters, eps, dim, norm_eps):
    m = ref.hc_mix_reduce(p, dim, norm_eps)
    return tuple(t.contiguous() for t in ref.hc_weights(m, base.to(m.dtype), scale.to(m.dtype), iters, eps))


@torch.library.custom_op("simtree::hc_weights_partials", mutates_args=())
def hc_weights_partials(p: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float, dim: int,
                        norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _weights_of_partials(p, base, scale, iters, eps, dim, norm_eps)


@torch.library.custom_op("simtree::hc_collapse", mutates_args=())
def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return ref.hc_collapse(x, pre)


def _head_of_partials(x, p, base, scale, eps, norm_eps):
    m = ref.hc_mix_reduce(p, x.shape[1] * x.shape[2], norm_eps)
    return ref.hc_collapse(x, torch.sigmoid(m * scale.to(m.dtype) + base.to(m.dtype)) + eps)


@torch.library.custom_op("simtree::hc_head", mutates_args=())
def hc_head(x: torch.Tensor, p: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    return _head_of_partials(x, p, base, scale, eps, norm_eps)


@torch.library.custom_op("simtree::hc_merge", mutates_args=())
def hc_merge(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return ref.hc_merge(x, out, post, comb)


def _cuda_kernel(name: str, torch_form):
    """An hc op's CUDA kernel: fused_mhc.<name> (same arguments) where every tensor argument is a
    16/32-bit float, the op's torch form elsewhere."""
    def kernel(*args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return (getattr(_fused_mhc(), name) if _triton(*tensors) else torch_form)(*args)
    return kernel


for _op, _name, _form in ((hc_mix_partials, "hc_mix_partials", ref.hc_mix_partials),
                          (hc_weights_partials, "hc_weights_partials", _weights_of_partials),
                          (hc_collapse, "hc_collapse", ref.hc_collapse), (hc_head, "hc_head", _head_of_partials),
                          (hc_merge, "hc_merge", ref.hc_merge)):
    _op.register_kernel("cuda")(_cuda_kernel(_name, _form))
