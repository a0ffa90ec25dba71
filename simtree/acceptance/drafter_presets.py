"""Acceptance of the block drafters seeded from PUBLISHED numbers (labelled as such), until
traces of their own runs replace them.

Source: the DSpark paper (deepseek-ai/DeepSpec, DSpark_paper.pdf), Table 1: accepted length
tau per round (the target's bonus token included), target Qwen3-8B, drafters of block 7,
chain drafting, sampling temperature 1.0, fixed block (the confidence scheduler off).  The
drafters of this project's targets are untrained (random weights, for costs); these numbers are
what a trained drafter of that design accepted on a smaller target, nothing measured here.

    model = drafter_preset("dspark", "gsm8k")     # an AcceptanceModel, chain acceptance only

The seed is one number per (drafter, workload), so the model is the simplest that reproduces
it: a chain whose every position is accepted with the same conditional rate alpha, solved from
tau = sum_{j=0..7} alpha^j (block 7 plus the bonus token).  Candidates of rank >= 1 get
probability 0 (the table says nothing about them): under these presets a tree gains nothing
over a chain - fit traces with marginal ranks (docs/acceptance.md) for that.
"""
from __future__ import annotations

import numpy as np

from simtree.acceptance.mixture import AcceptanceModel, from_marginals
from simtree.errors import SimtreeError

__all__ = ["PUBLISHED_BLOCK_TAU", "PUBLISHED_BLOCK_SOURCE", "PUBLISHED_BLOCK_LEN", "chain_accept_rate",
           "drafter_preset", "DRAFTER_PRESET_WORKLOADS"]

PUBLISHED_BLOCK_SOURCE = ("DSpark paper (deepseek-ai/DeepSpec DSpark_paper.pdf) Table 1: accepted length per "
                          "round incl. the bonus token, target Qwen3-8B, block 7, chain drafting, temperature 1.0")
PUBLISHED_BLOCK_LEN = 7
# (family, workload) -> tau; the workloads of the existing presets: gsm8k, mbpp, and MT-Bench for
# chat (the table has no ShareGPT column: "sharegpt" here is MT-Bench's number, labelled so)
PUBLISHED_BLOCK_TAU = {("block", "gsm8k"): 5.33, ("block", "mbpp"): 4.36, ("block", "sharegpt"): 3.11,
                       ("dspark", "gsm8k"): 6.17, ("dspark", "mbpp"): 5.16, ("dspark", "sharegpt"): 3.72}
DRAFTER_PRESET_WORKLOADS = ("gsm8k", "mbpp", "sharegpt")


def chain_accept_rate(tau: float, block_len: int = PUBLISHED_BLOCK_LEN) -> float:
    """alpha in [0, 1] with sum_{j=0..block_len} alpha^j = tau (bisection; tau in [1, block_len + 1])."""
    if not 1.0 <= tau <= block_len + 1:
        raise SimtreeError(f"accepted length {tau} is outside [1, {block_len + 1}] for a block of {block_len}")
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if sum(mid ** j for j in range(block_len + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def drafter_preset(family: str, workload: str, topk: int = 1) -> AcceptanceModel:
    """The published-seeded chain model of ``family`` on ``workload`` (module docstring)."""
    key = (family, workload)
    if key not in PUBLISHED_BLOCK_TAU:
        have = ", ".join(f"{f}/{w}" for f, w in PUBLISHED_BLOCK_TAU)
        raise SimtreeError(f"no published acceptance for drafter {family!r} on {workload!r} (have: {have})")
    alpha = chain_accept_rate(PUBLISHED_BLOCK_TAU[key])
    probs = np.zeros((PUBLISHED_BLOCK_LEN, max(int(topk), 1)))
    probs[:, 0] = alpha
    model = from_marginals(probs, f"{workload}_{family}_published", source="published")
    model.meta.update({"published": True, "source": PUBLISHED_BLOCK_SOURCE, "tau": PUBLISHED_BLOCK_TAU[key],
                       "alpha": round(alpha, 6), "family": family})
    return model
