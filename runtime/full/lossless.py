"""Live lossless check: speculative decoding must output plain greedy decoding, token for token.

    rows = check_lossless(model, prompts, [PolicySpec.from_dict("linear", {"budget": 4}), ...], 32)

With random weights the MTP layer almost never agrees with the target, so a check on them
would compare rounds that accept nothing.  :func:`make_predictable` makes both nearly a bigram
model of the token (the layers' output projections scaled by ``layer_gain``, the MTP layer's
fuse projection passing the token's embedding through), so drafts are accepted often and
rejected often: every path of the round is exercised.  The layers still shape every logit.

Where a policy's output differs, the row names the first differing token and the plain run's
top-1 minus top-2 logit there: a gap near the dtype's rounding (bf16) is a numerical near-tie
between two kernels' summation orders, a large one is a bug.
"""
from __future__ import annotations

import torch

from simtree.planning.modes import PolicySpec

from .drafting import round_shape
from .engine import FullEngine

__all__ = ["make_predictable", "check_lossless", "OUT_PROJECTIONS"]

# weights whose output feeds the residual stream (scaled by make_predictable)
OUT_PROJECTIONS = (".o", ".out", ".down", ".wo_b", ".experts_down", ".shared_down")


@torch.no_grad()
def make_predictable(model, layer_gain: float = 0.3) -> None:
    """In place: residual branches scaled by ``layer_gain``; the MTP fuse projection's token
    half the identity, its hidden half scaled by ``layer_gain``."""
    h = model.hidden
    for name, t in model.w.items():
        if name.endswith(OUT_PROJECTIONS):
            t.mul_(layer_gain)
    fc = model.w["mtp.fc"]
    fc[:, :h] = torch.eye(h, dtype=fc.dtype, device=fc.device)
    fc[:, h:] *= layer_gain


def _decode(model, prompts, spec, max_new_tokens: int, max_len: int):
    engine = FullEngine(model, round_shape(spec), len(prompts), max_len)
    engine.capture()
    engine.prefill(prompts)
    stats = engine.run(max_new_tokens=max_new_tokens)
    return [o[:max_new_tokens] for o in engine.outputs()], stats


@torch.no_grad()
def _margin(model, prompt, output, at: int, max_len: int) -> float:
    """The plain run's top-1 minus top-2 logit before output token ``at`` (batch 1, eager)."""
    seq = list(prompt) + list(output[:at])
    engine = FullEngine(model, round_shape(PolicySpec.from_dict("none")), 1, max_len, graphs=False)
    if len(seq) > 1:
        engine.prefill([seq[:-1]])
    hidden = model.decode(engine.st, torch.as_tensor([seq[-1]], device=model.device))
    top = model.logits(hidden)[0].float().topk(2).values
    return float(top[0] - top[1])


def check_lossless(model, prompts: list[list[int]], specs, max_new_tokens: int, max_len: int | None = None) -> list[dict]:
    """One row per policy: {policy, batch_size, match, first_diff, margin, accepted_tokens_per_round};
    the plain greedy outputs of the same prompts are the reference."""
    max_len = max_len or max(map(len, prompts)) + 16 * (max_new_tokens + 1) + 8
    plain, _ = _decode(model, prompts, PolicySpec.from_dict("none"), max_new_tokens, max_len)
    rows = []
    for spec in specs:
        outs, stats = _decode(model, prompts, spec, max_new_tokens, max_len)
        diff = [next((i for i, (a, b) in enumerate(zip(o, p)) if a != b), None) for o, p in zip(outs, plain)]
        bad = [(b, i) for b, i in enumerate(diff) if i is not None]
        row = {"policy": round_shape(spec).name, "batch_size": len(prompts), "match": not bad,
               "first_diff": None, "margin": None, "accepted_tokens_per_round": stats.accepted_tokens_per_round}
        if bad:
            b, i = bad[0]
            row["first_diff"] = f"sequence {b} token {i}"
            row["margin"] = _margin(model, prompts[b], plain[b], i, max_len)
        rows.append(row)
    return rows
