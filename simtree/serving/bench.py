"""The serving benchmark: arrival traces through continuous batching on a model's measured
costs, every policy side by side (``simtree bench-serve``).

Policies: ``none``; ``best_static`` (the fastest fixed tier of the controller's tier set on
this very trace, an oracle); ``threshold`` (vLLM Dynamic SD tiers: best linear length per batch
range, as ``simtree export vllm`` writes them); ``sglang_adaptive`` (SGLang's own
``AdaptiveSpeculativeParams`` with its default config, launched at 3 steps);
``sglang_adaptive_simtree`` (the same class with simtree's exported config);
``sglang_dspark`` (SGLang's own ``compute_verify_token_budget`` with simtree's SPS table);
``controller`` (:class:`simtree.control.Controller`).  Load levels are multiples of the
request rate that saturates plain decoding at the largest batch.
"""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from simtree.acceptance.model import get_workload
from simtree.control.controller import DEFAULT_TIERS, MIN_DWELL_STEPS, SWITCH_BURST, Controller, tier_shape
from simtree.costs.model import load_costs
from simtree.deploy.shipped import shipped_cost_paths
from simtree.engines.export import (NEAR_BEST, TierRow, adaptive_config, parse_vllm_tiers, sps_additive_table,
                                    vllm_per_batch_size)
from simtree.errors import SimtreeError, check_int
from simtree.fileio import read_json, write_atomic, write_text_atomic
from simtree.serving.costgrid import CostGrid
from simtree.serving.live_report import existing_section
from simtree.serving.policies import (ControllerDriver, DSparkDriver, FixedDriver, SGLangAdaptiveDriver,
                                      ThresholdDriver)
from simtree.serving.sim import MAX_BATCH, serve_replicas
from simtree.serving.traces import ARRIVALS, LENGTHS_SOURCE, make_trace

__all__ = ["POLICIES", "LOADS", "COLUMNS", "run_bench", "BUCKETS", "default_models", "REPLICAS"]

POLICIES = ("none", "best_static", "threshold", "sglang_adaptive", "sglang_adaptive_simtree", "sglang_dspark",
            "controller")
LOADS = (0.1, 0.4, 0.8, 1.5)
BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64))
COLUMNS = ["model", "load", "policy", "tok_s", "tpot_p50_ms", "tpot_p99_ms", "switches_per_min", "arrivals",
           "rate_req_s", "detail", "switches", "steps", "mean_batch", "tpot_p99_lo_ms", "tpot_p99_hi_ms",
           "replicas", "tok_s_runs", "catch_ups", "catch_up_s"]
SGLANG_LAUNCH_STEPS = 3
REPLICAS = 4   # acceptance seeds every policy serves each trace under (the same seeds for all)


def default_models() -> list[Path]:
    """One shipped bundle per model family: its default deployment (the first per model)."""
    seen, out = set(), []
    for path in shipped_cost_paths():
        model = load_costs(path).meta.get("model")
        if model not in seen and not path.name.endswith("_tp2.json"):
            seen.add(model)
            out.append(path)
    return out


def _rows(ctl: Controller, ctx: float) -> list[TierRow]:
    """Per batch range: best linear at its upper end, at mean context (simtree's export)."""
    lin = [i for i, t in enumerate(ctl.tiers) if t.spec.mode in ("none", "linear")]
    rows = []
    for lo, hi in BUCKETS:
        rate = ctl.predicted_tok_s(hi, ctx)
        steps = np.array([max(ctl.tiers[i].spec.fixed_budget - 1, 0) for i in lin])
        r = rate[lin]
        best = int(np.argmax(r))
        near = tuple(sorted({int(s) for s, v in zip(steps, r) if v >= (1 - NEAR_BEST) * r[best]}))
        rows.append(TierRow(lo, hi, ctl.tiers[int(np.argmax(rate))].name, float(rate.max()), int(steps[best]),
                            float(r[best]), near))
    return rows


def _sglang():
    try:
        from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams
        from sglang.srt.speculative.dspark_components.dspark_sps import load_sps_table_from_path

        from simtree.engines.sglang_dspark import load_dspark_planner
        DSparkScheduleConfig, compute_verify_token_budget, _ = load_dspark_planner()
    except ImportError as exc:
        raise SimtreeError(f"bench-serve drives SGLang's own policies and needs sglang importable "
                           f"(bash scripts/setup.sh installs it): {exc}") from None
    logging.getLogger("sglang").setLevel(logging.WARNING)
    return AdaptiveSpeculativeParams, DSparkScheduleConfig, compute_verify_token_budget, load_sps_table_from_path


def _model_setup(path: Path, out: Path, workload: str, sg) -> dict:
    costs = load_costs(path)
    grid = CostGrid(costs)
    acc = get_workload(workload).acceptance
    ctx = 512.0   # the SPS table's and tiers' context: about a ShareGPT prompt plus half its reply
    ctl = Controller(grid, acc)
    rows = _rows(ctl, ctx)
    model = costs.meta.get("model", path.stem)
    cfg_dir = out / "configs" / model
    adaptive_path = write_text_atomic(cfg_dir / "adaptive_config.json", json.dumps(adaptive_config(rows), indent=1))
    gamma = int(costs.draft.valid_range.get("num_steps", (1, 7))[1])
    sps, _ = sps_additive_table(costs, ctx, gamma, MAX_BATCH)
    sps_path = write_text_atomic(cfg_dir / "sps_table.json", json.dumps(sps, indent=1))
    tiers = [(int(k.split("-")[0]), int(k.split("-")[1]), v) for k, v in vllm_per_batch_size(rows).items()]
    write_text_atomic(cfg_dir / "vllm_tiers.json", json.dumps(vllm_per_batch_size(rows), indent=1))
    # plain decoding's capacity: a plain engine (no drafter to catch up)
    none_rate = MAX_BATCH / float(grid.verify.predict(1.0, ctx, MAX_BATCH)) * 1e6
    return {"model": model, "grid": grid, "acc": acc, "rows": rows, "tiers": tiers, "adaptive": str(adaptive_path),
            "sps": sg[3](str(sps_path)), "gamma": gamma, "none_rate": none_rate}


def _drivers(m: dict, sg) -> dict:
    params, sched_cfg, budget_fn = sg[0], sg[1], sg[2]
    grid, acc = m["grid"], m["acc"]
    return {"threshold": lambda: ThresholdDriver(grid, acc, m["tiers"]),
            "sglang_adaptive": lambda: SGLangAdaptiveDriver(grid, acc, params(SGLANG_LAUNCH_STEPS, None)),
            "sglang_adaptive_simtree": lambda: SGLangAdaptiveDriver(
                grid, acc, params(max(max(r.candidate_steps) for r in m["rows"]), m["adaptive"])),
            "sglang_dspark": lambda: DSparkDriver(grid, acc, m["sps"], sched_cfg(gamma=m["gamma"]), budget_fn),
            "controller": lambda: ControllerDriver(Controller(grid, acc))}


def run_bench(out: str | Path, *, models=None, loads=LOADS, arrivals=ARRIVALS, num_requests: int = 300,
              workload: str = "sharegpt", seed: int = 0, progress=None, keep_configs: bool = False,
              command: str = "", threshold_tiers: str | Path | None = None, replicas: int = REPLICAS) -> pd.DataFrame:
    """Every policy on every (model, arrivals, load); writes ``out/bench.csv``, ``bench.png`` and
    ``README.md`` (the command, the setup, the controller against the rest), and with
    ``keep_configs`` the SGLang / vLLM files the engines' policies ran on (``out/configs``).
    ``threshold_tiers``: a vLLM ``speculative_config`` JSON (or its
    ``num_speculative_tokens_per_batch_size`` object) for the threshold policy instead of simtree's.
    Every trace (arrivals from ``seed``) is served under acceptance seeds ``seed .. seed + replicas - 1``,
    the same for every policy (:func:`simtree.serving.sim.serve_replicas`)."""
    check_int(replicas, "replicas", 1)
    tiers = None if threshold_tiers is None else read_vllm_tiers(threshold_tiers)
    sg = _sglang()
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="simtree-bench-") as scratch:
        df = _run(out, Path(scratch) if not keep_configs else out, models, loads, arrivals, num_requests,
                  workload, seed, progress, sg, tiers, replicas)
    write_atomic(out / "bench.csv", lambda tmp: df.to_csv(tmp, index=False, float_format="%.6g"))
    _plot(df, out / "bench.png")
    live = existing_section(out / "README.md")   # the live run's section (simtree.serving.live_report) stays
    write_text_atomic(out / "README.md", _readme(df, command or f"simtree bench-serve --out {out}", num_requests,
                                                 workload, replicas) + ("\n" + live if live else ""))
    return df


def read_vllm_tiers(path: str | Path) -> list[tuple[int, int, int]]:
    """A vLLM ``speculative_config`` JSON (or its per-batch-size object) as sorted tiers."""
    data = read_json(path, "vLLM speculative config")
    if isinstance(data, dict) and "num_speculative_tokens_per_batch_size" in data:
        data = data["num_speculative_tokens_per_batch_size"]
    return parse_vllm_tiers(data, str(path))


def _run(out, cfg_root, models, loads, arrivals, num_requests, workload, seed, progress, sg,
         tiers=None, replicas: int = 1) -> pd.DataFrame:
    paths = [Path(p) for p in (models or default_models())]
    rows = []
    for path in paths:
        m = _model_setup(path, cfg_root, workload, sg)
        if tiers is not None:
            m["tiers"] = tiers
        statics = [tier_shape(m["acc"], s, i) for i, s in enumerate(DEFAULT_TIERS)]
        for kind in arrivals:
            for load in loads:
                base = make_trace(kind, 1.0, num_requests, seed)
                rate = load * m["none_rate"] / float(base.output_len.mean())
                trace = make_trace(kind, rate, num_requests, seed)
                w, seeds = m["acc"].weights, range(seed, seed + replicas)
                res = {t.name: serve_replicas(trace, lambda t=t: FixedDriver(m["grid"], t), w, seeds)
                       for t in statics}
                best = max(res, key=lambda k: res[k].tok_s)   # the fastest fixed tier over the replicas
                results = {"none": (res["none"], "none"), "best_static": (res[best], best)}
                for name, make in _drivers(m, sg).items():
                    results[name] = (serve_replicas(trace, make, w, seeds), "")
                for policy in POLICIES:
                    r, detail = results[policy]
                    rows.append({"model": m["model"], "load": f"{load:g}x", "policy": policy, "tok_s": r.tok_s,
                                 "tpot_p50_ms": r.tpot_p50_ms, "tpot_p99_ms": r.tpot_p99_ms,
                                 "switches_per_min": np.nan if policy == "sglang_dspark" else r.switches_per_min,
                                 "arrivals": kind, "rate_req_s": rate, "detail": detail, "switches": r.switches,
                                 "steps": r.steps, "mean_batch": r.mean_batch,
                                 "tpot_p99_lo_ms": r.tpot_p99_band_ms[0], "tpot_p99_hi_ms": r.tpot_p99_band_ms[1],
                                 "replicas": replicas, "tok_s_runs": " ".join(f"{x:.6g}" for x in r.tok_s_runs),
                                 "catch_ups": r.catch_ups, "catch_up_s": r.catch_up_s})
                if progress:
                    progress(f"{m['model']} {kind} {load:g}x")
    return pd.DataFrame(rows, columns=COLUMNS)


def _readme(df: pd.DataFrame, command: str, num_requests: int, workload: str, replicas: int = 1) -> str:
    ctl = df[df.policy == "controller"]
    bound = (ctl.steps // MIN_DWELL_STEPS).clip(lower=1)
    within = "yes" if bool((ctl.switches <= ctl.steps // MIN_DWELL_STEPS).all()) else "NO"
    used = float((ctl.switches / bound).max())
    lines = ["# Serving benchmark (simulated on the shipped H200 costs)", "",
             f"Regenerate: `{command}` (written by that command; docs/controller.md describes the model). In sample: "
             "the controller's settings (switch credits, margin, tail ranking and hold) were chosen on these "
             "traces and acceptance seeds; a new `--seed` tests them on others (docs/controller.md reports one).", "",
             f"{num_requests} requests per trace, ShareGPT lengths ({LENGTHS_SOURCE['source']}), acceptance: "
             f"{workload}; up to {MAX_BATCH} live sequences; loads are multiples of the request rate that "
             "saturates plain decoding at batch 64. `bench.csv` has one row per (model, arrivals, load, policy); "
             "`detail` names the best static tier; `sglang_dspark` sets a verify budget every step by design, "
             f"so its switches are not counted. Every trace is served under {replicas} acceptance seed(s), the same "
             "for every policy (common random numbers: a request's n-th round draws the same numbers under every "
             "policy): `tok_s` is the replicas' mean (each in `tok_s_runs`), `best_static` is the fixed tier "
             "fastest on that mean, the TPOT percentiles pool the replicas' requests, so a p99 over "
             f"{replicas * num_requests} requests is set by its {max(1, -(-replicas * num_requests // 100))} "
             "slowest. A policy that runs plain and drafted steps (threshold, SGLang's adaptive steps, the "
             "controller) pays the drafter's catch-up in the drafted step after plain ones (`catch_ups`, "
             "`catch_up_s`; docs/controller.md).", "",
             f"Controller switch bound: one switch's credit per {MIN_DWELL_STEPS} steps, at most {SWITCH_BURST} "
             f"held (switches <= steps // {MIN_DWELL_STEPS} after any step; at most {SWITCH_BURST} + W // "
             f"{MIN_DWELL_STEPS} in any W steps); every controller run within it: {within}; the most of its bound "
             "a run used: "
             f"{used:.0%}; {ctl.switches_per_min.max():.1f} switches/min at most.", "",
             *target_lines(df), "",
             "The controller against the best other policy at each point (TPOT p99 of best_static with its 95% "
             "bootstrap band over requests):", ""]
    lines += [f"- {line}" for line in summary_lines(df)]
    return "\n".join(lines) + "\n"


def _points(df: pd.DataFrame):
    for (model, kind, load), h in df.groupby(["model", "arrivals", "load"], sort=False):
        by = h.set_index("policy")
        others = by.drop(index="controller")
        yield model, kind, load, by.loc["controller"], others.loc[others.tok_s.idxmax()], by.loc["best_static"]


def target_lines(df: pd.DataFrame) -> list[str]:
    """The issue's targets, counted over the points: throughput >= every other policy; TPOT p99
    <= the best static's (a miss inside the best static's bootstrap band named as such)."""
    pts = list(_points(df))
    tok_miss = [f"{m} {k} {ld} ({c.tok_s / o.tok_s - 1:+.3%} vs {o.name})" for m, k, ld, c, o, _ in pts
                if c.tok_s < o.tok_s]
    wins = [_replica_wins(c, o) for *_, c, o, _ in pts]
    p99_miss = [(m, k, ld, c, b) for m, k, ld, c, _, b in pts if c.tpot_p99_ms > b.tpot_p99_ms]
    inside = sum(c.tpot_p99_ms <= b.tpot_p99_hi_ms for *_, c, b in p99_miss)
    hair = sum(c.tpot_p99_ms <= 1.001 * b.tpot_p99_ms for *_, c, b in p99_miss)
    return [f"Targets over {len(pts)} points: controller throughput >= every other policy at "
            f"{len(pts) - len(tok_miss)}" + (f" (short: {'; '.join(tok_miss)})" if tok_miss else "") +
            f"; TPOT p99 <= best_static's at {len(pts) - len(p99_miss)}" +
            (f" (above at {len(p99_miss)}, by at most "
             f"{max(c.tpot_p99_ms / b.tpot_p99_ms - 1 for *_, c, b in p99_miss):.1%}; {hair} of them by under 0.1%; "
             f"{inside} inside best_static's own 95% bootstrap band)" if p99_miss else "") + ". Replica by replica (the same "
            f"seeds), the controller's tok/s >= the best other policy's in {sum(w for w, _ in wins)} of "
            f"{sum(n for _, n in wins)} runs."]


def _replica_wins(c, o) -> tuple[int, int]:
    """(replicas where the controller's tok/s >= ``o``'s on the same seed, replicas)."""
    cr, orr = (np.array(str(x.tok_s_runs).split(), float) for x in (c, o))
    return int((cr >= orr).sum()), int(cr.size)


def summary_lines(df: pd.DataFrame) -> list[str]:
    """Per model and arrivals: the controller against the best other policy at each load."""
    return [f"{model} {kind} {load}: controller {c.tok_s:.0f} tok/s vs best other {o.name} {o.tok_s:.0f} "
            f"({c.tok_s / o.tok_s - 1:+.3%}; >= in {'/'.join(map(str, _replica_wins(c, o)))} replicas); "
            f"TPOT p99 {c.tpot_p99_ms:.2f} ms vs best_static {b.tpot_p99_ms:.2f} "
            f"[{b.tpot_p99_lo_ms:.2f}, {b.tpot_p99_hi_ms:.2f}] ({c.tpot_p99_ms / b.tpot_p99_ms - 1:+.1%}); p50 "
            f"{c.tpot_p50_ms:.2f} vs {b.tpot_p50_ms:.2f}; {c.switches_per_min:.1f} switches/min"
            for model, kind, load, c, o, b in _points(df)]


def _plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(df.groupby(["model", "arrivals"], sort=False))
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 7), squeeze=False)
    for col, ((model, kind), g) in enumerate(groups):
        loads = list(dict.fromkeys(g["load"]))
        none = g[g.policy == "none"].set_index("load").loc[loads, "tok_s"].to_numpy()
        for policy in POLICIES:
            h = g[g.policy == policy].set_index("load").loc[loads]
            style = dict(lw=2.5, color="k") if policy == "controller" else dict(lw=1, marker="o", ms=3)
            axes[0, col].plot(loads, h["tok_s"].to_numpy() / none, label=policy, **style)
            axes[1, col].plot(loads, h["tpot_p99_ms"], label=policy, **style)
        axes[0, col].set_title(f"{model}, {kind}", fontsize=9)
        axes[0, col].set_ylabel("tok/s over plain decoding's")
        axes[1, col].set_ylabel("TPOT p99 (ms)")
        axes[1, col].set_xlabel("load (x plain decoding's capacity at batch 64)")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)
