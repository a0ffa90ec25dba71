"""Measured against predicted at full scale: what ``simtree run --model ...`` runs.

    result = full_run("qwen3.6-27b", device="cuda", costs="B.json", policy="P.json",
                      batch_sizes=[1, 4, 16, 64], acceptance="gsm8k", out="DIR")

Per batch size: plain decoding, linear D=4 and the policy file's choice for (workload, batch)
- a choice the runtime cannot build on the device is skipped with a one-line note.  cost_aware
and batch_alloc decide each round's budgets from the cost bundle (none given: their runs fail,
each a row saying so); their bucket (``nodes``) is the most nodes the simulator's decision
gives any acceptance level (``acceptance.adaptive_bucket``; live: the max budget), the nodes
past a round's budget padding.  Each run: a fresh engine (CUDA graphs captured per bucket), a
context of ``context_len`` tokens, ``warmup_rounds`` rounds, then ``rounds`` measured rounds.

Acceptance (every row says which): ``replay`` from a trace file (``--replay``) or sampled on the
device from an acceptance model (``--acceptance``: a workload preset or a trace file, as
``simtree simulate`` reads it; stratified draws by default, ``sampling="iid"`` for independent
ones); ``live`` otherwise (the target decides; with random weights it accepts little).  A
replay's measured rounds start at the first row of its table.

Predictions come from the cost bundle (none given: the rows are measured only, NaN predicted)
and the simulator:

* ``predicted_round_ms`` - the cost models for the trees actually built: C_d(s, k, b) +
  C_v(nodes, l, b) averaged over the contexts l the measured rounds started at (plain: C_v(1,
  l, b), no draft).  ``cost_rel_err`` compares it with the measured round time: the cost error.
* ``predicted_tok_s`` - ``simtree.planning.simulate`` with the acceptance model behind the
  replay (the trace's positional fit, or the model sampled), the run's context and output
  length: cost x acceptance.  cost_aware and batch_alloc are priced as the plan prices them:
  their rule's trees (capped at the bucket) accepted, the run's bucket verified every round
  (``analytic_run(..., bucket=nodes)``).  ``rel_err`` is its error; ``accept_rel_err`` compares the
  accepted tokens per round (bonus included) it expects with the measured ones.  Live rows
  have no acceptance model: their prediction uses the measured acceptance (cost error only).

Errors are (predicted - measured) / measured.  A run that fails is recorded as a row with its
one-line reason, and the next run goes on.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from simtree.costs.runtime_path import path_note
from simtree.acceptance.model import Workload, get_workload
from simtree.acceptance.traces import MAX_CONTEXT_LEN
from simtree.errors import ExtrapolationWarning, SimtreeError, captured_warnings, check_int
from simtree.fileio import write_text_atomic
from simtree.models import get_model
from simtree.planning.modes import BLOCK_DRAFTER_MODES
from simtree.planning.simulate import PolicySpec, analytic_run

from .acceptance import SAMPLINGS, Live, ModelReplay, StratifiedReplay, TraceReplay, adaptive_bucket
from .block_engine import check_block_len, make_engine
from .build import build_model
from .drafting import RUNTIME_MODES, RoundShape, pad_round, round_shape
from .engine import release_memory
from .report import EXTRA_COLUMNS, SUMMARY_COLUMNS, write_summary

__all__ = ["full_run", "check_runs_fit", "memory_use", "run_max_len", "repredict", "run_shape", "runs_json",
           "measure_policy", "predict", "RunConfig", "AcceptanceSource", "SUMMARY_COLUMNS", "EXTRA_COLUMNS", "PLAIN",
           "LINEAR_D4"]

# rounds issued onto an idle device after each timed run: their issue time is the host_ms reported
HOST_PROBE_ROUNDS = 5

PLAIN, LINEAR_D4 = PolicySpec.from_dict("none"), PolicySpec.from_dict("linear", {"budget": 4})
MIN_DRAWS = 96     # replay draws per run that `simtree run --model` and gpu_run ask for by default
BATCH_SIZES = (1, 4, 16, 64)     # full_run's (and check_runs_fit's) default batch sizes


@dataclass(frozen=True)
class RunConfig:
    """A full_run's rounds and replay; its defaults are full_run's and check_runs_fit's."""
    context_len: int = 512
    rounds: int = 32
    warmup_rounds: int = 4
    seed: int = 0
    sampling: str = "stratified"     # acceptance-model replays: stratified or iid (ModelReplay)
    min_draws: int = 0               # a batch of B runs at least ceil(min_draws / B) rounds

    def for_batch(self, batch_size: int) -> "RunConfig":
        return replace(self, rounds=max(self.rounds, -(-int(self.min_draws) // max(int(batch_size), 1))))


def _rel(pred, meas) -> float:
    return (pred - meas) / meas if meas and math.isfinite(meas) and math.isfinite(pred) else float("nan")


class AcceptanceSource:
    """How each run gets its acceptance source, and the model its prediction uses."""

    def __init__(self, replay, acceptance, device, seed: int, sampling: str = "stratified"):
        self.replay, self.device, self.seed, self.sampling = replay, device, seed, sampling
        self.workload = None
        if sampling not in SAMPLINGS:
            raise SimtreeError(f"replay sampling {sampling!r} unknown: one of {', '.join(SAMPLINGS)}")
        if replay is not None and acceptance is not None:
            raise SimtreeError("give --replay or --acceptance, not both")
        if acceptance is not None:
            self.workload = get_workload(str(acceptance))
            self.name = self.workload.name
        elif replay is not None:
            probe = TraceReplay(replay, 1, "cpu")
            self.name, self.model = probe.workload, probe.prediction_model()
            ctx = [r.context_len for r in probe.records if r.context_len is not None]
            self.context = float(np.mean(ctx)) if ctx else None
        else:
            self.name = "live"

    @property
    def label(self) -> str:
        """The acceptance column: live, replay:<trace file> or replay:<acceptance model>."""
        if self.workload is not None:
            return f"replay:{self.workload.name}"
        return f"replay:{Path(self.replay).name}" if self.replay is not None else "live"

    def default_context(self) -> int:
        if self.workload is not None:
            return max(1, int(round(self.workload.mean_prompt_len)))
        return max(1, int(round(getattr(self, "context", None) or 512)))

    def make(self, rs: RoundShape, batch_size: int, rounds: int, costs=None, context_len: float | None = None):
        """The source of one run; ``costs``, ``context_len``: what cost_aware and batch_alloc decide with."""
        if self.workload is not None:
            decide = {"costs": costs, "context_len": context_len}
            if self.sampling == "stratified":
                return StratifiedReplay(self.workload.acceptance, rs, self.device, batch_size, rounds, self.seed,
                                        **decide)
            return ModelReplay(self.workload.acceptance, rs, self.device, self.seed, batch_size, **decide)
        if self.replay is not None:
            return TraceReplay(self.replay, batch_size, self.device).score_trees(
                rs, self.device, batch_size=batch_size, costs=costs, context_len=context_len)
        return Live()

    def round_shape(self, spec: PolicySpec, batch_size: int, costs, context_len: float) -> RoundShape:
        """The run's static shape: cost_aware and batch_alloc take the bucket of their analytic
        decision under the acceptance model (:func:`.acceptance.adaptive_bucket`) where there
        are one and a cost bundle, else their max budget."""
        rs = round_shape(spec)
        model = self.prediction_model()
        if model is None or costs is None or (rs.alloc == "fixed" and rs.drafter != "dspark") or \
                rs.drafter in ("block", "tfm"):
            return pad_round(rs, batch_size, costs)
        if rs.drafter == "dspark":   # the chain cut to the longest prefix the plan's decision verifies
            from simtree.planning.drafter_candidates import score_spec
            nodes = int(score_spec(costs, model, spec, batch_size, context_len)["nodes_per_seq"])
            return pad_round(round_shape(spec, nodes), batch_size, costs)
        return pad_round(round_shape(spec, adaptive_bucket(model, rs, batch_size, costs, context_len)), batch_size, costs)

    def shape_or_none(self, spec: PolicySpec, batch_size: int, costs, context_len: float) -> RoundShape | None:
        """:meth:`round_shape`, None where it cannot be made (full_run makes that run a failed row)."""
        try:
            with _decisions_quiet():
                return self.round_shape(spec, batch_size, costs, context_len)
        except Exception:   # noqa: BLE001 - a failed run is a row
            return None

    def prediction_model(self):
        if self.workload is not None:
            return self.workload.acceptance
        return getattr(self, "model", None)


def run_max_len(context_len: int, path_rows: int, warmup_rounds: int, rounds: int) -> int:
    """The rows a timed run's caches hold per sequence: the context, every round's accepted path
    (warm-up, measured and two spare: the capture's and the host probe's) and 8 more."""
    return int(context_len) + (int(warmup_rounds) + int(rounds) + 2) * int(path_rows) + 8


def measure_policy(model, rs: RoundShape, batch_size: int, source, cfg: RunConfig, costs=None):
    """(RunStats of ``cfg.rounds`` measured rounds, whether CUDA graphs ran); a capture that
    fell back to eager stages leaves its reason in the stats' notes.  ``costs``: the bundle
    cost_aware and batch_alloc decide with."""
    max_len = run_max_len(cfg.context_len, rs.path_rows, cfg.warmup_rounds, cfg.rounds)
    engine = make_engine(model, rs, batch_size, max_len, source, costs=costs)
    try:
        engine.capture()
        engine.fill_context(cfg.context_len, cfg.seed)
        if cfg.warmup_rounds:
            engine.run(rounds=cfg.warmup_rounds)
        engine.rewind_source()      # a replay's measured rounds start at its first row
        stats = engine.run(rounds=cfg.rounds, host_probe=HOST_PROBE_ROUNDS)
        if engine.capture_error:
            stats.notes.append(f"CUDA graph capture failed, eager stages: {engine.capture_error}")
        return stats, engine.graphs is not None
    finally:
        del engine
        release_memory()


NO_PREDICTION = {"predicted_round_ms": float("nan"), "predicted_tok_s": float("nan"), "predicted_accepted": float("nan")}


def predict(costs, acc_model, spec: PolicySpec, rs: RoundShape, batch_size: int, stats, workload: str) -> dict:
    """The cost-model round time of the trees built and the simulator's throughput (module
    docstring); NaN throughout without a cost bundle (``costs`` None)."""
    if costs is None:
        return dict(NO_PREDICTION)
    B = batch_size
    if rs.block_drafter:
        return _predict_block_drafter(costs, acc_model, spec, rs.nodes, B, stats)
    draft_us = 0.0 if rs.plain else float(costs.draft.predict(*spec.draft_shape(), B))
    verify_us = float(np.mean([float(costs.verify.predict(rs.nodes, float(c), B)) for c in stats.context_lens]))
    round_ms = (draft_us + verify_us) / 1e3
    if acc_model is None or rs.plain:
        acc = stats.accepted_tokens_per_round
        return {"predicted_round_ms": round_ms, "predicted_tok_s": B * acc / round_ms * 1e3,
                "predicted_accepted": 1.0 if rs.plain else float("nan")}
    wl = Workload(workload, acc_model, np.array([int(round(stats.context_lens[0]))]),
                  max(1, int(round(stats.tokens / B))), "full runtime")
    # the simulator's analytic run (simulate's, without its plain and linear comparisons, whose
    # shapes the run does not measure).  A measured run counts every token its rounds accept (a
    # fixed number of rounds, no sequence ends inside it): the prediction of that is accepted
    # tokens per round over the mean round, without the end-of-output term of the throughput
    # cost_aware and batch_alloc: the device verifies the run's bucket every round, as the plan prices them
    adaptive = spec.fixed_budget is None
    # (a padded bucket: priced at its nodes, the rule's trees capped at the bucket before padding)
    a = analytic_run(wl, spec, costs, B, bucket=rs.nodes, tree_cap=rs.padded_from or rs.nodes) if adaptive \
        else analytic_run(wl, spec, costs, B)
    round_us = a["total_us"] / a["rounds"]
    g, sim_tok_s = float(a["g"]), B * float(a["g"]) / float(round_us) * 1e6
    out = {"predicted_round_ms": round_ms, "predicted_tok_s": sim_tok_s, "predicted_accepted": g}
    if adaptive:
        out["note"] = (f"{spec.mode} verifies its bucket of {rs.nodes} nodes per sequence every round (predicted at "
                       f"that cost, as the plan prices it); its rule's trees hold {a['tree_nodes']:.1f} nodes")
    return out


def _predict_block_drafter(costs, acc_model, spec: PolicySpec, nodes: int, batch_size: int, stats) -> dict:
    """A block drafter's round as the planner scores it (:func:`simtree.planning.drafter_candidates.score_spec`)
    at the run's mean context: its C_d, C_v of the ``nodes`` its bucket verifies, the acceptance
    model's tokens per round (without one: the measured, the prediction then only of the round time)."""
    from simtree.planning.drafter_candidates import score_spec
    ctx = float(np.mean(stats.context_lens))
    live = acc_model is None     # C_d does not depend on the acceptance model: any one prices it
    r = score_spec(costs, get_workload("gsm8k").acceptance if live else acc_model, spec, batch_size, ctx)
    verify_us = float(np.mean([float(costs.verify.predict(nodes, float(c), batch_size)) for c in stats.context_lens]))
    round_ms = (r["draft_us"] + verify_us) / 1e3
    g = stats.accepted_tokens_per_round if live else r["tokens_per_round"]
    return {"predicted_round_ms": round_ms, "predicted_tok_s": batch_size * g / round_ms * 1e3,
            "predicted_accepted": float("nan") if live else r["tokens_per_round"],
            "note": f"{spec.mode}: the round priced by the drafter's own C_d"}


def _policies(policy, workload: str, batch_size: int, notes: list, extra=()) -> list[tuple[str, PolicySpec]]:
    out = [("plain", PLAIN), ("linear_d4", LINEAR_D4)]
    if policy is None:
        return out + list(extra)
    from simtree.planning.policy_file import Policy
    entry, clamped = Policy.load(policy).resolve(workload, batch_size)
    if clamped:
        notes.append(clamped)
    if entry.mode not in RUNTIME_MODES:
        notes.append(f"batch {batch_size}: the policy's {entry.mode} entry is not built on the device by the full "
                     f"runtime ({', '.join(RUNTIME_MODES)}): skipped")
        return out + list(extra)
    return out + [("plan", entry.params), *extra]     # the plan's choice before the shapes beside it


def run_shape(run: dict) -> RoundShape:
    """The shape a run measured (its bucket: ``nodes``, where it has one; ``padded_from``: the
    bucket before the bundle's pad map padded it)."""
    if run.get("padded_from"):
        rs = round_shape(PolicySpec.from_dict(run["mode"], run["params"]), run["padded_from"])
        return replace(rs, nodes=int(run["nodes"]), padded_from=int(run["padded_from"]))
    return round_shape(PolicySpec.from_dict(run["mode"], run["params"]), run.get("nodes"))


def _row(run: dict, source_label: str, pred: dict, cfg: RunConfig) -> dict:
    stats, rs = run["stats"], run_shape(run)
    meas_acc = stats.accepted_tokens_per_round
    return {"model": run["model"], "deployment": run["deployment"], "policy": f"{run['label']}:{rs.name}",
            "batch_size": run["batch_size"], "acceptance": source_label, "measured_tok_s": stats.tok_s,
            "predicted_tok_s": pred["predicted_tok_s"], "rel_err": _rel(pred["predicted_tok_s"], stats.tok_s),
            "measured_round_ms": stats.round_ms, "predicted_round_ms": pred["predicted_round_ms"],
            "draft_ms": float(np.median(stats.draft_ms)), "verify_ms": float(np.median(stats.verify_ms)),
            "commit_ms": float(np.median(stats.commit_ms)), "host_ms": float(np.median(stats.host_ms)),
            "cost_rel_err": _rel(pred["predicted_round_ms"], stats.round_ms),
            "accept_rel_err": _rel(pred["predicted_accepted"], meas_acc), "measured_accepted": meas_acc,
            "predicted_accepted": pred["predicted_accepted"], "speedup_vs_plain": float("nan"),
            "host_share": float(np.median(stats.host_ms)) / stats.round_ms, "nodes": rs.nodes,
            "padded_from": rs.padded_from,
            "context_len": cfg.context_len, "rounds": stats.rounds, "graphs": run["graphs"],
            "note": "; ".join(stats.notes + ([pred["note"]] if pred.get("note") else []) + _pad_note(rs))}


def _pad_note(rs: RoundShape) -> list[str]:
    if not rs.padded_from:
        return []
    return [f"verified in a bucket of {rs.nodes} nodes padded from {rs.padded_from} (the bundle's pad map: "
            "a cheaper verify at this batch, simtree.costs.verify_pad)"]


def _failed_row(run: dict, source_label: str, cfg: RunConfig) -> dict:
    rs = run_shape(run)
    row = {c: float("nan") for c in SUMMARY_COLUMNS + EXTRA_COLUMNS}
    row.update(model=run["model"], deployment=run["deployment"], policy=f"{run['label']}:{rs.name}",
               batch_size=run["batch_size"], acceptance=source_label, nodes=rs.nodes, context_len=cfg.context_len,
               rounds=0, graphs=False, note=run["error"])
    return row


def _rows(runs: list[dict], costs, source: AcceptanceSource, cfg: RunConfig, workload: str,
          notes: list) -> list[dict]:
    """One summary row per run, predictions from ``costs``; speed-ups against each batch's plain run."""
    rows = []
    for run in runs:
        if run.get("error"):
            rows.append(_failed_row(run, source.label, cfg))
            continue
        spec = PolicySpec.from_dict(run["mode"], run["params"])
        with captured_warnings() as caught:    # extrapolation of the cost models: notes
            pred = predict(costs, source.prediction_model(), spec, run_shape(run), run["batch_size"],
                           run["stats"], workload)
        notes += [" ".join(str(w.message).split()) for w in caught]
        rows.append(_row(run, source.label, pred, cfg))
    for B in dict.fromkeys(r["batch_size"] for r in rows):
        plain = next((r["measured_tok_s"] for r in rows if r["batch_size"] == B and r["policy"].startswith("plain")),
                     float("nan"))
        for r in rows:
            if r["batch_size"] == B and plain == plain and plain:
                r["speedup_vs_plain"] = r["measured_tok_s"] / plain
    return rows


def _load_costs(costs, required: bool = True):
    if costs is None:
        if not required:
            return None
        raise SimtreeError("the full-scale run needs --costs (a cost bundle) for its predictions")
    if not hasattr(costs, "verify"):
        from simtree.costs.model import load_costs
        costs = load_costs(costs)
    return costs


SAMPLING_NOTE = "replay sampling: "


def _sampling_note(sampling: str, workload: str) -> str:
    kind = "StratifiedReplay" if sampling == "stratified" else "ModelReplay"
    return f"{SAMPLING_NOTE}{sampling} (acceptance model {workload}; {kind})"


def full_run(model, *, device: str = "cuda", costs=None, policy=None, batch_sizes=BATCH_SIZES, replay=None,
             acceptance=None, policy_workload: str | None = None, out=None, context_len: int | None = None,
             rounds: int = RunConfig.rounds, warmup_rounds: int = RunConfig.warmup_rounds, seed: int = RunConfig.seed,
             dtype=None, progress=None, deadline: float | None = None, extra=(), sampling: str = RunConfig.sampling,
             min_draws: int = RunConfig.min_draws, skip=None) -> dict:
    """Run every (batch size, policy) and return {"rows", "notes", "config", "runs", "files"};
    ``model``: a registry name, a shape or a built model; ``progress(line)`` gets one line per
    run.  ``runs`` keeps every run's per-round measurements (:func:`runs_json` makes them JSON,
    :func:`repredict` predicts them again from another cost bundle).  ``deadline`` (a
    ``time.time()``): runs not started by then are skipped, each a row saying so; ``skip``: a line,
    every run is skipped, its row saying "skipped: <skip>" (a point the deployment memory check
    refuses), or a function of a run's PolicySpec and RoundShape (its verified bucket ``rs.nodes``,
    :func:`memory_use`) giving that line or None (a run the check refuses as it would allocate it:
    that run alone is skipped).  With ``out``
    the summary files are rewritten after every batch size, so a session cut short keeps the
    batch sizes it finished.  ``extra``: (label, PolicySpec) runs measured at every batch size
    besides plain and linear D=4 (e.g. the EAGLE shapes a plan made later may choose).
    ``sampling``: how an acceptance model's replay draws (stratified: ``StratifiedReplay``; iid:
    ``ModelReplay``).
    ``min_draws``: a batch of B sequences runs at least ceil(min_draws / B) measured rounds (a
    replay's accepted depths over rounds x B draws: small batches take more rounds).
    ``policy`` planning a deployment's batch under data-parallel attention (dp > 1) is refused in
    one line before anything runs: the rank runs B sequences, not ceil(B / dp) (plan the rank
    alone: :mod:`.rank_plan`)."""
    say = progress or (lambda line: None)
    if policy is not None:   # the runtime runs one rank with b sequences: not a deployment's batch b
        from simtree.planning.policy_file import Policy
        Policy.load(policy).check_rank_run(f"policy {policy}")
    costs, source, cfg = _setup(costs, replay, acceptance, device, context_len, rounds, warmup_rounds, seed, sampling,
                                min_draws)
    if isinstance(model, str) or not hasattr(model, "verify"):
        shape = get_model(model) if isinstance(model, str) else model
        say(f"building {shape.name} on {device}")
        model = build_model(model if isinstance(model, str) else shape, device, dtype, seed)   # a folder: its weights
    notes = [f"deployment: {model.deployment}", *getattr(model, "load_notes", [])]
    if acceptance is not None:
        notes.append(_sampling_note(sampling, source.name))
    if costs is None:
        notes.append("no cost bundle: measured only (summary.json keeps every round: "
                     "simtree.runtime.full.measure.repredict predicts them from a bundle later)")
    elif (stale := path_note(costs.meta)) is not None:    # the bundle prices a path this runtime no longer runs
        notes.append(stale)
        say(stale)
    workload = policy_workload or source.name
    for B in batch_sizes:     # a block drafter the bundle cannot price, or too long a block: one line, first
        for _, spec in _policies(policy, workload, B, [], extra):
            if spec.mode in BLOCK_DRAFTER_MODES:
                check_block_len(round_shape(spec), costs)
    runs = []
    pred_notes: list = []
    result = _result(runs, costs, source, cfg, workload, notes, replay, acceptance, None, pred_notes)
    for B in batch_sizes:
        measured = {}
        cfg_b = cfg.for_batch(B)
        for label, spec in _policies(policy, workload, B, notes, extra):
            run = {"label": label, "mode": spec.mode, "params": spec.to_dict(), "batch_size": B,
                   "model": model.shape.name, "deployment": model.deployment}
            try:
                with _decisions_quiet():
                    rs = source.round_shape(spec, B, costs, cfg_b.context_len)
            except Exception as exc:   # noqa: BLE001 - a failed run is a row
                run["error"] = "failed: " + " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                runs.append(run)
                continue
            run["nodes"] = rs.nodes
            if rs.padded_from:   # verified in the bundle's cheaper bucket (simtree.costs.verify_pad)
                run["padded_from"] = rs.padded_from
            why = skip(spec, rs) if callable(skip) else skip
            if why is not None or deadline is not None and rs not in measured and time.time() > deadline:
                run["error"] = f"skipped: {why}" if why is not None else "skipped: the session's time was up"
                runs.append(run)
                continue
            try:
                if rs not in measured:
                    t0 = time.perf_counter()
                    with _decisions_quiet():
                        src = source.make(rs, B, cfg_b.rounds, costs, cfg_b.context_len)
                        measured[rs] = measure_policy(model, rs, B, src, cfg_b, costs)
                    say(f"batch {B} {label} {rs.name}: {measured[rs][0].tok_s:.1f} tok/s, round "
                        f"{measured[rs][0].round_ms:.2f} ms ({time.perf_counter() - t0:.1f} s)")
                run["stats"], run["graphs"] = measured[rs]
            except Exception as exc:   # noqa: BLE001 - one failed run is a row; the next run goes on
                say(f"batch {B} {label} {rs.name} FAILED: {type(exc).__name__}: {exc}")
                run["error"] = "failed: " + " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                release_memory()
            runs.append(run)
        result = _result(runs, costs, source, cfg, workload, notes, replay, acceptance, out, pred_notes)
    return result


def _setup(costs, replay, acceptance, device, context_len, rounds, warmup_rounds, seed, sampling, min_draws):
    """(cost bundle, AcceptanceSource, RunConfig) of a :func:`full_run` call: without ``context_len``
    the acceptance source's (its workload's mean prompt, a trace's mean context, else 512)."""
    check_int(rounds, "--rounds", 1)
    if context_len is not None:   # 0 was taken for "the workload's", a huge one ran on for ever
        check_int(context_len, "--context-len", 1, MAX_CONTEXT_LEN)
    costs = _load_costs(costs, required=False)
    source = AcceptanceSource(replay, acceptance, device, seed, sampling)
    return costs, source, RunConfig(context_len or source.default_context(), rounds, warmup_rounds, seed, sampling,
                                    min_draws)


def memory_use(spec: PolicySpec, rs: RoundShape, cfg: RunConfig) -> dict:
    """The deployment memory check's ``drafter`` and ``cache_len`` (simtree.deploy.memory.rank_memory's)
    for one run as :func:`measure_policy` allocates it: ``spec``'s drafter verifying the run's bucket
    ``rs.nodes`` per sequence, caches of :func:`run_max_len` rows at ``cfg`` (the batch's:
    :meth:`RunConfig.for_batch`)."""
    from simtree.deploy.drafter_memory import drafter_use
    return {"drafter": replace(drafter_use(spec), nodes=int(rs.nodes)),
            "cache_len": run_max_len(cfg.context_len, rs.path_rows, cfg.warmup_rounds, cfg.rounds)}


def check_runs_fit(shape, deployment, machine, *, batch_sizes=BATCH_SIZES, costs=None, policy=None, replay=None,
                   acceptance=None, policy_workload: str | None = None, context_len: int | None = None,
                   rounds: int = RunConfig.rounds, warmup_rounds: int = RunConfig.warmup_rounds,
                   seed: int = RunConfig.seed, sampling: str = RunConfig.sampling, min_draws: int = RunConfig.min_draws,
                   extra=(), device: str = "cuda") -> None:
    """The deployment memory check (simtree.deploy.memory.check_rank_fits: the rank alone with all b
    sequences) of every run :func:`full_run` measures given the same arguments - each batch size's
    policies, at the bucket it verifies, the cache rows it allocates and the context it runs -, on
    ``machine``: a one-line SimtreeError naming the first run refused.  A run whose shape cannot be
    made is left to full_run (a failed row)."""
    from simtree.deploy.memory import check_rank_fits
    costs, source, cfg = _setup(costs, replay, acceptance, device, context_len, rounds, warmup_rounds, seed, sampling,
                                min_draws)
    workload = policy_workload or source.name
    for B in batch_sizes:
        cfg_b = cfg.for_batch(B)
        for label, spec in _policies(policy, workload, B, [], extra):
            if (rs := source.shape_or_none(spec, B, costs, cfg_b.context_len)) is None:
                continue
            try:
                check_rank_fits(shape, deployment, machine, B, cfg_b.context_len, **memory_use(spec, rs, cfg_b))
            except SimtreeError as exc:
                raise SimtreeError(f"run {label}:{rs.name} at batch {B}, context {cfg_b.context_len}, {rs.nodes} "
                                   f"node{'s' if rs.nodes > 1 else ''} a sequence: {exc}") from None


@contextlib.contextmanager
def _decisions_quiet():
    """The adaptive modes' decisions query C_v over contexts and node counts: their extrapolation
    is no prediction (the predictions' own, which the rows' notes keep, are)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExtrapolationWarning)
        yield


def _result(runs, costs, source, cfg, workload, notes, replay, acceptance, out, pred_notes: list) -> dict:
    """The rows of the runs so far, written under ``out``; ``notes`` (the runs') and
    ``pred_notes`` (the predictions', e.g. a cost model's extrapolation warning, which a bundle
    gives once: the list carries over from call to call)."""
    rows = _rows(runs, costs, source, cfg, workload, pred_notes)
    config = {**cfg.__dict__, "replay": None if replay is None else str(replay), "acceptance": acceptance,
              "workload": workload}
    result = {"rows": rows, "notes": list(dict.fromkeys(notes)), "prediction_notes": list(dict.fromkeys(pred_notes)),
              "config": config, "runs": runs, "files": {}}
    if out is not None:
        result["files"] = write_summary(rows, result["notes"] + result["prediction_notes"], Path(out))
        # every round's measurements, so another bundle can predict the runs again (repredict)
        saved = {**result, "runs": runs_json(runs)}
        write_text_atomic(Path(out) / "summary.json", json.dumps(saved, default=str, indent=1))
        result["files"]["json"] = str(Path(out) / "summary.json")
    return result


def runs_json(runs: list[dict]) -> list[dict]:
    """The runs with their RunStats as plain lists (summary.json)."""
    out = []
    for run in runs:
        r = dict(run)
        if "stats" in r:
            st = r["stats"]
            r["stats"] = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in st.__dict__.items()}
        out.append(r)
    return out


def repredict(summary, costs, out=None) -> dict:
    """Predict the measured runs of a summary.json (``full_run``'s result with ``runs_json``)
    again from another cost bundle - e.g. one fitted from the runtime's own step profile - and
    write the summary files under ``out``: the measurements stay, the predictions change."""
    from .engine import RunStats
    if not isinstance(summary, dict):
        summary = json.loads(Path(summary).read_text())
    cfg_d = summary["config"]
    # sessions from before the stratified replay drew independently
    cfg = RunConfig(cfg_d["context_len"], cfg_d["rounds"], cfg_d["warmup_rounds"], cfg_d["seed"],
                    cfg_d.get("sampling", "iid"))
    source = AcceptanceSource(cfg_d.get("replay"), cfg_d.get("acceptance"), "cpu", cfg.seed, cfg.sampling)
    runs = []
    for run in summary["runs"]:
        run = dict(run)
        if "stats" in run:
            st = dict(run["stats"])
            for k in ("accepted", "draft_ms", "verify_ms", "commit_ms", "host_ms", "context_lens"):
                st[k] = np.asarray(st[k], np.float64 if k != "accepted" else np.int64)
            run["stats"] = RunStats(**st)
        runs.append(run)
    pred_notes: list = []      # the session's own prediction notes belong to its bundle: replaced
    rows = _rows(runs, _load_costs(costs), source, cfg, cfg_d["workload"], pred_notes)
    # the sampling note from the recorded config (sessions before StratifiedReplay named ModelReplay)
    notes = [_sampling_note(cfg.sampling, source.name) if n.startswith(SAMPLING_NOTE) else n
             for n in summary.get("notes", [])]
    result = {"rows": rows, "notes": notes, "prediction_notes": list(dict.fromkeys(pred_notes)),
              "config": cfg_d, "runs": summary["runs"], "files": {}}
    if out is not None:
        result["files"] = write_summary(rows, result["notes"] + result["prediction_notes"], Path(out))
    return result
