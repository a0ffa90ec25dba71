"""TfM-style adapter: a light autoregressive adapter over the block's top-K candidates, trees
built best-first over its conditionals, ``width`` expansions at a time.

    tree = tfm_tree(w, hid, anchor, cand_k, budget, width)     # DeviceTree [B, budget]
    tree = tfm_tree_rescored(w, hid, anchor, cand_k, budget, width, rescore)    # a replay's

The backbone's block logits give each row d its top-``cand_k`` candidates (ids and log-probs).
The adapter keeps a state of width a per tree node: s_u = tanh(W_cell [s_parent ; E[t_u]])
(the root's parent state is 0, its token the anchor).  Node u at depth d scores the candidates
of row d: cond(c) = log_softmax_c(base_lp[d, c] + (s_u + W_in h_d) . E[cand[d, c]]), its
conditional over the candidates.  Best-first, ``width`` at a time: the root is expanded first
(its top-m children enter a pool), then each of ceil((budget - 1) / width) sequential steps
takes the ``width`` best pool entries by path score (cumulative conditional log-prob) as the
next nodes (node indices 1 + step * width + j: static) and expands them - their states, their
conditionals, their top-m children into the pool (m = min(cand_k, budget - 1): no node can
have more children).  The last step expands nothing.  Ties: the lower pool slot (earlier
parent, better rank).  Padding as in :mod:`.block`.

:func:`tfm_tree_rescored` (a replay's: ``rescore`` is ``DraftScores.rescore_at``): the
children's log-probs of nodes at depth d [B, n], by rank r [B, n, m], replaced by the
acceptance model's (its round's level, row d, column r) before they enter the pool - the
adapter still picks each rank's token and does all its work, the tree's shape is the model's
best-first tree.  :func:`tfm_tree` (live decoding): the adapter's own conditionals.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..head import logits_fp32
from .block import DeviceTree, finish_tree

__all__ = ["tfm_candidates", "tfm_tree", "tfm_tree_rescored", "tfm_steps"]


def tfm_steps(budget: int, width: int) -> int:
    """Sequential adapter steps of a round: the root's, then one per ``width`` nodes (the last
    step's nodes are not expanded): 1 + ceil((budget - 1) / width) - 1."""
    return 1 + max(0, -(-(int(budget) - 1) // int(width)) - 1)


def tfm_candidates(w: dict, hid: torch.Tensor, cand_k: int):
    """Per row: the top-``cand_k`` (log-probs float32, ids) [B, L, cand_k] of the block logits."""
    B, L, h = hid.shape
    logits = logits_fp32(hid.reshape(B * L, h), w["lm_head"])
    top, ids = logits.topk(cand_k, -1)
    lp = top - torch.logsumexp(logits, -1, keepdim=True)
    return lp.view(B, L, cand_k), ids.view(B, L, cand_k)


def _expand(w, s_par, tok, q_in, cand_emb, cand_lp, depth, L):
    """States [B, n, a] and conditionals [B, n, Kc] (float32) of n new nodes (tokens ``tok``
    [B, n], depth [B, n]) whose parents' states are ``s_par`` [B, n, a]."""
    B, n = tok.shape
    e = F.embedding(tok, w["tfm.emb"])
    s = torch.tanh(F.linear(torch.cat([s_par, e], -1), w["tfm.cell"]))
    d = depth.clamp(max=L - 1)
    q = s + q_in.gather(1, d[..., None].expand(B, n, q_in.shape[-1]))
    ce = cand_emb.gather(1, d[..., None, None].expand(B, n, *cand_emb.shape[2:]))          # [B, n, Kc, a]
    lpc = cand_lp.gather(1, d[..., None].expand(B, n, cand_lp.shape[-1]))
    cond = torch.log_softmax(lpc + torch.einsum("bna,bnka->bnk", q, ce).float(), -1)
    return s, cond


def tfm_tree(w: dict, hid: torch.Tensor, anchor: torch.Tensor, cand_k: int, budget: int,
             width: int) -> DeviceTree:
    """The adapter's best-first tree of ``budget`` nodes over its own conditionals (module
    docstring): hid [B, L, h] the block's backbone rows, anchor [B] the root tokens."""
    return _best_first(w, hid, anchor, cand_k, budget, width, lambda depth, lp: lp)


def tfm_tree_rescored(w: dict, hid: torch.Tensor, anchor: torch.Tensor, cand_k: int, budget: int, width: int,
                      rescore) -> DeviceTree:
    """:func:`tfm_tree` with the children's log-probs replaced by ``rescore(depth [B, n], lp
    [B, n, m])`` (a replay's acceptance model, by depth and rank) before they enter the pool."""
    return _best_first(w, hid, anchor, cand_k, budget, width, rescore)


def _best_first(w, hid, anchor, cand_k: int, budget: int, width: int, rescore) -> DeviceTree:
    B, L, h = hid.shape
    N, W, dev = int(budget), int(width), hid.device
    cand_lp, cand_ids = tfm_candidates(w, hid, cand_k)
    Kc = cand_k
    m = min(Kc, max(N - 1, 1))
    q_in = F.linear(hid, w["tfm.in"])                                         # [B, L, a]
    cand_emb = F.embedding(cand_ids, w["tfm.emb"])                            # [B, L, Kc, a]
    a = q_in.shape[-1]
    z = lambda: torch.zeros(B, N, dtype=torch.int64, device=dev)  # noqa: E731
    tokens, parents, depth, rank = z(), z(), z(), z()
    score = torch.zeros(B, N, dtype=torch.float32, device=dev)
    states = torch.zeros(B, N, a, dtype=hid.dtype, device=dev)
    tokens[:, 0] = anchor
    parents[:, 0] = -1
    P = N * m
    p_score = torch.full((B, P), float("-inf"), dtype=torch.float32, device=dev)
    p_tok, p_par, p_rank = (torch.zeros(B, P, dtype=torch.int64, device=dev) for _ in range(3))
    ranks = torch.arange(m, device=dev)

    def push(first: int, n: int, s, cond, dep, sc):
        """Nodes first..first+n-1 (states s, conditionals cond [B, n, Kc]) -> their top-m children."""
        states[:, first:first + n] = s
        c_lp, c_at = cond.topk(m, -1)                                         # [B, n, m]
        c_lp = rescore(dep, c_lp)
        d = dep.clamp(max=L - 1)
        c_tok = cand_ids.gather(1, d[..., None].expand(B, n, Kc)).gather(2, c_at)
        ok = (dep < L)[..., None]
        sl = slice(first * m, (first + n) * m)
        p_score[:, sl] = torch.where(ok, sc[..., None] + c_lp, float("-inf")).reshape(B, n * m)
        p_tok[:, sl] = c_tok.reshape(B, n * m)
        p_par[:, sl] = (first + torch.arange(n, device=dev))[None, :, None].expand(B, n, m).reshape(B, n * m)
        p_rank[:, sl] = ranks.expand(B, n, m).reshape(B, n * m)

    s0, c0 = _expand(w, torch.zeros(B, 1, a, dtype=hid.dtype, device=dev), anchor[:, None], q_in, cand_emb, cand_lp,
                     depth[:, :1], L)
    push(0, 1, s0, c0, depth[:, :1], score[:, :1])
    first = 1
    while first < N:
        n = min(W, N - first)
        best = torch.sort(p_score, dim=1, descending=True, stable=True).indices[:, :n]       # [B, n]
        sc = p_score.gather(1, best)
        par = p_par.gather(1, best)
        sl = slice(first, first + n)
        score[:, sl] = sc
        tokens[:, sl] = p_tok.gather(1, best)
        parents[:, sl] = par
        depth[:, sl] = depth.gather(1, par) + 1
        rank[:, sl] = p_rank.gather(1, best)
        p_score.scatter_(1, best, float("-inf"))
        if first + n < N:      # the last step's nodes are never expanded
            s_par = states.gather(1, par[..., None].expand(B, n, a))
            s, cond = _expand(w, s_par, tokens[:, sl], q_in, cand_emb, cand_lp, depth[:, sl], L)
            push(first, n, s, cond, depth[:, sl], sc)
        first += n
    return finish_tree(tokens, parents, depth, rank, score, m)
