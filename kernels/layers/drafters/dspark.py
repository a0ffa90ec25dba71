"""DSpark-style semi-autoregressive drafter: the parallel block backbone, a light sequential
Markov head and a confidence head.

    lp, ids, conf = dspark_draft(w, hid, anchor, topk)   # [B, L, k], [B, L, k], [B, L]
    n = verify_prefix_len(conf, threshold)                # [B]: positions to verify
    keep = threshold_keep(threshold)                      # the same rule on survivals, draft_round's keep

The backbone's block logits are computed once for all L rows (one LM-head GEMM); then, row by
row, the Markov head adds W2 W1[previous token] (rank r, DeepSpec's "vanilla" head) to the row's
logits, the row's top-k are its candidates and the top-1 is the next row's previous token (a
greedy chain; the anchor precedes row 0).  The confidence head reads the row's hidden state and
the previous token's Markov embedding: conf_j = sigmoid(w_c [h_j ; W1[prev_j]] + b_c), the
predicted probability that position j is accepted given that the ones before it were; the
predicted survival of the prefix of length j + 1 is the product of conf_0..conf_j.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from simtree.acceptance.confidence_head import check_threshold

from ..head import logits_fp32, topk_logp

__all__ = ["dspark_draft", "survival", "verify_prefix_len", "threshold_keep", "check_threshold"]


def dspark_draft(w: dict, hid: torch.Tensor, anchor: torch.Tensor, topk: int):
    """(log-probs float32 [B, L, topk], ids [B, L, topk], confidence float32 [B, L]) from the
    backbone's final-normed hidden states ``hid`` [B, L, h] and the anchor tokens [B]."""
    B, L, h = hid.shape
    base = logits_fp32(hid.reshape(B * L, h), w["lm_head"]).view(B, L, -1)
    w1, w2, cw, cb = w["markov.w1"], w["markov.w2"], w["conf.w"], w["conf.b"]
    prev = anchor
    lps, idss, confs = [], [], []
    for j in range(L):
        e = F.embedding(prev, w1)                                          # [B, r]
        lp, ids = topk_logp(base[:, j] + F.linear(e, w2).float(), topk)
        c = F.linear(torch.cat([hid[:, j], e.to(hid.dtype)], -1), cw, cb.to(hid.dtype))
        lps.append(lp)
        idss.append(ids)
        confs.append(torch.sigmoid(c.float())[:, 0])
        prev = ids[:, 0]
    return torch.stack(lps, 1), torch.stack(idss, 1), torch.stack(confs, 1)


def survival(conf: torch.Tensor) -> torch.Tensor:
    """Predicted probability that the first j + 1 positions are all accepted [B, L]."""
    return torch.cumprod(conf.float(), -1)


def verify_prefix_len(conf: torch.Tensor, threshold: float) -> torch.Tensor:
    """int64 [B]: the length of the longest prefix whose predicted survival is >= ``threshold``
    (survival falls with length, so it is the count of positions that clear it)."""
    return threshold_keep(threshold)(survival(conf))


def threshold_keep(threshold: float):
    """The prefix rule of a fixed ``threshold``: survivals [B, m] -> int64 [B], the count of
    positions whose survival is >= ``threshold`` (``draft_round``'s ``keep``)."""
    t = check_threshold(threshold)
    return lambda surv: (surv >= t).sum(-1)
