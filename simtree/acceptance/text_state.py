"""The text state of a position from its context alone: how much of it is not words.

A drafter's confidence is calibrated on one workload; on another it may be less sure than it
is right.  The MTP drafter of the trained target is underconfident on code relative to chat
(docs/acceptance.md, section 5, decision 9), and what says "code" before any verification is
the context itself: code is mostly punctuation, operators, indentation and names glued to
them, chat mostly words.  :func:`context_nonword_share` measures it at every context length -
the share of the last ``window`` context tokens that are not a word (a token that is letters,
with or without one leading space) - and :func:`fit_text_terms` fits how the calibration's
logit moves with it on the calibrating workload's own trials (one intercept and slope per rank
group, the calibration's curves fixed).  Chat holds code too (quoted snippets, answers with a
fenced block): within chat the drafter's top-1 is accepted more often than calibrated where the
context is not words (+0.03 to +0.10 on the development runs), the direction of code.  The term
is fitted on the calibrating workload's outcomes and read on another's context, where nothing
of the target's verdict is known.
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np
from scipy.special import expit

__all__ = ["WINDOW", "RIDGE", "word_tokens", "context_nonword_share", "fit_text_terms", "offset_logistic"]

WINDOW = 32        # context tokens the share is read over (16, 64, 128 tried on development data: docs/acceptance.md)
RIDGE = 1.0        # L2 penalty on each rank group's intercept and slope (logit units)
_WORD = re.compile(r"\s?[A-Za-z]+")


def word_tokens(decode: Callable[[list[int]], str], vocab_size: int) -> np.ndarray:
    """bool [vocab_size]: the tokens that are a word - letters only, with at most one leading
    space (``decode([id])`` gives a token's text)."""
    return np.array([bool(_WORD.fullmatch(decode([i]))) for i in range(vocab_size)])


def context_nonword_share(tokens: Sequence[int], is_word: np.ndarray, context_lens, window: int = WINDOW
                          ) -> np.ndarray:
    """float64 [n]: at each context length (the context being ``tokens[:len]``), the share of its
    last ``window`` tokens that are not words (:func:`word_tokens`; ids past the mask count as
    not words); 0 for an empty context."""
    toks = np.asarray(tokens, np.int64)
    nonword = ~np.asarray(is_word, bool)[np.clip(toks, 0, len(is_word) - 1)] | (toks >= len(is_word))
    csum = np.concatenate([[0], np.cumsum(nonword)])
    end = np.clip(np.asarray(context_lens, np.int64), 0, toks.size)
    start = np.maximum(end - window, 0)
    return (csum[end] - csum[start]) / np.maximum(end - start, 1)


def offset_logistic(offset: np.ndarray, hit: np.ndarray, X: np.ndarray, ridge: float = RIDGE,
                    iters: int = 50) -> np.ndarray:
    """float64 [k]: the coefficients b of a logistic regression of ``hit`` on ``X`` [n, k] with a
    fixed ``offset`` logit, expit(offset + X b) (Newton steps, an L2 ``ridge`` on b, until a step
    is below 1e-9 or ``iters``)."""
    b = np.zeros(X.shape[1])
    for _ in range(iters):
        p = expit(offset + X @ b)
        grad = X.T @ (hit - p) - ridge * b
        hess = (X * (p * (1 - p))[:, None]).T @ X + ridge * np.eye(X.shape[1])
        step = np.linalg.solve(hess, grad)
        b += step
        if np.abs(step).max() < 1e-9:
            break
    return b


def fit_text_terms(base_logit: np.ndarray, hit: np.ndarray, group: np.ndarray, feature: np.ndarray, groups: int,
                   ridge: float = RIDGE, iters: int = 25) -> np.ndarray:
    """float64 [groups, 2]: per rank group, the intercept and slope (b0, b1) maximising the
    likelihood of ``hit`` under expit(base_logit + b0 + b1 feature) (Newton, an L2 ``ridge`` on
    both): how the calibration's logit moves with the text feature.  With the intercept, each
    group's expected hits on its trials stay (nearly) its observed ones; a group with no trials
    moves nothing."""
    terms = np.zeros((groups, 2))
    for g in range(groups):
        at = group == g
        if not at.any():
            continue
        x = np.stack([np.ones(int(at.sum())), feature[at]], 1)
        b = offset_logistic(base_logit[at], hit[at].astype(np.float64), x, ridge, iters)
        terms[g] = b
    return terms
