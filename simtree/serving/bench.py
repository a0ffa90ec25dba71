"""The serving benchmark: arrival traces through continuous batching on a model's measured
costs, every policy side by side (``simtree bench-serve``).

Policies: ``none``; ``best_static`` (the fastest fixed tier of the controller's tier set on
this very trace, an oracle); ``threshold`` (vLLM Dynamic SD tiers: best linear length per batch
range, as ``simtree export vllm`` writes them); ``sglang_adaptive`` (SGLang's own
``AdaptiveSpeculativeParams`` with its default config, launched at 3 steps);
``sglang_adaptive_simtree`` (the same class with simtree's exported config);
``sglang_dspark`` (SGLang's own ``compute_verify_token_budget`` with simtree's SPS table);
``sglang_controller`` (simtree's controller as SGLang's adaptive-steps policy, what simtree's
SGLang plugin runs: :class:`simtree.engines.sglang_controller.SimtreeAdaptiveParams` over the
exported config's chains, priced at the export's context, every request counted as new);
``controller`` (:class:`simtree.control.Controller`).  Load levels are multiples of the
request rate that saturates plain decoding at the largest batch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
import signal
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd

from simtree.acceptance.model import get_workload
from simtree.control.controller import Controller
from simtree.control.tiers import DEFAULT_TIERS, tier_shape
from simtree.costs.model import load_costs
from simtree.deploy.shipped import shipped_cost_paths
from simtree.engines.export import (NEAR_BEST, TierRow, adaptive_config, parse_vllm_tiers, sps_additive_table,
                                    vllm_per_batch_size)
from simtree.engines.sglang_controller import COSTS_FILE, SimtreeAdaptiveParams, controller_config
from simtree.errors import SEED_MAX, SimtreeError, check_int
from simtree.fileio import check_out_folder, read_json, write_atomic, write_text_atomic
from simtree.serving.costgrid import CostGrid
from simtree.serving.bench_report import plot as _plot
from simtree.serving.bench_report import readme as _readme
from simtree.serving.live_report import existing_section
from simtree.serving.policies import (ControllerDriver, DSparkDriver, FixedDriver, SGLangAdaptiveDriver,
                                      ThresholdDriver)
from simtree.serving.sim import BOOTSTRAP, MAX_BATCH, serve_replicas
from simtree.serving.traces import ARRIVALS, make_trace, sharegpt_lengths

__all__ = ["POLICIES", "LOADS", "COLUMNS", "run_bench", "serve_points", "statics_key", "BUCKETS", "default_models",
           "REPLICAS", "OOS_CSV", "paired_p99_diff_band", "write_report"]

POLICIES = ("none", "best_static", "threshold", "sglang_adaptive", "sglang_adaptive_simtree", "sglang_dspark",
            "sglang_controller", "controller")
LOADS = (0.1, 0.4, 0.8, 1.5)
BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64))
COLUMNS = ["model", "load", "policy", "tok_s", "tpot_p50_ms", "tpot_p99_ms", "switches_per_min", "arrivals",
           "rate_req_s", "detail", "mean_batch", "tpot_p99_lo_ms", "tpot_p99_hi_ms", "tpot_p99_diff_lo_ms",
           "tpot_p99_diff_hi_ms", "seed", "replicas", "tok_s_runs", "catch_ups", "catch_up_s", "switches_runs",
           "steps_runs"]
OOS_CSV = "bench_oos.csv"   # every out-of-sample seed's rows, its arrivals seed in ``seed``
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


def _model_setup(path: Path, out: Path, workload: str, sg=None) -> dict:
    costs = load_costs(path)
    grid = CostGrid(costs)
    acc = get_workload(workload).acceptance
    ctx = 512.0   # the SPS table's and tiers' context: about a ShareGPT prompt plus half its reply
    ctl = Controller(grid, acc)
    rows = _rows(ctl, ctx)
    model = costs.meta.get("model", path.stem)
    cfg_dir = out / "configs" / model
    adaptive_path = write_text_atomic(cfg_dir / "adaptive_config.json", json.dumps(adaptive_config(rows), indent=1))
    # simtree's controller in SGLang: the same slots, the bundle beside them (simtree export sglang's files)
    text = Path(path).read_text()
    write_text_atomic(cfg_dir / COSTS_FILE, text)
    controller_path = write_text_atomic(cfg_dir / "adaptive_controller.json",
                                        json.dumps(controller_config(adaptive_config(rows), text, workload, ctx), indent=1))
    gamma = int(costs.draft.valid_range.get("num_steps", (1, 7))[1])
    sps, _ = sps_additive_table(costs, ctx, gamma, MAX_BATCH)
    sps_path = write_text_atomic(cfg_dir / "sps_table.json", json.dumps(sps, indent=1))
    tiers = [(int(k.split("-")[0]), int(k.split("-")[1]), v) for k, v in vllm_per_batch_size(rows).items()]
    write_text_atomic(cfg_dir / "vllm_tiers.json", json.dumps(vllm_per_batch_size(rows), indent=1))
    # plain decoding's capacity: a plain engine (no drafter to catch up)
    none_rate = MAX_BATCH / float(grid.verify.predict(1.0, ctx, MAX_BATCH)) * 1e6
    return {"model": model, "path": path, "grid": grid, "acc": acc, "rows": rows, "tiers": tiers,
            "adaptive": str(adaptive_path), "controller_cfg": str(controller_path),
            "sps": None if sg is None else sg[3](str(sps_path)), "gamma": gamma,
            "none_rate": none_rate}


def _drivers(m: dict, sg) -> dict:
    """Driver factories of the policies besides the fixed tiers (SGLang's only with ``sg``)."""
    params, sched_cfg, budget_fn = sg[:3] if sg is not None else (None, None, None)
    grid, acc = m["grid"], m["acc"]
    top = max(max(r.candidate_steps) for r in m["rows"])   # the exported launch's steps
    return {"threshold": lambda: ThresholdDriver(grid, acc, m["tiers"]),
            "sglang_adaptive": lambda: SGLangAdaptiveDriver(grid, acc, params(SGLANG_LAUNCH_STEPS, None)),
            "sglang_adaptive_simtree": lambda: SGLangAdaptiveDriver(grid, acc, params(top, m["adaptive"])),
            "sglang_controller": lambda: SGLangAdaptiveDriver(
                grid, acc, SimtreeAdaptiveParams(top, m["controller_cfg"], costs=grid)),
            "sglang_dspark": lambda: DSparkDriver(grid, acc, m["sps"], sched_cfg(gamma=m["gamma"]), budget_fn),
            "controller": lambda: ControllerDriver(Controller(grid, acc))}


def run_bench(out: str | Path, *, models=None, loads=LOADS, arrivals=ARRIVALS, num_requests: int = 300,
              workload: str = "sharegpt", seed: int = 0, progress=None, keep_configs: bool = False,
              command: str = "", threshold_tiers: str | Path | None = None, replicas: int = REPLICAS,
              out_of_sample=()) -> tuple[pd.DataFrame, str]:
    """Every policy on every (model, arrivals, load); writes ``out/bench.csv``, ``bench.png`` and
    ``README.md`` (the command, the setup, the controller against the rest), and with
    ``keep_configs`` the SGLang / vLLM files the engines' policies ran on (``out/configs``).
    ``threshold_tiers``: a vLLM ``speculative_config`` JSON (or its
    ``num_speculative_tokens_per_batch_size`` object) for the threshold policy instead of simtree's.
    Every trace (arrivals from ``seed``) is served under acceptance seeds ``seed .. seed + replicas - 1``,
    the same for every policy (:func:`simtree.serving.sim.serve_replicas`).  ``out_of_sample``: more
    arrivals seeds served the same way (the controller's settings were not chosen on them), each
    into ``out/bench_oos.csv`` (column ``seed``), their target counts in the README beside the in-sample ones.
    Returns the in-sample rows and the line naming where the traces' lengths came from."""
    check_int(replicas, "replicas", 1)
    check_out_folder(out)
    seeds = [check_int(seed, "--seed", 0, SEED_MAX - replicas + 1),   # acceptance seeds run to seed + replicas - 1
             *(check_int(s, "--out-of-sample seed", 0, SEED_MAX) for s in out_of_sample)]
    if len(set(seeds)) != len(seeds):
        raise SimtreeError(f"out-of-sample seeds {list(out_of_sample)} must differ from each other and from --seed {seed}")
    tiers = None if threshold_tiers is None else read_vllm_tiers(threshold_tiers)
    _sglang()     # fail before any work, in one line, where SGLang's policies cannot be loaded
    out = Path(out)
    args = [(models, loads, arrivals, num_requests, workload, s, replicas) for s in seeds]
    kw = dict(threshold_tiers=tiers)
    frames = {seed: serve_points(*args[0], cfg_root=out if keep_configs else None, progress=progress, **kw)} \
        if len(seeds) == 1 else {}
    if not frames:   # the seeds side by side, one process each (the configs kept are the in-sample seed's)
        pool = ProcessPoolExecutor(max_workers=len(seeds), initializer=_worker_signals)
        try:
            futures = {s: pool.submit(serve_points, *a, cfg_root=out if keep_configs and s == seed else None, **kw)
                       for s, a in zip(seeds, args)}
            for s, fut in futures.items():
                frames[s] = fut.result()
                if progress:
                    progress(f"seed {s} served")
        except BaseException:   # an interrupt or a failed seed: the other seeds' work is not waited for
            for proc in list((getattr(pool, "_processes", None) or {}).values()):   # no public kill before 3.14
                proc.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    write_atomic(out / "bench.csv", lambda tmp: frames[seed].to_csv(tmp, index=False, float_format="%.6g"))
    if len(seeds) > 1:
        stacked = pd.concat([frames[s] for s in seeds[1:]], ignore_index=True)
        write_atomic(out / OOS_CSV, lambda tmp: stacked.to_csv(tmp, index=False, float_format="%.6g"))
    lengths = sharegpt_lengths(1, np.random.default_rng(seed))[2]   # as the worker processes read them
    write_report(out, command or f"simtree bench-serve --out {out}", num_requests, workload, lengths, replicas,
                 seeds[1:])
    return frames[seed], lengths


def _worker_signals() -> None:
    """A seed's worker process: SIGTERM ends it at once and SIGINT (a terminal's Ctrl-C reaches the
    whole group) is left to the parent, which says in one line that the command was interrupted
    (the fork would otherwise carry over the parent's handlers, and each worker would print its own
    traceback)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def write_report(out: str | Path, command: str, num_requests: int, workload: str, lengths_source: str,
                 replicas: int = REPLICAS, out_of_sample=()) -> None:
    """``out/bench.png`` and ``out/README.md`` from the CSVs in ``out`` (``bench.csv``; the
    ``out_of_sample`` seeds' rows of ``bench_oos.csv``), so the report is a function of the files it
    reports on; the README's live run section (:mod:`simtree.serving.live_report`) stays."""
    out = Path(out)
    df = pd.read_csv(out / "bench.csv")
    stacked = pd.read_csv(out / OOS_CSV) if out_of_sample else None
    oos = {int(s): stacked[stacked.seed == int(s)].reset_index(drop=True) for s in out_of_sample}
    _plot(df, out / "bench.png")
    live = existing_section(out / "README.md")
    write_text_atomic(out / "README.md", _readme(df, command, num_requests, workload, lengths_source, replicas, oos)
                      + ("\n" + live if live else ""))


def paired_p99_diff_band(tpot_ms: np.ndarray, base_ms: np.ndarray, resamples: int = BOOTSTRAP,
                         seed: int = 0) -> tuple[float, float]:
    """The 2.5 and 97.5 percentiles of p99(``tpot_ms``) - p99(``base_ms``) over ``resamples`` bootstrap
    resamples of the requests, the same requests drawn for both: two policies served on the same
    arrivals and acceptance draws (the same request at each index) compared pairwise, so what the
    requests drawn move in both cancels and what is left is the policies' own difference."""
    if tpot_ms.shape != base_ms.shape:
        raise SimtreeError(f"paired samples differ in size: {tpot_ms.shape} vs {base_ms.shape}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, tpot_ms.size, (resamples, tpot_ms.size))
    diff = np.percentile(tpot_ms[idx], 99, axis=1) - np.percentile(base_ms[idx], 99, axis=1)
    return float(np.percentile(diff, 2.5)), float(np.percentile(diff, 97.5))


def read_vllm_tiers(path: str | Path) -> list[tuple[int, int, int]]:
    """A vLLM ``speculative_config`` JSON (or its per-batch-size object) as sorted tiers."""
    data = read_json(path, "vLLM speculative config")
    if isinstance(data, dict) and "num_speculative_tokens_per_batch_size" in data:
        data = data["num_speculative_tokens_per_batch_size"]
    return parse_vllm_tiers(data, str(path))


def serve_points(models=None, loads=LOADS, arrivals=ARRIVALS, num_requests: int = 300, workload: str = "sharegpt",
                 seed: int = 0, replicas: int = REPLICAS, *, policies=POLICIES, extra=None, cfg_root=None,
                 threshold_tiers=None, statics_cache=None, progress=None) -> pd.DataFrame:
    """The benchmark's rows (``COLUMNS``) of ``policies`` at every (model, arrivals, load) point, and
    of every ``extra`` policy: ``{name: make(m)}`` where ``make`` takes the model's setup (``grid``,
    ``acc``, ...) and returns a driver factory.  ``statics_cache``: a folder where the fixed tiers'
    results are kept, keyed on everything they depend on (:func:`statics_key`).  The SGLang / vLLM
    files the engines' policies run on go under ``cfg_root`` (a scratch folder when not given)."""
    with tempfile.TemporaryDirectory(prefix="simtree-bench-") as scratch:
        return _serve_points(models, loads, arrivals, num_requests, workload, seed, replicas, tuple(policies),
                             dict(extra or {}), Path(cfg_root or scratch), threshold_tiers, statics_cache, progress)


def _serve_points(models, loads, arrivals, num_requests, workload, seed, replicas, policies, extra, cfg_root,
                  threshold_tiers, statics_cache, progress) -> pd.DataFrame:
    check_int(replicas, "replicas", 1)
    engines = [p for p in policies if p not in ("none", "best_static")]
    sg = _sglang() if any(p.startswith("sglang") for p in engines) else None
    rows = []
    for path in [Path(p) for p in (models or default_models())]:
        m = _model_setup(path, cfg_root, workload, sg)
        if threshold_tiers is not None:
            m["tiers"] = threshold_tiers
        statics = [tier_shape(m["acc"], s, i) for i, s in enumerate(DEFAULT_TIERS)]
        drivers = _drivers(m, sg)
        for kind in arrivals:
            for load in loads:
                base = make_trace(kind, 1.0, num_requests, seed)
                rate = load * m["none_rate"] / float(base.output_len.mean())
                trace = make_trace(kind, rate, num_requests, seed)
                w, seeds = m["acc"].weights, range(seed, seed + replicas)
                res = _serve_statics(m, statics, trace, seeds, statics_cache)
                best = max(res, key=lambda k: res[k].tok_s)   # the fastest fixed tier over the replicas
                results = {"none": (res["none"], "none"), "best_static": (res[best], best)}
                for name in engines:
                    results[name] = (serve_replicas(trace, drivers[name], w, seeds), "")
                for name, make in extra.items():
                    results[name] = (serve_replicas(trace, make(m), w, seeds), "")
                static_ms = results["best_static"][0].tpot_ms
                for policy in (*policies, *extra):
                    r, detail = results[policy]
                    diff = paired_p99_diff_band(r.tpot_ms, static_ms)   # the same requests, both policies
                    rows.append({"model": m["model"], "load": f"{load:g}x", "policy": policy, "tok_s": r.tok_s,
                                 "tpot_p50_ms": r.tpot_p50_ms, "tpot_p99_ms": r.tpot_p99_ms,
                                 "switches_per_min": np.nan if policy == "sglang_dspark" else r.switches_per_min,
                                 "arrivals": kind, "rate_req_s": rate, "detail": detail, "mean_batch": r.mean_batch,
                                 "tpot_p99_lo_ms": r.tpot_p99_band_ms[0], "tpot_p99_hi_ms": r.tpot_p99_band_ms[1],
                                 "tpot_p99_diff_lo_ms": diff[0], "tpot_p99_diff_hi_ms": diff[1], "seed": seed,
                                 "replicas": replicas, "tok_s_runs": _runs(r.tok_s_runs),
                                 "catch_ups": r.catch_ups, "catch_up_s": r.catch_up_s,
                                 "switches_runs": _runs(r.switches_runs), "steps_runs": _runs(r.steps_runs)})
                if progress:
                    progress(f"{m['model']} {kind} {load:g}x")
    return pd.DataFrame(rows, columns=COLUMNS)


def _runs(values) -> str:
    return " ".join(f"{x:.6g}" for x in values)


def statics_key(m: dict, statics, trace, seeds) -> str:
    """A digest of everything the fixed tiers' results at one point depend on: the cost bundle's
    file, every tier's numbers under the acceptance model (its shape, verified nodes and accepted
    drafts' distribution per level, the levels' weights), the trace, the acceptance seeds, the
    batch limit and the simulator's own code (:mod:`simtree.serving.sim`, ``policies``, ``costgrid``,
    ``traces``, :mod:`simtree.control.catchup` and ``tiers``, and the cost forms that turn the bundle
    into times; not the controller's own code, which no fixed tier runs)."""
    from simtree.control import catchup, tiers
    from simtree.costs import base_forms, forms, model, moe_forms, surface_fit
    from simtree.serving import costgrid, policies, sim, traces
    h = hashlib.sha256()
    h.update(Path(m["path"]).read_bytes())
    for t in statics:
        h.update(t.name.encode())
        for a in (t.nodes, t.accepted, t.cdf, t.weights):
            h.update(np.ascontiguousarray(a, np.float64).tobytes())
    for a in (trace.arrival_s, trace.prompt_len, trace.output_len):
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(repr((list(seeds), MAX_BATCH)).encode())
    for mod in (sim, policies, costgrid, traces, catchup, tiers, base_forms, forms, model, moe_forms, surface_fit):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()


def _serve_statics(m: dict, statics, trace, seeds, cache) -> dict:
    """Every fixed tier served on ``trace`` under ``seeds`` (from ``cache`` when it holds them)."""
    path = None if cache is None else Path(cache) / f"statics_{statics_key(m, statics, trace, seeds)}.pkl"
    if path is not None and path.is_file():
        return pickle.loads(path.read_bytes())
    res = {t.name: serve_replicas(trace, lambda t=t: FixedDriver(m["grid"], t), m["acc"].weights, seeds)
           for t in statics}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: Path(tmp).write_bytes(pickle.dumps(res)))
    return res
