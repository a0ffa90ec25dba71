"""Live lossless check: speculative decoding must output plain greedy decoding, token for token.

    rows = check_lossless(model, prompts, [PolicySpec.from_dict("linear", {"budget": 4}), ...], 32)

With random weights the MTP layer almost never agrees with the target, so a check on them
would compare rounds that accept nothing.  :func:`make_predictable` makes both nearly a bigram
model of the token (the layers' output projections scaled by ``layer_gain``, the MTP layer's
fuse projection passing the token's embedding through), so drafts are accepted often and
rejected often: every path of the round is exercised.  The layers still shape every logit.

Where a policy's output differs, the row names the first differing token and the plain run's
top-1 minus top-2 logit there (``margin``), and probes the same position through the verify
forward: the plain prefix committed by the prefill, then a chain of the policy's node count
rooted at the last prefix token (``_probe``).  ``deviation`` is the largest difference between
that row's logits and the decode step's; ``verify_token`` the token the verify forward picks
there.  A margin within twice a deviation at the dtype's rounding is a numerical near-tie
between two kernels' summation orders (bf16: different row counts take different GEMM
tilings), above all where ``verify_token`` is the speculative run's token; a margin far above
it, or a deviation far above rounding, is a bug in a round.
"""
from __future__ import annotations

import torch

from simtree.planning.modes import PolicySpec

from .block_engine import make_engine
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
        if name.endswith(OUT_PROJECTIONS):   # an FP8 weight through its block scales
            (model.w[name + "_scale_inv"] if t.dtype == torch.float8_e4m3fn else t).mul_(layer_gain)
    if "mtp.fc" in model.w:
        fc = model.w["mtp.fc"]
        fc[:, :h] = torch.eye(h, dtype=fc.dtype, device=fc.device)
        fc[:, h:] *= layer_gain
    else:       # V4: the token projection the identity, the streams' projection scaled
        e = model.w["mtp.e_proj"]
        e.copy_(torch.eye(e.shape[0], dtype=e.dtype, device=e.device))
        model.w["mtp.h_proj"].mul_(layer_gain)


def _decode(model, prompts, spec, max_new_tokens: int, max_len: int, costs=None, drafter=None):
    engine = make_engine(model, round_shape(spec), len(prompts), max_len, costs=costs, **(drafter or {}))
    engine.capture()
    engine.prefill(prompts)
    stats = engine.run(max_new_tokens=max_new_tokens)
    return [o[:max_new_tokens] for o in engine.outputs()], stats


@torch.no_grad()
def _probe(model, prompt, output, at: int, nodes: int, max_len: int) -> dict:
    """At output token ``at`` of the plain run (batch 1, eager): ``margin`` (the decode step's
    top-1 minus top-2 logit), ``deviation`` (max |verify - decode| logit at that position, the
    verify forward over a chain of ``nodes`` rows: the plain continuation, root leaves where it
    ends) and ``verify_token`` (the verify forward's argmax there)."""
    seq = list(prompt) + list(output[:at])
    engine = FullEngine(model, round_shape(PolicySpec.from_dict("none")), 1, max_len, graphs=False)
    if len(seq) > 1:
        engine.prefill([seq[:-1]])
    # the verify forward writes no state: the decode step after it sees the same prefix
    chain = [seq[-1]] + list(output[at:at + max(nodes, 1) - 1])
    pad = max(nodes, 1) - len(chain)
    tokens = torch.as_tensor([chain + [0] * pad], device=model.device)
    parents = torch.as_tensor([list(range(-1, len(chain) - 1)) + [0] * pad], device=model.device)
    verify = model.logits(model.verify(engine.st, tokens, parents)[0][:1])[0].float()
    decode = model.logits(model.decode(engine.st, tokens[:, 0]))[0].float()
    top = decode.topk(2).values
    return {"margin": float(top[0] - top[1]), "deviation": float((verify - decode).abs().max()),
            "verify_token": int(verify.argmax())}


def check_lossless(model, prompts: list[list[int]], specs, max_new_tokens: int, max_len: int | None = None,
                   costs=None, drafter: dict | None = None) -> list[dict]:
    """One row per policy: {policy, batch_size, match, first_diff, plain_token, spec_token, margin,
    deviation, verify_token, accepted_tokens_per_round} (the diagnosis, module docstring, where
    the outputs differ); the plain greedy outputs of the same prompts are the reference.
    ``costs``: the bundle cost_aware and batch_alloc decide with; ``drafter``: the block
    drafters' engine arguments (``sizes``, ``seed``: :class:`.block_engine.BlockEngine`)."""
    max_len = max_len or max(map(len, prompts)) + 16 * (max_new_tokens + 1) + 8
    plain, _ = _decode(model, prompts, PolicySpec.from_dict("none"), max_new_tokens, max_len)
    rows = []
    for spec in specs:
        outs, stats = _decode(model, prompts, spec, max_new_tokens, max_len, costs, drafter)
        diff = [next((i for i, (a, b) in enumerate(zip(o, p)) if a != b), None) for o, p in zip(outs, plain)]
        bad = [(b, i) for b, i in enumerate(diff) if i is not None]
        row = {"policy": round_shape(spec).name, "batch_size": len(prompts), "match": not bad,
               "first_diff": None, "plain_token": None, "spec_token": None, "margin": None, "deviation": None,
               "verify_token": None, "accepted_tokens_per_round": stats.accepted_tokens_per_round}
        if bad:
            b, i = bad[0]
            row.update(first_diff=f"sequence {b} token {i}", plain_token=int(plain[b][i]), spec_token=int(outs[b][i]))
            row.update(_probe(model, prompts[b], plain[b], i, round_shape(spec).nodes, max_len))
        rows.append(row)
    return rows
