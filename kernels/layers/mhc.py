"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual stream is ``hc``
parallel streams x [T, hc, h]; each block (attention, MoE) reads one mix of them and writes
its output back into all of them.

From the streams, one projection (fp32) of their unweighted-RMS-normed concatenation gives

    pre  [T, hc]      = sigmoid(scale0 * w_pre + base_pre) + eps        (collapse weights)
    post [T, hc]      = 2 sigmoid(scale1 * w_post + base_post)          (expand weights)
    comb [T, hc, hc]  = Sinkhorn(softmax_rows(scale2 * w_comb + base_comb) + eps)

(Sinkhorn: columns normalised once, then ``iters - 1`` rounds of rows then columns), and

    block input  = sum_j pre_j x_j
    new x_k      = post_k * block(input) + sum_j comb[j, k] x_j

After the last layer :func:`hc_head` collapses the streams with its own sigmoid weights.
The checkpoint's weights: ``fn`` [(2 + hc) hc, hc h], ``base`` [(2 + hc) hc], ``scale`` [3].

The layer form ``v4_hc`` (:mod:`.forms`) picks the path: "torch" runs the ops above as ~10
(hc_pre) and ~5 (hc_post) small torch ops; "fused" as the custom ops of :mod:`.ops` (Triton on
CUDA, their torch forms as one op each on the CPU): hc_pre = mix partials (the RMS norm's sum
of squares on the same read of x as the mix GEMM, K split over programs) + weights (the splits'
fixed-order sum, the RMS scale and the Sinkhorn) + collapse; hc_post = one merge; hc_head = mix
partials + collapse.  float64 keeps the torch path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops
from .forms import v4_form

__all__ = ["mix", "hc_pre", "hc_post", "hc_head", "expand"]


def _dt(x: torch.Tensor) -> torch.dtype:
    """fp32, or float64 in a float64 model."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fused(x: torch.Tensor) -> bool:
    return x.dtype != torch.float64 and v4_form("v4_hc") == "fused"


def mix(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm of the streams' concatenation [T, hc h] (fp32), times fn^T."""
    flat = x.reshape(x.shape[0], x.shape[1] * x.shape[2]).to(_dt(x))
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return F.linear(flat, fn.to(flat.dtype))


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams x [T, hc, h] -> (block input [T, h] in x's dtype, post [T, hc], comb [T, hc, hc] fp32)."""
    if _fused(x):
        p = ops.hc_mix_partials(x, fn)
        pre, post, comb = ops.hc_weights_partials(p, base, scale, iters, hc_eps, x.shape[1] * x.shape[2], norm_eps)
        return ops.hc_collapse(x, pre), post, comb
    m = mix(x, fn, norm_eps)
    pre, post, comb = ops.hc_weights(m, base.to(m.dtype), scale.to(m.dtype), iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)
    return collapsed, post, comb


def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new x [T, hc, h]: post_k * out + sum_j comb[j, k] x_j (in x's dtype; under v4_hc="fused" in
    fp32, rounded once: the torch path rounds post, comb and the two terms to x's dtype)."""
    if _fused(x):
        return ops.hc_merge(x, out, post, comb)
    dt = x.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dt).transpose(1, 2) @ x


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """Streams x [T, hc, h] -> [T, h]: sum_j (sigmoid(scale * w_j + base_j) + eps) x_j."""
    if _fused(x):
        return ops.hc_head(x, ops.hc_mix_partials(x, fn), base, scale, hc_eps, norm_eps)
    m = mix(x, fn, norm_eps)
    pre = torch.sigmoid(m * scale.to(m.dtype) + base.to(m.dtype)) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)


def expand(x: torch.Tensor, hc: int) -> torch.Tensor:
    """[T, h] -> [T, hc, h]: the embedding copied into every stream."""
    return x.unsqueeze(1).expand(-1, hc, -1).contiguous()
