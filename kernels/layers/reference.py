"""Plain torch forms of the layers' fused ops: the definitions the Triton kernels (fused.py)
are tested against, and what runs on the CPU.  Each computes in float32 (float64 for float64
inputs) and rounds once, to the input's dtype unless stated.

    rms_norm(x [.., D], w [D] | None)                 x / rms(x) * w
    gated_rms_norm(o [N, H, V], z [N, H*V], w [V])    rms_norm(o) * w * SiLU(z)   -> [N, H*V]
    silu_mul(gu [T, 2I])                              SiLU(gu[:, :I]) * gu[:, I:] -> [T, I]
    sigmoid_mul(o [T, H, D], gate [T, H, D])          o * sigmoid(gate)           -> [T, H*D]
    gdn_gates(ba [N, 2HV], neg_a [HV], dt_bias [HV])  g = neg_a softplus(a + dt_bias), beta = sigmoid(b)
    norm_rope(x [T, H, D], w | None, cs [T, R], lo)   optional RMSNorm, then rotate-half RoPE on
                                                      channels [lo, lo + R) (cs = cos | sin)
    tree_conv(x [N, C], state [B, W-1, C], idx [N, W], weight [C, W], splits)
                                                      SiLU(sum_t src(idx[:, t]) * weight[:, t]),
                                                      written as three row-major blocks
    gather_rows(state [B, W-1, C], x [N, C], idx [B, W-1])   state rows <- their sources

DeepSeek-V4's hyper-connections (kernels/layers/mhc.py), the streams x [T, hc, h], K = hc h:

    hc_mix_partials(x, fn [n, K])           [S, T, n + 1]: split s's partial dot products of the
                                            flat streams with fn's rows | its partial sum of squares
                                            (S = 1 here; the Triton kernel splits K)
    hc_mix_reduce(p, K, eps)                m [T, n] = sum_s dots * rsqrt(sum_s squares / K + eps):
                                            RMSNorm(flat x) @ fn^T
    hc_collapse(x, pre [T, hc])             sum_j pre_j x_j                        -> [T, h]
    hc_merge(x, out [T, h], post, comb)     post_k out + sum_j comb[j, k] x_j      -> [T, hc, h]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["compute_dtype", "rms_norm", "gated_rms_norm", "silu_mul", "sigmoid_mul", "gdn_gates",
           "norm_rope", "tree_conv", "gather_rows", "conv_sources", "hc_weights", "hc_mix_partials",
           "hc_mix_reduce", "hc_collapse", "hc_merge", "EPS"]

EPS = 1e-6


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _rms(x: torch.Tensor, w, eps: float) -> torch.Tensor:
    dt = compute_dtype(x)
    xf = x.to(dt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.to(dt)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = EPS) -> torch.Tensor:
    return _rms(x, weight, eps).to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    N, H, V = o.shape
    y = _rms(o, weight, eps) * F.silu(z.reshape(N, H, V).to(compute_dtype(o)))
    return y.reshape(N, H * V).to(o.dtype)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    a, b = gu.to(compute_dtype(gu)).chunk(2, -1)
    return (F.silu(a) * b).to(gu.dtype)


def swiglu(gu: torch.Tensor, limit: float) -> torch.Tensor:
    """silu_mul with V4's ``swiglu_limit``: gate clamped above at limit, up to [-limit, limit]."""
    a, b = gu.to(compute_dtype(gu)).chunk(2, -1)
    return (F.silu(a.clamp(max=limit)) * b.clamp(-limit, limit)).to(gu.dtype)


def sigmoid_mul(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    dt = compute_dtype(o)
    return (o.to(dt) * torch.sigmoid(gate.to(dt))).reshape(o.shape[0], -1).to(o.dtype)


def gdn_gates(ba: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [N, HV] in float32 (float64 for float64 ``ba``)."""
    dt = compute_dtype(ba)
    b, a = ba.to(dt).chunk(2, -1)
    return neg_a.to(dt) * F.softplus(a + dt_bias.to(dt)), torch.sigmoid(b)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cs: torch.Tensor, lo: int, inverse: bool = False,
              eps: float = EPS, norm: bool = False) -> torch.Tensor:
    """x [T, H, D] -> [T, H, D] contiguous in x's dtype: RMSNorm (where ``norm``, times ``weight``
    where given), then channels [lo, lo + R) rotated by cs [T, R] (cos [R/2] | sin [R/2];
    ``inverse``: by the negative angles)."""
    dt = compute_dtype(x)
    y = _rms(x, weight, eps) if norm else x.to(dt)
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half].to(dt), cs[:, None, half:].to(dt)
    if inverse:
        sin = -sin
    r1, r2 = y[..., lo:lo + half], y[..., lo + half:lo + 2 * half]
    rot = torch.cat([r1 * cos - r2 * sin, r1 * sin + r2 * cos], -1)
    return torch.cat([y[..., :lo], rot, y[..., lo + 2 * half:]], -1).to(x.dtype).contiguous()


def conv_sources(x: torch.Tensor, state: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows named by idx (>= 0: row of x; < 0: row -1 - idx of state [B * (W-1), C])."""
    rows = state.reshape(-1, state.shape[-1])
    from_x = x[idx.clamp(min=0)]
    from_state = rows[(-1 - idx).clamp(min=0)].to(x.dtype)
    return torch.where((idx >= 0)[..., None], from_x, from_state)


def tree_conv(x: torch.Tensor, state: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
              splits: tuple[int, int], silu: bool = True) -> torch.Tensor:
    """The short causal conv of every node over the taps ``idx`` [N, W] (tap W-1: the node
    itself), as a flat tensor holding [N, s0] | [N, s1 - s0] | [N, C - s1] row-major blocks
    (q, k, v of a GDN layer, each contiguous)."""
    dt = compute_dtype(x)
    taps = conv_sources(x, state, idx).to(dt)                          # [N, W, C]
    y = (taps * weight.to(dt).t()[None]).sum(1)
    if silu:
        y = F.silu(y)
    y = y.to(x.dtype)
    s0, s1 = splits
    return torch.cat([y[:, :s0].reshape(-1), y[:, s0:s1].reshape(-1), y[:, s1:].reshape(-1)])


def gather_rows(state: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> None:
    """In place: state[b, s] <- source idx[b, s] (every source read before any row is written)."""
    new = conv_sources(x, state, idx)
    state.copy_(new.to(state.dtype).view(state.shape))


def hc_weights(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float):
    """DeepSeek-V4 hyper-connection weights from the mixes m [T, (2 + hc) hc] (kernels/layers/mhc.py):
    pre = sigmoid(s0 m_pre + b) + eps, post = 2 sigmoid(s1 m_post + b), comb = Sinkhorn(row softmax
    (s2 m_comb + b) + eps): columns once, then ``iters - 1`` rounds of rows and columns."""
    T, n = m.shape
    hc = int(round((-2 + (4 + 4 * n) ** 0.5) / 2))
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax(m[:, 2 * hc:].reshape(T, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_mix_partials(x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """x [T, hc, h], fn [n, hc h] -> [1, T, n + 1]: the flat streams' dot products with fn's rows
    and their sum of squares (fp32; float64 for float64 x)."""
    dt = compute_dtype(x)
    flat = x.reshape(x.shape[0], x.shape[1] * x.shape[2]).to(dt)
    return torch.cat([flat @ fn.to(dt).t(), flat.square().sum(-1, keepdim=True)], -1)[None]


def hc_mix_reduce(p: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """Partials [S, T, n + 1] of a mix over ``dim`` channels -> m [T, n]."""
    tot = p.sum(0)
    return tot[:, :-1] * torch.rsqrt(tot[:, -1:] / dim + eps)


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x [T, hc, h], pre [T, hc] -> sum_j pre_j x_j [T, h] in x's dtype."""
    dt = compute_dtype(x)
    return (pre.to(dt).unsqueeze(-1) * x.to(dt)).sum(1).to(x.dtype)


def hc_merge(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new x [T, hc, h] = post_k out + sum_j comb[j, k] x_j, in fp32, rounded once to x's dtype."""
    dt = compute_dtype(x)
    y = post.to(dt).unsqueeze(-1) * out.to(dt).unsqueeze(-2) + comb.to(dt).transpose(1, 2) @ x.to(dt)
    return y.to(x.dtype)
