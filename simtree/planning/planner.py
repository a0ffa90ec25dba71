"""Planner: for each workload and batch size, the speculation policy of highest predicted
decode throughput, searched over

- none (plain decoding);
- linear, budget D in 2..16 (drafted depth D - 1 up to 15);
- EAGLE s steps x top-k x budget D (s 1..15, k 2..4, D 2..16; k = 1 is the linear family), trees
  built by :func:`simtree.trees.builders.eagle_tree` from the acceptance model's per-rank
  probabilities as draft scores (the same builder the runtime uses);
- best-first (DDTree) budget D x drafted depth p (1..15), heap width 1 (the cost model does not
  charge heap steps, so a wider pop can only lose accepted length);
- cost-aware adaptive budget per round (CaDDTree), max budget 16, depth p (1..15);
- batch-level allocation across the batch's requests (DSpark-style), max 16 per sequence;
- where the cost bundle has a block drafter's C_d (its ``drafters`` key): that family's grid
  (:func:`simtree.planning.drafter_candidates.drafter_specs`: block marginals' trees, TfM trees,
  DSpark's confidence-scheduled or fixed-threshold prefix), priced by its own C_d; left out at a
  (workload, batch size) where the deployment memory check refuses the rank with that drafter
  (its weights, caches and round buffers beside the target's, at the workload's mean prompt plus
  output length: :func:`simtree.planning.drafter_candidates.drafter_memory_check`), a note per
  batch size saying so.  (The MTP-drafted modes need no such check: the target's count holds
  their draft layer, and ``simtree plan`` refuses a deployment that does not hold it at its
  largest batch.)

Every tree family reaches the same drafted depth as linear (15 at budget 16), bounded by the
budget: a tree of D nodes is at most D - 1 deep, so drafting deeper than D - 1 (s or p) builds
the same tree for more draft cost, and those candidates are left out.

Every candidate is scored by :mod:`simtree.planning.simulate`'s analytic mode (fixed shapes
vectorised over candidates); cost_aware and batch_alloc as the full runtime runs them, their
rule's trees verified in a static bucket every round (:func:`simtree.planning.adaptive.adaptive_bucket`).  Output: :class:`PlanResult` with all candidates (each with the
cost-model axes it queries outside their measured range, ``extrapolated``), the chosen
policy per (workload, batch size) and :meth:`PlanResult.to_policy` (contract 3).  A tree
chosen for a predicted gain over the best linear / plain policy below the verify fit's
held-out median error is flagged ``within_model_error``.
"""
from __future__ import annotations

import json
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from simtree.acceptance.model import Workload
from simtree.costs.model import Costs
from simtree.errors import ExtrapolationWarning, SimtreeError
from simtree.planning.modes import (MODES, RUNTIME_MODES, TREE_MODES, BatchAllocParams, BestFirstParams, CostAwareParams, EagleParams,
                                    LinearParams, NoneParams, PolicySpec, check_batch_size)
from simtree.planning.policy_file import RANK_SUFFIX, Policy, PolicyEntry, deployment_label
from simtree.planning.ranges import extrapolated_axes, measured_ranges, queried_ranges, range_notes
from simtree.planning.simulate import analytic_run, analytic_static, static_round
from simtree.trees.builders import eagle_max_nodes

__all__ = ["DEFAULT_BATCH_SIZES", "FAMILIES", "SearchSpace", "PlanResult", "candidate_specs", "plan",
           "choose_policies", "check_workload_names", "read_candidates", "CAVEAT_NOTE"]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
CAVEAT_NOTE = "caveat of this cost bundle: "    # the note that leads a plan of a bundle with a caveat
MODES_NOTE = "searched the families {} only (--modes)"   # a plan restricted to some families
# the families searched: every mode `simtree run` builds (a plan names no other), simplest first
FAMILIES = tuple(m for m in MODES if m in RUNTIME_MODES)
_MAX_BUDGET = 16
_MAX_DEPTH = _MAX_BUDGET - 1   # linear's deepest chain: every family may draft as deep


@dataclass(frozen=True)
class SearchSpace:
    budgets: tuple[int, ...] = tuple(range(2, _MAX_BUDGET + 1))
    eagle_steps: tuple[int, ...] = tuple(range(1, _MAX_DEPTH + 1))
    eagle_topk: tuple[int, ...] = (2, 3, 4)
    draft_depths: tuple[int, ...] = tuple(range(1, _MAX_DEPTH + 1))
    adaptive_max_budget: int = _MAX_BUDGET
    adaptive: bool = True
    modes: tuple[str, ...] = FAMILIES   # the families searched (plain decoding always is)

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise SimtreeError(f"plan modes {', '.join(unknown) or '(none)'}: choose among {', '.join(FAMILIES)}")
        unbuilt = [m for m in self.modes if m not in FAMILIES]
        if unbuilt:
            raise SimtreeError(f"plan mode {unbuilt[0]}: simtree run does not build it, so a plan may not name it "
                               f"(it runs {', '.join(FAMILIES)})")

    @property
    def searched(self) -> tuple[str, ...]:
        """The families searched, in FAMILIES order: ``modes`` and plain decoding."""
        return tuple(m for m in FAMILIES if m in self.modes or m == "none")


def candidate_specs(space: SearchSpace = SearchSpace()) -> tuple[list[PolicySpec], list[PolicySpec]]:
    """(fixed-shape specs, adaptive specs) of the search space.  Depths (eagle steps s,
    drafted positions p) deeper than the budget's D - 1 are left out: a tree of D nodes is at
    most D - 1 deep, so they build the same tree as depth D - 1 for more draft cost."""
    fixed: list[PolicySpec] = [NoneParams()] + [LinearParams(d) for d in space.budgets]
    fixed += [EagleParams(num_steps=s, topk=k, budget=d)
              for s in space.eagle_steps for k in space.eagle_topk for d in space.budgets
              if d <= eagle_max_nodes(s, k) and s <= d - 1]
    fixed += [BestFirstParams(budget=d, draft_depth=p, width=1)
              for p in space.draft_depths for d in space.budgets if p <= d - 1]
    adaptive: list[PolicySpec] = []
    if space.adaptive:
        m = space.adaptive_max_budget
        adaptive = [cls(m, p) for cls in (CostAwareParams, BatchAllocParams)
                    for p in space.draft_depths if p <= max(m - 1, 1)]
    return [f for f in fixed if f.mode in space.searched], [a for a in adaptive if a.mode in space.searched]


@dataclass
class PlanResult:
    """candidates: one row per (workload, batch_size, policy); chosen: the best per pair
    (:func:`choose_policies` at ``model_error``, derived).

    source: what the policy file keeps (cost bundle meta, workloads, planner settings), also
    the plan's ``notes``, ``model_error`` and ``synthetic`` (read from it, see there);
    ``batch_sizes`` are the candidates' own."""

    model: str
    device: str
    source: dict
    candidates: pd.DataFrame
    chosen: pd.DataFrame = field(init=False)

    def __post_init__(self) -> None:
        self.chosen = choose_policies(self.candidates, self.model_error)

    @property
    def synthetic(self) -> bool:
        """Planned on the SYNTHETIC roofline rather than measured costs (``source["synthetic"]``)."""
        return bool(self.source.get("synthetic", False))

    @property
    def deployment(self) -> str:
        """The deployment planned ("tp=1" for one GPU), from the cost models' meta; "ep=8 rank"
        for one rank of ep=8 planned alone (``simtree.deploy.costs.one_rank``: batch b is the b
        sequences on the rank, no collectives; ``meta["rank_of"]``)."""
        meta = self.source.get("costs") or {}
        if meta.get("rank_of"):
            return deployment_label(f"{meta['rank_of']}{RANK_SUFFIX}")
        return str(meta.get("deployment") or "tp=1")

    @property
    def communication(self) -> dict | None:
        """{"assumed": bool, "label": ...} of the collectives the costs rest on; None for one GPU
        and for one rank planned alone (no collectives priced)."""
        meta = self.source.get("costs") or {}
        if meta.get("rank_of"):
            return None
        comm = meta.get("communication")
        return comm if isinstance(comm, dict) and "assumed" in comm else None

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The planned batch sizes, ascending."""
        return tuple(sorted(int(b) for b in self.candidates["batch_size"].unique()))

    @property
    def notes(self) -> list[str]:
        """One-line caveats for the report: the cost bundle's :attr:`caveat` first (where it has
        one), cost-model axes queried outside the measured range, with both ranges
        (``source["notes"]``)."""
        return [str(n) for n in self.source.get("notes", []) or []]

    @property
    def caveat(self) -> str | None:
        """What a plan of this cost bundle must say about where its profile came from (a shipped
        bundle's deployments.yaml caveat, simtree/deploy/shipped.py), or None."""
        return (self.source.get("costs") or {}).get("caveat") or None

    @property
    def model_error(self) -> float | None:
        """The verify fit's held-out median relative error (``source["verify_heldout_median_error"]``,
        None when the bundle has none), the margin below which a tree choice is flagged."""
        err = self.source.get("verify_heldout_median_error")
        return float(err) if isinstance(err, (int, float)) and not isinstance(err, bool) else None

    def to_policy(self) -> Policy:
        entries, sizes = [], self.batch_sizes
        lower = {b: (sizes[i - 1] + 1 if i else 1) for i, b in enumerate(sizes)}
        for row in self.chosen.itertuples():
            entries.append(PolicyEntry(row.workload, lower[row.batch_size], int(row.batch_size),
                                       PolicySpec.from_dict(row.mode, json.loads(row.params)),
                                       float(row.tok_s), float(row.gain_vs_linear), float(row.gain_vs_none),
                                       bool(row.within_model_error)))
        return Policy(self.model, self.device, entries, self.source, deployment=self.deployment)


# Static tables depend only on the acceptance model and the specs: computed once per workload
# and shared by every cost bundle planned with it.
_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _static_table(workload: Workload, specs: list[PolicySpec]) -> pd.DataFrame:
    key = tuple(spec.name for spec in specs)
    cached = _TABLES.setdefault(workload.acceptance, {})
    if key in cached:
        return cached[key]
    rows = []
    for spec in specs:
        shape = static_round(workload.acceptance, spec)
        s, k = spec.draft_shape()
        rows.append({"policy": spec.name, "mode": spec.mode, "params": json.dumps(spec.to_dict(), sort_keys=True),
                     "budget": spec.fixed_budget, "tokens_per_round": shape.tokens_per_round,
                     "nodes_per_seq": shape.nodes_per_seq, "nodes_std": shape.nodes_std,
                     "draft_steps": s, "draft_topk": k,
                     "min_nodes": float(shape.nodes.min()), "max_nodes": float(shape.nodes.max())})
    cached[key] = pd.DataFrame(rows)
    return cached[key]


def _choose(df: pd.DataFrame) -> pd.Series:
    """Highest tok/s; among near-ties (1e-9 relative) the simpler family (FAMILIES order) wins."""
    best = df["tok_s"].max()
    near = df[df["tok_s"] >= best * (1 - 1e-9)]
    return near.iloc[int(np.argmin([FAMILIES.index(m) for m in near["mode"]]))]


def check_workload_names(workloads, labels: Sequence[str] | None = None) -> None:
    """One-line error when two workloads share a name (a plan's policy is keyed by it);
    ``labels``: where each came from (preset or trace path), named in the error."""
    for i, w in enumerate(workloads):
        j = next((j for j in range(i) if workloads[j].name == w.name), None)
        if j is not None:
            where = f" ({labels[j]} and {labels[i]})" if labels else ""
            raise SimtreeError(f"two workloads named {w.name!r}{where}: plan them separately or rename "
                               "one (a trace's workload field names it)")


def _score(costs: Costs, workload: Workload, table: pd.DataFrame, adaptive: list[PolicySpec], b: int) -> pd.DataFrame:
    """Every candidate of one (workload, batch size): the fixed shapes of ``table`` (scored
    vectorised) and the ``adaptive`` specs, with their tok/s and round and draft latency, and
    the [ctx_lo, ctx_hi] of contexts each asks C_v at (the run's [l0, l0 + N], widened by an
    adaptive spec's bucketed decision contexts); ``verify``: how the adaptive specs' verify is
    priced (:func:`~simtree.planning.simulate.analytic_run`)."""
    steps = table["draft_steps"].to_numpy()
    draft = np.zeros(len(table))
    drafted = steps > 0  # plain decoding drafts nothing: never ask C_d about it
    draft[drafted] = costs.draft.predict(steps[drafted], table["draft_topk"].to_numpy()[drafted], b)
    out = analytic_static(table["tokens_per_round"].to_numpy(), table["nodes_per_seq"].to_numpy(),
                          draft, costs, b, workload.mean_prompt_len, workload.output_len)
    lo, hi = workload.mean_prompt_len, workload.mean_prompt_len + workload.output_len
    df = table.assign(workload=workload.name, batch_size=b, tok_s=out["throughput_tok_s"],
                      round_us=out["total_us"] / out["rounds"], draft_us=draft, ctx_lo=lo, ctx_hi=hi)
    rows = []
    for spec in adaptive:
        a = analytic_run(workload, spec, costs, b)
        rows.append({"policy": spec.name, "mode": spec.mode, "params": json.dumps(spec.to_dict(), sort_keys=True),
                     "budget": None, "tokens_per_round": a["g"], "nodes_per_seq": a["n"], "nodes_std": a["nodes_std"],
                     "draft_steps": spec.draft_depth, "draft_topk": 1, "min_nodes": 1.0,
                     "max_nodes": float(spec.max_nodes), "workload": workload.name, "batch_size": b,
                     "tok_s": a["tok_s"], "round_us": a["total_us"] / a["rounds"], "draft_us": a["draft_us"],
                     "ctx_lo": min(lo, a["decision_ctx"][0]), "ctx_hi": max(hi, a["decision_ctx"][1])})
    return pd.concat([df, pd.DataFrame(rows)], ignore_index=True) if rows else df


def _drafter_rows(costs: Costs, workload: Workload, specs: list[PolicySpec], b: int) -> pd.DataFrame:
    """The block-drafter candidates (:mod:`simtree.planning.drafter_candidates`) of one
    (workload, batch size), scored as the fixed shapes are (``score_run``)."""
    from simtree.planning.drafter_candidates import score_run
    lo, hi = workload.mean_prompt_len, workload.mean_prompt_len + workload.output_len
    rows = []
    for spec in specs:
        r = score_run(costs, workload, spec, b)
        rows.append({"policy": spec.name, "mode": spec.mode, "params": json.dumps(spec.to_dict(), sort_keys=True),
                     "budget": spec.fixed_budget, "tokens_per_round": r["tokens_per_round"],
                     "nodes_per_seq": r["nodes_per_seq"], "nodes_std": 0.0, "draft_steps": 0, "draft_topk": 0,
                     "min_nodes": 1.0, "max_nodes": float(spec.max_nodes), "workload": workload.name,
                     "batch_size": b, "tok_s": r["tok_s"], "round_us": r["round_us"], "draft_us": r["draft_us"],
                     "ctx_lo": lo, "ctx_hi": hi})
    return pd.DataFrame(rows)


def plan(costs: Costs, workloads: Sequence[Workload], batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
         space: SearchSpace = SearchSpace(), progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """Search every candidate for every (workload, batch size); see the module docstring.  Costs
    of one rank of a deployment of several GPUs (``meta["deployment"]``) are planned composed
    with their communication (:func:`simtree.deploy.costs.deployment_costs`)."""
    from simtree.deploy.costs import deployment_costs

    from simtree.planning.drafter_candidates import drafter_memory_check, drafter_specs, drafters_that_fit, memory_notes

    # the block drafters the bundle has C_d for (draft_steps 0: the MTP layer's C_d is not asked)
    costs = deployment_costs(costs)
    blocks = [sp for sp in drafter_specs(costs, max(space.budgets)) if sp.mode in space.searched]
    fits, refused = (drafter_memory_check(costs) if blocks else None), {}
    if not batch_sizes:
        raise SimtreeError("plan needs at least one batch size")
    sizes = sorted({check_batch_size(b, "batch sizes") for b in batch_sizes})
    if not workloads:
        raise SimtreeError("plan needs at least one workload")
    check_workload_names(workloads)
    fixed, adaptive = candidate_specs(space)
    total, done, frames, spans = len(workloads) * len(sizes), 0, [], {}
    ranges = measured_ranges(costs)
    with warnings.catch_warnings():
        # the plan reports every axis it queries outside the measured range in its notes
        # (the spans below): the cost models' own warnings would say it again
        warnings.simplefilter("ignore", ExtrapolationWarning)
        for workload in workloads:
            table = _static_table(workload, fixed)
            for b in sizes:
                df = _score(costs, workload, table, adaptive, b)
                fitting, out = drafters_that_fit(fits, blocks, b, workload.mean_prompt_len + workload.output_len)
                refused.setdefault(b, []).extend((workload.name, spec, mem) for spec, mem in out)
                if fitting:
                    df = pd.concat([df, _drafter_rows(costs, workload, fitting, b)], ignore_index=True)
                queries = queried_ranges(df)
                drafted = df["draft_steps"].to_numpy() > 0
                for key, (lo, hi) in queries.items():
                    sel = drafted if key[0] == "draft" else np.ones(len(df), bool)
                    if sel.any():
                        old = spans.get(key, (np.inf, -np.inf))
                        spans[key] = (min(old[0], float(lo[sel].min())), max(old[1], float(hi[sel].max())))
                frames.append(df.assign(extrapolated=extrapolated_axes(queries, ranges, drafted)))
                done += 1
                if progress:
                    progress(done, total)
    cands = pd.concat(frames, ignore_index=True).drop(columns=["draft_steps", "draft_topk", "min_nodes", "max_nodes",
                                                             "ctx_lo", "ctx_hi"])
    if not np.all(np.isfinite(cands["tok_s"])) or np.any(cands["tok_s"] <= 0):
        bad = cands[~np.isfinite(cands["tok_s"]) | (cands["tok_s"] <= 0)].iloc[0]
        raise SimtreeError(f"cost model gave a non-positive or NaN latency for {bad['policy']} at batch {bad['batch_size']}")
    meta = dict(costs.meta)
    source = {"costs": meta, "synthetic": bool(meta.get("synthetic", False)),
              "workloads": {w.name: w.acceptance.summary() | {"mean_prompt_len": w.mean_prompt_len,
                                                               "output_len": w.output_len} for w in workloads},
              "planner": "simtree.planner analytic search", "num_candidates": int(len(cands)),
              "verify_heldout_median_error": costs.verify.heldout_median_error,
              "notes": range_notes(ranges, spans) + memory_notes(refused)}
    if meta.get("caveat"):   # the shipped bundle's deployments.yaml caveat (simtree/deploy/shipped.py)
        source["notes"].insert(0, CAVEAT_NOTE + meta["caveat"])
    if space.searched != FAMILIES:
        source["modes"] = list(space.searched)
        source["notes"].append(MODES_NOTE.format(", ".join(space.searched)))
    return PlanResult(str(meta.get("model", "unknown")), str(meta.get("device", "unknown")), source, cands)


def choose_policies(cands: pd.DataFrame, model_error: float | None = None) -> pd.DataFrame:
    """The best candidate per (workload, batch size), with gain_vs_none, gain_vs_linear (the
    best of linear and none), the name of the best linear candidate, and within_model_error:
    a tree chosen for a predicted gain over that best linear / plain policy smaller than
    ``model_error`` (the verify fit's held-out median relative error)."""
    chosen = []
    for _, grp in cands.groupby(["workload", "batch_size"], sort=False):
        best = _choose(grp).copy()
        baseline = grp.loc[grp["mode"].isin(["linear", "none"])].sort_values("tok_s")
        best["gain_vs_none"] = best["tok_s"] / float(grp.loc[grp["mode"] == "none", "tok_s"].max())
        best["gain_vs_linear"] = best["tok_s"] / float(baseline["tok_s"].iloc[-1])
        best["best_linear"] = baseline.iloc[-1]["policy"]
        best["within_model_error"] = bool(model_error is not None and best["mode"] in TREE_MODES
                                          and best["gain_vs_linear"] - 1.0 < model_error)
        chosen.append(best)
    return pd.DataFrame(chosen).reset_index(drop=True)


_CANDIDATE_COLUMNS = ("workload", "batch_size", "policy", "mode", "params", "budget", "tokens_per_round",
                      "nodes_per_seq", "tok_s")


def read_candidates(path: str | Path, policy: Policy | None = None) -> pd.DataFrame:
    """A plan's candidates.csv, checked: readable, the planner's columns, at least one row,
    tok_s > 0, and (with ``policy``) from the same plan as the policy file: each entry's chosen
    policy is a row at its planned batch size (batch_max) with the entry's predicted tok/s."""
    path = Path(path)
    if not path.is_file():
        raise SimtreeError(f"{path} does not exist: point at a folder written by `simtree plan`")
    try:
        cands = pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise SimtreeError(f"{path} is not a readable candidates table ({type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:120]})") from None
    missing = [c for c in _CANDIDATE_COLUMNS if c not in cands.columns]
    if missing:
        raise SimtreeError(f"{path}: missing column {missing[0]!r} (not a candidates table of `simtree plan`)")
    if cands.empty:
        raise SimtreeError(f"{path} has a header but no candidate rows")
    tok = pd.to_numeric(cands["tok_s"], errors="coerce")
    batch = pd.to_numeric(cands["batch_size"], errors="coerce")
    if tok.isna().any() or not np.all(np.isfinite(tok)) or (tok <= 0).any():
        raise SimtreeError(f"{path}: tok_s must be a finite number > 0 in every row")
    if batch.isna().any() or (batch != batch.round()).any() or (batch < 1).any():
        raise SimtreeError(f"{path}: batch_size must be an integer >= 1 in every row")
    if cands["mode"].isin(["none"]).groupby([cands["workload"], batch]).sum().min() < 1:
        raise SimtreeError(f"{path}: every (workload, batch size) needs its plain-decoding row (mode none)")
    cands = cands.assign(tok_s=tok.astype(float), batch_size=batch.astype(int), workload=cands["workload"].astype(str))
    budget = pd.to_numeric(cands["budget"], errors="coerce")
    if (budget.dropna() == budget.dropna().round()).all():   # blank for adaptive rows: keep ints as ints
        cands["budget"] = budget.astype("Int64")
    if "extrapolated" in cands.columns:
        cands["extrapolated"] = [x if isinstance(x, str) else "" for x in cands["extrapolated"]]
    if policy is not None:
        for e in policy.entries:
            name = e.params.name
            rows = cands[(cands["workload"] == e.workload) & (cands["batch_size"] == e.batch_max)
                         & (cands["policy"] == name)]
            if rows.empty or not np.isclose(rows["tok_s"].iloc[0], e.predicted_tok_s, rtol=1e-6):
                found = f"{rows['tok_s'].iloc[0]:.6g} tok/s" if not rows.empty else "no such row"
                raise SimtreeError(f"{path} and the policy file ({policy.model} on {policy.device}) are not from one "
                                   f"plan: the policy's {name} for {e.workload!r} at batch {e.batch_max} predicts "
                                   f"{e.predicted_tok_s:.6g} tok/s, the candidates table has {found}")
    return cands
