"""Plan report: markdown + PNG figures from a :class:`simtree.planning.planner.PlanResult`
(:func:`write_plan_report`; :func:`write_plan_reports` for every bundle
:func:`simtree.planning.bundles.plan_bundles` planned, as `simtree plan` does).  Rendering
only: the planning is :mod:`simtree.planning`'s.

- ``gain_heatmap.png``: per workload, predicted gain of the best tree (EAGLE or best-first)
  over linear speculation at the SAME budget D, over (batch size x budget);
- ``throughput_vs_batch.png``: best predicted throughput of each policy family vs batch size;
- ``plan.md``: the chosen policy table, with a loud SYNTHETIC banner when the costs are not
  measured, "communication assumed" when the deployment's collectives come from the default
  alpha-beta model rather than measurements, a shipped bundle's caveat (where its profile came
  from) beside them, and the adaptive budget against the best fixed one (with the spread of its
  per-round budgets);
- ``adaptive_vs_fixed.csv``: that comparison as a table (:func:`simtree.planning.compare.adaptive_vs_fixed`);
- ``tree_vs_linear.csv``: per workload, batch size, budget D and EAGLE tree shape, the
  predicted tree and linear throughput at the same D and their ratio (``gain``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from simtree.costs.synthetic import SYNTHETIC_LABEL
from simtree.costs.runtime_path import path_note
from simtree.errors import SimtreeError
from simtree.models import DECODE_STAGE
from simtree.planning.bands import bands_from_policy
from simtree.planning.bundles import PlannedBundles
from simtree.planning.compare import adaptive_vs_fixed
from simtree.planning.modes import TREE_MODES
from simtree.planning.planner import CAVEAT_NOTE, FAMILIES, MODES_NOTE, PlanResult, read_candidates
from simtree.planning.policy_file import Policy

__all__ = ["gain_grid", "tree_vs_linear", "write_plan_report", "render_plan_dir", "plan_folders", "write_plan_reports", "write_bundle_report", "write_plan_index",
           "TREE_VS_LINEAR_COLUMNS"]

TREE_VS_LINEAR_COLUMNS = ("workload", "batch_size", "budget", "shape", "linear_tok_s", "tree_tok_s", "gain")

_BANNER = ("> **SYNTHETIC COST MODEL** - " + SYNTHETIC_LABEL + ". These predictions come from an "
           "analytic roofline, not from measurements on this GPU; run `simtree profile` and "
           "`simtree fit` and pass `--costs` for real numbers.\n")


def gain_grid(candidates: pd.DataFrame, workload: str) -> pd.DataFrame:
    """[batch size x budget]: best tree tok/s at budget D / linear tok/s at D."""
    df = candidates[(candidates["workload"] == workload) & candidates["budget"].notna()]
    df = df.assign(budget=df["budget"].astype(int))
    tree = df[df["mode"].isin(["eagle", "best_first"])].groupby(["batch_size", "budget"])["tok_s"].max()
    lin = df[df["mode"] == "linear"].groupby(["batch_size", "budget"])["tok_s"].max()
    return (tree / lin).unstack("budget")


def tree_vs_linear(candidates: pd.DataFrame) -> pd.DataFrame:
    """Every EAGLE tree candidate against linear speculation at the same budget D, per workload
    and batch size (:data:`TREE_VS_LINEAR_COLUMNS`; shape = the tree's policy name, sS_kK_dD)."""
    df = candidates[candidates["budget"].notna()]
    lin = (df[df["mode"] == "linear"].assign(budget=lambda d: d["budget"].astype(int))
           .groupby(["workload", "batch_size", "budget"])["tok_s"].max().rename("linear_tok_s"))
    tree = df[df["mode"] == "eagle"].assign(budget=lambda d: d["budget"].astype(int))
    if tree.empty or lin.empty:   # a plan searching no EAGLE or no linear shapes (--modes)
        return pd.DataFrame(columns=list(TREE_VS_LINEAR_COLUMNS))
    out = tree.join(lin, on=["workload", "batch_size", "budget"], how="inner")
    out = out.rename(columns={"policy": "shape", "tok_s": "tree_tok_s"}).assign(
        gain=lambda d: d["tree_tok_s"] / d["linear_tok_s"])
    order = {w: i for i, w in enumerate(dict.fromkeys(candidates["workload"]))}
    # stable: within a budget the planner's order (steps, then top-k)
    out = out.sort_values(["workload", "batch_size", "budget"], key=lambda c: c.map(order) if c.name == "workload"
                          else c, kind="stable")
    return out.loc[:, list(TREE_VS_LINEAR_COLUMNS)].reset_index(drop=True)


def _comm_banner(result: PlanResult) -> str | None:
    comm = result.communication
    if comm is None:
        return None
    if comm.get("assumed"):
        return (f"> **communication assumed** - the collectives of {result.deployment} come from the default "
                "alpha-beta model (docs/deployments.md), not from measurements on these GPUs; measure them "
                "(`simtree profile --sweep collectives_gpu`) and fit them (`simtree fit`) for measured numbers.\n")
    return f"> Communication of {result.deployment}: measured ({comm.get('source', '')}).\n"


def _figures(result: PlanResult, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(result.chosen["workload"]))
    tag = " [SYNTHETIC costs]" if result.synthetic else ""
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4.2), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        grid = gain_grid(result.candidates, wl)
        im = ax.imshow(grid.to_numpy(), aspect="auto", origin="lower", cmap="RdBu_r", vmin=0.7, vmax=1.3)
        ax.set_xticks(range(grid.shape[1]), grid.columns.tolist(), fontsize=7)
        ax.set_yticks(range(grid.shape[0]), grid.index.tolist())
        ax.set_xlabel("budget D (nodes incl. root)")
        ax.set_ylabel("batch size")
        ax.set_title(f"{wl}: best tree / linear at same D{tag}", fontsize=9)
        for (i, j), v in np.ndenumerate(grid.to_numpy()):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=5)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    heat = out / "gain_heatmap.png"
    fig.savefig(heat, dpi=130)
    plt.close(fig)

    fig, axes = plt.subplots(2, len(workloads), figsize=(5.2 * len(workloads), 7.0), squeeze=False)
    for col, wl in enumerate(workloads):
        df = result.candidates[result.candidates["workload"] == wl]
        best = df.groupby(["mode", "batch_size"])["tok_s"].max().unstack("batch_size")
        for fam in FAMILIES:
            if fam in best.index:
                axes[0][col].plot(best.columns, best.loc[fam], marker="o", ms=3, label=fam)
                axes[1][col].plot(best.columns, best.loc[fam] / best.loc["none"], marker="o", ms=3, label=fam)
        axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("decode tok/s (batch)")
        axes[0][col].set_title(f"{wl}: best of each family{tag}", fontsize=9)
        axes[1][col].set_ylabel("speedup vs plain decoding")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    thr = out / "throughput_vs_batch.png"
    fig.savefig(thr, dpi=130)
    plt.close(fig)
    return [heat, thr]


def write_plan_report(result: PlanResult, out_dir: str | Path, bands: pd.DataFrame | None = None) -> dict[str, Path]:
    """Write plan.md, gain_heatmap.png, throughput_vs_batch.png, candidates.csv,
    adaptive_vs_fixed.csv and tree_vs_linear.csv into out_dir; ``bands``
    (:func:`simtree.planning.bands.plan_bands`) adds the uncertainty of each choice to plan.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    heat, thr = _figures(result, out)
    cand = out / "candidates.csv"
    result.candidates.to_csv(cand, index=False)
    versus = adaptive_vs_fixed(result.candidates)
    versus_csv = out / "adaptive_vs_fixed.csv"
    versus.to_csv(versus_csv, index=False)
    tvl = out / "tree_vs_linear.csv"
    tree_vs_linear(result.candidates).to_csv(tvl, index=False, float_format="%.6g")
    lines = [f"# simtree plan: {result.model} at {result.deployment} on {result.device}", ""]
    if result.synthetic:
        lines += [_BANNER, ""]
    banner = _comm_banner(result)
    if banner:
        lines += [banner, ""]
    caveat_note = CAVEAT_NOTE + result.caveat if result.caveat else None
    if caveat_note:     # where the bundle's profile came from: beside the banners on the costs, not among the ranges
        lines += [f"> **caveat of this cost bundle** - {result.caveat}\n", ""]
    lines += ["Predicted by simtree's analytic simulator (expected accepted length per round, context "
              "growing as it decodes). Acceptance models:", ""]
    for name, info in result.source.get("workloads", {}).items():
        lines.append(f"- **{name}**: {info.get('source', '')}; linear D=4 gives "
                     f"{info.get('linear_accepted_tokens_d4', float('nan')):.2f} tokens/round; "
                     f"prompt ~{info.get('mean_prompt_len', 0):.0f}, output {info.get('output_len', 0)} tokens")
    error = result.model_error
    lines += ["", "## Chosen policy", ""]
    modes_note = MODES_NOTE.format(", ".join(result.source["modes"])) if result.source.get("modes") else None
    if modes_note:      # what the search left out, beside what it chose
        lines += [f"Only some policy families were searched: {modes_note}.", ""]
    if error is not None:
        lines += [f"A tree marked *within model error* gains less over the best linear / plain policy (`vs "
                  f"linear`) than the verify cost model's held-out median error ({100 * error:.1f}%): the "
                  "prediction cannot tell it from that policy.", ""]
    lines += ["| workload | batch | policy | tree | tokens/round | nodes/seq | tok/s | vs linear | vs none | "
              "best linear | extrapolated |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.chosen.itertuples():
        on = "on" if r.mode in TREE_MODES else "off"
        if getattr(r, "within_model_error", False):
            on += " (within model error)"
        extra = str(getattr(r, "extrapolated", "") or "")
        extra = ", ".join(extra.split("+")) if extra else "-"
        lines.append(f"| {r.workload} | {r.batch_size} | {r.policy} | {on} | {r.tokens_per_round:.2f} | "
                     f"{r.nodes_per_seq:.1f} | {r.tok_s:.0f} | {r.gain_vs_linear:.3f} | {r.gain_vs_none:.2f} | "
                     f"{r.best_linear} | {extra} |")
    lines += _band_lines(result, bands)
    lines += _adaptive_lines(result.candidates, versus, versus_csv.name)
    notes = [n for n in result.notes if n not in (caveat_note, modes_note)]
    if notes:
        lines += ["", "## Extrapolated costs", "",
                  "`extrapolated` names the cost-model axes a chosen policy queries outside the measured "
                  "range (`draft.num_steps`: drafting deeper than the profile measured). Queried by this plan:", ""]
        lines += [f"- {n}" for n in notes]
    lines += ["", f"![gain heat map]({heat.name})", "", f"![throughput vs batch]({thr.name})", "",
              f"All {len(result.candidates)} candidates: `{cand.name}`; every EAGLE tree against linear at the "
              f"same budget: `{tvl.name}`" + (" (communication assumed)." if banner and "assumed" in banner else "."),
              "", _source_line(result.source.get("costs", {})), ""]
    md = out / "plan.md"
    md.write_text("\n".join(lines))
    return {"markdown": md, "heatmap": heat, "throughput": thr, "candidates": cand, "adaptive_vs_fixed": versus_csv,
            "tree_vs_linear": tvl}


def _band_lines(result: PlanResult, bands: pd.DataFrame | None) -> list[str]:
    """plan.md's section on the uncertainty of each choice (rows of ``bands``)."""
    if bands is None or bands.empty:
        return []
    k = int(bands["band_models"].max())
    lines = ["", "## Uncertainty", "",
             f"Each choice predicted again under {k} bootstrap acceptance models (a preset: models within its "
             "calibration targets; traces: their sequences resampled and refitted), at the same cost models: the "
             "10th-90th percentile of its tok/s, and of its advantage over the runner-up (the best policy of another "
             "family), both predicted under each model. **within band**: the runner-up is at least as fast under at "
             "least 10% of the models, so the acceptance data cannot tell the two apart. Each prediction counts "
             "whole rounds (the last one's surplus is not output), which moves it by up to g / N as the model moves "
             "g: a point advantage can lie outside its band.", "",
             "| workload | batch | policy | tok/s | band | runner-up | advantage | advantage band | |",
             "|---|---|---|---|---|---|---|---|---|"]
    chosen = result.chosen.set_index(["workload", "batch_size"])
    cands = result.candidates.set_index(["workload", "batch_size", "policy"])
    for r in bands.itertuples():
        c = chosen.loc[(r.workload, r.batch_size)]
        if r.runner_up is None or pd.isna(r.runner_up):
            runner = advantage = spread = "-"
        else:
            runner = r.runner_up
            advantage = f"{100 * (c['tok_s'] / cands.loc[(r.workload, r.batch_size, r.runner_up), 'tok_s'] - 1):+.1f}%"
            spread = f"{100 * r.advantage_lo:+.1f}% to {100 * r.advantage_hi:+.1f}%"
        lines.append(f"| {r.workload} | {r.batch_size} | {c['policy']} | {c['tok_s']:.0f} | {r.tok_s_lo:.0f}-{r.tok_s_hi:.0f} "
                     f"| {runner} | {advantage} | {spread} | {'**within band**' if r.within_band else ''} |")
    return lines


def _adaptive_lines(candidates: pd.DataFrame, versus: pd.DataFrame, csv_name: str) -> list[str]:
    """plan.md's section on the adaptive budget: per (workload, batch) the best cost_aware
    policy beside the best fixed shape, and the mean and spread (std over its rounds) of the
    nodes a sequence verifies per round."""
    if versus.empty:
        return []
    spread = candidates.set_index(["workload", "batch_size", "policy"])
    lines = ["", "## Adaptive budget vs the best fixed budget", "",
             "cost_aware decides each round's nodes across the batch (each node priced at its marginal verify cost "
             "given the other sequences' trees, at the rate the policy runs at); the best fixed shape is searched "
             "over every budget and depth. `nodes/seq` is the mean and the spread (std over the policy's rounds) of "
             "the nodes one sequence verifies per round: priced as the full runtime runs it, every round verifies "
             f"its static bucket (no spread; the rule's trees within it are padded to it). Table: `{csv_name}`.", "",
             "| workload | batch | best fixed | tok/s | cost-aware | tok/s | vs fixed | nodes/seq (mean ± std) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in versus.itertuples():
        row = spread.loc[(r.workload, r.batch_size, r.adaptive_policy)]
        std = float(row["nodes_std"]) if "nodes_std" in spread.columns else float("nan")
        lines.append(f"| {r.workload} | {r.batch_size} | {r.best_fixed_policy} | {r.best_fixed_tok_s:.0f} | "
                     f"{r.adaptive_policy} | {r.adaptive_tok_s:.0f} | {100 * (r.adaptive_tok_s / r.best_fixed_tok_s - 1):+.2f}% | "
                     f"{float(row['nodes_per_seq']):.1f} ± {std:.2f} |")
    # the rate a policy runs at before its last round (b g / round time): where the adaptive
    # budget trails only by a last round that outputs part of its tokens, it leads on this
    steady = lambda name, r: (r.batch_size * spread.loc[(r.workload, r.batch_size, name), "tokens_per_round"]  # noqa: E731
                              / spread.loc[(r.workload, r.batch_size, name), "round_us"])
    behind = [r for r in versus.itertuples() if r.adaptive_tok_s < r.best_fixed_tok_s]
    if behind:
        worst = max(1 - r.adaptive_tok_s / r.best_fixed_tok_s for r in behind)
        ahead = [r for r in behind if steady(r.adaptive_policy, r) >= steady(r.best_fixed_policy, r)]
        lines += ["", f"The adaptive budget trails in {len(behind)} of {len(versus)} cells, by at most "
                  f"{100 * worst:.2f}%. Counting every token of every round (b g / round time, without the "
                  f"last round's overshoot of N), the adaptive budget leads in {len(ahead)} of those "
                  f"{len(behind)} cells."]
    return lines


def _source_line(costs: dict) -> str:
    """Where the cost models came from, in one readable line (the policy file keeps it all)."""
    if costs.get("synthetic"):
        return "Cost models: **SYNTHETIC** (analytic roofline, not measured)."
    src, meta = costs.get("source", {}), costs.get("profile_meta", {})
    if not isinstance(src, dict):
        return f"Cost models: {src}."
    parts = [f"profile `{src.get('profile', '?')}` ({src.get('sha256', '?')[:19]})",
             f"verify stage `{src.get('verify_stage', '?')}`, draft stage `{src.get('draft_stage', '?')}`"]
    if meta:
        parts.append(f"measured {meta.get('collected', '?')} on {meta.get('gpu_name', meta.get('device', '?'))}, "
                     f"torch {meta.get('torch_version', '?')}, triton {meta.get('triton_version', '?')}")
    experts = (meta.get("expert_dtypes") or {}).get(costs.get("model"))
    if experts:     # the experts' weight format the profile timed (bf16 or block-scaled fp8)
        parts.append(f"experts timed in {experts}")
    extras = ((meta.get("compose") or {}).get("round_extras") or {}).get(costs.get("model"))
    if extras:   # what the composed verify step adds each round (e.g. graph vs eager metadata)
        decode = [x for x in extras if x.split("/")[0] in DECODE_STAGE.values()]
        rest = [x for x in extras if x not in decode]
        if rest:
            parts.append("the composed verify step includes " + ", ".join(f"`{x}`" for x in rest))
        if decode:
            parts.append("plain decoding (n = 1) is " + ", ".join(f"`{x}`" for x in decode)
                         + " in place of the tree verify and commit")
    line = "Cost models: " + "; ".join(parts) + "."
    stale = path_note(costs)     # timed on a path the runtime no longer runs (simtree/costs/runtime_path.py)
    return line + (f" **Runtime path changed since:** {stale}." if stale else "")


def plan_folders(plan_dir: str | Path) -> list[Path]:
    """The plan folders at or under ``plan_dir``: itself when it holds candidates.csv, else
    every sub-folder (any depth) that does, e.g. the one-per-model folders of `simtree plan`."""
    plan_dir = Path(plan_dir)
    if not plan_dir.is_dir():
        raise SimtreeError(f"{plan_dir} is not a folder: point at a folder written by `simtree plan`")
    if (plan_dir / "candidates.csv").is_file():
        return [plan_dir]
    found = sorted(p.parent for p in plan_dir.rglob("candidates.csv") if p.is_file())
    if not found:
        raise SimtreeError(f"{plan_dir} holds no plan (no candidates.csv in it or its sub-folders): "
                           "point at a folder written by `simtree plan`")
    return found


def render_plan_dir(plan_dir: str | Path) -> list[dict[str, Path]]:
    """Re-render plan.md and the PNGs of every plan folder at or under ``plan_dir`` (its
    candidates.csv + policy.json, which must come from one plan: the policy's chosen rows are
    checked against the table), e.g. after changing the plots.  One dict of paths per folder;
    a folder that cannot be rendered does not stop the others: one error naming each after."""
    outputs, failed = [], []
    folders = plan_folders(plan_dir)
    for folder in folders:
        try:
            policy = Policy.load(folder / "policy.json")
            cands = read_candidates(folder / "candidates.csv", policy)
            result = PlanResult(policy.model, policy.device, policy.source, cands)
            outputs.append(write_plan_report(result, folder, bands_from_policy(policy)))
        except SimtreeError as exc:
            if len(folders) == 1:
                raise
            failed.append(f"{folder}: {exc}")
    if failed:
        raise SimtreeError(f"{len(failed)} of {len(folders)} plan folders not rendered (the others were): "
                           + "; ".join(failed))
    return outputs


def write_bundle_report(output: dict) -> dict:
    """The report of one planned bundle (an output of ``plan_bundles``), in its folder."""
    output["report"] = write_plan_report(output["result"], output["folder"], output["bands"])
    return output["report"]


def write_plan_reports(planned: PlannedBundles) -> list[dict]:
    """The report of every bundle ``plan_bundles`` planned, in the folder of its policy file,
    and plans.md where it planned several; returns its outputs, each with ``report`` (paths)."""
    for o in planned.outputs:
        if "report" not in o:   # rendered already as its bundle finished (simtree plan)
            o["report"] = write_plan_report(o["result"], o["folder"], o["bands"])
    if planned.index_dir is not None:
        write_plan_index(planned.index_dir, planned.outputs, planned.notes)
    return planned.outputs


def write_plan_index(out: Path, outputs: list[dict], notes: list[str]) -> Path:
    """plans.md: one line per planned deployment (its folder, what its communication rests on)
    and the plan-wide notes (defaults waiting for a profile)."""
    lines = ["# simtree plans", "", "| model | deployment | device | communication | plan |", "|---|---|---|---|---|"]
    for o in outputs:
        r = o["result"]
        comm = (r.communication or {}).get("label", "none (one GPU)")
        folder = Path(o["report"]["markdown"]).parent.name
        lines.append(f"| {r.model} | {r.deployment} | {r.device} | {comm} | [{folder}]({folder}/plan.md) |")
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    path = out / "plans.md"
    path.write_text("\n".join(lines) + "\n")
    return path
