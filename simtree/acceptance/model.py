"""Acceptance models: how many draft tokens the target accepts, per tree node, per workload.

One model is a mixture of per-round *levels* (easy and hard rounds), each a table
``accept_table [P, K]``: ``accept_table[d, r]`` = P(the rank-r child at depth d+1 is accepted |
its parent was accepted), rank by draft score among siblings (0 = best); ranks are disjoint
events, so rows sum to <= 1 (the positional model of :mod:`simtree.acceptance.phi`).  A level is drawn
per sequence per round; the drafter is assumed to know its level (its scores move with it), so
trees are built per level.  The same table read as per-position top-K marginals of a block
drafter (rows sorted desc, assumed calibrated) serves the best-first / cost-aware modes.

Three ways to get one:

1. :func:`fit_positional` - counts from acceptance traces (JSONL, below);
2. :func:`from_marginals` - per-round ``[P, K]`` marginals of a block drafter, one level each
   (or from the ``marginal_probs`` field of traces, :func:`fit_marginals`);
3. :func:`calibrate_linear` - from one number: the mean accepted tokens per round of linear
   speculation at budget D.  Assumption that extends it to trees: a geometric model - every
   depth accepts the drafter's top-1 with the same alpha, each lower-ranked sibling catches a
   fixed share ``sibling_share`` of the probability mass left by the ranks above it
   (rank-decay), and rounds come in three difficulty levels alpha*(1 -+ spread) with weights
   1/4, 1/2, 1/4; alpha is solved so that the *linear chain* reproduces the number exactly.
   Nothing else about trees is measured by that number.

"Accepted tokens" in the published figures (and in ``mean_accepted_tokens``) is read as the
tokens a sequence gains per verify round INCLUDING the target's bonus token, so a chain of
budget D (D-1 drafts) gives between 1 and D; simtree's ``Phi`` excludes the bonus.

Trace format (JSONL, one record per round per sequence; written by the runtime)::

    {"workload": "sharegpt", "batch_size": 8, "round": 12, "seq": 3,
     "parents": [-1, 0, 0, 1],            # draft tree, topological (simtree.trees.tree)
     "log_probs": [0.0, -0.1, -2.3, -0.4], # draft score of each node given its parent
     "accepted_node": 3,                   # deepest accepted node (0 = nothing accepted)
     "num_accepted": 2,                    # optional: depth of accepted_node (checked)
     "context_len": 517,                   # optional
     "marginal_probs": [[0.8, 0.1], ...]}  # optional [P][K] block-drafter marginals

Unknown keys are ignored; a malformed record raises a one-line SimtreeError naming the line.
See docs/traces.md.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from simtree.errors import SimtreeError, TreeError, check_whole
from simtree.acceptance.phi import expected_accepted_positional, sibling_rank
from simtree.probs import check_prob_rows
from simtree.trees.tree import DraftTree

__all__ = ["AcceptanceModel", "Workload", "PRESETS", "PUBLISHED_V4_FLASH_MTP", "calibrate_linear",
           "from_marginals", "fit_positional", "fit_marginals", "read_traces", "get_workload"]

# DeepSeek-V4-Flash MTP (3 steps, top-1, 4 draft tokens = linear budget D=4 incl. root):
# mean accepted tokens per round, read as including the bonus token.
PUBLISHED_V4_FLASH_MTP = {"gsm8k": 2.84, "mbpp": 2.67, "sharegpt": 2.39}
DEFAULT_DEPTH, DEFAULT_TOPK = 16, 4
_LEVEL_FACTORS, _LEVEL_WEIGHTS = np.array([-1.0, 0.0, 1.0]), np.array([0.25, 0.5, 0.25])
_ALPHA_MAX = 0.98    # no depth accepts more surely than this (calibration and trace fits)
MIN_TRACE_RECORDS = 100   # fewer records than this: the positional fit warns that it is unreliable
# Bounds of the lengths a workload brings: 1M tokens is beyond today's longest context windows
# (and far beyond any measured cost-model range); larger values are typing errors, and an output
# of 1e8 tokens would only make the planner crawl.
MAX_CONTEXT_LEN = 1 << 20
MAX_OUTPUT_LEN = 1 << 20


@dataclass(frozen=True, eq=False)
class AcceptanceModel:
    """Mixture of per-round acceptance tables.

    tables  float64 [L, P, K]  accept_table per level (rows sum <= 1)
    weights float64 [L]        level probabilities (sum 1)
    """

    name: str
    tables: np.ndarray
    weights: np.ndarray
    source: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        tables = np.asarray(self.tables, np.float64)
        if tables.ndim == 2:
            tables = tables[None]
        weights = np.asarray(self.weights, np.float64).reshape(-1)
        if tables.ndim != 3 or tables.shape[0] != weights.shape[0] or tables.size == 0:
            raise SimtreeError(f"acceptance model {self.name!r}: tables {tables.shape} and weights "
                               f"{weights.shape} must be [L, P, K] and [L]")
        check_prob_rows(tables, f"acceptance model {self.name!r}: table", axis=2)  # row [level, depth]
        check_prob_rows(weights, f"acceptance model {self.name!r}: level weights")
        if abs(weights.sum() - 1) > 1e-6:
            raise SimtreeError(f"acceptance model {self.name!r}: level weights sum to {weights.sum():.6g} "
                               "(must sum to 1)")
        tables.setflags(write=False)
        weights.setflags(write=False)
        object.__setattr__(self, "tables", tables)
        object.__setattr__(self, "weights", weights)

    @property
    def num_levels(self) -> int:
        return int(self.tables.shape[0])

    @property
    def depth(self) -> int:
        return int(self.tables.shape[1])

    @property
    def topk(self) -> int:
        return int(self.tables.shape[2])

    def table(self, level: int, depth: int | None = None) -> np.ndarray:
        """[depth, K] table of one level; rows beyond P repeat the deepest row (extrapolation)."""
        t = self.tables[level]
        if depth is None or depth <= t.shape[0]:
            return t if depth is None else t[:depth]
        return np.vstack([t, np.repeat(t[-1:], depth - t.shape[0], axis=0)])

    def marginals(self, level: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """Synthetic block-drafter marginals (tokens [P, K] = rank ids, probs [P, K] sorted desc)."""
        probs = -np.sort(-self.table(level, positions), axis=1)
        return np.tile(np.arange(self.topk, dtype=np.int64), (probs.shape[0], 1)), probs

    def propose(self, level: int, topk: int):
        """EAGLE ``propose`` callback (top-``topk``) whose draft scores are this level's per-rank
        probabilities.

        Scores are the running minimum along the rank so that sibling order by score is the rank
        order even where a fitted table is not monotone in rank (a miscalibrated drafter).
        """
        probs = np.minimum.accumulate(self.table(level, 64), axis=1)
        probs = np.hstack([probs, np.zeros((probs.shape[0], max(topk - probs.shape[1], 0)))])
        scores = np.log(np.maximum(probs, 1e-300))

        def propose(parents, tokens, frontier):
            depth = np.zeros(parents.shape[0], np.int64)
            for i in range(1, parents.shape[0]):
                depth[i] = depth[parents[i]] + 1
            k = topk
            rows = np.minimum(depth[frontier], scores.shape[0] - 1)
            toks = np.tile(np.arange(k, dtype=np.int64), (frontier.shape[0], 1))
            return toks, scores[rows, :k]
        return propose

    def expected_accepted(self, tree: DraftTree) -> float:
        """Phi(tree) averaged over levels (draft tokens, bonus excluded)."""
        return float(sum(w * expected_accepted_positional(tree, self.table(i, max(tree.max_depth, 1)))
                         for i, w in enumerate(self.weights)))

    def linear_accepted(self, budget: int) -> float:
        """Mean accepted draft tokens of a chain of ``budget`` nodes (bonus excluded)."""
        return float(self.weights @ _chain_phi(self.tables, budget))

    def summary(self) -> dict:
        return {"name": self.name, "source": self.source, "levels": self.num_levels,
                "depth": self.depth, "topk": self.topk,
                "linear_accepted_tokens_d4": 1.0 + self.linear_accepted(4), **self.meta}


def _chain_phi(tables: np.ndarray, budget: int) -> np.ndarray:
    """[L]: Phi of a chain of ``budget`` nodes per level: sum_i prod_{d<i} table[d, 0]."""
    steps = max(int(budget) - 1, 0)
    top1 = np.concatenate([tables[:, :, 0], np.repeat(tables[:, -1:, 0], max(steps - tables.shape[1], 0), 1)], 1)
    return np.cumprod(top1[:, :steps], axis=1).sum(axis=1)


def _level_tables(alphas: np.ndarray, depth: int, topk: int, sibling_share: float) -> np.ndarray:
    """[L, P, K]: rank 0 = alpha, rank r >= 1 = share of the mass left by ranks < r (capped
    at rank r-1's probability)."""
    left = 1.0 - alphas
    cols = [alphas]
    for _ in range(1, topk):  # capped by the rank above: a lower rank never beats a higher one
        cols.append(np.minimum(left * sibling_share, cols[-1]))
        left = left - cols[-1]
    row = np.stack(cols, axis=1)  # [L, K]
    return np.repeat(row[:, None, :], depth, axis=1)


def calibrate_linear(mean_accepted_tokens: float, budget: int = 4, *, name: str = "calibrated",
                     depth: int = DEFAULT_DEPTH, topk: int = DEFAULT_TOPK, sibling_share: float = 0.35,
                     spread: float = 0.25, source: str = "") -> AcceptanceModel:
    """Geometric positional model whose chain of ``budget`` nodes accepts ``mean_accepted_tokens``
    per round including the bonus token (see the module docstring for the assumption)."""
    if not math.isfinite(mean_accepted_tokens) or not 1.0 < mean_accepted_tokens < budget:
        raise SimtreeError(f"mean accepted tokens {mean_accepted_tokens} must lie in (1, {budget}) for a "
                           f"linear budget of {budget} (it counts the bonus token)")
    if not 0.0 <= spread < 1.0 or not 0.0 <= sibling_share <= 1.0:
        raise SimtreeError(f"spread {spread} must be in [0, 1) and sibling_share {sibling_share} in [0, 1]")
    factors = 1.0 + spread * _LEVEL_FACTORS if spread > 0 else np.ones(1)
    weights = _LEVEL_WEIGHTS if spread > 0 else np.ones(1)

    def chain(alpha: float) -> float:
        a = np.minimum(alpha * factors, _ALPHA_MAX)
        return float(weights @ _chain_phi(a[:, None, None], budget))

    target = mean_accepted_tokens - 1.0
    if chain(1.0 / factors.min()) < target:
        raise SimtreeError(f"mean accepted tokens {mean_accepted_tokens} is above what budget {budget} "
                           f"reaches with alpha <= {_ALPHA_MAX} and spread {spread}")
    lo, hi = 0.0, 1.0 / factors.min()
    for _ in range(60):  # bisection: chain() is increasing in alpha
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if chain(mid) < target else (lo, mid)
    alphas = np.minimum(0.5 * (lo + hi) * factors, _ALPHA_MAX)
    tables = _level_tables(alphas, depth, topk, sibling_share)
    meta = {"alpha_levels": [round(float(a), 4) for a in alphas], "sibling_share": sibling_share,
            "spread": spread, "calibrated_to": {"mean_accepted_tokens": mean_accepted_tokens,
                                                "linear_budget": budget}}
    return AcceptanceModel(name, tables, weights, source or "calibrate_linear", meta)


def from_marginals(marginal_probs: Sequence | np.ndarray, name: str = "marginals",
                   weights: Sequence[float] | None = None, source: str = "marginals") -> AcceptanceModel:
    """Levels from per-round block-drafter marginals: [P, K] or [L, P, K] (each row sorted desc
    here; assumed calibrated: P(target = rank-r candidate) = its marginal prob)."""
    probs = np.asarray(marginal_probs, np.float64)
    if probs.ndim == 2:
        probs = probs[None]
    if probs.ndim != 3:
        raise SimtreeError(f"marginals must be [P, K] or [L, P, K], got shape {probs.shape}")
    w = np.full(probs.shape[0], 1.0 / probs.shape[0]) if weights is None else np.asarray(weights, np.float64)
    return AcceptanceModel(name, -np.sort(-probs, axis=2), w / max(w.sum(), 1e-300), source)


# ---- traces ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceRecord:
    workload: str
    batch_size: int
    tree: DraftTree
    accepted_node: int
    context_len: int | None
    marginal_probs: np.ndarray | None
    round_index: int | None = None   # the record's "round" (0 = first round after the prompt)


def _record(obj, where: str) -> TraceRecord:
    if not isinstance(obj, dict):
        raise SimtreeError(f"{where}: a trace record must be a JSON object")
    if "schema" in obj and not str(obj["schema"]).startswith("simtree.trace/"):
        raise SimtreeError(f"{where}: schema {obj['schema']!r} is not a simtree.trace/* record")
    for key in ("workload", "batch_size", "parents", "log_probs", "accepted_node"):
        if key not in obj:
            raise SimtreeError(f"{where}: trace record lacks the field {key!r}")
    if not isinstance(obj["workload"], str) or not obj["workload"]:
        raise SimtreeError(f"{where}: workload {obj['workload']!r} must be a non-empty string")
    for key in ("parents", "log_probs"):
        if not isinstance(obj[key], list):
            raise SimtreeError(f"{where}: {key} must be a list (one entry per draft tree node), got {obj[key]!r}")
    try:
        tree = DraftTree(obj["parents"], None, obj["log_probs"])
    except TreeError as exc:
        raise SimtreeError(f"{where}: {exc}") from None
    # every integer field: an integer, or a float with an integral value (4.0) as JSON written
    # by other tools gives it
    node = check_whole(obj["accepted_node"], f"{where}: accepted_node (a node of the {tree.num_nodes}-node tree)",
                       0, tree.num_nodes - 1)
    batch = check_whole(obj["batch_size"], f"{where}: batch_size", 1)
    if "num_accepted" in obj and obj["num_accepted"] != int(tree.depth[node]):
        raise SimtreeError(f"{where}: num_accepted {obj['num_accepted']!r} != depth {int(tree.depth[node])} "
                           f"of accepted_node {node}")
    marg = obj.get("marginal_probs")
    if marg is not None:
        try:
            marg = np.asarray(marg, np.float64)
        except (TypeError, ValueError):
            raise SimtreeError(f"{where}: marginal_probs is not a [P][K] list of numbers") from None
        if marg.ndim != 2:
            raise SimtreeError(f"{where}: marginal_probs must be a [P][K] table of probabilities (rows sum <= 1)")
        check_prob_rows(marg, f"{where}: marginal_probs", axis=1)
    ctx, rnd = obj.get("context_len"), obj.get("round")
    if rnd is not None:
        rnd = check_whole(rnd, f"{where}: round", 0)
    if ctx is not None:
        ctx = check_whole(ctx, f"{where}: context_len (tokens)", 1, MAX_CONTEXT_LEN)
    return TraceRecord(obj["workload"], batch, tree, node, ctx, marg, rnd)


def read_traces(path: str | Path, workload: str | None = None) -> list[TraceRecord]:
    """Parse and validate a JSONL trace file (optionally keep one workload)."""
    path = Path(path)
    if not path.is_file():
        raise SimtreeError(f"trace file {path} does not exist")
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise SimtreeError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason}); "
                           "traces are JSON lines") from None
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise SimtreeError(f"{path}:{i}: not valid JSON ({getattr(exc, 'msg', 'nested too deeply')})") from None
            rec = _record(obj, f"{path}:{i}")
            if workload is None or rec.workload == workload:
                records.append(rec)
    if not records:
        raise SimtreeError(f"{path}: no trace records" + (f" for workload {workload!r}" if workload else ""))
    return records


def fit_positional(records: Iterable[TraceRecord], name: str | None = None, *, topk: int = DEFAULT_TOPK,
                   depth: int = DEFAULT_DEPTH, prior_strength: float = 5.0,
                   unobserved_share: float = 0.35) -> AcceptanceModel:
    """Positional table from traces: for every accepted node, each child is a trial at
    (its depth - 1, its sibling rank), a success if it is on the accepted path.

    Sparse cells shrink towards the shallower row (empirical Bayes, ``prior_strength`` pseudo
    trials); depths never observed repeat the deepest observed one.  Ranks never drafted in
    any trace (e.g. ranks >= 1 of chain traces) carry no evidence: they get
    ``unobserved_share`` of the mass the observed ranks leave free in their row (capped at the
    rank above, as :func:`calibrate_linear`'s rank-decay), so they never take mass from the
    observed ranks.  ``meta["imputed_ranks"]`` lists them.
    """
    records = list(records)
    if not 0.0 <= unobserved_share <= 1.0:
        raise SimtreeError(f"unobserved_share {unobserved_share} must be in [0, 1]")
    trials, hits = np.zeros((depth, topk)), np.zeros((depth, topk))
    for rec in records:
        tree, rank = rec.tree, sibling_rank(rec.tree)
        on_path = np.zeros(tree.num_nodes, bool)
        on_path[tree.path_to(rec.accepted_node)] = True
        child = np.flatnonzero((np.arange(tree.num_nodes) > 0) & on_path[np.maximum(tree.parents, 0)])
        child = child[(rank[child] < topk) & (tree.depth[child] <= depth)]
        np.add.at(trials, (tree.depth[child] - 1, rank[child]), 1.0)
        np.add.at(hits, (tree.depth[child] - 1, rank[child]), on_path[child].astype(float))
    if trials[0, 0] == 0:
        raise SimtreeError("traces hold no draft node under an accepted node: nothing to fit")
    seen = trials.sum(0) > 0  # a suffix of ranks is unseen: rank r exists only if r-1 does
    prior = np.where(seen, hits.sum(0) / np.maximum(trials.sum(0), 1e-12), 0.0)
    table = np.zeros((depth, topk))
    for d in range(depth):
        table[d] = np.where(seen, (hits[d] + prior_strength * prior) / (trials[d] + prior_strength), 0.0)
        prior = table[d]
    # Observed rates are conditional on the sibling existing, so rows can exceed 1 by sampling
    # noise when parents had different numbers of children: rescale observed ranks only then.
    # No depth is certain either: a row that sums above _ALPHA_MAX (e.g. traces where every
    # draft was accepted) is scaled down to it, as calibrate_linear caps alpha (a finite
    # sample never shows that the next draft cannot be rejected).
    capped = np.flatnonzero(table.sum(1) > _ALPHA_MAX)
    table /= np.maximum(table.sum(1, keepdims=True) / _ALPHA_MAX, 1.0)
    for r in np.flatnonzero(~seen):
        free = np.maximum(1.0 - table[:, :r].sum(1), 0.0)
        table[:, r] = np.minimum(unobserved_share * free, table[:, r - 1]) if r else 0.0
    observed = int(np.flatnonzero(trials[:, 0] > 0).max()) + 1
    meta = {"records": len(records), "observed_depth": observed,
            "imputed_ranks": [int(r) for r in np.flatnonzero(~seen)],
            "capped_depths": [int(d) + 1 for d in capped],
            "mean_accepted_tokens": 1.0 + float(np.mean([r.tree.depth[r.accepted_node] for r in records]))}
    workload = name or records[0].workload
    return AcceptanceModel(workload, table, np.ones(1), "fit_positional(traces)", meta)


def fit_marginals(records: Iterable[TraceRecord], name: str | None = None, max_levels: int = 32) -> AcceptanceModel:
    """Levels from the ``marginal_probs`` of trace records (an even subsample of <= max_levels)."""
    records = [r for r in records if r.marginal_probs is not None]
    if not records:
        raise SimtreeError("traces carry no marginal_probs: use the positional fit instead")
    shapes = {r.marginal_probs.shape for r in records}
    if len(shapes) != 1:
        raise SimtreeError(f"trace marginal_probs have different shapes {sorted(shapes)[:4]}")
    pick = np.linspace(0, len(records) - 1, min(max_levels, len(records))).round().astype(int)
    return from_marginals(np.stack([records[i].marginal_probs for i in pick]), name or records[0].workload,
                          source="fit_marginals(traces)")


# ---- workloads --------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Workload:
    """An acceptance model plus the lengths a request brings: prompt lengths [m] (samples of the
    distribution; the simulator draws from them) and output tokens per sequence."""

    name: str
    acceptance: AcceptanceModel
    prompt_lens: np.ndarray
    output_len: int
    note: str = ""

    @property
    def mean_prompt_len(self) -> float:
        return float(np.mean(self.prompt_lens))


def _depths(depths: list[int]) -> str:
    return ", ".join(str(d) for d in depths[:6]) + (", ..." if len(depths) > 6 else "")


def _lognormal_quantiles(mean: float, sigma: float, m: int = 64) -> np.ndarray:
    """m deterministic quantiles of a log-normal with the given mean (prompt-length samples)."""
    from scipy.stats import norm
    if not (math.isfinite(mean) and mean >= 1):
        raise SimtreeError(f"mean prompt length {mean} must be a finite number >= 1 (tokens)")
    z = norm.ppf((np.arange(m) + 0.5) / m)
    return np.maximum(np.round(np.exp(math.log(mean) - 0.5 * sigma ** 2 + sigma * z)), 1).astype(np.int64)


# Prompt/output lengths are assumed defaults (GSM8K zero-shot chat prompts, MBPP with tests,
# ShareGPT conversations), not measured; override them in the CLI.
_PRESET_LENGTHS = {"gsm8k": (256, 0.4, 256), "mbpp": (384, 0.4, 256), "sharegpt": (640, 0.9, 384)}
PRESETS = tuple(PUBLISHED_V4_FLASH_MTP)


def get_workload(spec: str, prompt_len: float | None = None, output_len: int | None = None) -> Workload:
    """A preset name (gsm8k, mbpp, sharegpt) or a JSONL trace file (positional fit), optionally
    ``file.jsonl#workload`` to pick one workload of a mixed file."""
    spec = str(spec)
    if spec in PUBLISHED_V4_FLASH_MTP:
        mean, sigma, out = _PRESET_LENGTHS[spec]
        acc = calibrate_linear(PUBLISHED_V4_FLASH_MTP[spec], 4, name=spec,
                               source=f"DeepSeek-V4-Flash MTP published {PUBLISHED_V4_FLASH_MTP[spec]} "
                                      "tokens/round at linear D=4 (incl. bonus), geometric extension")
        note = "preset"
    elif ".jsonl" in spec or Path(spec).is_file():
        path, _, only = spec.partition("#")  # "traces.jsonl#sharegpt" keeps one workload
        records = read_traces(path, only or None)
        names = sorted({r.workload for r in records})
        if len(names) > 1:
            raise SimtreeError(f"{path} holds workloads {', '.join(names)}: pick one as {path}#<workload>")
        acc = fit_positional(records, names[0])
        if len(records) < MIN_TRACE_RECORDS:
            warnings.warn(f"{path}: only {len(records)} trace records for workload {names[0]!r} (fewer than "
                          f"{MIN_TRACE_RECORDS}): its fitted acceptance is unreliable", RuntimeWarning, stacklevel=2)
        if acc.meta["capped_depths"]:
            warnings.warn(f"{path}: workload {names[0]!r} accepts nearly every draft at depths "
                          f"{_depths(acc.meta['capped_depths'])}; capped at {_ALPHA_MAX} per depth (a finite trace "
                          "cannot show certain acceptance)", RuntimeWarning, stacklevel=2)
        # the prompt is the context of a sequence's first round; later rounds' contexts already
        # include generated tokens, which the simulator adds itself
        first = [r.context_len for r in records if r.context_len is not None and r.round_index == 0]
        ctx = first or [r.context_len for r in records if r.context_len is not None]
        mean, sigma, out = (float(np.mean(ctx)) if ctx else 512.0), 0.5, 256
        note = f"fitted from {len(records)} trace records"
    else:
        raise SimtreeError(f"unknown workload {spec!r}: use one of {', '.join(PRESETS)} or a .jsonl trace file")
    if prompt_len is not None:
        if isinstance(prompt_len, bool) or not math.isfinite(prompt_len) or not 1 <= prompt_len <= MAX_CONTEXT_LEN:
            raise SimtreeError(f"prompt length must be in [1, {MAX_CONTEXT_LEN}] tokens, got {prompt_len}")
        mean = prompt_len
    if output_len is not None:
        out = check_whole(output_len, "output length", 1, MAX_OUTPUT_LEN)
    return Workload(acc.name, acc, _lognormal_quantiles(mean, sigma), int(out), note)
