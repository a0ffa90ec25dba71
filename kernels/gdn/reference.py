"""Plain torch references for the GDN tree verify (docs/math/gdn_tree_solve.md).

One value head, a_t = exp(g_t), q and k L2-normalised, q scaled by K^-1/2:

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = b_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

Shapes (flat ragged batch, as TreeBatch.to_torch gives them):
    q, k [N, H, K]; v [N, HV, V]; g, beta [N, HV]; state [B, HV, K, V];
    parents int64 [N] (local, -1 for the root); cu_nodes int64 [B+1].
Computation runs in float64 when any input is float64, otherwise float32.

``gdn_tree_verify_dense_ref`` (reference (b)) is the plain per-tree version the tests compare
the kernels against; ``gdn_tree_verify_dense_batched`` is the same masked solve batched over
all trees at once (the torch backend of ``gdn_tree_verify``, used on CPU every round).
"""
from __future__ import annotations

import torch

from .meta import TreeMeta, tree_meta

__all__ = ["gdn_sequential_ref", "gdn_accepted_paths_ref", "gdn_tree_verify_ref", "gdn_tree_verify_dense_ref",
           "gdn_tree_verify_dense_batched", "tree_causal_conv_ref", "prep_qk", "delta_rule_step",
           "gdn_fold_pending_ref"]


def _work_dtype(*xs: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def _l2norm(x, on: bool):
    """x / ||x|| over the last dim (clamped at 1e-6) when ``on``, else x."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) if on else x


def _norm_qk(q, k, scale, qk_l2norm, dt):
    """Normalise q, k and scale q (K^-1/2 unless ``scale``): [N, H, K] each, in ``dt``."""
    q, k = _l2norm(q.to(dt), qk_l2norm), _l2norm(k.to(dt), qk_l2norm)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k


def prep_qk(q, k, HV, scale, qk_l2norm, dt):
    """q, k [N, H, K] L2-normalised (when ``qk_l2norm``), q scaled (K^-1/2 unless ``scale``),
    both in ``dt`` and repeated from key heads to the HV value heads: [N, HV, K] each."""
    q, k = _norm_qk(q, k, scale, qk_l2norm, dt)
    rep = HV // q.shape[1]
    return q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)


def delta_rule_step(S, q, k, v, g, b):
    """One delta-rule token for all heads (leading batch dims allowed): returns (S_t, o_t)
    with S_t = a_t S + k_t u_t^T, u_t = b_t (v_t - a_t S^T k_t), o_t = S_t^T q_t, a_t = e^g.
    S [..., HV, K, V]; q, k [..., HV, K] (as ``prep_qk`` gives them); v [..., HV, V];
    g, b [..., HV]."""
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
    qh, kh = prep_qk(q, k, HV, scale, qk_l2norm, dt)
    S = state.to(dt).clone()
    outs = []
    for t in range(q.shape[0]):
        S, o = delta_rule_step(S, qh[t], kh[t], v[t].to(dt), g[t].to(dt), beta[t].to(dt))
        outs.append(o)
    return torch.stack(outs), S


def gdn_accepted_paths_ref(q, k, v, g, beta, state, trees, cu_nodes, accepted, *, scale=None,
                           qk_l2norm=True):
    """The commit's ground truth: each tree's accepted root path (``trees[b].path_to(
    accepted[b])``, rows offset by ``cu_nodes[b]``) decoded token by token from ``state[b]``
    (``gdn_sequential_ref``); the final states stacked [B, HV, K, V]."""
    out = []
    for b, t in enumerate(trees):
        rows = torch.as_tensor(t.path_to(int(accepted[b])), device=q.device) + int(cu_nodes[b])
        out.append(gdn_sequential_ref(q[rows], k[rows], v[rows], g[rows], beta[rows], state[b],
                                      scale=scale, qk_l2norm=qk_l2norm)[1])
    return torch.stack(out)


def gdn_tree_verify_ref(q, k, v, g, beta, state, parents, cu_nodes, *, scale=None,
                        qk_l2norm=True, return_states=False):
    """Reference (a): the recurrence along every root-to-node path.

    Each node's state is its parent's state advanced by one token, so node j sees exactly
    its own root path.  Returns o [N, HV, V] (and per-node states [N, HV, K, V] if asked).
    """
    dt = _work_dtype(q, k, v, g, beta, state)
    HV = v.shape[1]
    qh, kh = prep_qk(q, k, HV, scale, qk_l2norm, dt)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)
    out = torch.empty(v.shape, dtype=dt, device=v.device)
    states = torch.empty((q.shape[0], HV, k.shape[2], v.shape[2]), dtype=dt, device=v.device)
    cu = cu_nodes.tolist()
    par = parents.tolist()
    for b in range(len(cu) - 1):
        for j in range(cu[b], cu[b + 1]):
            p = par[j]
            S_prev = state[b].to(dt) if p < 0 else states[cu[b] + p]
            states[j], out[j] = delta_rule_step(S_prev, qh[j], kh[j], v[j], g[j], beta[j])
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
    qh, kh = prep_qk(q, k, HV, scale, qk_l2norm, dt)
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


def _dense_padded(xp, S0, H, K, V, want_inv):
    """The dense masked solve for ``nt`` trees padded to ``n`` nodes, all at once.

    xp [nt, n, F]: per padded row q, k [H*K] each, v [HV*V], g, beta [HV], then the row's
    ancestor-or-self mask over its tree's nodes (1.0 / 0.0, >= n columns); padding rows are
    all zero (empty mask: identity rows of I + A, zero right-hand side).  S0 [nt, HV, K, V].
    Returns o, u [nt, H, R, n, V], G [nt, HV, n] and (I + A)^-1 [nt, H, R, n, n] or None.
    """
    nt, n, _ = xp.shape
    HV = S0.shape[1]
    R, HK = HV // H, H * K              # value heads per key head (as repeat_interleave)
    c = 2 * HK + HV * V
    qk = xp[..., :2 * HK].reshape(nt, n, 2, H, K).permute(0, 3, 2, 1, 4).reshape(nt, H, 2 * n, K)
    vh = xp[..., 2 * HK:c].reshape(nt, n, H, R, V).permute(0, 2, 3, 1, 4)    # [nt, H, R, n, V]
    b = xp[..., c + HV:c + 2 * HV].transpose(1, 2).reshape(nt, H, R, n, 1)
    anc = xp[..., c + 2 * HV:c + 2 * HV + n]                          # [nt, n, n] 0/1
    # G_j = sum_{m <= j} g_m = (mask @ g)_j, formed as g^T mask^T: [nt, HV, n] contiguous, so
    # that everything computed from it comes out in the standard layout
    G = torch.bmm(xp[..., c:c + HV].transpose(1, 2), anc.transpose(1, 2))
    Gh = G.view(nt, H, R, n)
    # e^{G_j - G_m} only where m is an ancestor-or-self (<= 1 there); masking before exp
    # keeps unrelated pairs, whose G_j - G_m can be huge, from overflowing to inf.  G is
    # finite, so (G_j - G_m) * mask is exactly the reference's where(mask, G_j - G_m, 0)
    mask = anc[:, None, None]
    decay = torch.exp((Gh[..., :, None] - Gh[..., None, :]) * mask) * mask   # [nt, H, R, n, n]
    dots = qk @ qk[:, :, n:].transpose(-1, -2)                        # [nt, H, 2n, n]: q.k, k.k
    S0h = S0.view(nt, H, R, K, V).transpose(2, 3).reshape(nt, H, K, R * V)
    proj = (qk @ S0h).view(nt, H, 2 * n, R, V).transpose(2, 3)        # [nt, H, R, 2n, V]: q S0, k S0
    eG = torch.exp(Gh)[..., None]
    # A = diag(b) (K K^T o decay), strictly lower on ancestors; its diagonal is never read:
    # unitriangular=True solves with I + strict(A), i.e. u = (I + A)^-1 diag(b)(V - e^G K S0)
    # (full-size contiguous operand first: the products come out in the standard layout the
    # solve and the matmul want, not a broadcast-permuted one they would copy)
    A = decay * dots[:, :, None, n:] * b
    rhs = b * (vh - eG * proj[..., n:, :])
    u = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    o = eG * proj[..., :n, :] + (decay * dots[:, :, None, :n]) @ u
    inv = None
    if want_inv:
        eye = torch.eye(n, dtype=A.dtype, device=A.device).expand_as(A)
        inv = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
    return o, u, G, inv


def gdn_tree_verify_dense_batched(q, k, v, g, beta, state, parents, cu_nodes, *, scale=None,
                                  qk_l2norm=True, return_aux=False, meta: TreeMeta | None = None,
                                  return_inverse=False, bucket: int = 16):
    """The dense masked solve of ``gdn_tree_verify_dense_ref``, batched over the trees.

    Same math, same outputs up to float rounding: trees are padded (padding rows get an empty
    ancestor mask, so they are identity rows of I + A with zero right-hand side, and are
    dropped), the ancestor mask comes from the ancestor bitmask (``meta.bits``; built here
    when not given), G = mask @ g, and one unit-lower-triangular solve over [trees, HV] gives
    u directly (the reference forms (I + A)^-1 first).  q.k and k.k are formed per key head
    and shared by its value heads.  Trees are grouped by node count rounded up to ``bucket``,
    each group padded only to its own largest tree (one batched solve per group, so a ragged
    batch does not pay for its largest tree everywhere); ``bucket=0``: one group.  Plain
    differentiable torch ops.

    Returns o [N, HV, V]; with return_aux also {"u": [N, HV, V], "G": [N, HV]} and, with
    return_inverse, "inverse": list of (I + A)^-1 [HV, n_b, n_b] per tree, as the reference.
    """
    dt = _work_dtype(q, k, v, g, beta, state)
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    dev = v.device
    cu = cu_nodes.to(dev, torch.int64)
    if meta is None:
        meta = tree_meta(parents.to(dev), cu, validate=False)
    cnt = cu[1:] - cu[:-1]
    counts = cnt.tolist()
    B, n_max = len(counts), max(counts)
    m = torch.arange(n_max, device=dev)
    qn, kn = _norm_qk(q, k, scale, qk_l2norm, dt)
    # one row per node (and a zero row N for padding) of everything a padded tree row needs
    pieces = (qn.reshape(N, -1), kn.reshape(N, -1), v.reshape(N, -1), g, beta,
              (meta.bits[:, m // 64] >> (m % 64)) & 1)                 # ancestor-or-self [N, n_max]
    X = v.new_empty((N + 1, sum(p.shape[1] for p in pieces)), dtype=dt)
    X[N] = 0
    col = 0
    for p in pieces:
        X[:N, col:col + p.shape[1]] = p
        col += p.shape[1]
    S0 = state.to(dt)
    groups: dict[int, list[int]] = {}
    for b, c in enumerate(counts):
        groups.setdefault(-(-c // bucket) if bucket else 0, []).append(b)
    whole = len(groups) == 1
    if not whole:
        out, u_all, G_all = (v.new_empty(s, dtype=dt) for s in ((N, HV, V), (N, HV, V), (N, HV)))
    invs: list = [None] * B
    for trees in groups.values():
        n = max(counts[b] for b in trees)
        tb = torch.arange(B, device=dev) if whole else torch.tensor(trees, device=dev)
        ar = torch.arange(n, device=dev)
        valid = ar < cnt[tb, None]                                    # [nt, n] real rows
        src = torch.where(valid, cu[tb, None] + ar, N)                # padded row -> node (N: zero)
        o, u, G, inv = _dense_padded(X[src], S0 if whole else S0[tb], H, K, V,
                                     return_aux and return_inverse)
        rows = (o.permute(0, 3, 1, 2, 4)[valid].reshape(-1, HV, V),   # this group's nodes, in order
                u.permute(0, 3, 1, 2, 4)[valid].reshape(-1, HV, V), G.transpose(1, 2)[valid])
        if whole:
            out, u_all, G_all = rows
        else:
            idx = src[valid]
            for dst, r in zip((out, u_all, G_all), rows):
                dst.index_copy_(0, idx, r)
        if inv is not None:
            inv = inv.reshape(len(trees), HV, n, n)
            for s, b in enumerate(trees):
                invs[b] = inv[s, :, :counts[b], :counts[b]]
    if not return_aux:
        return out
    aux = {"u": u_all, "G": G_all}
    if return_inverse:
        aux["inverse"] = invs
    return out, aux


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


def gdn_fold_pending_ref(state, pending):
    """The deferred commit's fold for every sequence (waiting or not), in float64:

        S* = d S + sum_{p < len} w_p k_p u_p^T      (``pending.GDNPendingPath``)

    state [B, HV, K, V]; returns S* [B, HV, K, V] float64 (state is not modified)."""
    B, HV = state.shape[:2]
    H = pending.k.shape[2]
    out = state.double() * pending.decay.double()[..., None, None]
    for b in range(B):
        n = int(pending.length[b])
        kh = pending.k[b, :n].double().repeat_interleave(HV // H, dim=1)      # [n, HV, K]
        out[b] += torch.einsum("ph,phk,phv->hkv", pending.w[b, :n].double(), kh,
                               pending.u[b, :n].double())
    return out
