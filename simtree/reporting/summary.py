"""Headline results of the committed reports, read from their data files (CSV / JSON only).

``simtree report --summary`` prints the headline table that README.md holds between
``<!-- summary:start -->`` and ``<!-- summary:end -->``; ``--write`` refreshes that copy and
rewrites ``reports/README.md``, the index of report folders (what each holds, the command
that regenerates it, its headline number). ``tests/test_readme_summary.py`` fails when
either copy is stale, so a new measurement and its headline travel together.

    from simtree.reporting.summary import summary_table, reports_index, write_summary
    print(summary_table("."))          # the README's table, from ./reports and the shipped profile
    write_summary(".")                 # README.md's block + reports/README.md, atomically

Each folder's headline is one function of the folder's path; it reads only the files the
folder's regenerating command writes, so the numbers here never come from markdown prose.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from simtree.errors import SimtreeError
from simtree.fileio import read_json, write_text_atomic
from simtree.acceptance.out_of_sample import FAMILIES, TARGETS, short_of

__all__ = ["START", "END", "PLAN_TOLERANCE", "MIN_POLICIES", "plan_points", "plan_gap", "plan_standing", "plan_gaps", "Folder", "FOLDERS", "headlines", "summary_table", "reports_index",
           "replace_block", "write_summary", "gdn_headline", "v4_headline", "profile_headline",
           "fit_headline", "plan_headline", "acceptance_headline", "floor_headline", "validation_headline", "loop_headline", "modes_headline", "cpu_host_headline",
           "live_headline", "bench_serve_headline"]

START, END = "<!-- summary:start -->", "<!-- summary:end -->"
MODEL_NAMES = {"qwen3.6-27b": "Qwen3.6-27B", "deepseek-v4-flash": "DeepSeek-V4-Flash"}


@dataclass(frozen=True)
class Folder:
    """One report folder: ``path`` relative to the repository root, what it ``holds``, the
    ``command`` that regenerates it, and ``headline(folder) -> str`` read from its data."""
    path: str
    result: str
    holds: str
    command: str
    headline: Callable[[Path], str]


def _pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f}%"


def _span(values, digits: int = 1, unit: str = "x") -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.{digits}f}{unit}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else \
        f"{lo:.{digits}f}-{hi:.{digits}f}{unit}"


def _csv(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise SimtreeError(f"report data file not found: {path}")
    return pd.read_csv(path)


def _model(name: str) -> str:
    return MODEL_NAMES.get(name, name)


def gdn_headline(folder: Path) -> str:
    """bench_gdn.csv: the tree verify against the per-branch recurrent verify at the largest
    tree, and against the memory floor at 16 sequences and more (median latencies)."""
    bench = _csv(folder / "bench_gdn.csv")
    ok = bench[bench.status == "ok"]
    table = ok.pivot_table(index=["batch_size", "nodes_per_seq"], columns="variant",
                           values="latency_us_median", aggfunc="median")
    n_max = int(table.index.get_level_values("nodes_per_seq").max())
    largest = table.xs(n_max, level="nodes_per_seq")
    speedup = (largest["recurrent_baseline"] / largest["triton_tree"]).dropna()
    big = table[table.index.get_level_values("batch_size") >= 16]
    floor = (big["triton_tree"] / big["memory_floor"]).dropna()
    batches = largest.index.get_level_values("batch_size")
    return (f"{_span(speedup)} faster than the per-branch recurrent verify at n = {n_max} "
            f"(batch {min(batches)}-{max(batches)}); at most {floor.max():.2f}x the memory floor "
            f"at batch >= 16")


def v4_headline(folder: Path) -> str:
    """summary_v4.json: tree over linear verify of the same tokens, and the commit's share of
    the verify, with the shipped Triton attention core."""
    triton = read_json(folder / "summary_v4.json", "V4 benchmark summary")["by_attention"]["triton"]
    return (f"tree verify at most {triton['tree_over_linear_max_n_le_8']:.3f}x a linear verify "
            f"of the same n <= 8 tokens; accepted-path commit a median "
            f"{_pct(triton['commit_frac_median'], 1)} of the verify (max {_pct(triton['commit_frac_max'])})")


def profile_headline(folder: Path) -> str:
    """profile.compose.json: the composed model step against the measured 8-layer stacks."""
    stacks = read_json(folder / "profile.compose.json", "composition summary")["stack_validation"]
    parts = [f"{_model(key.split('/')[0])} median {_pct(v['median_abs_rel_err'], 1)} "
             f"(max {_pct(v['max_abs_rel_err'], 1)})" for key, v in sorted(stacks.items())]
    rows = len(_csv(folder / "profile.csv"))
    return f"{rows} rows; composed verify step vs measured 8-layer stack: " + ", ".join(parts)


def _deployed(model: str, deployment) -> str:
    """"Qwen3.6-27B at tp=1": the model's name and the deployment its bundle or plan is of."""
    return f"{_model(model)} at {deployment or 'tp=1'}"


def fit_headline(folder: Path) -> str:
    """<model>_<tag>.json: the kept verify form's k-fold held-out median / p90 relative error."""
    from simtree.costs.model import VerifyCostModel

    parts = []
    for path in sorted(folder.glob("*.json"), reverse=True):
        bundle = read_json(path, "cost bundle")
        info = bundle["verify"]["info"]
        err = info["fit_error"]["heldout"][info["form"]]
        convex = "" if VerifyCostModel.from_dict(bundle["verify"]).convex_in_n else ", not convex in n"
        cells = (info.get("verify_cells") or {}).get("heldout")   # the shipped C_v: its measured cells corrected
        corrected = (f"; {_pct(cells['median'], 1)} / {_pct(cells['p90'], 1)} with its measured cells corrected"
                     if cells else "")
        parts.append(f"{_deployed(bundle['meta']['model'], bundle['meta'].get('deployment'))} "
                     f"{_pct(err['median'], 1)} / {_pct(err['p90'], 1)} ({info['form']}{convex}{corrected})")
    if not parts:
        raise SimtreeError(f"no cost bundle (*.json) in {folder}")
    return "C_v held-out median / p90 error: " + ", ".join(parts)


def plan_headline(folder: Path) -> str:
    """<model>[_<tag>]_<device>/policy.json: where a tree is chosen and its predicted gain."""
    parts = []
    for path in sorted(folder.glob("*/policy.json"), reverse=True):
        policy = read_json(path, "policy")
        entries = policy["entries"]
        trees = [e for e in entries if e["tree_on"]]
        within = sum(bool(e.get("within_model_error")) for e in trees)
        gains = f", {_span([e['gain_vs_linear'] for e in trees], 2)}" if trees else ""
        comm = (policy.get("source", {}).get("costs") or {}).get("communication")
        notes = [f"{within} within the fit's error"] if within else []
        if isinstance(comm, dict) and comm.get("assumed"):
            notes.append("communication assumed")
        parts.append(f"{_deployed(policy['model'], policy.get('deployment'))} {len(trees)} of {len(entries)}{gains}"
                     + (f" ({'; '.join(notes)})" if notes else ""))
    if not parts:
        raise SimtreeError(f"no plan (*/policy.json) in {folder}")
    return ("a tree chosen at (workload, batch) entries, predicted gain over the best linear "
            "draft: " + "; ".join(parts))


def loop_headline(folder: Path) -> str:
    """loop_results.csv: predicted (planned) vs measured throughput of every run, and whether
    the planner's choice was the best measured policy at each batch size."""
    runs = _csv(folder / "loop_results.csv")
    err = runs["err_tok_s"].abs()
    best = runs.loc[runs.groupby("batch_size")["measured_tok_s"].idxmax()]
    chosen_best = int((best["role"] == "chosen").sum())
    return (f"predicted vs measured throughput, in sample (the bundle fitted on the same session's CPU profile): "
            f"median error {_pct(err.median())} "
            f"(max {_pct(err.max())}) over {len(runs)} runs; the planner's choice measured "
            f"best at {chosen_best} of {len(best)} batch sizes")


def modes_headline(folder: Path) -> str:
    """modes.csv and lossless.csv (``python -m simtree.runtime.full.modes_gpu report``): the plan's
    choice against every mode measured beside it, and every mode's live lossless check."""
    runs, checks = _csv(folder / "modes.csv"), _csv(folder / "lossless.csv")
    plans, other = plans_counted(runs)
    ok = int((1 - plans["plan_over_best"] <= PLAN_TOLERANCE).sum())
    modes = sorted(set(runs["mode"]) - {"none", "linear"})
    match = checks["match"].astype(str) == "True"
    tie = ~match & (checks["near_tie"].astype(str) == "True")
    ties = "; ".join(f"top-2 gap {m:.4f} within twice the verify-vs-decode deviation {d:.4f}"
                     for m, d in zip(checks.loc[tie, "margin"], checks.loc[tie, "deviation"]))
    dtypes = "/".join(sorted(checks["dtype"].astype(str).unique()))
    batches = "; ".join(f"{_model(m)} at batch {', '.join(str(b) for b in sorted(g['batch_size'].unique()))}"
                        for m, g in runs.groupby("model"))      # each model's own: the models ran different ones
    return (f"{len(modes)} modes ({', '.join(modes)}) beside plain and linear D=4, decoded at full scale under "
            f"replayed acceptance on {', '.join(sorted(runs['gpu'].astype(str).unique()))} "
            f"({batches}): the plan's choice best or within "
            f"2% at {ok} of {len(plans)} (model, batch) points whose plan priced what ran (worst "
            f"{plans['plan_over_best'].min():.3f} of the best measured"
            + (f"; {other} more planned another batch, not counted" if other else "") + "); "
            f"{dtypes} lossless: {int(match.sum())} of {len(checks)} mode checks match plain greedy, "
            f"{int(tie.sum())} near-tie{'s' if int(tie.sum()) != 1 else ''}{f' ({ties})' if ties else ''}, "
            f"{int((~match & ~tie).sum())} differ beyond one")


def cpu_host_headline(folder: Path) -> str:
    """tree_renumber.csv and stack_interleave.csv: where renumbering trees pays on the host,
    and how much slower a stack runs than the sum of its pieces timed alone."""
    renumber = _csv(folder / "tree_renumber.csv")
    pays = renumber[renumber["pays"].astype(str) == "True"]
    where = ", ".join(f"b{b} n{n}" for b, n in zip(pays.batch_size, pays.nodes_per_seq)) or "none"
    stacks = _csv(folder / "stack_interleave.csv")
    stack_ratio = stacks[stacks.piece == "stack"]["ratio"]
    return (f"depth-first renumbering costs the host less than it saves the kernel at "
            f"{len(pays)} of {len(renumber)} shapes ({where}); a tiny model's stack takes "
            f"{_span(stack_ratio, 2)} the sum of its pieces timed alone")


def acceptance_headline(folder: Path) -> str:
    """preset_calibration.csv (the presets against the published V4-Flash table, in sample) and
    published_holdout.json (the table split: fitted on its linear column, its trees predicted)."""
    cal = _csv(folder / "preset_calibration.csv")
    lin = cal[cal["shape"].str.endswith("accepted tokens") & cal["shape"].str.contains("_k1_")]
    gain = cal[cal["shape"].str.contains("gain over linear")]
    text = (f"presets, in sample (fitted to the whole published V4-Flash table): linear within "
            f"{(lin.preset - lin.published).abs().max():.3f} tokens, tree gains within "
            f"{(gain.preset - gain.published).abs().max():.1f} points")
    holdout = folder / "published_holdout.json"
    if holdout.exists():
        h = read_json(holdout, "acceptance hold-out")["summary"]
        lin_only, split = h["linear_only"], h["split"]
        text += (f"; out of sample, fitted on the table's linear column only, its tree gains are predicted within "
                 f"a median {lin_only['median_points']:.1f} points (worst {lin_only['worst_points']:.1f}: the linear "
                 f"column cannot tell how often rank 2 is right); fitted on the gains at D = 5, 6 too, those at "
                 f"D = 7, 8 within {split['median_points']:.1f} (worst {split['worst_points']:.1f})")
    return text


# the plan's choice counts as right within this share of the best measured policy's throughput
PLAN_TOLERANCE = 0.02


def plan_gap(plan_tok_s: float, best_tok_s: float) -> float:
    """How far the plan's measured throughput falls below the best measured policy's (a share;
    <= 0: the plan's choice is the best)."""
    return 1.0 - plan_tok_s / best_tok_s


MIN_POLICIES = 6   # an out-of-sample point counts for the plan's choice with this many policies measured


def plan_points(rows) -> list[dict]:
    """Per (model, batch_size, context_len) of out-of-sample runs (dicts with predicted_tok_s,
    measured_tok_s, policy): the frozen bundle's fastest predicted policy among those measured,
    where it stands against the measured best (``ok``: within PLAN_TOLERANCE), and whether the
    point counts (``counted``: at least MIN_POLICIES policies measured there, and no run asked for
    there left unmeasured - ``point_complete`` False in a row: the bundle's choice may be the run
    that failed)."""
    points: dict = {}
    for r in rows:
        points.setdefault((r["model"], int(r["batch_size"]), int(r["context_len"])), []).append(r)
    out = []
    for (model, b, ctx), rs in sorted(points.items()):
        chosen = max(rs, key=lambda r: float(r["predicted_tok_s"]))
        best = max(rs, key=lambda r: float(r["measured_tok_s"]))
        gap = plan_gap(float(chosen["measured_tok_s"]), float(best["measured_tok_s"]))
        out.append({"model": model, "batch_size": b, "context_len": ctx, "policies": len(rs),
                    "chosen": chosen["policy"], "best": best["policy"], "gap": gap, "ok": gap <= PLAN_TOLERANCE,
                    "counted": len(rs) >= MIN_POLICIES and all(str(r.get("point_complete", True)) != "False"
                                                               for r in rs)})
    return out


def plans_counted(runs: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """(the plan's choices of a modes table whose plan priced what ran, how many others were left out):
    a row with ``plan_of_run`` False (its plan priced a deployment's batch while the run measured one
    rank) is not counted; a table without the column counts every choice."""
    plans = runs[runs["plan_choice"].astype(str) == "True"]
    if "plan_of_run" not in plans:
        return plans, 0
    kept = plans["plan_of_run"].astype(str) == "True"
    return plans[kept], int((~kept).sum())


def plan_standing(runs) -> list[tuple]:
    """[(model, batch_size, plan run, best run, plan_gap)] for each (model, batch size) with a
    plan run ("plan:" policy) among ``runs`` (dicts with model, batch_size, policy and
    measured_tok_s; runs that did not measure are left out), sorted."""
    groups: dict = {}
    for r in runs:
        if math.isfinite(float(r["measured_tok_s"])):
            groups.setdefault((r["model"], int(r["batch_size"])), []).append(r)
    out = []
    for key in sorted(groups):
        ran = groups[key]
        plan = next((r for r in ran if str(r["policy"]).startswith("plan:")), None)
        if plan is not None:
            best = max(ran, key=lambda r: float(r["measured_tok_s"]))
            out.append((*key, plan, best, plan_gap(float(plan["measured_tok_s"]), float(best["measured_tok_s"]))))
    return out


def plan_gaps(runs: pd.DataFrame) -> dict:
    """{(model, batch_size): plan_gap} (:func:`plan_standing`) of a runs table."""
    return {(m, b): gap for m, b, _, _, gap in plan_standing(runs.to_dict("records"))}


def acceptance_oos_line(acc: pd.DataFrame) -> str:
    """acceptance_out_of_sample.csv in one clause: each out-of-sample family's
    (:data:`simtree.acceptance.out_of_sample.FAMILIES`) median and worst |rel_err| (prompts no
    calibration read), none pooled with another, with whether its prompts are fresh or seen and
    which target (:data:`simtree.acceptance.out_of_sample.TARGETS`) it falls short of."""
    parts = []
    drafter = acc["drafter"].astype(str) if "drafter" in acc else pd.Series("mtp", index=acc.index)
    for (split, workload, *who), words in FAMILIES.items():     # who: a block drafter's family
        rows = acc[(acc["split"] == split) & (acc["workload"] == workload) & (drafter == (who or ["mtp"])[0])]
        err = rows["rel_err"].abs()
        if len(err):
            seen = sorted(set(rows["prompts"].astype(str))) if "prompts" in rows else []
            label = f" ({seen[0]} prompts)" if len(seen) == 1 else ""
            short = [f"{_pct(TARGETS[key])} {'median' if key == 'median_abs_rel_err' else 'worst'} target"
                     for key in short_of(err.median(), err.max())]
            parts.append(f"{words}{label} median {_pct(err.median(), 1)}, worst {_pct(err.max(), 1)} ({len(err)} rows)"
                         + (f", short of the {' and '.join(short)}" if short else ""))
    pooled = ""
    if "prompts" in acc:     # every out-of-sample row on prompts no version of the model was developed on
        err = acc[(acc["split"] != "in_sample") & (acc["prompts"].astype(str) == "fresh")]["rel_err"].abs()
        if len(err):
            short = short_of(err.median(), err.max())
            pooled = (f"pooled over its {len(err)} out-of-sample rows on fresh prompts median {_pct(err.median(), 1)}, "
                      f"worst {_pct(err.max(), 1)} (targets {_pct(TARGETS['median_abs_rel_err'])} / "
                      f"{_pct(TARGETS['max_abs_rel_err'])}: {'short' if short else 'met'}); by family: ")
    return ("accepted tokens per round of a trained Qwen3.5-architecture target, its drafter calibrated on a "
            "workload's linear runs and each run predicted from the drafter's confidences on its own held-out prompts, "
            + pooled + "; ".join(parts))


def validation_headline(folder: Path) -> str:
    """throughput_out_of_sample.csv (``python -m simtree.runtime.full.oos report``): frozen bundles
    against a later GPU run at points off their profile, and where the frozen bundle's choice
    stands; acceptance_out_of_sample.csv where present (drafter, policy, workload, split)."""
    runs = _csv(folder / "throughput_out_of_sample.csv")
    err = runs["rel_err"].abs()
    models = ", ".join(_model(m) for m in sorted(runs["model"].unique()))
    gpus = ", ".join(sorted(str(g).replace("NVIDIA ", "").split(" ")[0] for g in runs["gpu"].unique()))
    checks = [c for c in plan_points(runs.to_dict("records")) if c["counted"]]
    within, points = sum(c["ok"] for c in checks), len(checks)
    worst = runs.loc[err.idxmax()]
    line = (f"throughput predicted by bundles frozen before a later {gpus} run ({models}; batch "
            f"{int(runs['batch_size'].min())}-{int(runs['batch_size'].max())}, context "
            f"{int(runs['context_len'].min())}-{int(runs['context_len'].max())}; acceptance replayed), out of sample: "
            f"median {_pct(err.median(), 1)}, worst {_pct(err.max(), 1)} ({_model(worst['model'])} batch "
            f"{int(worst['batch_size'])} at context {int(worst['context_len'])}"
            f"{', off the profile grid' if str(worst.get('on_profile_grid')) == 'False' else ''}) over "
            f"{len(runs)} runs; the frozen bundle's choice best or within 2% at {within} of {points} points with at "
            f"least {MIN_POLICIES} policies measured and every run asked for there measured")
    acc_path = folder / "acceptance_out_of_sample.csv"
    if acc_path.exists():
        line += "; " + acceptance_oos_line(_csv(acc_path))
    return line


def h100_headline(folder: Path) -> str:
    """drafters_fit.csv (the drafter families' C_d fits of drafters_profile.csv, one per context
    timed; the profile's rows say how they were timed: variant ``round``, the runtime's own round)
    and fp8_times.csv (FP8 against bf16 experts of the V4-Flash ep=8 rank under CUDA graphs)."""
    from simtree.costs.drafter_fit import sweep_label
    from simtree.drafters import ROUND_VARIANT

    fit = _csv(folder / "drafters_fit.csv")
    worst = {m: g.groupby("drafter", sort=False)["heldout_median"].max()     # over the contexts fitted
             for m, g in fit.groupby("model", sort=True)}
    prof = _csv(folder / "drafters_profile.csv")
    if (prof["variant"] == ROUND_VARIANT).any():    # the fit takes the round rows where a table has them
        prof = prof[prof["variant"] == ROUND_VARIANT]
    timed = sweep_label(prof)
    parts = [f"{_model(m)} {', '.join(f'{d} {_pct(e, 1)}' for d, e in w.items())}" for m, w in worst.items()]
    t = _csv(folder / "fp8_times.csv")
    t = t[t["op"] == "routed_experts"].pivot_table(index="tokens", columns="path", values="median_us")
    ratio = t["bf16"] / t["fp8"]
    faster = ratio[ratio > 1]
    text = (f"drafter C_d (block, TfM, DSpark; {timed}) fitted per context with held-out median error "
            f"{_pct(fit['heldout_median'].max(), 1)} at worst over the contexts ({'; '.join(parts)}); "
            f"V4-Flash rank's routed experts in FP8 {_span(faster.values, 2)} faster "
            f"than bf16 at {int(faster.index.min())}-{int(faster.index.max())} tokens, "
            f"{_span((1 / ratio[ratio <= 1]).values, 2)} slower beyond")
    if (folder / "floor.csv").exists():
        text += "; " + floor_headline(_csv(folder / "floor.csv"))
    return text


def floor_headline(t: pd.DataFrame) -> str:
    """floor.csv (profiler/bench/floor_table.py): GDN verify + commit and the V4 layer's verify
    against their memory floors, beside issue-stated targets (1.4x at batch >= 16, 6 us at batch
    1 n <= 16; V4 4x at batch, n <= 16, tree / linear 1.05)."""
    parts = []
    variant = t["variant"].fillna("default") if "variant" in t.columns else pd.Series("default", index=t.index)
    gdn = t[t["layer_kind"] == "gdn"].assign(variant=variant)

    def gdn_worst(k: pd.DataFrame) -> str:
        big = k[(k["batch"] >= 16) & (k["nodes"] <= 128)]["ratio"].max()
        one = k[(k["batch"] == 1) & (k["nodes"] <= 16)]["measured_us"].max()
        return (f"at most {big:.2f}x the two-pass floor at batch >= 16 (target 1.4x), "
                f"{one:.1f} us at batch 1, n <= 16 (target 6)")

    for kernel, label in (("gdn_verify+commit", "GDN verify + commit"), ("gdn_verify_fold+defer", "deferred"),
                          ("gdn_verify_fold+arm", "one launch a round")):
        k = gdn[(gdn["kernel"] == kernel) & (gdn["variant"].isin(["default", "round"]))]
        if len(k):
            parts.append(f"{label} {gdn_worst(k)}")
    pairs = gdn[gdn["kernel"].isin(["gdn_verify+commit", "gdn_verify_fold+defer", "gdn_verify_fold+arm"])]
    if pairs["variant"].nunique() > 2:   # launch variants timed: the fastest pair at each shape
        best = pairs.loc[pairs.groupby(["batch", "nodes"])["measured_us"].idxmin()]
        parts.append(f"the fastest of {pairs['variant'].nunique()} launch variants at each shape {gdn_worst(best)}")
    if (t["kernel"] == "block_fused_bf16").any():   # runs with the attention's linears in FP8 beside earlier bf16 ones
        fp8_runs = sorted({int(r) for r in t.loc[t["kernel"] == "block_fused_bf16", "run"].dropna()}) \
            if "run" in t.columns else []
        parts.append("V4 points of run " + ", ".join(map(str, fp8_runs)) + " (column run) with the attention's linears "
                     "in FP8 against the floor at those bytes, the earlier runs' points in bf16")
    for kernel, label in (("block_current", "V4 layer verify (the path before the fusions)"),
                          ("block_fused_all", "with the fusions (variant fused_all: v4_topk, v4_hc, v4_comp)"),
                          ("block_fused_live", "and with the compressors' padding rows skipped (variant fused_live)"),
                          ("block_fused_pool", "and with HCA's windows pooled split too (variant fused_pool: the "
                                               "runtime's forms)"),
                          ("block_fused_bf16", "fused_pool with the attention's linears in bf16 against the bf16 "
                                               "floor (variant fused_bf16)")):
        v4 = t[(t["kernel"] == kernel) & (t["batch"] <= 16) & (t["nodes"] <= 16)]
        if len(v4):
            worst = v4.groupby("layer_kind")["ratio"].max()
            parts.append(f"{label} at most " + ", ".join(f"{kind.upper()} {r:.1f}x" for kind, r in worst.items())
                         + f" its memory floor (target 4x), tree / linear at most {v4['tree_over_linear'].max():.3f}")
    return "; ".join(parts)


def live_headline(folder: Path) -> str:
    """summary.csv, composed_vs_measured.csv and lossless.csv of the full-scale runtime's H200
    sessions: predicted vs measured throughput, the plan's choice against the best measured
    policy per batch size, the host's share of a round, the composed step and the lossless check."""
    runs = _csv(folder / "summary.csv")
    err = runs["rel_err"].abs()
    # the plan against every policy measured at its batch size: the reported runs and the other
    # EAGLE shapes (alternatives.csv), as summary.md's plan check
    others = folder / "alternatives.csv"
    every = pd.concat([runs, _csv(others)]) if others.exists() else runs
    gaps = plan_gaps(every)
    ok, total = sum(g <= PLAN_TOLERANCE for g in gaps.values()), len(gaps)
    cvm = _csv(folder / "composed_vs_measured.csv")["rel_err"].abs()
    models = ", ".join(_model(m) for m in sorted(runs["model"].unique()))
    return (f"{models}: predicted vs measured throughput, in sample (each bundle fitted on the same session's "
            f"profile, acceptance replayed from the predicting preset), median {_pct(err.median(), 1)} (worst "
            f"{_pct(err.max(), 1)}) over {len(runs)} runs; the plan's choice best or within 2% at {ok} of "
            f"{total} (model, batch) points; host {_pct(runs['host_share'].max(), 1)} of a round at most; "
            f"composed vs measured step median {_pct(cvm.median(), 1)}; "
            f"{_lossless_by_dtype(_csv(folder / 'lossless.csv'))}")


def bench_serve_headline(folder: Path) -> str:
    """bench.csv of the serving benchmark: the controller against the best other policy (the
    least margin over every model, arrival process and load) and its TPOT p99 against the best
    static policy's."""
    df = _csv(folder / "bench.csv")
    margins, tpot = [], []
    for _, g in df.groupby(["model", "arrivals", "load"]):
        by = g.set_index("policy")
        margins.append(by.loc["controller", "tok_s"] / by.drop(index="controller")["tok_s"].max() - 1)
        tpot.append(by.loc["controller", "tpot_p99_ms"] / by.loc["best_static", "tpot_p99_ms"] - 1)
    models = ", ".join(_model(m) for m in sorted(df["model"].unique()))
    return (f"{models}, in sample (the controller's settings chosen on these traces): the controller's throughput "
            f"vs the best other policy {100 * min(margins):+.2f}% at "
            f"worst, {100 * max(margins):+.2f}% at best over {len(margins)} (arrivals, load) points; TPOT p99 vs "
            f"the best static {100 * max(tpot):+.1f}% at worst; at most "
            f"{df[df.policy == 'controller']['switches_per_min'].max():.0f} switches/min"
            + _live_full_clause(sorted(folder.glob("serve_live_full*.csv"))))


def _live_full_clause(paths: list[Path]) -> str:
    """'; live at full scale ...': the controller's full-scale live runs (serve_live_full*.csv, one
    per model, out of sample: a frozen shipped bundle), each one's worst phase TPOT error; empty
    without them."""
    from simtree.data import data_path
    from simtree.serving.live_report import experts, read_full_run, tpot_errors
    parts, models = [], []
    for path in paths:
        df, shipped = read_full_run(path)    # the report's checks (columns, rows, the frozen committed bundle, its device)
        models.append(str(df.iloc[-1]["model"]))
        if models.count(models[-1]) > 1:
            raise SimtreeError(f"{path}: a second full-scale live run of {models[-1]} beside bench.csv: one per model")
        err, _ = tpot_errors(df)
        last = df.iloc[-1]
        kept = shipped.parent != data_path("costs")
        bundle = "the shipped bundle of the time, kept beside it" if kept else "frozen shipped bundle"
        parts.append(f"{_model(last['model'])} {last['dtype']}{experts(str(last['model']))} on {last['device']}, batch changing "
                     f"{', '.join(str(b) for b in df.batch_size)}; {bundle}, out of sample: measured TPOT vs "
                     f"predicted {100 * err.abs().max():.1f}% at worst over {len(err)} phases")
    return f"; live at full scale ({'; '.join(parts)})" if parts else ""


def _lossless_by_dtype(lossless: pd.DataFrame) -> str:
    """'lossless in bf16 3 of 6 policy checks match plain greedy (...)' per dtype; checks on a
    model cut to fewer layers say so (sessions before the dtype column: bf16, whole models)."""
    if "dtype" not in lossless:
        lossless = lossless.assign(dtype="bf16")
    parts = []
    for dtype, group in lossless.groupby("dtype", sort=True):
        match = group["match"].astype(str) == "True"
        text = f"lossless in {dtype} {int(match.sum())} of {len(group)} policy checks match plain greedy"
        if "layers" in group:
            cut = sorted({f"{_model(m)} {ls} layers" for m, ls in zip(group["model"], group["layers"].astype(str))
                          if ls.split("/")[0] != ls.split("/")[-1]})
            text += f" ({', '.join(cut)})" if cut else ""
        if (~match).any():
            text += f" (largest plain top-2 gap where one differs {group.loc[~match, 'margin'].max():.4f})"
        parts.append(text)
    return "; ".join(parts)


FOLDERS: tuple[Folder, ...] = (
    Folder("reports/h200/gdn", "GDN tree verify (one layer, Qwen3.6-27B shapes, H200)",
           "GDN tree verify vs the per-branch recurrent verify, flash-linear-attention and the "
           "memory floor; GPU correctness vs float64 references",
           "`python -m simtree.profiler.bench.bench_gdn --out reports/h200/gdn` (H200), then "
           "`python -m simtree.profiler.bench.report_gdn reports/h200/gdn`", gdn_headline),
    Folder("reports/h200/v4", "DeepSeek-V4 tree verify (CSA / HCA / SWA, H200)",
           "V4 compressed-attention tree verify vs linear verify, commit cost, host planning",
           "`python -m simtree.profiler.bench.bench_v4 --out reports/h200/v4` (H200), then "
           "`python -m simtree.profiler.bench.report_v4 reports/h200/v4`", v4_headline),
    Folder("simtree/data/profiles/h200", "Shipped H200 profile (package data)",
           "the rank profiles the shipped cost bundles are fitted from (profile_<model>_<tag>.csv, one per "
           "default deployment, from the full-runtime sessions: reports/h200/live) and the kernel-level "
           "profile of every stage (profile.csv), with its composition check",
           "`simtree profile --sweep default_gpu.yaml --out simtree/data/profiles/h200/profile.csv` (H200)",
           profile_headline),
    Folder("reports/h200/fit", "Cost-model fit (shipped bundles)",
           "C_v / C_d fits of the shipped profile: bundles, plots, every form's held-out error",
           "`bash scripts/ship_defaults.sh`", fit_headline),
    Folder("reports/h200/plan", "Plans on the embedded default",
           "policy, plan report, every candidate's prediction and tree vs linear per deployment (three "
           "workloads, batch 1-64)",
           "`simtree plan --out reports/h200/plan`", plan_headline),
    Folder("reports/acceptance", "Acceptance models",
           "presets calibrated to the published V4-Flash MTP table, and the table split (linear column "
           "fitted, trees predicted)",
           "`python -m simtree.acceptance.calibrate --out reports/acceptance` and "
           "`python -m simtree.acceptance.holdout --traces T --out reports/acceptance`", acceptance_headline),
    Folder("reports/h200/live", "Full-scale runtime on the H200",
           "Qwen3.6-27B whole and one DeepSeek-V4-Flash ep=8 rank decoding under CUDA graphs: "
           "predicted vs measured per policy and batch, composed vs measured step, lossless check",
           "`bash scripts/full_report.sh reports/h200/live/sessions` (the sessions' archives from "
           "`bash scripts/full_gpu.sh MODEL` and `bash scripts/lossless_fp32_gpu.sh` on the H200: "
           "docs/full_runtime.md; the rank profiles it also writes are the ones shipped in "
           "simtree/data/profiles/h200, and the in-sample bundles it fits them to, costs_<model>.json, are not kept "
           "here)",
           live_headline),
    Folder("reports/validation", "Predictions out of sample",
           "cost bundles frozen (committed) before the GPU run that tests them, measured at batch sizes, "
           "contexts and budgets off their profile: the first runs every EAGLE / linear / plain policy per point, the "
           "latest (folders *_modes) every mode the runtime builds (plain, linear, EAGLE, best-first, cost-aware, "
           "batch allocation, block, TfM, DSpark) from bundles frozen with the block drafters' C_d (`oos freeze`)",
           "`bash scripts/oos_gpu.sh MODEL reports/validation/frozen_<bundle>.json` on the GPU; from its runs "
           "(`mkdir -p R; tar xzf reports/validation/oos_runs.tgz -C R`): `python -m simtree.runtime.full.oos report "
           "R/qwen3.6-27b R/deepseek-v4-flash R/deepseek-v4-flash_later R/qwen3.6-27b_b1b64 R/deepseek-v4-flash_b1b64 "
           "R/deepseek-v4-flash_modes R/qwen3.6-27b_modes --bundle reports/validation/frozen_h100_qwen3.6-27b_tp1.json "
           "--bundle reports/validation/frozen_h100_deepseek-v4-flash_ep8_v2.json --bundle "
           "reports/validation/frozen_h100_deepseek-v4-flash_ep8_modes.json --bundle "
           "reports/validation/frozen_h100_qwen3.6-27b_tp1_modes.json --out reports/validation` (each bundle's "
           "fitted profile, by its sha256: beside it or shipped)", validation_headline),
    Folder("reports/h100/live", "Full-scale runtime on the H100 (real-architecture layers, V4 at FP8)",
           "Qwen3.6-27B whole and one DeepSeek-V4-Flash ep=8 rank (FP8 experts) decoding under CUDA graphs: "
           "predicted vs measured per policy and batch, composed vs measured step, lossless check",
           "`tar xzf reports/h100/live/sessions.tgz -C S && bash scripts/full_report.sh S reports/h100/live` (the "
           "archives of `bash scripts/full_gpu.sh MODEL` on an H100; it also writes the profiles shipped in "
           "simtree/data/profiles/h100 and the bundles frozen in reports/validation)", live_headline),
    Folder("reports/h100/fit", "Cost-model fit (shipped H100 bundles, real-architecture layers)",
           "C_v / C_d fits of the shipped H100 rank profiles (simtree/data/profiles/h100: V4-Flash ep=8 with FP8 "
           "experts, Qwen3.6-27B tp=1): the bundles and every form's held-out error",
           "`MACHINE=h100 bash scripts/ship_defaults.sh`", fit_headline),
    Folder("reports/h100/plan", "Plans on the H100 defaults",
           "policy, plan report, every candidate's prediction and tree vs linear per deployment (three "
           "workloads, batch 1-64)",
           "`simtree plan --machine h100 --out reports/h100/plan`", plan_headline),
    Folder("reports/h100", "Drafters, FP8 experts and verify floors (H100)",
           "the block, TfM and DSpark drafters' rounds (the runtime's own draft code) profiled under CUDA graphs "
           "for both targets at two contexts, their C_d fits per context; FP8 against bf16 expert GEMMs of the "
           "V4-Flash ep=8 rank; GDN and V4 verify against their "
           "memory floor (floor.csv: `bash scripts/gdn_floor_gpu.sh`, `bash scripts/v4_floor_gpu.sh`, then "
           "`python -m simtree.profiler.bench.floor_table --gdn D1 --v4 D2 --out reports/h100/floor.csv`; the committed table holds two GDN runs and three V4 runs added in turn: `python -m simtree.profiler.bench.floor_table --gdn D1 --gdn-from reports/h100/floor.csv --v4-from reports/h100/floor.csv --out reports/h100/floor.csv` (a GDN run of some variants), `python -m simtree.profiler.bench.floor_table --v4 D2 --v4 D3 --v4 D4 --v4 D5 --gdn-from reports/h100/floor.csv --out reports/h100/floor.csv` (the V4 runs, column run: 4K, HCA at 4223, four 4K points with the swapped attention launch, eight 4K points with the attention's linears in FP8; a later run's rows replace an earlier one's at the same point))",
           "`OUT=DIR bash scripts/drafters_gpu.sh` (one H100 call, both models into one table), its "
           "drafters_profile.csv copied here, then `python -m simtree.costs.drafter_fit "
           "reports/h100/drafters_profile.csv --out reports/h100/drafters_fit.csv`; `bash scripts/fp8_gpu.sh` "
           "(its fp8_times.csv); verify_tokens.csv (the V4-Flash rank's verify replayed on the drafted, uniform, "
           "per-sequence and one-token sets): `OUT=DIR python scripts/v4_verify_tokens_gpu.py --batch-sizes 4,64 "
           "--shapes linear,dspark --rounds 2` on the GPU - the committed file is the output of the script as it "
           "was before it stamped model, context, rounds, GPU and torch into every row and wrote LF (its CRLF "
           "line ends converted; run on an NVIDIA H100 80GB HBM3 with torch 2.11 on 2026-12-07, as the call "
           "reported)",
           h100_headline),
    Folder("reports/h100/modes", "Every runnable mode at full scale beside the plan's choice (H100)",
           "per model and batch, every mode the full runtime builds (plain, linear, EAGLE, best-first, "
           "cost-aware, batch allocation, block, TfM, DSpark) measured under CUDA graphs with replayed "
           "acceptance beside the plan's choice, and each mode's bf16 greedy output against plain greedy",
           "`python -m simtree.runtime.full.modes_gpu report reports/h100/modes/runs.tgz --gpu \"NVIDIA H100 80GB "
           "HBM3\" --out reports/h100/modes` (the runs in runs.tgz: `OUT=DIR bash scripts/modes_gpu.sh M` on the GPU, "
           "one model a call: Qwen3.6-27B with BATCH_SIZES=1,4 and 16,64 in one session, the two folders combined into "
           "one; DeepSeek-V4-Flash at the default 1,4,16,64 (folder deepseek-v4-flash) and, in an earlier session, with "
           "BATCH_SIZES=8,32 (folder deepseek-v4-flash-b8-b32)); "
           "verify_pad.csv: `python scripts/verify_pad_gpu.py --out DIR` on the GPU; verify_shape.csv: `python "
           "scripts/verify_shape_gpu.py --model qwen3.6-27b --out FILE` on the GPU (the batch-64 rows with --batch-sizes "
           "64 --nodes 4,5,6,7,8 --shapes chain,eagle_top2,cost_aware_p3), verify_shape.md: `python "
           "scripts/verify_shape_gpu.py --summary reports/h100/modes/verify_shape.csv --gpu \"NVIDIA H100 80GB HBM3\" "
           "--buckets simtree/data/profiles/h100/buckets_qwen3.6-27b_tp1.csv --out reports/h100/modes/verify_shape.md`",
           modes_headline),
    Folder("reports/h200/modes", "Every runnable mode at full scale beside the plan's choice (H200)",
           "the same modes runs on an H200, both models at batch 1, 4, 16, 64, priced and planned by the shipped "
           "H200 bundles of the run's time (V4-Flash's then on its look-alike profile, since refitted) and the "
           "H100 drafter C_d",
           "`python -m simtree.runtime.full.modes_gpu report reports/h200/modes/runs.tgz --gpu \"NVIDIA H200\" "
           "--out reports/h200/modes` (the runs: `BATCH_SIZES=1,4,16,64 OUT=DIR bash scripts/modes_gpu.sh M` on an "
           "H200, each model's folder and tests log packed into runs.tgz)",
           modes_headline),
    Folder("reports/bench_serve", "Serving benchmark (simulated, shipped H200 costs)",
           "Poisson and bursty ShareGPT traces through continuous batching: none, best static, vLLM-style "
           "threshold, SGLang's own adaptive and DSpark planners, simtree's controller",
           "`simtree bench-serve --out reports/bench_serve --out-of-sample 100,200,300`", bench_serve_headline),
    Folder("reports/cpu_loop", "Closed loop on a 2-core CPU",
           "the same loop on this repository's CPU machine, every run measured twice (repeat.md)",
           "`PHASES=\"measure plan runs report repeat\" bash scripts/loop_cpu.sh reports/cpu_loop` (without a "
           "folder it writes out/cpu_loop)", loop_headline),
    Folder("reports/cpu_host", "Host costs on the CPU",
           "host time of depth-first tree renumbering; pieces timed alone vs inside a stack",
           "the two commands in its README (`tune_gdn --renumber-cost`, "
           "`scripts/cpu_stack_interleave.py`)", cpu_host_headline),
)


def headlines(root: str | Path = ".") -> list[tuple[Folder, str]]:
    """(folder, headline) for every entry of FOLDERS, read under the repository ``root``."""
    root = Path(root)
    if not (root / "reports").is_dir():
        raise SimtreeError(f"no reports/ folder under {root.resolve()}: run this in a simtree checkout")
    out = []
    for folder in FOLDERS:
        try:
            out.append((folder, folder.headline(root / folder.path)))
        except (KeyError, ValueError, TypeError) as exc:
            if isinstance(exc, SimtreeError):
                raise
            raise SimtreeError(f"{folder.path}: its data files lack what the headline reads "
                               f"({type(exc).__name__}: {exc})") from None
    return out


def summary_table(root: str | Path = ".") -> str:
    """The README's headline table: one row per folder, linked from the repository root."""
    lines = ["| result | current | data |", "|---|---|---|"]
    for folder, headline in headlines(root):
        lines.append(f"| {folder.result} | {headline} | [{folder.path}/]({folder.path}/) |")
    return "\n".join(lines) + "\n"


def reports_index(root: str | Path = ".") -> str:
    """The whole of reports/README.md: one line per report folder (links relative to reports/)."""
    lines = ["# Reports", "",
             "Current measured results only, one folder each; older snapshots and tuning runs are in "
             "git history (see `docs/kernels/tuning_history.md`). Generated by "
             "`simtree report --summary --write` from each folder's data files; "
             "`tests/test_readme_summary.py` fails when this file is stale.", ""]
    profile = None
    for folder, headline in headlines(root):
        if not folder.path.startswith("reports/"):
            profile = (folder, headline)
            continue
        rel = folder.path[len("reports/"):]
        lines.append(f"- [{rel}/]({rel}/): {folder.holds}. Regenerate: {folder.command}. "
                     f"Headline: {headline}.")
    if profile is not None:
        folder, headline = profile
        lines += ["", f"The profile behind the shipped cost bundles is package data, "
                      f"[`{folder.path}/`](../{folder.path}/): {folder.holds}. Regenerate: "
                      f"{folder.command}, then `bash scripts/ship_defaults.sh`. Headline: {headline}."]
    return "\n".join(lines) + "\n"


def replace_block(text: str, block: str, where: str = "README.md", start: str = START, end: str = END) -> str:
    """``text`` with everything between the ``start`` and ``end`` markers replaced by ``block``."""
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise SimtreeError(f"{where}: needs one '{start}' line followed by one '{end}' line")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{block}{end}{tail}"


def write_summary(root: str | Path = ".", readme: str = "README.md") -> list[Path]:
    """Refresh README.md's headline block and rewrite reports/README.md; the paths written."""
    root = Path(root)
    readme_path = root / readme
    if not readme_path.is_file():
        raise SimtreeError(f"README not found: {readme_path}")
    table = summary_table(root)
    written = [write_text_atomic(readme_path, replace_block(readme_path.read_text(), table, readme))]
    written.append(write_text_atomic(root / "reports" / "README.md", reports_index(root)))
    return written

