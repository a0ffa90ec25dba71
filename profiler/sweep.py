"""Run a profile sweep described in YAML: expand the grid, time each point, append atomically.

    result = run_sweep("default_gpu.yaml", "reports/h200/profile.csv")

A sweep is a YAML file; a name that is not a file here is read from the shipped sweeps
(``simtree/data/sweeps/``: default_gpu, quick_cpu, runtime_cpu, runtime_gpu; with or without
``.yaml``).

Robustness: each measured point is appended to the table at once (atomic rewrite through
``simtree.costs.profile_table.append_rows``); a rerun skips points already in the table (resume);
``max_minutes`` stops between points; an out-of-memory point, a missing kernel or a failing
variant is logged to ``<table>.points.jsonl`` and skipped (not retried on resume unless
``retry_failed``); a lost CUDA context (illegal memory access) stops the sweep cleanly.
``<table>.meta.json`` holds the machine facts, the sweep, the correctness checks and counts.

Sweep YAML (``yaml.safe_load``)::

    name: default_gpu
    device: cuda            # cuda | cpu | auto
    dtype: bf16
    max_minutes: 7
    target_s: 0.05          # timing budget per point
    models: [qwen3.6-27b, deepseek-v4-flash]
    grid: {batch_size: [1, 4], nodes_per_seq: [1, 8], context_len: [4096], tree_shape: [eagle]}
    stages:                 # in priority order; "attention" and "proj" expand per layer kind
      - {stage: proj, grid: {context_len: [0], tree_shape: [any]}}
      - {stage: attention, variants: [...], budget_s: 120}
    compose: {stack_layers: 8}
    deployment: ep=8        # optional: profile each model's rank of this deployment (its shard
                            # shape, ModelShape.shard); or {model: deployment}; --deployment overrides
    stages:
      - {stage: collectives, ops: [all_reduce, all_to_all], group_sizes: [2, 8]}   # profiler/collectives.py

A table holds one deployment per model (the composition sums one rank's parts): a sweep at
another deployment of a model already in the table is refused before any point runs.
"""
from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from simtree.costs.profile_table import MIN_INT
from simtree.costs.runtime_path import V4_FORMS, runtime_path
from simtree.kernels.layers.forms import v4_form
from simtree.costs.steps import TREE_SHAPES, Point, StepBuilder, Unavailable
from simtree.data import data_path
from simtree.parallel import DEFAULT_DEPLOYMENT, parse_deployment
from simtree.errors import SimtreeError
from simtree.fileio import read_yaml
from simtree.machine.hostprobe import probe as host_probe
from simtree.models import (COMMIT_STAGE, DECODE_STAGE, HASH_MLP_STAGE, MODEL_ROUND_STAGE, ROUND_STAGE, VERIFY_STAGE,
                            get_model)

from .collectives import COLLECTIVES_STAGE, check_collectives_entry
from .drafter_pieces import DRAFTER_STAGES, drafter_point_axes
from .stages import NO_BUILDERS, build_workload, check_variant, default_variants
from .sweep_io import (Deadline, advance, cuda_alive, hard_deadline, log_point, one_line, progress_bar,
                       read_log_skips)

__all__ = ["run_sweep", "load_sweep", "expand_points", "SweepResult", "SWEEP_DIR", "default_sweep_path"]

SWEEP_DIR = data_path("sweeps")
GRID_KEYS = ("batch_size", "nodes_per_seq", "context_len", "tree_shape", "num_steps", "topk")
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_STICKY = ("illegal memory access", "unspecified launch failure", "device-side assert",
           "an illegal instruction", "misaligned address")


@dataclass
class SweepResult:
    table: Path
    measured: int = 0
    skipped_done: int = 0      # already in the table
    skipped_logged: int = 0    # logged failed / oom / unavailable by an earlier run
    to_run: int = 0
    failed: int = 0
    unavailable: int = 0
    oom: int = 0
    stopped: str = ""
    elapsed_s: float = 0.0
    checks: dict = field(default_factory=dict)
    compose: dict = field(default_factory=dict)

    @property
    def not_run(self) -> int:
        """Points left to run that were not: a stage's budget_s, the time limit, a lost CUDA
        context, a deadline or an interruption (every other point is counted once)."""
        return self.to_run - (self.measured + self.failed + self.oom + self.unavailable)

    @property
    def exit_code(self) -> int:
        """1 when points were left to run and none got measured (all failed, or no time), else 0."""
        return 1 if self.to_run and not self.measured else 0

    def summary(self) -> str:
        logged = f", {self.skipped_logged} skipped as logged failed earlier" if self.skipped_logged else ""
        return (f"{self.measured} measured, {self.skipped_done} already in table{logged}, {self.failed} failed, "
                f"{self.oom} oom, {self.unavailable} unavailable, {self.not_run} not run"
                f"{' (' + self.stopped + ')' if self.stopped else ''} in {self.elapsed_s:.0f} s -> {self.table}")


def default_sweep_path(device: str | None = None) -> Path:
    """default_gpu.yaml when CUDA is usable (or asked for), quick_cpu.yaml otherwise."""
    import torch

    use_gpu = device == "cuda" or (device in (None, "auto") and torch.cuda.is_available())
    return SWEEP_DIR / ("default_gpu.yaml" if use_gpu else "quick_cpu.yaml")


def load_sweep(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():   # a shipped sweep by file name or name: default_gpu.yaml, default_gpu
        path = next((p for p in (SWEEP_DIR / path.name, SWEEP_DIR / f"{path.name}.yaml") if p.is_file()), path)
    spec = read_yaml(path, "sweep")   # a folder or a binary file: one-line SimtreeError
    if not isinstance(spec, dict) or not isinstance(spec.get("stages"), list) or not spec.get("models"):
        raise SimtreeError(f"{path.name}: a sweep needs 'models' and a list of 'stages'")
    spec.setdefault("name", path.stem)
    _check_spec(spec, path.name)
    spec["_path"] = str(path)
    return spec


# scalar settings of a sweep: (type, smallest allowed value, inclusive)
_SCALARS = {"max_minutes": (float, 0, False), "target_s": (float, 0, False), "flush_s": (float, 0, True),
            "grace_s": (float, 0, True), "flush_rows": (int, 1, True), "seed": (int, 0, True),
            "cpu_threads": (int, 1, True)}


# every key a sweep YAML may set at its top level and in a (non-collectives) stage entry
_TOP_KEYS = {"name", "device", "dtype", "models", "grid", "stages", "compose", "deployment", "core_variants",
             *_SCALARS}
_STAGE_KEYS = {"stage", "variants", "models", "budget_s", "grid"}


def _check_keys(mapping: dict, known: set[str], where: str) -> None:
    """A typo'd key (``gird:``) is an error, not a setting silently left at its default."""
    unknown = sorted(str(k) for k in mapping if k not in known)
    if unknown:
        raise SimtreeError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")


def _number(value, kind, low: float, inclusive: bool, where: str):
    """``value`` as a finite ``kind`` (int or float) >= / > ``low``; a one-line error otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (kind is float or float(value).is_integer())
    if ok and (value >= low if inclusive else value > low):
        return kind(value)
    need = f"{'an integer' if kind is int else 'a number'} {'>=' if inclusive else '>'} {low}"
    raise SimtreeError(f"{where} must be {need}, got {value!r}")


def _check_device(device, where: str) -> None:
    if not isinstance(device, str) or not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
        raise SimtreeError(f"{where} must be cuda, cuda:<index>, cpu or auto, got {device!r}")


def _str_list(value, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise SimtreeError(f"{where} must be a non-empty list of names, got {value!r}")
    return value


def _check_spec(spec: dict, name: str) -> None:
    """Types and ranges of everything a sweep YAML sets, checked before any point runs, so a
    typo is one error up front rather than points timed wrongly or logged as failed."""
    _check_keys(spec, _TOP_KEYS, name)
    for key, (kind, low, inclusive) in _SCALARS.items():
        if key in spec:
            spec[key] = _number(spec[key], kind, low, inclusive, f"{name}: {key}")
    _check_device(spec.get("device", "auto"), f"{name}: device")
    _str_list(spec["models"], f"{name}: models")
    compose = spec.get("compose")
    if isinstance(compose, dict) and "stack_layers" in compose:
        _number(compose["stack_layers"], int, 1, True, f"{name}: compose.stack_layers")
    elif compose is not None and not isinstance(compose, (bool, dict)):
        raise SimtreeError(f"{name}: compose must be true/false or a mapping, got {compose!r}")
    dep = spec.get("deployment")
    if dep is not None:
        for d in (dep.values() if isinstance(dep, dict) else [dep]):
            if not isinstance(d, str):
                raise SimtreeError(f"{name}: deployment must be a string such as 'ep=8' or a mapping of models to one")
            try:
                parse_deployment(d)
            except SimtreeError as exc:
                raise SimtreeError(f"{name}: {exc}") from None
    cv = spec.get("core_variants")
    if cv is not None and not (isinstance(cv, dict) and all(isinstance(v, str) for v in cv.values())):
        raise SimtreeError(f"{name}: core_variants must map stage names to variant names")
    _check_grid(spec.get("grid") or {}, f"{name}: grid")
    for i, entry in enumerate(spec["stages"]):
        where = f"{name}: stage entry {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("stage"), str):
            raise SimtreeError(f"{where} needs a 'stage' name")
        if entry["stage"] == COLLECTIVES_STAGE:
            check_collectives_entry(entry, where)
            continue
        if entry["stage"] not in known_stages():
            raise SimtreeError(f"{where}: unknown stage {entry['stage']!r} (known: {', '.join(sorted(known_stages()))})")
        _check_keys(entry, _STAGE_KEYS, where)
        if "variants" in entry:
            _str_list(entry["variants"], f"{where} variants")
        if "models" in entry:
            _str_list(entry["models"], f"{where} models")
        if "budget_s" in entry:
            entry["budget_s"] = _number(entry["budget_s"], float, 0, False, f"{where} budget_s")
        _check_grid(entry.get("grid") or {}, f"{where} grid")


def _check_grid(grid, where: str) -> None:
    if not isinstance(grid, dict):
        raise SimtreeError(f"{where} must be a mapping of grid keys to lists")
    for key, values in grid.items():
        if key not in GRID_KEYS:
            raise SimtreeError(f"{where}: unknown grid key {key!r} (known: {', '.join(GRID_KEYS)})")
        if not isinstance(values, list) or not values:
            raise SimtreeError(f"{where}: {key} must be a non-empty list")
        for v in values:
            if key == "tree_shape":
                if v not in TREE_SHAPES:
                    raise SimtreeError(f"{where}: unknown tree_shape {v!r} (known: {', '.join(TREE_SHAPES)})")
            else:
                _number(v, int, MIN_INT[key], True, f"{where}: {key} value")


def known_stages() -> set[str]:
    """Every stage name (and alias) a sweep entry may name."""
    names = {"attention", "proj", "mlp_step", "lm_head_step", "draft_step", "stack_verify_step",
             "model_verify_step", MODEL_ROUND_STAGE, COLLECTIVES_STAGE, HASH_MLP_STAGE, *DRAFTER_STAGES}
    for per_kind in (VERIFY_STAGE, COMMIT_STAGE, ROUND_STAGE, DECODE_STAGE):
        names |= set(per_kind.values())
    names |= {f"{k}_proj_step" for k in VERIFY_STAGE}
    return names


def _stage_names(alias: str, kinds: tuple[str, ...]) -> list[str]:
    if alias == "attention":
        return [VERIFY_STAGE[k] for k in kinds]
    if alias == "proj":
        return [f"{k}_proj_step" for k in kinds]
    if alias in VERIFY_STAGE.values():
        return [alias] if any(VERIFY_STAGE[k] == alias for k in kinds) else []
    for per_kind in (COMMIT_STAGE, ROUND_STAGE, DECODE_STAGE):
        if alias in per_kind.values():
            return [alias] if any(per_kind.get(k) == alias for k in kinds) else []
    if alias.endswith("_proj_step"):
        return [alias] if alias.removesuffix("_proj_step") in kinds else []
    return [alias]


def _with_checkpoints(names: list[str], models: list[str] | None) -> list[str]:
    """The sweep's model names with each checkpoint folder of ``models`` (``--model PATH``) in
    the place of the sweep's models of its family: the sweep's grid at the checkpoint's shape."""
    folders = [m for m in models or [] if Path(m).expanduser().is_dir()]
    if not folders:
        return list(names)
    out = []
    for name in names:
        family = get_model(name).family
        out += [f for f in folders if get_model(f).family == family] or [name]
    return list(dict.fromkeys(out))


def expand_points(spec: dict, device: str, only_stage: str | None = None,
                  models: list[str] | None = None) -> list[tuple[int, Point]]:
    """(entry index, Point) for every grid point of the sweep ``spec`` (as ``load_sweep``
    returns it: checked), in YAML priority order; ``only_stage``: one stage or several,
    comma-separated."""
    out = []
    stages = set(only_stage.split(",")) if only_stage else None
    base = dict(spec.get("grid") or {})
    for i, entry in enumerate(spec["stages"]):
        if entry["stage"] == COLLECTIVES_STAGE:
            continue   # timed by its own processes (profiler/collectives.py), not per model
        grid = {**base, **(entry.get("grid") or {})}
        for name in _with_checkpoints(entry.get("models") or spec["models"], models):
            if models and name not in models:
                continue
            model = get_model(name)
            for stage in _stage_names(entry["stage"], model.kinds()):
                if stages and stage not in stages:
                    continue
                variants = entry.get("variants") or default_variants(stage, device)
                for variant, shape, l, b, n, s, k in itertools.product(
                        variants, grid.get("tree_shape", ["any"]), grid.get("context_len", [0]),
                        grid.get("batch_size", [1]), grid.get("nodes_per_seq", [1]),
                        grid.get("num_steps", [0]), grid.get("topk", [0])):
                    if stage == "draft_step":
                        n = max(int(k), 1)   # a draft step feeds topk tokens per sequence
                    elif stage in DRAFTER_STAGES:   # each family's axes (profiler/drafter_pieces.py)
                        n, s, k = drafter_point_axes(stage, int(b), int(n), int(l), int(s), int(k))
                    out.append((i, Point(stage, str(variant), name, int(b), int(n), int(l), str(shape), int(s), int(k))))
    seen, unique = set(), []
    for i, p in out:  # the draft rewrite of n can create duplicates
        if p not in seen:
            seen.add(p)
            unique.append((i, p))
    return unique


def run_sweep(sweep: str | Path | None = None, out: str | Path = "reports/profile.csv", *,
              device: str | None = None, max_minutes: float | None = None,
              only_stage: str | None = None, models: list[str] | None = None,
              retry_failed: bool = False, remeasure: bool = False, progress: bool = True,
              compose: bool | None = None, echo=print,
              builders: Mapping[str, StepBuilder] = NO_BUILDERS, deployment: str | None = None) -> SweepResult:
    """Run (or resume) a sweep into the profile table ``out``; see the module docstring.
    ``remeasure``: first drop the table's rows (and logged failures) of the points this call
    selects (``only_stage`` / ``models``), so they are measured again, e.g. after a kernel
    change; every other row stays.  ``builders``: {variant: StepBuilder} for the variants the
    profiler does not build itself (`simtree profile` passes the runtime's).  ``deployment``
    ("tp=2", "ep=8"; default the sweep's ``deployment``, else one GPU): every model is timed at
    the shape of one rank of it, and its rows say so."""
    import torch

    from simtree.costs import profile_table as pt

    from simtree.machine import metadata
    from .pieces import Ctx
    from .timing import l2_cache_bytes

    if device is not None:
        _check_device(device, "--device")
    if max_minutes is not None:
        max_minutes = _number(max_minutes, float, 0, False, "--max-minutes")
    spec = load_sweep(sweep or default_sweep_path(device))
    if only_stage:
        unknown = sorted(set(only_stage.split(",")) - known_stages())
        if unknown:
            raise SimtreeError(f"--only-stage: unknown stage(s) {', '.join(map(repr, unknown))}")
    device = device or spec.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    metadata.require_device(device)
    dtype_name = spec.get("dtype", "bf16" if device.startswith("cuda") else "fp32")
    if dtype_name not in _DTYPES:
        raise SimtreeError(f"sweep dtype must be one of {', '.join(_DTYPES)}, got {dtype_name!r}")
    dtype = getattr(torch, _DTYPES[dtype_name])
    max_s = 60 * float(max_minutes if max_minutes is not None else spec.get("max_minutes", 10))
    target_s = float(spec.get("target_s", 0.05))
    table = Path(out)
    if deployment is not None:   # a model named with a deployment that cannot hold it: before its points
        for name in models or ():
            _check_holds(name, parse_deployment(deployment).name, metadata.device_label(device))
    points = expand_points(spec, device, only_stage, models)
    comm_entries = [e for e in spec["stages"] if e["stage"] == COLLECTIVES_STAGE
                    and (not only_stage or COLLECTIVES_STAGE in only_stage.split(","))]
    if not points and not comm_entries:
        if models:
            for name in models:
                get_model(name)          # an unknown model: its own one-line error
            swept = sorted({str(m) for e in spec["stages"] for m in (e.get("models") or spec.get("models") or [])})
            raise SimtreeError(f"sweep {spec['name']}: no grid points for --model {', '.join(models)} "
                               f"(the sweep's models: {', '.join(swept) or 'none'}; check --only-stage)")
        raise SimtreeError(f"sweep {spec['name']}: no grid points (check --only-stage / --model)")

    label = metadata.device_label(device)
    deployments = {name: deployment_of(spec, name, deployment) for name in {p.model for _, p in points}}
    for name, dep in sorted(deployments.items()):
        get_model(name).shard(dep)   # a split that does not divide the model: one line before any point
        if deployment is not None or spec.get("deployment") is not None:
            _check_holds(name, dep, label)
    _check_one_deployment(table, deployments)
    row_base = {"device": label, "dtype": dtype_name}
    keys = [pt.row_key({**row_base, "deployment": deployments[p.model], **_point_row(p)}) for _, p in points]
    selected = set(keys)
    table.parent.mkdir(parents=True, exist_ok=True)   # after every check: a refused sweep writes nothing
    _clear_stale_temps(table)
    if remeasure:
        echo(f"remeasure: {pt.drop_rows(table, selected)} rows of the selected points dropped "
             f"(an interrupted remeasure is finished by the same command without --remeasure)")
    in_table = pt.measured_keys(table)
    logged = set() if retry_failed else read_log_skips(table) - (selected if remeasure else set()) - in_table
    done = in_table | logged
    meta = {**metadata.collect_metadata(device), "sweep": spec["name"], "sweep_file": spec["_path"],
            # how fast the host ran when this sweep started (simtree run compares its own)
            "host_probe": host_probe("cuda" if device.startswith("cuda") else "cpu"),
            "sweep_id": f"{spec['name']}-{time.strftime('%Y%m%dT%H%M%S')}", "deployments": deployments,
            # how the MoE pieces route (pieces.mlp_piece; simtree fit reads it: profile_moe_routing)
            "moe_routing": "uniform",
            # the experts' weight format each model was timed with (bf16 or block-scaled fp8)
            "expert_dtypes": {name: get_model(name).mlp.get("expert_dtype", "bf16") for name in sorted(deployments)},
            # the runtime path each model was timed on (forms, the V4 attention linears' format): simtree
            # plan says when a bundle's differs from what the runtime runs (simtree/costs/runtime_path.py)
            "runtime_paths": {name: runtime_path(get_model(name), {k: v4_form(k) for k in V4_FORMS})
                              for name in sorted(deployments)},
            "sweep_spec": {k: v for k, v in spec.items() if not k.startswith("_")},
            "timing": {"target_s": target_s, "method": "CUDA graph of L2-rotated copies, event-timed per replay"
                       if device.startswith("cuda") else "perf_counter"}}
    old_meta = pt.read_meta(table)
    meta["previous_sweeps"] = _previous_sweeps(old_meta)
    # The sidecar describes the machine that measured the table's rows: it is rewritten once
    # this call has added rows (at its first flush), never by a call that adds none.

    res = SweepResult(table)
    threads = torch.get_num_threads()
    if not device.startswith("cuda"):  # oversubscribed CPUs stall multi-threaded GEMMs badly
        torch.set_num_threads(int(spec.get("cpu_threads", 1)))
        meta["torch_threads"] = torch.get_num_threads()
    t_start = time.monotonic()
    dev = torch.device(device)
    l2 = l2_cache_bytes(dev)
    ctxs: dict[str, Ctx] = {}
    unavailable: dict[tuple, str] = {}
    entry_start: dict[int, float] = {}
    modes: dict[str, int] = {}
    todo = [(i, p, key) for (i, p), key in zip(points, keys) if key not in done]
    res.skipped_done = sum(key in in_table for key in keys)
    res.skipped_logged = len(points) - len(todo) - res.skipped_done
    res.to_run = len(todo)
    echo(f"sweep {spec['name']} on {label} ({dtype_name}): {len(todo)} points to run, "
         f"{res.skipped_done} already in the table"
         + (f", {res.skipped_logged} logged failed/unavailable (--retry-failed retries them)" if res.skipped_logged else "")
         + f"; budget {max_s / 60:.1f} min")

    # Rows are appended atomically in small batches (every flush_s seconds): rewriting the
    # whole table per point would cost more than timing it; a hard kill loses <= flush_s.
    pending: list[dict] = []
    last_flush = [time.monotonic()]
    flush_s, flush_rows = float(spec.get("flush_s", 3.0)), int(spec.get("flush_rows", 50))
    added = [0]   # rows this call wrote to the table

    def flush() -> None:
        rows = pending[:]
        pending.clear()
        last_flush[0] = time.monotonic()
        if rows:
            pt.append_rows(table, rows)
            if not added[0]:
                pt.write_meta(table, meta)
            added[0] += len(rows)
    interrupted = False
    bar = progress_bar(progress, len(todo))
    task = bar.add_task("profiling", total=len(todo)) if bar else None
    current = None
    alarm = hard_deadline(max_s + float(spec.get("grace_s", 45)))
    try:
        for entry_i, p, key in todo:
            if time.monotonic() - t_start > max_s:
                res.stopped = f"max {max_s / 60:.1f} min reached"
                break
            entry = spec["stages"][entry_i]
            entry_start.setdefault(entry_i, time.monotonic())
            group = (p.model, p.stage, p.variant)
            if (p.model, p.stage) != current:
                current = (p.model, p.stage)
                echo(f"[{time.monotonic() - t_start:6.1f}s] {p.model} {p.stage}")
            if entry.get("budget_s") and time.monotonic() - entry_start[entry_i] > float(entry["budget_s"]):
                advance(bar, task)   # not run
                continue
            if group in unavailable:
                res.unavailable += 1
                log_point(table, {"key": key, "status": "unavailable", "reason": unavailable[group]})
                advance(bar, task)
                continue
            if p.model not in ctxs:
                # one rank's shape: heads / MLP columns per TP rank, local experts under EP
                ctxs[p.model] = Ctx(get_model(p.model).shard(deployments[p.model]), dev, dtype,
                                    int(spec.get("seed", 0)))
            for name, c in ctxs.items():   # keep one model's weights (V4's experts are 13 GB)
                if name != p.model:
                    c.weights.clear()
            ctx = ctxs[p.model]
            ctx.notes.setdefault("core_variant", {}).update(spec.get("core_variants") or {})
            ck = f"{p.model}/{p.stage}/{p.variant}"
            t0 = time.monotonic()
            try:
                wl = build_workload(ctx, p, builders)   # raises Unavailable before any check runs
                if ck not in res.checks:
                    try:
                        res.checks[ck] = check_variant(ctx, p.stage, p.variant, builders)
                    except Unavailable:
                        raise
                    except Exception as exc:  # a wrong result is reported, the timing still runs
                        res.checks[ck] = "FAILED: " + one_line(exc)
                        echo(f"  check {ck}: {res.checks[ck]}")
                stats = _measure(wl, device, l2, target_s)
                row = {**row_base, "deployment": deployments[p.model], **_point_row(p),
                       "latency_us_median": stats.median_us,
                       "latency_us_p10": stats.p10_us, "latency_us_p90": stats.p90_us,
                       "repeats": stats.repeats}
                pending.append(row)
                modes[stats.mode] = modes.get(stats.mode, 0) + 1
                res.measured += 1
                log_point(table, {"key": key, "status": "ok", "mode": stats.mode, "copies": stats.copies,
                             "median_us": round(stats.median_us, 3), "seconds": round(time.monotonic() - t0, 3)})
            except Unavailable as exc:
                unavailable[group] = str(exc)
                res.unavailable += 1
                echo(f"  unavailable {p.model} {p.stage} {p.variant}: {exc}")
                log_point(table, {"key": key, "status": "unavailable", "reason": str(exc)})
            except Exception as exc:   # incl. SimtreeError from a kernel's own input checks
                msg = one_line(exc)
                if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in msg.lower():
                    res.oom += 1
                    log_point(table, {"key": key, "status": "oom", "reason": msg})
                    echo(f"  oom {p.model} {p.stage} {p.variant} b={p.batch_size} n={p.nodes_per_seq} l={p.context_len}")
                    advance(bar, task)
                    continue
                res.failed += 1
                log_point(table, {"key": key, "status": "failed", "reason": msg})
                if device.startswith("cuda") and (any(s in msg.lower() for s in _STICKY) or not cuda_alive()):
                    res.stopped = f"CUDA context lost at {p}: {msg}; rerun to resume"
                    echo("  " + res.stopped)
                    break
                if res.failed <= 20:
                    echo(f"  failed {p}: {msg}")
            finally:
                if device.startswith("cuda"):
                    try:
                        torch.cuda.empty_cache()
                    except Exception:  # a lost context is reported above
                        pass
            if pending and (len(pending) >= flush_rows or time.monotonic() - last_flush[0] > flush_s):
                flush()
            advance(bar, task)
    except Deadline:
        res.stopped = f"hard deadline {max_s / 60:.1f} min + grace reached inside a point"
        echo("  " + res.stopped)
    except KeyboardInterrupt:
        interrupted = True
        res.stopped = "interrupted; " + ("finish with the same command without --remeasure" if remeasure
                                         else "rerun the same command to resume")
    finally:
        alarm()
        flush()
        torch.set_num_threads(threads)
        if bar:
            bar.stop()
        res.elapsed_s = time.monotonic() - t_start
        if added[0]:
            # the table can hold rows of several sweeps (resumed, or re-measured stage by
            # stage): keep the earlier sweeps' checks, this sweep's override where it re-checked
            meta.update({"checks": {**old_meta.get("checks", {}), **res.checks},
                         "timing_modes": modes, "result": res.summary(),
                         "elapsed_s": round(res.elapsed_s, 1)})
            pt.write_meta(table, meta)
    if interrupted:
        echo(res.summary())
        raise KeyboardInterrupt

    if comm_entries and not interrupted and not res.stopped:
        from .collectives import run_collectives_entry
        for entry in comm_entries:
            left_s = max(0.0, max_s - (time.monotonic() - t_start))
            done = run_collectives_entry(entry, table, device=device, dtype_name=dtype_name, max_s=left_s,
                                         remeasure=remeasure, echo=echo, models=entry.get("models") or spec["models"])
            res.measured += done["measured"]
            res.skipped_done += done["skipped"]
            res.to_run += done["measured"] + done["failed"]
            res.failed += done["failed"]
            added[0] += done["measured"]
        res.elapsed_s = time.monotonic() - t_start
        if added[0]:
            meta.update({"checks": {**old_meta.get("checks", {}), **res.checks}, "result": res.summary(),
                         "elapsed_s": round(res.elapsed_s, 1)})
            pt.write_meta(table, meta)

    want_compose = spec.get("compose") if compose is None else compose
    if want_compose and table.exists() and not (added[0] or remeasure):
        # nothing changed: the last composition stands (not rewritten, no new timestamps)
        res.compose = _read_compose_summary(table)
    elif want_compose and table.exists():   # pure pandas: also after a lost CUDA context
        from .compose import compose_table
        try:
            res.compose = compose_table(table, stack_layers=int((spec.get("compose") or {}).get("stack_layers", 8))
                                        if isinstance(spec.get("compose"), dict) else 8)
        except SimtreeError as exc:
            echo(f"composition skipped: {exc}")
    echo(res.summary())
    if res.not_run:
        again = "the same command without --remeasure" if remeasure else "the same command again"
        echo(f"{res.not_run} points not run (a stage's budget_s or the sweep's time limit ran out): "
             f"run {again} to measure them; the table keeps what it has")
    return res


def _check_holds(model: str, deployment: str, device_label: str) -> None:
    """Refuse, as `simtree plan` does, a deployment whose GPUs cannot hold the model's weights
    (the rank's, batch 1): this device's machine, else the default one (a CPU profiles ranks
    of the default machine's deployments)."""
    from simtree.machine.machines import get_machine, machine_for_device
    from simtree.deploy.memory import check_fits
    from simtree.deploy.shipped import DEFAULT_MACHINE

    check_fits(model, deployment, machine_for_device(device_label) or get_machine(DEFAULT_MACHINE), 1, 0)


def deployment_of(spec: dict, model: str, override: str | None = None) -> str:
    """The canonical deployment a sweep times ``model`` at: ``override`` (``--deployment``),
    else the sweep's ``deployment`` (one for all models, or {model: deployment}), else one GPU."""
    dep = override if override is not None else spec.get("deployment")
    if isinstance(dep, dict):
        dep = dep.get(model)
    return parse_deployment(dep or DEFAULT_DEPLOYMENT).name


def _check_one_deployment(table: Path, deployments: dict) -> None:
    """A table holds one deployment per model: refuse (before any point) a sweep that would add
    rows of another deployment of a model already in it."""
    if not table.exists():
        return
    from simtree.costs.profile_table import load_profile

    df = load_profile(table, allow_empty=True)
    for model, dep in sorted(deployments.items()):
        have = sorted(set(df.loc[df["model"] == model, "deployment"]) - {dep})
        if have:
            raise SimtreeError(f"{table.name} holds {model} rows at {', '.join(have)}: a sweep at {dep} writes its own "
                               f"table (--out), one deployment per model and table")


def _previous_sweeps(old_meta: dict) -> list[dict]:
    """The sidecar's earlier sweeps, the last one added with the machine it ran on (a later
    sweep on another machine rewrites the sidecar's machine facts).  Sidecars written before
    sweeps were recorded with their machine list bare sweep ids: {"sweep_id": id} each."""
    prev = old_meta.get("previous_sweeps")
    prev = [{"sweep_id": p} if isinstance(p, str) else p
            for p in (prev if isinstance(prev, list) else []) if isinstance(p, (str, dict))]
    if "sweep_id" in old_meta:
        prev.append({k: old_meta[k] for k in ("sweep_id", "device", "gpu_name", "host", "collected", "result")
                     if k in old_meta})
    return prev


def _read_compose_summary(table: Path) -> dict:
    from simtree.fileio import read_json

    from simtree.costs.profile_table import side_path

    path = side_path(table, "compose.json")
    try:
        summary = read_json(path, "composition summary") if path.exists() else {}
    except SimtreeError:
        return {}
    return summary if isinstance(summary, dict) else {}


def _clear_stale_temps(table: Path) -> None:
    """Temp files a killed write left beside the table (``write_atomic``'s ``.<name>.*.tmp``)."""
    from simtree.costs.profile_table import side_path

    if table.parent.is_dir():
        for name in (table.name, side_path(table, "meta.json").name, side_path(table, "compose.json").name):
            for tmp in table.parent.glob(f".{name}.*.tmp"):
                tmp.unlink(missing_ok=True)


def _measure(wl, device: str, l2: int, target_s: float):
    """Build the point's step (plus L2-rotation copies on GPU) and time it; the buffers die
    with this frame so the allocator can return them before the next point."""
    from .timing import rotation_copies, time_workload

    step, inst = wl.make()
    fns = [step]
    copies = rotation_copies(inst, l2) if device.startswith("cuda") and wl.shared_bytes < 2 * l2 else 1
    if copies > 1:
        # Rotation only matters while re-reading L2-resident inputs is a visible part of the
        # step; a step over ~1 ms dwarfs an L2 refill (~15 us), so time it alone.
        import torch
        step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 > 1e-3:
            copies = 1
    for _ in range(copies - 1):
        fns.append(wl.make()[0])
    return time_workload(fns, device, target_s=target_s, use_graph=not wl.eager)


def _point_row(p: Point) -> dict:
    return {"stage": p.stage, "model": p.model, "variant": p.variant, "batch_size": p.batch_size,
            "nodes_per_seq": p.nodes_per_seq, "total_tokens": p.tokens, "context_len": p.context_len,
            "tree_shape": p.tree_shape, "num_steps": p.num_steps, "topk": p.topk}


def main(argv: list[str] | None = None) -> int:
    """``python -m simtree.profiler.sweep [--sweep SWEEP] [--out OUT] [--device D] [--max-minutes M]``
    (``simtree profile`` without the runtime's own variant, runtime_tiny: the profiler does not
    import the runtime)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m simtree.profiler.sweep", description=main.__doc__)
    ap.add_argument("--sweep", default=None)
    ap.add_argument("--out", default="reports/profile.csv")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--only-stage", default=None, help="one stage, or several comma-separated")
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--retry-failed", action="store_true")
    ap.add_argument("--remeasure", action="store_true",
                    help="measure the selected points again (their rows are dropped first)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--deployment", default=None, help="time each model's rank of this deployment, e.g. ep=8")
    args = ap.parse_args(argv)
    try:
        res = run_sweep(args.sweep, args.out, device=args.device, max_minutes=args.max_minutes,
                        only_stage=args.only_stage, models=args.model, retry_failed=args.retry_failed,
                        remeasure=args.remeasure, deployment=args.deployment,
                        progress=not args.no_progress, echo=lambda s: print(s, flush=True))
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return res.exit_code


if __name__ == "__main__":
    sys.exit(main())
