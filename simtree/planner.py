"""Planner: for each workload and batch size, the speculation policy of highest predicted
decode throughput, searched over

- none (plain decoding);
- linear, budget D in 2..16;
- EAGLE s steps x top-k x budget D (s 1..6, k 2..4, D 2..16; k = 1 is the linear family), trees
  built by :func:`simtree.builders.eagle_tree` from the acceptance model's per-rank
  probabilities as draft scores (the same builder the runtime uses);
- best-first (DDTree) budget D x drafted depth p (1..6), heap width 1 (the cost model does not
  charge heap steps, so a wider pop can only lose accepted length);
- cost-aware adaptive budget per round (CaDDTree), max budget 16, depth p;
- batch-level allocation across the batch's requests (DSpark-style), max 16 per sequence.

Every candidate is scored by :mod:`simtree.simulate`'s analytic mode (fixed shapes
vectorised over candidates).  Output: :class:`PlanResult` with all candidates, the chosen
policy per (workload, batch size) and :meth:`PlanResult.to_policy` (contract 3).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from simtree.acceptance import Workload
from simtree.builders import eagle_max_nodes
from simtree.errors import SimtreeError
from simtree.policy import Policy, PolicyEntry
from simtree.simulate import PolicySpec, analytic_run, analytic_static, static_round

__all__ = ["DEFAULT_BATCH_SIZES", "SearchSpace", "PlanResult", "candidate_specs", "plan", "choose_policies",
           "resolve_costs", "plan_and_write"]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
FAMILIES = ("none", "linear", "eagle", "best_first", "cost_aware", "batch_alloc")
TREE_MODES = ("eagle", "best_first", "cost_aware", "batch_alloc")


@dataclass(frozen=True)
class SearchSpace:
    budgets: tuple[int, ...] = tuple(range(2, 17))
    eagle_steps: tuple[int, ...] = tuple(range(1, 7))
    eagle_topk: tuple[int, ...] = (2, 3, 4)
    draft_depths: tuple[int, ...] = tuple(range(1, 7))
    adaptive_max_budget: int = 16
    adaptive: bool = True


def candidate_specs(space: SearchSpace = SearchSpace()) -> tuple[list[PolicySpec], list[PolicySpec]]:
    """(fixed-shape specs, adaptive specs) of the search space."""
    fixed = [PolicySpec("none")] + [PolicySpec("linear", {"budget": d}) for d in space.budgets]
    fixed += [PolicySpec("eagle", {"num_steps": s, "topk": k, "budget": d})
              for s in space.eagle_steps for k in space.eagle_topk for d in space.budgets
              if d <= eagle_max_nodes(s, k)]
    fixed += [PolicySpec("best_first", {"budget": d, "width": 1, "draft_depth": p})
              for p in space.draft_depths for d in space.budgets]
    adaptive = []
    if space.adaptive:
        m = space.adaptive_max_budget
        adaptive = [PolicySpec(mode, {key: m, "draft_depth": p})
                    for mode, key in (("cost_aware", "max_budget"), ("batch_alloc", "max_budget_per_seq"))
                    for p in space.draft_depths]
    return fixed, adaptive


@dataclass
class PlanResult:
    """candidates: one row per (workload, batch_size, policy); chosen: the best per pair."""

    model: str
    device: str
    source: dict
    candidates: pd.DataFrame
    chosen: pd.DataFrame
    synthetic: bool = False
    batch_sizes: tuple[int, ...] = field(default_factory=tuple)

    def to_policy(self) -> Policy:
        entries, sizes = [], sorted(self.batch_sizes)
        lower = {b: (sizes[i - 1] + 1 if i else 1) for i, b in enumerate(sizes)}
        for row in self.chosen.itertuples():
            entries.append(PolicyEntry(row.workload, lower[row.batch_size], int(row.batch_size), row.mode,
                                       json.loads(row.params), row.mode in TREE_MODES,
                                       float(row.tok_s), float(row.gain_vs_linear), float(row.gain_vs_none)))
        return Policy(self.model, self.device, entries, self.source)


def _static_table(workload: Workload, specs: list[PolicySpec]) -> pd.DataFrame:
    w = workload.acceptance.weights
    rows = []
    for spec in specs:
        shape = static_round(workload.acceptance, spec)
        s, k = spec.draft_shape()
        rows.append({"policy": spec.name, "mode": spec.mode, "params": json.dumps(spec.params, sort_keys=True),
                     "budget": spec.budget, "tokens_per_round": 1.0 + float(w @ shape.accepted),
                     "nodes_per_seq": float(w @ shape.nodes), "draft_steps": s, "draft_topk": k})
    return pd.DataFrame(rows)


def _choose(df: pd.DataFrame) -> pd.Series:
    """Highest tok/s; among near-ties (1e-9 relative) the simpler family (FAMILIES order) wins."""
    best = df["tok_s"].max()
    near = df[df["tok_s"] >= best * (1 - 1e-9)]
    return near.iloc[int(np.argmin([FAMILIES.index(m) for m in near["mode"]]))]


def plan(costs, workloads: Sequence[Workload], batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
         space: SearchSpace = SearchSpace(), progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """Search every candidate for every (workload, batch size); see the module docstring."""
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise SimtreeError(f"batch sizes must be integers >= 1, got {list(batch_sizes)}")
    if not workloads:
        raise SimtreeError("plan needs at least one workload")
    fixed, adaptive = candidate_specs(space)
    total, done, frames = len(workloads) * len(sizes), 0, []
    for workload in workloads:
        table = _static_table(workload, fixed)
        for b in sizes:
            steps = table["draft_steps"].to_numpy()
            draft = np.zeros(len(table))
            drafted = steps > 0  # plain decoding drafts nothing: never ask C_d about it
            draft[drafted] = costs.draft.predict(steps[drafted], table["draft_topk"].to_numpy()[drafted], b)
            out = analytic_static(table["tokens_per_round"].to_numpy(), table["nodes_per_seq"].to_numpy(),
                                  draft, costs, b, workload.mean_prompt_len, workload.output_len)
            df = table.assign(workload=workload.name, batch_size=b, tok_s=out["throughput_tok_s"],
                              round_us=out["total_us"] / out["rounds"], draft_us=draft)
            rows = []
            for spec in adaptive:
                a = analytic_run(workload, spec, costs, b)
                rows.append({"policy": spec.name, "mode": spec.mode, "params": json.dumps(spec.params, sort_keys=True),
                             "budget": None, "tokens_per_round": a["g"], "nodes_per_seq": a["n"],
                             "workload": workload.name, "batch_size": b,
                             "tok_s": b * a["rounds"] * a["g"] / a["total_us"] * 1e6,
                             "round_us": a["total_us"] / a["rounds"], "draft_us": a["draft_us"]})
            frames.append(pd.concat([df, pd.DataFrame(rows)], ignore_index=True) if rows else df)
            done += 1
            if progress:
                progress(done, total)
    cands = pd.concat(frames, ignore_index=True).drop(columns=["draft_steps", "draft_topk"])
    if not np.all(np.isfinite(cands["tok_s"])) or np.any(cands["tok_s"] <= 0):
        bad = cands[~np.isfinite(cands["tok_s"]) | (cands["tok_s"] <= 0)].iloc[0]
        raise SimtreeError(f"cost model gave a non-positive or NaN latency for {bad['policy']} at batch {bad['batch_size']}")
    meta = dict(getattr(costs, "meta", {}) or {})
    synthetic = bool(meta.get("synthetic", False))
    source = {"costs": meta, "synthetic": synthetic,
              "workloads": {w.name: w.acceptance.summary() | {"mean_prompt_len": w.mean_prompt_len,
                                                               "output_len": w.output_len} for w in workloads},
              "planner": "simtree.planner analytic search", "num_candidates": int(len(cands))}
    return PlanResult(str(meta.get("model", "unknown")), str(meta.get("device", "unknown")), source, cands,
                      choose_policies(cands), synthetic, tuple(sizes))


def choose_policies(cands: pd.DataFrame) -> pd.DataFrame:
    """The best candidate per (workload, batch size), with gain_vs_none, gain_vs_linear (the
    best of linear and none) and the name of the best linear candidate."""
    chosen = []
    for _, grp in cands.groupby(["workload", "batch_size"], sort=False):
        best = _choose(grp).copy()
        baseline = grp.loc[grp["mode"].isin(["linear", "none"])].sort_values("tok_s")
        best["gain_vs_none"] = best["tok_s"] / float(grp.loc[grp["mode"] == "none", "tok_s"].max())
        best["gain_vs_linear"] = best["tok_s"] / float(baseline["tok_s"].iloc[-1])
        best["best_linear"] = baseline.iloc[-1]["policy"]
        chosen.append(best)
    return pd.DataFrame(chosen).reset_index(drop=True)


# ---- entry points of `simtree plan` / `simtree simulate` --------------------------------------
COSTS_DIR = Path(__file__).resolve().parent / "data" / "costs"


def resolve_costs(paths: Sequence[str] = ()) -> list:
    """Cost bundles from ``paths``; none given -> shipped simtree/data/costs/*.json, and when
    none ship, the SYNTHETIC roofline (meta["synthetic"] is True)."""
    from simtree.costmodel import load_costs
    from simtree.synthetic import synthetic_costs

    files = list(paths) or sorted(str(p) for p in COSTS_DIR.glob("*.json"))
    return [load_costs(p) for p in files] if files else [synthetic_costs()]


def plan_and_write(cost_paths: Sequence[str] = (), workload_specs: Sequence[str] = (),
                   batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, out_dir: str = "reports/plan",
                   prompt_len: float | None = None, output_len: int | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   space: SearchSpace = SearchSpace()) -> list[dict]:
    """Plan every cost bundle x workloads; write policy.json + report per bundle.

    Returns one dict per bundle: result (PlanResult), policy (path), report (paths).
    """
    from simtree.acceptance import PRESETS, get_workload
    from simtree.report import write_plan_report

    bundles = resolve_costs(cost_paths)
    workloads = [get_workload(w, prompt_len, output_len) for w in (workload_specs or PRESETS)]
    outputs = []
    for bundle in bundles:
        result = plan(bundle, workloads, batch_sizes, space, progress)
        sub = Path(out_dir)
        if len(bundles) > 1:
            sub = sub / f"{result.model}_{result.device}".replace("/", "_").replace(" ", "_")
        policy_path = result.to_policy().save(sub / "policy.json")
        outputs.append({"result": result, "policy": policy_path, "report": write_plan_report(result, sub)})
    return outputs
