"""Planner candidates of the block-drafter families, priced by their own C_d: offered where the
cost bundle has the family's cost (the full runtime builds every one: ``runtime/full/block_engine.py``).

    rows = score_drafter_candidates(costs, acc, batch_size=16, context_len=1024)
    specs = drafter_specs(costs)                  # the planner's grid (PolicySpecs) of the bundle's families
    row = score_spec(costs, acc, spec, 16, 1024)  # one spec (the full runtime's prediction of a run)

Each candidate is scored as the analytic simulator scores the built-in modes: the tokens a
sequence gains per round (bonus included, averaged over the acceptance model's levels as its
rounds spread over them) times the batch, over the round's time C_v + C_d:

- ``block`` {budget n, block_len L}: the best-first tree of n nodes from the drafter's marginals
  over L positions (``best_first`` of the acceptance model, width 1); C_d = block(n, L, b).
- ``tfm`` {budget n, width w}: the best-first tree over the adapter's conditionals, w expansions
  a step (``best_first`` with width w over the drafter's block); C_d = tfm(n, ceil((n-1)/w), b).
- ``dspark`` {block_len L, threshold}: a chain of L drafted by the Markov head; the batch
  verifies the prefixes chosen by the confidence schedule (``threshold`` None: batch_alloc's
  rule over the batch's survivals, the full runtime round's rule on the levels' mix - the m positions
  most likely to survive, m maximising the round's rate (B + their survival) / (C_d + C_v(1 +
  m / B, l, B))) or those whose survival clears a fixed ``threshold`` in [0, 1]; the survival
  of a position is the level's chain acceptance (a calibrated confidence head).  Each sequence
  draws its level every round, so a round's tokens are the expectation over the levels: level
  l stands for B w_l sequences (fluid, as the simulator's analytic batch_alloc, not B whole
  sequences apportioned to the heaviest levels - at B = 1 that was every round at the likeliest
  level).  The full runtime verifies a static bucket: the chain cut to the longest prefix any
  level is given (:func:`dspark_bucket`), every round, priced C_v(bucket, l, b); C_d =
  dspark(MARGINAL_TOPK, L, b, l).  In a deployment under data-parallel attention each rank
  schedules its own ceil(b / dp) sequences: the schedule and the bucket are a rank's (B above
  is the rank's batch).

A family the bundle has no cost for, a block length beyond the drafter's, a threshold outside
[0, 1]: one-line errors.  :func:`drafter_memory_check`: whether a candidate's drafter fits the
bundle's GPU at a batch and context (the planner leaves out one that does not).  The replays of
a full-runtime run shape and draw their trees from the built-in policy the simulator scores for
them (:func:`stand_in`).
"""
from __future__ import annotations

import math

import numpy as np

from simtree.acceptance.confidence_head import check_threshold
from simtree.acceptance.mixture import AcceptanceModel
from simtree.acceptance.predict import accepted_per_round
from simtree.drafters import MARGINAL_TOPK
from simtree.errors import SimtreeError
from simtree.planning.allocation import batch_allocation

__all__ = ["score_drafter_candidates", "default_drafter_grid", "drafter_specs", "score_spec", "score_run",
           "spec_candidate", "stand_in", "dspark_bucket", "drafter_memory_check", "drafters_that_fit", "memory_notes"]


def default_drafter_grid(block_len: int = 7, max_budget: int = 32) -> list[tuple[str, dict]]:
    out = [("block", {"budget": n, "block_len": block_len}) for n in (4, 8, 16, 32) if n <= max_budget]
    out += [("tfm", {"budget": n, "width": w}) for n in (8, 16, 32) for w in (1, 4) if n <= max_budget]
    out += [("dspark", {"block_len": block_len, "threshold": t}) for t in (None, 0.3, 0.6)]
    return out


def spec_candidate(spec) -> tuple[str, dict]:
    """(family, candidate params) of a block-drafter PolicySpec (block, tfm, dspark)."""
    p = spec.to_dict()
    if spec.mode == "dspark":
        return "dspark", {"block_len": p["block_len"], "threshold": p.get("threshold")}
    if spec.mode in ("block", "tfm"):
        return spec.mode, p
    raise SimtreeError(f"mode {spec.mode!r} is not drafted by a block drafter")


def _candidate_spec(fam: str, p: dict, block_len: int):
    from simtree.planning.modes import PolicySpec
    if fam == "tfm":
        return PolicySpec.from_dict("tfm", {"budget": p["budget"], "width": p["width"], "block_len": block_len})
    if fam == "dspark" and p.get("threshold") is None:
        return PolicySpec.from_dict("dspark", {"block_len": p["block_len"]})
    return PolicySpec.from_dict(fam, p)


def drafter_specs(costs, max_budget: int = 32) -> list:
    """The default grid as PolicySpecs, for the families the bundle has a cost for (none: [])."""
    drafters = getattr(costs, "drafters", None) or {}
    out = []
    for fam in sorted(drafters):
        own = drafters[fam].block_len or 7
        out += [_candidate_spec(f, p, own) for f, p in default_drafter_grid(own, max_budget) if f == fam]
    return out


def drafter_memory_check(costs):
    """The deployment memory check of the bundle's rank with a block drafter: a function
    (spec, batch_size, context_len) -> :class:`simtree.deploy.memory.RankMemory` of one rank of
    the bundle's deployment (``meta["rank_of"]``: the rank alone, holding all b sequences) running
    ``spec``'s drafter beside the target; None where there is nothing to check against, as
    ``simtree.deploy.select`` has it: a model the registry does not know, a device no machine
    table describes."""
    from simtree.deploy.memory import rank_memory
    from simtree.machine.machines import machine_for_device
    from simtree.models import get_model, list_models
    meta = costs.meta
    name, machine = str(meta.get("model", "")), machine_for_device(str(meta.get("device", "")))
    if machine is None or name not in list_models():
        return None
    shape, alone = get_model(name), meta.get("rank_of")
    dep = alone or meta.get("deployment") or "tp=1"
    return lambda spec, b, ctx: rank_memory(shape, dep, machine, int(b), int(math.ceil(ctx)), rank_alone=bool(alone),
                                            drafter=spec)


def drafters_that_fit(fits, specs: list, batch_size: int, context_len: float) -> tuple[list, list]:
    """(the block-drafter ``specs`` whose drafter fits at ``batch_size`` and ``context_len``,
    [(spec, RankMemory)] of the others); ``fits``: :func:`drafter_memory_check`'s (None: all fit)."""
    if fits is None:
        return list(specs), []
    mems = [fits(spec, batch_size, context_len) for spec in specs]
    return [s for s, m in zip(specs, mems) if m.fits], [(s, m) for s, m in zip(specs, mems) if not m.fits]


def memory_notes(refused: dict) -> list[str]:
    """One line per batch size where block-drafter candidates were left out: ``refused`` {batch
    size: [(workload name, spec, RankMemory)]}, the first of them named with the check's numbers."""
    notes = []
    for b, out in sorted(refused.items()):
        if out:
            workload, spec, mem = out[0]
            notes.append(f"batch {b}: {len(out)} block-drafter candidate(s) not planned, the deployment memory check "
                         f"refuses one {mem.deployment} rank on {mem.machine.name} with their drafter (e.g. {spec.name} "
                         f"for {workload}, {mem.rank_batch} sequences at context {mem.context_len}: "
                         f"{mem.total_bytes / 1e9:.1f} GB, {mem.drafter_bytes / 1e9:.1f} GB of it the "
                         f"{mem.drafter.use.family} drafter's, of {mem.usable_bytes / 1e9:.1f} GB usable)")
    return notes


def stand_in(spec):
    """The built-in policy whose trees the simulator scores for a block-drafter spec (replays
    shape and draw their trees by it): block - best-first over block_len positions; tfm - the
    same, ``width`` pops a step; dspark - the chain of block_len drafts (the prefix verified is
    the runtime's: a replay's acceptance on it is the chain's)."""
    from simtree.planning.modes import BestFirstParams, LinearParams
    if spec.mode == "block":
        return BestFirstParams(spec.budget, spec.block_len)
    if spec.mode == "tfm":
        return BestFirstParams(spec.budget, spec.block_len, spec.width)
    if spec.mode == "dspark":
        return LinearParams(spec.block_len + 1)
    return spec


def score_run(costs, workload, spec, batch_size: int) -> dict:
    """A block-drafter spec over a workload's run, as the planner scores the fixed shapes: the
    round (:func:`score_spec`) at the run's middle context, the run priced by ``analytic_static``;
    the row plus ``tok_s`` and ``round_us``."""
    from simtree.planning.simulate import analytic_static
    lo, n = workload.mean_prompt_len, workload.output_len
    r = score_spec(costs, workload.acceptance, spec, batch_size, lo + n / 2)
    out = analytic_static(r["tokens_per_round"], r["nodes_per_seq"], r["draft_us"], costs, batch_size, lo, n)
    return {**r, "tok_s": float(out["throughput_tok_s"][0]), "round_us": float(out["total_us"][0] / out["rounds"][0])}


def score_spec(costs, acc: AcceptanceModel, spec, batch_size: int, context_len: float) -> dict:
    """The row of :func:`score_drafter_candidates` of one block-drafter PolicySpec."""
    fam, p = spec_candidate(spec)
    if fam == "tfm":
        costs.drafter("tfm").check_block_len(spec.block_len)
    return _score_one(costs, acc, fam, p, int(batch_size), float(context_len))


def _dspark_survival(acc: AcceptanceModel, L: int) -> np.ndarray:
    """[levels, L] survivals: each level's chain acceptance cumulated."""
    return np.stack([np.cumprod(acc.table(i, L)[:, 0]) for i in range(acc.num_levels)])


def dspark_bucket(lens: np.ndarray) -> int:
    """The static chain a DSpark run verifies every round: the root and the longest prefix the
    schedule (or threshold) verifies, at least one drafted position."""
    return 1 + max(int(np.max(lens)) if np.size(lens) else 0, 1)


def _score_one(costs, acc, fam: str, p: dict, b: int, l: int) -> dict:
    model = costs.drafter(fam)
    if fam == "block":
        L = model.check_block_len(int(p["block_len"]))
        n = int(p["budget"])
        g = accepted_per_round(acc, "best_first", {"budget": n, "width": 1, "draft_depth": L})
        draft, verify = model.predict(n, L, b, l), costs.verify.predict(n, l, b)
    elif fam == "tfm":
        n, w = int(p["budget"]), int(p["width"])
        if n < 1 or w < 1:
            raise SimtreeError(f"tfm candidate: budget and width must be >= 1, got {n}, {w}")
        L = model.check_block_len(int(p.get("block_len", model.block_len or 7)))
        g = accepted_per_round(acc, "best_first", {"budget": n, "width": w, "draft_depth": L})
        draft, verify = model.predict(n, max(1, math.ceil((n - 1) / w)), b, l), costs.verify.predict(n, l, b)
    elif fam == "dspark":
        from simtree.deploy.costs import rank_batch_of
        L = model.check_block_len(int(p["block_len"]))
        rb = rank_batch_of(costs, b)   # a rank schedules its own sequences (ceil(b / dp) of a deployment's b)
        surv, w = _dspark_survival(acc, L), acc.weights
        draft = float(model.predict(MARGINAL_TOPK, L, b, l))          # its top-K drafted
        thr = p.get("threshold")
        if thr is None:   # level l: rb w_l sequences; K of their positions verified: 1 + K / rb nodes a sequence
            lens = batch_allocation(list(surv), rb * w, lambda n: costs.verify.predict(n, l, b), draft, rb)
            kept = surv[np.arange(L)[None, :] < lens[:, None]]
            thr_used = float(kept.min()) if kept.size else 1.0
        else:
            thr_used = check_threshold(thr)
            lens = (surv >= thr_used).sum(1)
        chosen = np.arange(L)[None, :] < lens[:, None]
        g = 1.0 + float(w @ (surv * chosen).sum(1))
        # the full runtime verifies a static bucket every round: the chain cut to the longest prefix
        n = dspark_bucket(lens[w > 0])
        verify = costs.verify.predict(n, l, b)
        p = {**p, "threshold_used": round(thr_used, 6), "verified_per_seq": round(float(w @ lens), 4), "bucket": n}
    else:
        raise SimtreeError(f"unknown drafter family {fam!r}")
    step = float(verify) + float(draft)
    return {"family": fam, "params": p, "batch_size": b, "context_len": l, "tokens_per_round": float(g),
            "nodes_per_seq": float(n),
            "verify_us": float(verify), "draft_us": float(draft), "predicted_tok_s": b * float(g) / step * 1e6}


def score_drafter_candidates(costs, acc: AcceptanceModel, *, batch_size: int, context_len: int,
                             candidates: list[tuple[str, dict]] | None = None) -> list[dict]:
    """One row per candidate (module docstring), best first."""
    if batch_size < 1 or context_len < 0:
        raise SimtreeError(f"batch_size must be >= 1 and context_len >= 0, got {batch_size}, {context_len}")
    if candidates is None:   # the default grid of the families the bundle has costs for
        candidates = [(f, p) for f, p in default_drafter_grid() if f in getattr(costs, "drafters", {})]
    rows = [_score_one(costs, acc, fam, dict(p), int(batch_size), int(context_len)) for fam, p in candidates]
    return sorted(rows, key=lambda r: -r["predicted_tok_s"])
