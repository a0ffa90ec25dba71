"""``live_run``: decode live with a policy on the shipped (or given) models and report measured
against predicted throughput.  What ``simtree run`` calls.

Measured: tokens/s of the decode rounds (all B sequences), accepted tokens per round
(incl. the bonus token, as simtree.simulate counts), per-round latency median / p90 and its
draft / verify / commit split.  Predicted (when a cost bundle is given): simtree.simulate
with the acceptance model fitted from this run's own traces (positional fit), this run's mean
prompt length and output length - so the comparison tests the cost model, not the acceptance
model.  Note a cost bundle of another device (e.g. the shipped H200 ones) predicts that
device, not this CPU.
"""
from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from simtree.errors import SimtreeError
from simtree.runtime.data import prompts as load_prompts
from simtree.runtime.engine import SpecEngine, check_spec, greedy_decode
from simtree.simulate import PolicySpec
from simtree.runtime.loading import DEFAULT_MODELS_DIR, load_model
from simtree.runtime.tokenizer import ByteTokenizer
from simtree.runtime.trace import TraceWriter

__all__ = ["live_run"]

NEEDS_COSTS = ("cost_aware", "batch_alloc")


def _resolve_spec(policy, policy_workload, workload, batch_size, mode, params):
    if policy is not None:
        from simtree.policy import Policy
        entry = Policy.load(policy).lookup(policy_workload or workload, batch_size)
        return check_spec(entry), {"policy": str(policy), "policy_workload": policy_workload or workload,
                                   "predicted_tok_s_in_policy": entry.predicted_tok_s}
    return check_spec(SimpleNamespace(mode=mode, params=params)), {}


def _pct(x, q):
    return float(np.percentile(np.asarray(x, np.float64), q)) if len(x) else float("nan")


def live_run(*, mode: str = "eagle", params: dict | None = None, policy=None, policy_workload: str | None = None,
             workload: str = "sharegpt", batch_size: int = 4, prompts: int | None = None,
             max_new_tokens: int = 64, costs=None, models_dir=None, out=None, check_lossless: bool = False,
             threads: int = 1, device: str = "cpu", progress=None) -> dict:
    """Run live speculative decoding; returns the report dict (also written to ``out/run.json``
    with traces in ``out/traces.jsonl`` when ``out`` is given).

    ``costs``: a path to a CostBundle JSON, a bundle object, or None (then cost_aware /
    batch_alloc fall back to simtree.synthetic's SYNTHETIC bundle, labelled so).
    ``progress(done, total)``: called as tokens are produced.  ``threads``: torch CPU threads
    (1 by default: these models are too small to gain from more, and a shared CPU makes
    extra threads spin).  ``device``: "cpu" or "cuda" (GPU rounds are timed after a
    synchronise; the GDN layers then use the Triton kernels).
    """
    if batch_size < 1 or max_new_tokens < 1:
        raise SimtreeError("batch size and max_new_tokens must be >= 1")
    torch.set_num_threads(max(1, int(threads)))
    spec, policy_info = _resolve_spec(policy, policy_workload, workload, batch_size, mode, params or {})
    costs_label = None
    if isinstance(costs, (str, Path)):
        from simtree.costmodel import load_costs
        costs_label, costs = str(costs), load_costs(costs)
    elif costs is not None:
        costs_label = str(getattr(costs, "meta", {}).get("source", "given"))
    engine_costs = costs
    if spec.mode in NEEDS_COSTS and costs is None:
        from simtree.synthetic import SYNTHETIC_LABEL, synthetic_costs
        engine_costs, costs_label = synthetic_costs(), SYNTHETIC_LABEL
    models_dir = Path(models_dir) if models_dir else DEFAULT_MODELS_DIR
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise SimtreeError(f"device {device!r} is not available here (use cpu or cuda)")
    target = load_model(models_dir / "target").to(device)
    draft = load_model(models_dir / "draft").to(device)
    count = max(prompts or batch_size, 1)
    count = math.ceil(count / batch_size) * batch_size  # whole batches only: B stays constant
    texts = load_prompts(workload, count)
    if len(texts) < count:
        raise SimtreeError(f"workload {workload} has only {len(texts)} prompts, {count} requested")
    tok = ByteTokenizer()
    ids = [tok.encode(t) for t in texts]
    engine = SpecEngine(target, draft, engine_costs)
    host = _host_against(costs, device)
    out = Path(out) if out else None
    trace = TraceWriter(out / "traces.jsonl") if out else None
    results, mismatches, done = [], 0, 0
    try:
        for s in range(0, count, batch_size):
            chunk = ids[s:s + batch_size]
            cb = None if progress is None else (lambda n, base=done: progress(base + n, count * max_new_tokens))
            res = engine.generate(chunk, max_new_tokens, spec, workload=workload, trace=trace, progress=cb)
            done += batch_size * max_new_tokens
            results.append(res)
            if check_lossless:
                mismatches += sum(o != greedy_decode(target, p, max_new_tokens) for o, p in zip(res.outputs, chunk))
    finally:
        if trace is not None:
            trace.close()
    rounds = [r for res in results for r in res.rounds]
    round_us = [r.round_us for r in rounds]
    decode_us = sum(round_us)
    produced = sum(res.tokens_produced for res in results)
    accepted = [a for r in rounds for a in r.accepted]
    measured = {
        "tokens_per_s": produced / max(decode_us, 1e-9) * 1e6,
        "accepted_tokens_per_round": 1.0 + float(np.mean(accepted)) if accepted else 1.0,
        "mean_nodes_per_seq": float(np.mean([n for r in rounds for n in r.nodes])) if rounds else 0.0,
        "round_us_median": _pct(round_us, 50), "round_us_p90": _pct(round_us, 90),
        "draft_us_median": _pct([r.draft_us for r in rounds], 50),
        "verify_us_median": _pct([r.verify_us for r in rounds], 50),
        "commit_us_median": _pct([r.commit_us for r in rounds], 50),
        "rounds": len(rounds), "tokens_produced": produced, "decode_s": decode_us / 1e6,
        "prefill_s": sum(res.prefill_us for res in results) / 1e6,
    }
    report = {
        "schema": "simtree.run/1", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": spec.mode, "params": spec.params, "workload": workload, "batch_size": batch_size,
        "prompts": count, "max_new_tokens": max_new_tokens, "models": str(models_dir),
        "device": (torch.cuda.get_device_name() if device == "cuda" else
                   f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"),
        "torch_version": torch.__version__, "costs": costs_label, **policy_info, "measured": measured,
        "predicted": None, "host": host, "lossless_checked": check_lossless,
        "lossless_mismatches": mismatches if check_lossless else None,
        "sample_output": tok.decode(results[0].outputs[0]) if results else "",
    }
    if costs is not None and out is not None and rounds:
        report["predicted"] = _predict(costs, out / "traces.jsonl", spec, batch_size, [len(p) for p in ids],
                                       max_new_tokens, workload)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.json").write_text(json.dumps(report, indent=1) + "\n")
        report["files"] = {"report": str(out / "run.json"), "traces": str(out / "traces.jsonl")}
    return report


def _host_against(costs, device: str) -> dict | None:
    """The host's speed now (``simtree.hostprobe``) against when the cost bundle's profile was
    taken (its ``host_probe``): {probe, profile_probe, vs_profile} (> 1: slower now, so the
    bundle's latencies read short), or None without a bundle that recorded one."""
    then = (getattr(costs, "meta", None) or {}).get("profile_meta", {}).get("host_probe")
    if not isinstance(then, dict):
        return None
    from simtree.hostprobe import probe, ratio
    now = probe(device)
    x = ratio(now, then)
    return {"probe": now, "profile_probe": then, "vs_profile": x if math.isfinite(x) else None}


def _predict(costs, trace_path: Path, spec: PolicySpec, batch_size: int, prompt_lens: list[int],
             output_len: int, workload: str) -> dict:
    """The simulator's prediction for this run: positional acceptance fitted from the run's
    traces (table width = the widest sibling set drafted, so no rank is imputed), the run's
    own prompt lengths and output length."""
    from simtree.acceptance import Workload, fit_positional, get_workload, read_traces
    from simtree.simulate import PolicySpec, simulate

    if spec.mode == "none":  # nothing drafted, nothing to fit; mode none ignores acceptance
        acc = get_workload("sharegpt").acceptance
    else:
        records = read_traces(trace_path)
        width = max(int(r.tree.num_children.max()) for r in records)
        acc = fit_positional(records, workload, topk=max(width, 1))
    wl = Workload(workload, acc, np.asarray(prompt_lens, np.int64), int(output_len), "this run")
    sim = simulate(costs, wl, batch_size, PolicySpec(spec.mode, spec.params))
    return {"tokens_per_s": sim.throughput_tok_s, "accepted_tokens_per_round": sim.accepted_tokens_per_round,
            "round_us": sim.round_latency_us, "draft_us": sim.draft_us, "verify_us": sim.verify_us,
            "mean_nodes_per_seq": sim.mean_nodes_per_seq, "synthetic": sim.synthetic,
            "acceptance": "none" if spec.mode == "none" else "positional fit of this run's traces"}
