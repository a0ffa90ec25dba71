"""The model's ends: token embedding, and final norm + LM head with float32 logits.

Greedy decoding reads the argmax of logits computed from bf16 inputs with float32 accumulation
and a float32 output (``torch.mm(..., out_dtype=torch.float32)`` on CUDA), so two candidates
whose bf16-rounded logits tie are still told apart (issue 32: a greedy token once depended on
an exact bf16 tie).  Elsewhere the logits are the model dtype's, widened to float32.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from . import ops

__all__ = ["embed", "logits_fp32", "greedy", "topk_logp"]

_OUT_DTYPE_MM = {"ok": True}   # off after the first failure on this build


def embed(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [...] -> [numel, h]."""
    return F.embedding(tokens.reshape(-1), table)


def logits_fp32(x: torch.Tensor, w_lm: torch.Tensor) -> torch.Tensor:
    """x [T, h] @ w_lm [V, h]^T -> float32 [T, V] (float64 for float64 models)."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _OUT_DTYPE_MM["ok"]:
        try:
            return torch.mm(x, w_lm.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError) as exc:   # a torch without mm(out_dtype): bf16 logits
            _OUT_DTYPE_MM["ok"] = False
            warnings.warn(f"torch.mm(out_dtype=float32) unavailable ({' '.join(str(exc).split())[:120]}): "
                          "logits are rounded to the model dtype", RuntimeWarning, stacklevel=2)
    out = F.linear(x, w_lm)
    return out if out.dtype == torch.float64 else out.float()


def greedy(x: torch.Tensor, w_norm: torch.Tensor, w_lm: torch.Tensor, eps: float) -> torch.Tensor:
    """Final RMSNorm, float32 logits, argmax: x [T, h] -> int64 [T]."""
    return logits_fp32(ops.rms_norm(x, w_norm, eps), w_lm).argmax(-1)


def topk_logp(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities float32 [..., k], token ids [..., k]) of the k most likely tokens."""
    top, ids = logits.topk(k, -1)
    return (top.float() - torch.logsumexp(logits.float(), -1, keepdim=True)).clamp(max=0.0), ids
