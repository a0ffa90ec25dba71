"""Live decoding of given prompts round by round, with per-round statistics and traces: what
``simtree run`` on the tiny default reads (:mod:`simtree.runtime.live`).

    result = generate(model, prompts, max_new_tokens=48, spec=EagleParams(3, 2, 6), trace=writer)
    result.outputs       # per prompt: max_new_tokens greedy tokens (the first from the prefill)
    result.rounds        # RoundStats per decode round (ms)

One engine decodes the batch (:func:`.block_engine.make_engine`: a
:class:`~simtree.runtime.full.engine.FullEngine`, or a block drafter's): the same rounds, stages
and timing as every other run of the runtime (milliseconds, as the engine reports them).  The
host reads the output lengths once a round (to stop; ``progress``), the round's statistics once
after the last (``FullEngine.stats``); a controller's choice (the context lengths, the accepted
lengths it observes) and a trace (the round's buffers) read more, each round.  The
batch is static: every sequence decodes every round until the slowest has ``max_new_tokens``;
the tokens past it are cut from the outputs and counted in ``tokens_produced``.  Each round
records how many sequences were still short of max_new_tokens when it began (``live``) and,
with a trace writer, one record per sequence (:mod:`.round_trace`): the round's tree as the
engine drafted it (padding left out), the accepted node, the target's tokens along the
accepted path and, for the marginal modes, the drafter's top-K along its chain.
With a controller, plain rounds let the MTP layer fall behind (:mod:`.engine`); the round that
resumes drafting, or the plain round that found its buffer full, records the catch-up's time
(``catchup_ms``, part of its ``round_ms``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from simtree.errors import SimtreeError, check_int
from simtree.planning.modes import PolicySpec

from .acceptance import ShapeSources
from .block_engine import make_engine
from .drafting import pad_round, round_shape
from .engine import OUT_CAP, sync_device
from .round_trace import round_records

__all__ = ["RoundStats", "GenerationResult", "generate", "greedy_decode", "check_fits", "check_spec", "state_rows", "TRACE_TOPK"]

TRACE_TOPK = 8     # traced linear rounds: candidates kept per drafted position (the chain is their top-1)


@dataclass
class RoundStats:
    draft_ms: float
    verify_ms: float
    commit_ms: float
    nodes: list          # tree size per sequence (root included; padding excluded)
    accepted: list       # accepted draft tokens per sequence (bonus excluded)
    live: int = 0        # sequences still short of max_new_tokens when the round began
    catchup_ms: float = 0.0   # the MTP layer catching up on earlier plain rounds before this one (engine.catch_up)

    @property
    def round_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.commit_ms + self.catchup_ms


@dataclass
class GenerationResult:
    outputs: list        # per prompt: the first max_new_tokens generated token ids
    rounds: list         # RoundStats per decode round
    prefill_ms: float
    tokens_produced: int  # all tokens the decode rounds produced (before cutting)


def state_rows(prompts, rs, max_new_tokens: int) -> int:
    """Cache rows per sequence: a sequence keeps decoding until the slowest has its tokens,
    gaining at most a round's accepted path each round."""
    return max(map(len, prompts)) + rs.path_rows * (max_new_tokens + 1) + 2


def check_spec(spec) -> PolicySpec:
    """``spec`` when it is a :class:`PolicySpec` (validated when it was built, so the engine
    runs exactly the policy the planner predicted); a one-line SimtreeError otherwise."""
    if not isinstance(spec, PolicySpec):
        raise SimtreeError(f"a decoding policy is a PolicySpec (NoneParams, LinearParams, EagleParams, ...), "
                           f"got {type(spec).__name__}")
    return spec


def check_fits(model, spec: PolicySpec):
    """The round shape of ``spec`` (a one-line error for one the engine cannot build), refused
    where its top-k exceeds the model's vocabulary."""
    rs = round_shape(check_spec(spec))
    if rs.topk > model.vocab:
        raise SimtreeError(f"{spec.mode} topk {rs.topk} exceeds the model's vocabulary ({model.vocab} tokens): "
                           f"use --topk <= {model.vocab}")
    return rs


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, spec: PolicySpec, costs=None,
             workload: str = "", trace=None, progress=None, controller=None, source=None) -> GenerationResult:
    """Decode ``max_new_tokens`` greedy tokens for each prompt (one batch) with ``spec``;
    ``costs``: the bundle cost_aware and batch_alloc decide with; ``trace``: an open
    :class:`simtree.runtime.trace.TraceWriter`, or any object with its ``write_records``
    (:class:`.round_trace.RecordList`) (linear rounds then keep the drafter's top TRACE_TOPK per
    position); ``progress(done_tokens)``: a callback.  ``controller``
    (:class:`simtree.control.Controller`, or any object with its ``tiers``, ``choose`` and
    ``observe``): each round runs the tier it chooses instead of ``spec``.  ``source(rs)``: the
    acceptance source of round shape ``rs``'s rounds (a replay, e.g. ``measure.AcceptanceSource.make``;
    each drafted shape its own, :class:`.acceptance.ShapeSources`); default live (the target
    decides)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise SimtreeError("every prompt needs at least one token")
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", 1, OUT_CAP)
    bad = [t for p in prompts for t in p if not 0 <= int(t) < model.vocab]
    if bad:
        raise SimtreeError(f"token {bad[0]} outside the model's vocabulary [0, {model.vocab})")
    B = len(prompts)
    # the bundle's cheaper bucket at this batch where it pads (C_v was fitted on that envelope)
    rs = pad_round(check_fits(model, spec), B, costs)
    tiers = {} if controller is None else {t.name: pad_round(check_fits(model, t.spec), B, costs)
                                           for t in controller.tiers}
    widest = max([rs, *tiers.values()], key=lambda s: s.path_rows)
    topk = min(TRACE_TOPK, model.vocab) if trace is not None else 0
    shapes = [s for s in tiers.values() if s != rs]
    drafted = {s: source(s) for s in [rs, *shapes] if not s.plain} if source is not None else {}
    engine = make_engine(model, rs, B, state_rows(prompts, widest, max_new_tokens),
                         ShapeSources(drafted) if drafted else None, costs=costs, shapes=shapes, trace_topk=topk)
    engine.capture()
    sync_device(engine.device)
    t0 = time.perf_counter()
    engine.prefill(prompts)
    sync_device(engine.device)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    lens = np.ones(B, np.int64)     # outputs per sequence (the prefill made the first)
    prompt_lens = np.array([len(p) for p in prompts], np.int64)
    engine.begin()
    t0, done = time.perf_counter(), 0
    while lens.min() < max_new_tokens:
        # the target's context: the prompt and every output but the newest (whose KV the next round writes)
        ctx_lens = (prompt_lens + lens - 1).tolist() if trace is not None or controller is not None else None
        # a static batch: every sequence has decoded as many rounds (the controller weighs the youngest's tail)
        tier = None if controller is None else controller.choose(B, ctx_lens, rounds_done=[done] * B)
        if tier is not None:
            engine.use(tiers[tier.name])
        engine.step()
        new_lens = np.asarray(engine.out_len.tolist(), np.int64)   # the round's one read
        if tier is not None:
            controller.observe(tier, new_lens - lens - 1)            # accepted drafts: the gain less the bonus
        if trace is not None:
            trace.write_records(round_records(engine.last_round(), workload=workload, round_index=done,
                                              mode=engine.rs.spec.mode, context_lens=ctx_lens))
        done += 1
        lens = new_lens
        if progress is not None:
            progress(int(np.minimum(lens, max_new_tokens).sum()))
    stats = engine.stats(time.perf_counter() - t0)
    before = 1 + np.concatenate([np.zeros((1, B), np.int64), np.cumsum(stats.accepted + 1, 0)[:-1]])
    rounds = [RoundStats(float(stats.draft_ms[r]), float(stats.verify_ms[r]), float(stats.commit_ms[r]),
                         stats.nodes[r].tolist(), stats.accepted[r].tolist(), int((before[r] < max_new_tokens).sum()),
                         float(stats.catchup_ms[r])) for r in range(stats.rounds)]
    produced = int(stats.accepted.sum()) + stats.rounds * B
    outputs = [o[:max_new_tokens] for o in engine.outputs()]
    return GenerationResult(outputs, rounds, prefill_ms, produced)


def greedy_decode(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding of the prompts (one decode step per token): the lossless reference."""
    return generate(model, prompts, max_new_tokens, PolicySpec.from_dict("none")).outputs
