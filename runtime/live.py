"""``live_run``: decode live with a policy on the shipped tiny default (or a given checkpoint of a
byte vocabulary) and report measured against predicted throughput.  What ``simtree run`` calls.

The model is a Hugging Face checkpoint read by ``simtree.checkpoints`` (the shipped
``runtime-tiny``: qwen3_5_text with its MTP layer, ``simtree.runtime.full.tiny``), decoded by the
runtime's one engine (:class:`simtree.runtime.full.engine.FullEngine`, through
:func:`simtree.runtime.full.generate.generate`), the MTP layer drafting.

A static batch decodes all B sequences every round until the slowest has ``max_new_tokens``;
sequences already done keep producing tokens that are cut from their outputs.  Measured over
the decode rounds (the prefill, which makes each output's first token, is reported apart):

* ``tokens_per_s`` (compared with the prediction): the tokens the outputs keep
  (``max_new_tokens - 1`` per prompt) per second of round time, each round's time counted in
  the share of sequences still short of max_new_tokens in it (``live / B``).  That is what
  simtree.planning.simulate predicts: it runs every sequence of the batch every round, outputs
  ``output_len`` tokens per sequence (a last round's surplus is not output) and has no
  finished sequences idling in the batch (they finish together, or their slot takes a new
  request).
* ``delivered_tokens_per_s``: the same tokens over all the rounds' time: what this static
  batch delivered, the rounds after a sequence finished included.
* ``produced_tokens_per_s``: every token the rounds produced, cut ones included;
  ``overshoot`` = produced / delivered - 1.
* accepted tokens per round (incl. the bonus token, as simtree.planning.simulate counts), per-round
  latency median / p90 and its draft / verify / commit split (null without decode rounds).

Predicted (when a cost bundle is given and a decode round ran): simtree.planning.simulate with the
acceptance model fitted from this run's own traces (the depth x rank x confidence fit where
they log the drafter's top-K, else the positional fit), this run's prompt lengths
and ``max_new_tokens - 1`` output tokens (what the decode rounds must produce) - so the
comparison tests the cost model, not the acceptance model.  A bundle (or policy) of another
model or device predicts that model on that device: the report then carries a warning, the
prediction is marked ``comparable: false`` and the host-speed comparison is skipped.

Files: ``out/run.json`` and ``out/traces.jsonl`` of one run always belong together: traces are
staged under a hidden name and moved into place at the end, the old run.json is removed first
and the new one written atomically.
"""
from __future__ import annotations

import contextlib
import json
import math
import platform
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from simtree.costs.model import Costs
from simtree.errors import ExtrapolationWarning, SimtreeError, captured_warnings, check_int
from simtree.fileio import write_text_atomic
from simtree.machine.metadata import device_label, require_device
from simtree.planning.modes import ADAPTIVE_MODES, BLOCK_DRAFTER_MODES, NoneParams, PolicySpec
from simtree.runtime.data import prompts as load_prompts
from simtree.runtime.full.build import build_model
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.generate import check_fits, check_spec, generate, greedy_decode
from simtree.runtime.tokenizer import VOCAB_SIZE, ByteTokenizer
from simtree.runtime.trace import TraceWriter

__all__ = ["live_run", "RUNTIME_MODEL", "dumps"]
RUNTIME_MODEL = "runtime-tiny"   # the shipped tiny default (simtree/data/models/runtime-tiny), as profiles name it
COMPARISON = ("measured.tokens_per_s vs predicted.tokens_per_s: output tokens (max_new_tokens - 1 per "
              "prompt from the decode rounds) per second of round time counted while each sequence "
              "still decoded, as simtree.planning.simulate counts; delivered_tokens_per_s adds the rounds a "
              "finished sequence waited for the batch, produced_tokens_per_s counts the cut tokens too")


def _finite(obj):
    """The report with every NaN / infinite float as None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.generic):
        return _finite(obj.item())
    return obj


def dumps(report: dict) -> str:
    """Strict JSON of a run report (NaN / inf -> null)."""
    return json.dumps(_finite(report), indent=1, allow_nan=False)


def _device_name(device: str) -> str:
    """The device as profile tables and cost bundles name it (``device_label``)."""
    require_device(device)
    return device_label(device)


def _mismatch(what: str, source, model, device, here: str) -> str | None:
    """A warning line when ``model`` / ``device`` (of a cost bundle or policy) are not this
    runtime's model on this device; None when they match (or are not named)."""
    bad = []
    if model not in (None, "") and str(model) != RUNTIME_MODEL:
        bad.append(f"model {model}")
    if device not in (None, "") and str(device) != here:
        bad.append(f"device {device}")
    if not bad:
        return None
    return (f"{what} {source} is for {' on '.join(bad)}, not this run's {RUNTIME_MODEL} on {here}: "
            "its predictions are not comparable with this run's measurements")


def _resolve_spec(policy, policy_workload, workload, batch_size, spec, warn, here: str) -> tuple[PolicySpec, dict]:
    """(the policy to run, what the report records about a policy file); a policy file's entry
    for (workload, batch size) replaces ``spec``."""
    if policy is not None:
        from simtree.planning.policy_file import Policy
        path = Path(policy)
        if path.is_dir():
            hint = f" ({path / 'policy.json'})" if (path / "policy.json").is_file() else ""
            raise SimtreeError(f"--policy {path} is a folder: give the policy JSON file{hint}")
        pol = Policy.load(path)
        if pol.model not in (None, "") and str(pol.model) != RUNTIME_MODEL:   # as `simtree simulate` refuses it
            raise SimtreeError(f"--policy {path} is a plan for {pol.model}, not {RUNTIME_MODEL}, the model this run "
                               "decodes: plan for it (scripts/loop_cpu.sh does) or give --mode and its parameters")
        name = policy_workload or workload
        entry, clamped = pol.resolve(name, batch_size)
        if clamped:
            warn(clamped)
        other = _mismatch("policy", path, pol.model, pol.device, here)
        if other:
            warn(other)
        return entry.params, {"policy": str(policy), "policy_workload": name,
                                   "predicted_tok_s_in_policy": entry.predicted_tok_s,
                                   "policy_model": pol.model, "policy_device": pol.device,
                                   "policy_comparable": other is None}
    if spec is None:
        raise SimtreeError("no policy to run: give a PolicySpec (e.g. EagleParams(3, 2, 6)) or a policy file")
    return check_spec(spec), {}


def _pct(x, q):
    return float(np.percentile(np.asarray(x, np.float64), q)) if len(x) else None


def _one_line(text) -> str:
    return " ".join(str(text).split())


@contextlib.contextmanager
def _extrapolation_notes():
    """Yields a list that, once the block ends, holds the cost models' extrapolation warnings
    raised inside (``ExtrapolationWarning``) as one-line notes, each once.  Every other warning
    raised inside is re-emitted after the block (under the caller's filters, each distinct one
    once), also when the block raises."""
    notes, registry = [], {}
    try:
        with captured_warnings() as caught:
            yield notes
    finally:
        for w in caught:
            if issubclass(w.category, ExtrapolationWarning):
                if _one_line(w.message) not in notes:
                    notes.append(_one_line(w.message))
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=registry,
                                       source=w.source)


class _Warnings(list):
    """Warning lines of a run, each once."""

    def __call__(self, line: str) -> None:
        if line not in self:
            self.append(line)


def live_run(*, spec: PolicySpec | None = None, policy=None, policy_workload: str | None = None,
             workload: str = "sharegpt", batch_size: int = 4, prompts: int | None = None,
             max_new_tokens: int = 64, costs: str | Path | Costs | None = None, models_dir=None, out=None,
             check_lossless: bool = False, threads: int = 1, device: str = "cpu", progress=None,
             controller: bool = False) -> dict:
    """Run live speculative decoding; returns the report dict (also written to ``out/run.json``
    with traces in ``out/traces.jsonl`` when ``out`` is given).

    ``spec``: the policy to run (e.g. ``EagleParams(3, 2, 6)``); ``policy``: a policy file
    whose entry for (``policy_workload`` or ``workload``, ``batch_size``) is run instead.
    ``costs``: a path to a CostBundle JSON, a bundle object, or None (then cost_aware /
    batch_alloc fall back to simtree.costs.synthetic's SYNTHETIC bundle, labelled so).
    ``progress(done, total)``: called as tokens are produced.  ``threads``: torch CPU threads
    (1 by default: these models are too small to gain from more, and a shared CPU makes
    extra threads spin).  ``device``: "cpu" or "cuda" (GPU rounds are timed after a
    synchronise; the GDN layers then use the Triton kernels).

    The report's ``warnings`` (cost bundle / policy of another model or device, a batch size
    outside the policy's range) and ``notes`` (cost-model extrapolation, a run without decode
    rounds) are one line each.  ``controller``: each round's tier is chosen online by
    :class:`simtree.control.Controller` (on ``costs``, else the synthetic bundle, and the
    workload's preset acceptance); the report's ``controller`` says what it ran.
    ``models_dir``: a checkpoint folder (default: the shipped ``runtime-tiny``).
    """
    trace = None   # _live_run discards its staged traces itself when it raises
    try:
        with _extrapolation_notes() as extrapolated:
            report, out, trace = _live_run(
                spec=spec, policy=policy, policy_workload=policy_workload, workload=workload,
                batch_size=batch_size, prompts=prompts, max_new_tokens=max_new_tokens, costs=costs,
                models_dir=models_dir, out=out, check_lossless=check_lossless, threads=threads, device=device,
                progress=progress, controller=controller)
        notes = report.setdefault("notes", [])
        notes += [n for n in extrapolated if n not in notes]
        if out is not None:
            _write(report, out, trace)
    except BaseException:
        _discard_staged(trace)
        raise
    return report


def _discard_staged(trace) -> None:
    """Remove the staged traces of a run that raised before ``_write`` moved them into place
    (``trace`` None: there are none; after that move, a no-op)."""
    if trace is not None:
        trace.discard()


def _live_run(*, spec, policy, policy_workload, workload, batch_size, prompts, max_new_tokens, costs,
              models_dir, out, check_lossless, threads, device, progress, controller=False) -> tuple:
    """-> (report, out, the staged traces ``_write`` commits there); (report, None, None)
    without ``out``."""
    batch_size = check_int(batch_size, "--batch-size")
    max_new_tokens = check_int(max_new_tokens, "--max-new-tokens")
    if prompts is not None:
        prompts = check_int(prompts, "--prompts")
    threads = check_int(threads, "--threads")
    here = _device_name(device)
    warn = _Warnings()
    torch.set_num_threads(threads)
    spec, policy_info = _resolve_spec(policy, policy_workload, workload, batch_size, spec, warn, here)
    if spec.mode in BLOCK_DRAFTER_MODES:
        raise SimtreeError(f"mode {spec.mode} drafts with a block drafter, which the full runtime builds: "
                           "run it with --model (a registry model or checkpoint)")
    costs_label = None
    if isinstance(costs, (str, Path)):
        from simtree.costs.model import load_costs
        costs_label, costs = str(costs), load_costs(costs)
    elif costs is not None:
        costs_label = str(costs.meta.get("source", "given"))
    comparable = True
    if costs is not None:
        meta = costs.meta
        other = _mismatch("cost bundle", costs_label, meta.get("model"), meta.get("device"), here)
        if other:
            warn(other)
            comparable = False
    engine_costs = costs
    if spec.mode in ADAPTIVE_MODES and costs is None:
        from simtree.costs.synthetic import SYNTHETIC_LABEL, synthetic_costs
        engine_costs, costs_label = synthetic_costs(), SYNTHETIC_LABEL
    round_shape(spec)    # a policy the engine cannot build: one line before the model loads
    models_dir = str(models_dir) if models_dir else RUNTIME_MODEL
    model = build_model(models_dir, device=device, dtype=torch.float32)
    source = Path(getattr(getattr(model, "shape", None), "source", "") or "")
    if source.name == "config.json":   # the report names the folder the weights came from
        models_dir = str(source.parent)
    if model.vocab < VOCAB_SIZE:
        raise SimtreeError(f"vocab_size {model.vocab} is smaller than the byte tokenizer's {VOCAB_SIZE}: "
                           f"{models_dir} is not a model of this runtime")
    limit = int(model.shape.config.get("max_position_embeddings") or 0) if model.shape.config else 0
    if limit and max_new_tokens > limit:
        raise SimtreeError(f"--max-new-tokens {max_new_tokens}: at most {limit}, the positions the model has "
                           f"(max_position_embeddings of {models_dir})")
    check_fits(model, spec)
    ctl = _controller(engine_costs, workload) if controller else None
    count = prompts or batch_size
    count = math.ceil(count / batch_size) * batch_size  # whole batches only: B stays constant
    texts = load_prompts(workload, count)
    if len(texts) < count:
        raise SimtreeError(f"workload {workload} has only {len(texts)} prompts, {count} requested")
    tok = ByteTokenizer()
    ids = [tok.encode(t) for t in texts]
    host = _host_against(costs, device) if comparable else None
    out = Path(out) if out else None
    scratch = None
    if out is None and costs is not None:   # traces for the prediction's acceptance fit only
        scratch = tempfile.TemporaryDirectory(prefix="simtree-run-")
    trace_dir = out if out is not None else (Path(scratch.name) if scratch else None)
    trace = TraceWriter(trace_dir / "traces.jsonl", staged=True) if trace_dir is not None else None
    results, mismatches, done = [], 0, 0
    total = count * max_new_tokens   # every output is cut to max_new_tokens
    if progress is not None:
        progress(0, total)   # decoding begins: a run stopped before its first round says "0 of N"
    try:
        for s in range(0, count, batch_size):
            chunk = ids[s:s + batch_size]
            cb = None if progress is None else (lambda n, base=done: progress(base + n, total))
            res = generate(model, chunk, max_new_tokens, spec, costs=engine_costs, workload=workload, trace=trace,
                           progress=cb, controller=ctl)
            done += len(chunk) * max_new_tokens
            results.append(res)
            if check_lossless:
                plain = greedy_decode(model, chunk, max_new_tokens)
                mismatches += sum(o != p for o, p in zip(res.outputs, plain))
        if trace is not None:
            trace.close()
        rounds = [r for res in results for r in res.rounds]
        report = _report(results, rounds, spec, workload, batch_size, count, max_new_tokens, models_dir, here,
                         costs_label, policy_info, host, check_lossless, mismatches, tok)
        if ctl is not None:
            report["controller"] = {"steps": ctl.steps, "switches": ctl.switches, "bound": ctl.max_switches,
                                    "tiers": [t.name for t in ctl.tiers], "acceptance_ratio": ctl.ratio}
        if costs is not None and rounds and ctl is None:
            report["predicted"] = _predict(costs, trace.tmp_path, spec, batch_size, [len(p) for p in ids],
                                           max_new_tokens - 1, workload)
            report["predicted"]["comparable"] = comparable
            report["notes"] += [n for n in report["predicted"].pop("notes", []) if n not in report["notes"]]
    except BaseException:
        _discard_staged(trace)
        raise
    finally:
        if scratch is not None:
            scratch.cleanup()
    report["warnings"] = list(warn)
    if out is None:
        return report, None, None
    report["files"] = {"report": str(out / "run.json"), "traces": str(out / "traces.jsonl")}
    return report, out, trace


def _controller(costs, workload: str):
    """The online controller of ``simtree run --controller``: the workload's preset acceptance
    (sharegpt for a workload without one) and the run's costs (else the synthetic bundle)."""
    from simtree.acceptance.model import PRESETS, get_workload
    from simtree.control import Controller
    if costs is None:
        from simtree.costs.synthetic import synthetic_costs
        costs = synthetic_costs()
    return Controller(costs, get_workload(workload if workload in PRESETS else "sharegpt").acceptance)


def _write(report: dict, out: Path, trace) -> None:
    """run.json and traces.jsonl of this run, never beside another run's: the old run.json
    goes first, then the staged traces move into place, then run.json is written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").unlink(missing_ok=True)
    trace.commit()
    body = {k: v for k, v in report.items() if k != "files"}
    write_text_atomic(out / "run.json", dumps(body) + "\n")


def _report(results, rounds, spec, workload, batch_size, count, max_new_tokens, models_dir, here,
            costs_label, policy_info, host, check_lossless, mismatches, tok) -> dict:
    round_us = [r.round_ms * 1e3 for r in rounds]   # the engine's ms; run.json keeps its us fields
    decode_us = sum(round_us)
    produced = sum(res.tokens_produced for res in results)
    # tokens the outputs keep, and those of them the decode rounds made (the first is the prefill's)
    delivered = sum(len(o) for res in results for o in res.outputs)
    delivered_decode = delivered - count
    accepted = [a for r in rounds for a in r.accepted]
    busy_us = sum(r.round_ms * 1e3 * r.live / batch_size for r in rounds)   # round time while sequences decoded
    rate = lambda n, us: n / us * 1e6 if rounds and us > 0 else None  # noqa: E731
    measured = {
        "tokens_per_s": rate(delivered_decode, busy_us),
        "delivered_tokens_per_s": rate(delivered_decode, decode_us),
        "produced_tokens_per_s": rate(produced, decode_us),
        "accepted_tokens_per_round": 1.0 + float(np.mean(accepted)) if accepted else None,
        "mean_nodes_per_seq": float(np.mean([n for r in rounds for n in r.nodes])) if rounds else None,
        "round_us_median": _pct(round_us, 50), "round_us_p90": _pct(round_us, 90),
        "draft_us_median": _pct([r.draft_ms * 1e3 for r in rounds], 50),
        "verify_us_median": _pct([r.verify_ms * 1e3 for r in rounds], 50),
        "commit_us_median": _pct([r.commit_ms * 1e3 for r in rounds], 50),
        "rounds": len(rounds), "tokens_produced": produced, "tokens_delivered": delivered,
        "tokens_delivered_by_decode": delivered_decode,
        "overshoot": produced / delivered_decode - 1 if delivered_decode else None,
        "decode_s": decode_us / 1e6, "busy_s": busy_us / 1e6, "prefill_s": sum(res.prefill_ms for res in results) / 1e3,
    }
    notes = []
    if not rounds:
        notes.append(f"max_new_tokens {max_new_tokens}: the prefill produced the only token, no decode round "
                     "ran: nothing to measure per round or to predict")
    sample = [t for t in results[0].outputs[0] if t < VOCAB_SIZE] if results else []
    return {
        "schema": "simtree.run/1", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": spec.mode, "params": spec.to_dict(), "workload": workload, "batch_size": batch_size,
        "prompts": count, "max_new_tokens": max_new_tokens, "models": str(models_dir), "model": RUNTIME_MODEL,
        "device": (here if here != "cpu" else
                   f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"),
        "torch_version": torch.__version__, "costs": costs_label, **policy_info, "measured": measured,
        "predicted": None, "comparison": COMPARISON, "host": host, "lossless_checked": check_lossless,
        "lossless_mismatches": mismatches if check_lossless else None,
        "sample_output": tok.decode(sample), "notes": notes,
    }


def _host_against(costs: Costs | None, device: str) -> dict | None:
    """The host's speed now (``simtree.machine.hostprobe``) against when the cost bundle's profile was
    taken (its ``host_probe``): {probe, profile_probe, vs_profile} (> 1: slower now, so the
    bundle's latencies read short), or None without a bundle that recorded one."""
    if costs is None:
        return None
    then = costs.meta.get("profile_meta", {}).get("host_probe")
    if not isinstance(then, dict):
        return None
    from simtree.machine.hostprobe import probe, ratio
    now = probe(device)
    x = ratio(now, then)
    return {"probe": now, "profile_probe": then, "vs_profile": x if math.isfinite(x) else None}


def _predict(costs: Costs, trace_path: Path, spec: PolicySpec, batch_size: int, prompt_lens: list[int],
             output_len: int, workload: str) -> dict:
    """The simulator's prediction for this run: acceptance fitted from the run's traces - the
    depth x rank x confidence model (``fit_confidence``) where they log the drafter's top-K
    (linear and marginal modes), else positional counts (``fit_positional``; table width = the
    widest sibling set drafted, so no rank is imputed) - the run's own prompt lengths and the
    tokens its decode rounds must produce per sequence."""
    from simtree.acceptance.fit import fit_confidence, has_topk
    from simtree.acceptance.model import Workload, fit_positional, get_workload, read_traces
    from simtree.planning.simulate import simulate

    fitted = "none"
    if isinstance(spec, NoneParams):  # nothing drafted, nothing to fit; mode none ignores acceptance
        acc = get_workload("sharegpt").acceptance
    else:
        records = read_traces(trace_path)
        if has_topk(records):
            acc, fitted = fit_confidence(records, workload), "confidence fit of this run's traces"
        else:
            width = max(int(r.tree.num_children.max()) for r in records)
            acc, fitted = fit_positional(records, workload, topk=max(width, 1)), "positional fit of this run's traces"
    wl = Workload(workload, acc, np.asarray(prompt_lens, np.int64), int(output_len), "this run")
    # cost_aware and batch_alloc: priced as the engine runs them, the rule's trees verified in the
    # bucket of the policy's max budget each round (generate's round shape)
    bucket = spec.max_nodes if spec.mode in ADAPTIVE_MODES else None
    sim = simulate(costs, wl, batch_size, spec, bucket=bucket)
    return {"tokens_per_s": sim.throughput_tok_s, "accepted_tokens_per_round": sim.accepted_tokens_per_round,
            "round_us": sim.round_latency_us, "draft_us": sim.draft_us, "verify_us": sim.verify_us,
            "mean_nodes_per_seq": sim.mean_nodes_per_seq, "rounds": sim.rounds, "synthetic": sim.synthetic,
            "acceptance": fitted,
            "notes": [_one_line(n) for n in sim.notes]}
