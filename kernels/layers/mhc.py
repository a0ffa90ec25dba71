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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["hc_pre", "hc_post", "hc_head", "expand"]


def _mix(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm of the streams' concatenation [T, hc h] (fp32), times fn^T."""
    flat = x.reshape(x.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return F.linear(flat, fn.float())


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams x [T, hc, h] -> (block input [T, h] in x's dtype, post [T, hc], comb [T, hc, hc] fp32)."""
    hc = x.shape[1]
    m = _mix(x, fn, norm_eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax(m[:, 2 * hc:].view(-1, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), -1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)
    return collapsed, post, comb


def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new x [T, hc, h]: post_k * out + sum_j comb[j, k] x_j (in x's dtype)."""
    dt = x.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.bmm(comb.to(dt).transpose(1, 2), x)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """Streams x [T, hc, h] -> [T, h]: sum_j (sigmoid(scale * w_j + base_j) + eps) x_j."""
    pre = torch.sigmoid(_mix(x, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)


def expand(x: torch.Tensor, hc: int) -> torch.Tensor:
    """[T, h] -> [T, hc, h]: the embedding copied into every stream."""
    return x.unsqueeze(1).expand(-1, hc, -1).contiguous()
