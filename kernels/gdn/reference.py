"""Plain torch references for the GDN tree verify (DESIGN §1, "The GDN tree solve").

One value head, a_t = exp(g_t), q and k L2-normalised, q scaled by K^-1/2:

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = b_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

Shapes (flat ragged batch, as TreeBatch.to_torch gives them):
    q, k [N, H, K]; v [N, HV, V]; g, beta [N, HV]; state [B, HV, K, V];
    parents int64 [N] (local, -1 for the root); cu_nodes int64 [B+1].
Computation runs in float64 when any input is float64, otherwise float32.
"""
from __future__ import annotations

import torch

__all__ = ["gdn_sequential_ref", "gdn_tree_verify_ref", "gdn_tree_verify_dense_ref",
           "tree_causal_conv_ref"]


def _work_dtype(*xs: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def _prep_qk(q, k, HV, scale, qk_l2norm, dt):
    """Normalise/scale q, k and repeat key heads to value heads: [N, H, K] -> [N, HV, K]."""
    q, k = q.to(dt), k.to(dt)
    if qk_l2norm:
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rep = HV // q.shape[1]
    return (q * scale).repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)


def _step(S, q, k, v, g, b):
    """One delta-rule token for all heads (leading batch dims allowed).
    S [..., HV, K, V]; q, k [..., HV, K]; v [..., HV, V]; g, b [..., HV]."""
    Sd = torch.exp(g)[..., None, None] * S
    u = b[..., None] * (v - torch.einsum("...hkv,...hk->...hv", Sd, k))
    S_new = Sd + k[..., :, None] * u[..., None, :]
    return S_new, torch.einsum("...hkv,...hk->...hv", S_new, q)


def gdn_sequential_ref(q, k, v, g, beta, state, *, scale=None, qk_l2norm=True):
    """Sequential recurrence over ONE chain (the ground truth).

    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; state [HV, K, V].
    Returns (o [T, HV, V], final state [HV, K, V]) in the work dtype (float64 if any input is).
    """
    dt = _work_dtype(q, k, v, g, beta, state)
    HV = v.shape[1]
    qh, kh = _prep_qk(q, k, HV, scale, qk_l2norm, dt)
    S = state.to(dt).clone()
    outs = []
    for t in range(q.shape[0]):
        S, o = _step(S, qh[t], kh[t], v[t].to(dt), g[t].to(dt), beta[t].to(dt))
        outs.append(o)
    return torch.stack(outs), S


def gdn_tree_verify_ref(q, k, v, g, beta, state, parents, cu_nodes, *, scale=None,
                        qk_l2norm=True, return_states=False):
    """Reference (a): the recurrence along every root-to-node path.

    Each node's state is its parent's state advanced by one token, so node j sees exactly
    its own root path.  Returns o [N, HV, V] (and per-node states [N, HV, K, V] if asked).
    """
    dt = _work_dtype(q, k, v, g, beta, state)
    HV = v.shape[1]
    qh, kh = _prep_qk(q, k, HV, scale, qk_l2norm, dt)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)
    out = torch.empty(v.shape, dtype=dt, device=v.device)
    states = torch.empty((q.shape[0], HV, k.shape[2], v.shape[2]), dtype=dt, device=v.device)
    cu = cu_nodes.tolist()
    par = parents.tolist()
    for b in range(len(cu) - 1):
        for j in range(cu[b], cu[b + 1]):
            p = par[j]
            S_prev = state[b].to(dt) if p < 0 else states[cu[b] + p]
            states[j], out[j] = _step(S_prev, qh[j], kh[j], v[j], g[j], beta[j])
    return (out, states) if return_states else out


def _dense_one(qh, kh, v, g, beta, S0, par):
    """Dense masked solve for one tree, all heads. Returns o, u, G, inverse [HV, n, n]."""
    n = len(par)
    anc = torch.zeros((n, n), dtype=torch.bool, device=v.device)
    for j in range(n):
        if par[j] >= 0:
            anc[j] = anc[par[j]]
        anc[j, j] = True
    strict = anc & ~torch.eye(n, dtype=torch.bool, device=v.device)
    G = anc.to(g.dtype) @ g                                   # [n, HV]: G_j = sum_{m<=j} g_m
    Gh = G.T                                                  # [HV, n]
    # e^{G_j - G_m} only where m is an ancestor-or-self (<= 1 there); masking before exp
    # keeps unrelated pairs, whose G_j - G_m can be hugely positive, from overflowing to inf
    decay = torch.exp(torch.where(anc, Gh[:, :, None] - Gh[:, None, :], 0.0)) * anc
    kk = torch.einsum("jhk,mhk->hjm", kh, kh)
    A = beta.T[:, :, None] * kk * decay * strict              # strictly lower (ancestors only)
    eye = torch.eye(n, dtype=A.dtype, device=A.device)
    inv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)   # (I + A)^-1
    ks0 = torch.einsum("jhk,hkv->hjv", kh, S0)
    rhs = beta.T[:, :, None] * (v.transpose(0, 1) - torch.exp(Gh)[:, :, None] * ks0)
    u = inv @ rhs                                             # [HV, n, V]
    qs0 = torch.einsum("jhk,hkv->hjv", qh, S0)
    qk = torch.einsum("jhk,mhk->hjm", qh, kh) * decay
    o = torch.exp(Gh)[:, :, None] * qs0 + qk @ u
    return o.transpose(0, 1), u.transpose(0, 1), G, inv


def gdn_tree_verify_dense_ref(q, k, v, g, beta, state, parents, cu_nodes, *, scale=None,
                              qk_l2norm=True, return_aux=False):
    """Reference (b): the dense masked solve (I + A) U = diag(b)(V - diag(e^G) K S0).

    Returns o [N, HV, V]; with return_aux also {"u": [N, HV, V], "G": [N, HV],
    "inverse": list of [HV, n_b, n_b] per tree}.
    """
    dt = _work_dtype(q, k, v, g, beta, state)
    HV = v.shape[1]
    qh, kh = _prep_qk(q, k, HV, scale, qk_l2norm, dt)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)
    cu = cu_nodes.tolist()
    par = parents.tolist()
    outs, us, Gs, invs = [], [], [], []
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        o, u, G, inv = _dense_one(qh[s:e], kh[s:e], v[s:e], g[s:e], beta[s:e],
                                  state[b].to(dt), par[s:e])
        outs.append(o), us.append(u), Gs.append(G), invs.append(inv)
    out = torch.cat(outs)
    if return_aux:
        return out, {"u": torch.cat(us), "G": torch.cat(Gs), "inverse": invs}
    return out


def tree_causal_conv_ref(x, conv_state, weight, parents, cu_nodes, bias=None,
                         activation="silu"):
    """Per-path causal conv: node j's window is its W-1 nearest ancestors, then j itself.

    x [N, D]; conv_state [B, D, W-1] (oldest first); weight [D, W]. Returns [N, D].
    """
    W = weight.shape[1]
    dt = _work_dtype(x, conv_state, weight)
    out = torch.empty(x.shape, dtype=dt, device=x.device)
    cu = cu_nodes.tolist()
    par = parents.tolist()
    for b in range(len(cu) - 1):
        for j in range(cu[b], cu[b + 1]):
            path, node = [], j - cu[b]
            while node >= 0:                                   # walk up to the root
                path.append(x[cu[b] + node].to(dt))
                node = par[cu[b] + node]
            hist = [conv_state[b, :, i].to(dt) for i in range(W - 1)] + path[::-1]
            window = torch.stack(hist[-W:], dim=1)             # [D, W], oldest first
            y = (window * weight.to(dt)).sum(dim=1)
            if bias is not None:
                y = y + bias.to(dt)
            out[j] = torch.nn.functional.silu(y) if activation == "silu" else y
    return out
