"""Acceptance predicted out of sample on the trained Qwen3.5-architecture target (CPU).

    python -m simtree.runtime.acceptance_oos --sharegpt-start 1400 --code-start 2000 --humaneval-start 0 --out reports/validation
    ... --prompts sharegpt=128:128 --prompts sharegpt_code=256:128   # a workload's calibration:test prompts
    python -m simtree.runtime.acceptance_oos --quick --out /tmp/oos              # a small check
    python -m simtree.runtime.acceptance_oos --reuse-traces T --out DIR          # analyse kept traces again
    ... --drafters mtp,block,dspark    # with the trained block drafters' rows (:mod:`.acceptance_oos_drafters`)

With the checkpoint ``--model`` (default: the shipped ``qwen3.5-tiny-sharegpt``, its MTP layer
the drafter) and its tokenizer, live on the full runtime (:mod:`.target_trace`), per workload
(ShareGPT chat, ShareGPT code, HumanEval code; :mod:`.acceptance_oos_prompts` says which prompts
and which are fresh) split in two halves:

1. the ``calibration`` half decoded with the linear policies (``LINEAR``): the only acceptance
   outcomes any prediction reads - the drafter's calibration on that workload
   (:func:`simtree.acceptance.fit.fit_calibration`: P(target takes a candidate | its draft
   probability, depth, rank, and what the context lookup proposes (:func:`simtree.acceptance.fit.lookup_states`):
   :func:`simtree.acceptance.transfer.uses_lookup`; and the context's text state,
   :mod:`simtree.acceptance.text_state`, read from the prompts and the decoded text:
   :mod:`.acceptance_oos_text`), what an engine's linear acceptance metrics give a user; from
   the same runs, how often a marginal tree's node below an off-chain node is accepted
   (:mod:`simtree.acceptance.off_chain`);
2. the ``test`` half decoded with the linear policies and every tree policy (``TREES``: EAGLE
   and best-first trees, cost_aware and batch_alloc deciding with the shipped H200 Qwen3.6-27B
   bundle ``COSTS``) and traced;
3. each half decoded once more as a drafting pass (:func:`.target_trace.draft_confidences`):
   plain greedy decoding, the MTP layer drafting its 15-position chain at every generated
   position, its top-8 probabilities and the lookup's rank kept, nothing of the target's verdict;
4. every run's mean accepted tokens per round predicted from a calibration and the drafting
   pass of the run's own prompts (:func:`simtree.acceptance.transfer.transfer_model`) and
   compared (:mod:`simtree.acceptance.out_of_sample`).  ``split`` says what is out of sample:
   ``policies`` (the test half's trees, calibrated on the same workload's linear runs of the
   other half: new policies on new prompts), ``prompts`` (the test half's linear runs, same
   calibration: new prompts), ``workload`` (a code workload's test half, every policy,
   calibrated on ShareGPT chat's linear runs: new prompts of another workload),
   ``workload_shift`` (the same, the chat calibration moved per rank by a seeded random
   1/``SHIFT_SHARE`` of the code workload's calibration rounds:
   :mod:`simtree.acceptance.workload_shift`), ``in_sample`` (the calibrating runs, prompts
   ``seen``).  No acceptance outcome of a test half enters any prediction.  Beside it
   (``confidence_only_*``: the calibration without the lookup;
   ``baseline_*``: the outcome-fitted model of the calibrating workload's linear D = 16 run,
   :func:`simtree.acceptance.fit.fit_confidence`).

The command line (:mod:`.acceptance_oos_cli`) writes ``acceptance_out_of_sample.csv`` and
``acceptance_out_of_sample.md`` (a generated summary ending in the run's settings, summary and
the decode's lossless check as a JSON block: every policy's outputs equal plain decoding's)
atomically under ``--out``; ``--traces DIR`` keeps the traces, which ``--reuse-traces DIR``
analyses again without decoding (the workloads the folder holds: earlier tables kept ShareGPT
chat and HumanEval only).  ``--drafters`` adds the
trained block drafters' rows (:mod:`.acceptance_oos_drafters`: calibrated on one shape's run on
development prompts, predicting other shapes on fresh ones), their traces under ``DIR/drafters``.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from simtree.acceptance.fit import fit_calibration, fit_confidence
from simtree.acceptance.lookup_folds import lookup_cv
from simtree.acceptance.off_chain import fit_off_chain_scale
from simtree.acceptance.out_of_sample import oos_summary, oos_table
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.traces import read_traces
from simtree.acceptance.transfer import parse_drafts, read_drafts, transfer_model, uses_lookup
from simtree.acceptance.workload_shift import fit_workload_shift, sample_rounds, shifted_calibration
from simtree.costs.model import load_costs
from simtree.data import data_path
from simtree.errors import SimtreeError
from simtree.fileio import read_json, write_text_atomic

from .acceptance_oos_prompts import (CODE_START, CODE_WORKLOADS, DEVELOPMENT_WORKLOADS, HALVES, HUMANEVAL_START,
                                     OOS_WORKLOADS, SEEN_SHAREGPT, SHAREGPT_START, code_prompts, development_prompts,
                                     development_sizes, held_out_halves, held_out_prompts,
                                     prompt_status, status_of_test_half)
from .acceptance_oos_record import half_records
from .acceptance_oos_text import text_features, tokenizer_words
from .bpe import BpeTokenizer
from .full.build import build_model
from .target_trace import draft_confidences, policy_name, trace_policies

__all__ = ["run_oos", "analyse", "decode_halves", "load_halves", "table_status", "kept_workloads",
           "prompt_token_ids", "held_out_prompts", "development_prompts",
           "prompt_status", "predicted_accepted", "DEFAULT_MODEL", "LINEAR", "TREES", "COSTS", "SEEN_SHAREGPT",
           "SHAREGPT_START", "CODE_START", "HUMANEVAL_START", "CHAIN", "SHIFT_SHARE", "SHIFT_SEED", "code_prompts",
           "half_sizes", "table_halves", "HALVES"]

DEFAULT_MODEL = data_path("models", "qwen3.5-tiny-sharegpt")
LINEAR = [("linear", {"budget": 4}), ("linear", {"budget": 8}), ("linear", {"budget": 16})]
TREES = [("eagle", {"num_steps": 3, "topk": 2, "budget": 4}), ("eagle", {"num_steps": 4, "topk": 2, "budget": 8}),
         ("eagle", {"num_steps": 4, "topk": 4, "budget": 12}), ("eagle", {"num_steps": 6, "topk": 3, "budget": 16}),
         ("best_first", {"budget": 4, "width": 1, "draft_depth": 3}),
         ("best_first", {"budget": 8, "width": 1, "draft_depth": 5}),
         ("best_first", {"budget": 12, "width": 1, "draft_depth": 6}),
         ("best_first", {"budget": 16, "width": 1, "draft_depth": 8}),
         ("cost_aware", {"max_budget": 16, "draft_depth": 6}),
         ("batch_alloc", {"max_budget_per_seq": 8, "draft_depth": 6})]
CHAIN = 15                # positions of the drafting pass's chain (linear D = 16's)
# the bundle cost_aware and batch_alloc weigh tree size against verify cost with (measured and
# predicted alike): the shipped H200 Qwen3.6-27B one
COSTS = data_path("costs", "h200_qwen3.6-27b_tp1.json")
# chat -> code with a workload shift (docs/acceptance.md, section 5, decision 9): the chat calibration
# moved per rank by a seeded random 1/SHIFT_SHARE of the code calibration half's linear rounds
SHIFT_SHARE = 8
SHIFT_SEED = 0
SHIFT_CELLS = "rank"
# prompts per half: ``halves`` {workload: (calibration, test)} (every workload's in FULL), else ``prompts`` each
FULL = {"halves": HALVES, "max_new_tokens": 64, "trees": TREES}
QUICK = {"prompts": 3, "max_new_tokens": 16, "trees": [TREES[1], TREES[5], TREES[8]]}


def half_sizes(settings: dict, workload: str, development: bool = False) -> tuple[int, int]:
    """(calibration prompts, test prompts) of a workload's halves under ``settings``; ``development``:
    of its development prompts, which hold fewer (:func:`development_sizes`)."""
    halves = settings.get("halves") or {}
    sizes = tuple(halves[workload]) if workload in halves else (settings["prompts"], settings["prompts"])
    return development_sizes(workload, *sizes) if development else sizes


def table_halves(settings: dict, starts: dict | None, workloads=None) -> tuple[dict, dict]:
    """({workload: first prompt index, None for the development prompts}, {workload: (calibration
    prompts, test prompts)}) of the table's halves under ``settings`` (:func:`half_sizes`): of
    ``workloads`` (default :data:`OOS_WORKLOADS` from ``starts[workload]``, or with ``starts`` None
    :data:`DEVELOPMENT_WORKLOADS`' development prompts).  What the command line checks a reuse
    against and :func:`run_oos` decodes."""
    development = starts is None
    if workloads is None:
        workloads = DEVELOPMENT_WORKLOADS if development else OOS_WORKLOADS
    return ({w: None if development else starts[w] for w in workloads},
            {w: half_sizes(settings, w, development) for w in workloads})


def table_status(starts: dict | None, spans: dict) -> dict:
    """{workload: "fresh" | "seen"}, the label of a workload's out-of-sample rows: its test half's
    (:func:`prompt_status` of the halves from ``starts[workload]``, whose held-out ranges
    ``spans[workload]`` gives: :func:`half_spans`); ``starts`` None (the development prompts): seen."""
    if starts is None:
        return {w: "seen" for w in OOS_WORKLOADS}
    return {w: status_of_test_half(w, spans[w]["test"]) for w in starts}


def _half_dir(traces, workload: str, half: str):
    return None if traces is None else Path(traces) / f"{workload}_{half}"


def _decode_half(model, ids, policies, settings, workload, half, traces, costs, say) -> dict:
    t0 = time.perf_counter()
    out = _half_dir(traces, workload, half)
    done = trace_policies(model, ids, [("none", {}), *policies], settings["max_new_tokens"], workload, out=out,
                          say=say, costs=costs)
    plain = done.pop("none")["outputs"]
    pass_ = draft_confidences(model, ids, CHAIN, settings["max_new_tokens"], workload, out=out)
    lossless = {name: r["outputs"] == plain for name, r in done.items()}
    lossless["drafting_pass"] = pass_["outputs"] == plain
    if say is not None:
        say(f"{workload} {half}: {len(done)} policies and the drafting pass, {time.perf_counter() - t0:.0f}s")
    return {"runs": done, "drafts": parse_drafts(pass_["records"], f"{workload} {half} drafting pass"),
            "lossless": lossless, "prompts": len(ids), "prompt_ids": ids}


def _half_policies(settings: dict, half: str) -> list:
    return LINEAR if half == "calibration" else [*LINEAR, *settings["trees"]]


def predicted_accepted(model, run: dict, costs=None) -> float:
    """Accepted tokens per round (bonus included) the acceptance ``model`` predicts for a run
    (its mode and params); cost_aware and batch_alloc: the simulator's analytic decision at the
    run's ``context_len`` for its ``batch_size`` under ``costs`` (each level's budget, the levels
    weighed as its rounds spread)."""
    mode, params = run["mode"], run["params"]
    if mode not in ("cost_aware", "batch_alloc"):
        return accepted_per_round(model, mode, params)
    from simtree.planning.adaptive import AdaptiveRounds
    from simtree.planning.modes import PolicySpec
    ad = AdaptiveRounds(model, PolicySpec.from_dict(mode, dict(params)), costs, run.get("batch_size", 1))
    nodes, weights = ad.decide(float(run.get("context_len", 0.0)))
    gain = 1.0 + np.array([ad.phi(lv, int(n)) for lv, n in enumerate(nodes)])
    return float(np.asarray(weights) @ gain)


def decode_halves(model_dir, settings: dict, prompt_ids: dict, traces=None, say=print,
                  starts: dict | None = None, spans: dict | None = None) -> dict:
    """{(workload, half): {"runs", "drafts", "lossless", "prompts"}}: each workload's two halves
    (``prompt_ids``: {workload: (calibration prompts, test prompts)} as token ids,
    :func:`prompt_token_ids`) decoded live, the calibration half with ``LINEAR``, the test half
    with ``LINEAR`` and the trees, each once more as a drafting pass; ``traces``: keep the traces
    there (with ``lossless.json``, which :func:`load_halves` reads back, and each half's record of
    what it decoded: ``starts`` {workload: first index, None for the development prompts},
    :mod:`.acceptance_oos_record`; ``spans``: the halves' held-out ranges, :func:`half_spans`, found
    there when not given)."""
    torch.set_num_threads(1)
    model = build_model(str(model_dir), device="cpu", dtype=torch.float32)
    costs = load_costs(COSTS)
    halves = {}
    for workload, both in prompt_ids.items():
        records = {} if starts is None else half_records(workload, starts[workload], *map(len, both),
                                                         spans=(spans or {}).get(workload))
        for half, ids in zip(("calibration", "test"), both):
            halves[workload, half] = _decode_half(model, ids, _half_policies(settings, half), settings, workload, half,
                                                  traces, costs, say)
            if half in records:
                halves[workload, half]["decoded"] = records[half]
    if traces is not None:
        write_text_atomic(Path(traces) / "lossless.json", json.dumps(
            {f"{w} {h}": {"lossless": v["lossless"], "prompts": v["prompts"],
                          **({"decoded": v["decoded"]} if "decoded" in v else {})} for (w, h), v in halves.items()}))
    return halves


def kept_workloads(traces) -> list[str]:
    """The workloads whose two halves the kept folder ``traces`` holds (:func:`load_halves`)."""
    return [w for w in OOS_WORKLOADS if all(_half_dir(traces, w, h).is_dir() for h in ("calibration", "test"))]


def load_halves(traces, settings: dict, prompt_ids: dict | None = None) -> dict:
    """The halves of :func:`decode_halves` read back from the traces it kept (no decoding): to
    analyse a run again; every workload whose two halves the folder holds (:func:`kept_workloads`);
    ``prompt_ids``: {workload: (calibration prompts, test prompts)} as token ids, kept with each
    half (the text state reads them; :func:`prompt_token_ids`)."""
    traces = Path(traces)
    kept = read_json(traces / "lossless.json", "kept run") if (traces / "lossless.json").is_file() else {}
    halves = {}
    for workload in kept_workloads(traces):
        for half in ("calibration", "test"):
            folder, runs = _half_dir(traces, workload, half), {}
            for mode, params in _half_policies(settings, half):
                name = policy_name(mode, params)
                records = read_traces(folder / f"{workload}_{name}.jsonl", workload)
                runs[name] = {"mode": mode, "params": dict(params), "records": records,
                              "context_len": float(np.mean([r.context_len for r in records]))}
            drafts = read_drafts(folder / f"{workload}_drafts_p{CHAIN}.jsonl", workload)
            info = kept.get(f"{workload} {half}", {})
            halves[workload, half] = {"runs": runs, "drafts": drafts, "lossless": info.get("lossless", {}),
                                      "prompts": info.get("prompts", int(np.unique(drafts.seq).size))}
            if prompt_ids is not None:
                ids = prompt_ids[workload][0 if half == "calibration" else 1]
                halves[workload, half]["prompt_ids"] = ids[:halves[workload, half]["prompts"]]
    if not halves:
        raise SimtreeError(f"{traces} holds no kept halves (<workload>_calibration and <workload>_test folders)")
    return halves


def prompt_token_ids(model_dir, prompts: dict):
    """({workload: (calibration prompts, test prompts)} as the checkpoint's tokenizer encodes
    ``prompts`` ({workload: (calibration texts, test texts)}, :func:`run_oos`'s) for decoding,
    its word tokens): what :func:`decode_halves`, :func:`load_halves` and :func:`analyse` read."""
    tok = BpeTokenizer.from_file(Path(model_dir))
    return ({w: tuple([tok.encode(p) for p in half] for half in both) for w, both in prompts.items()},
            tokenizer_words(tok))


def _run_row(r: dict, name: str, workload: str, split: str, key: str, batch: int, status: str) -> dict:
    return {"drafter": "mtp", "policy": name, "mode": r["mode"], "params": r["params"], "workload": workload,
            "split": split, "records": r["records"], "batch_size": batch, "context_len": r["context_len"],
            "drafts": key, "calibrated_on": key.split("@")[1], "prompts": status}


def _rows(halves: dict, status: dict) -> tuple[list[dict], set]:
    """The table's runs and the (drafts @ calibration) keys they are predicted under: each half's
    runs on its own workload's calibration (the calibration half: in sample, its prompts ``seen``
    whatever their status, the outcomes were fitted); a code workload's test half also from chat
    (``workload``) and from chat shifted on a few of its own calibration rounds (``workload_shift``,
    calibrated on ``sharegpt+<workload>``)."""
    linear = {policy_name(*p) for p in LINEAR}
    runs, keys = [], set()
    for (workload, half), h in halves.items():
        key, fresh = f"{workload} {half}@{workload}", status.get(workload, "seen")
        for name, r in h["runs"].items():
            split = "in_sample" if half == "calibration" else ("prompts" if name in linear else "policies")
            runs.append(_run_row(r, name, workload, split, key, h["prompts"], "seen" if split == "in_sample" else fresh))
        keys.add(key)
        if workload in CODE_WORKLOADS and half == "test" and ("sharegpt", "calibration") in halves:
            for split, cal in (("workload", "sharegpt"), ("workload_shift", f"sharegpt+{workload}")):
                key = f"{workload} {half}@{cal}"
                runs += [_run_row(r, name, workload, split, key, h["prompts"], fresh) for name, r in h["runs"].items()]
                keys.add(key)
    return runs, keys


def analyse(halves: dict, status: dict | None = None, words=None, earlier: bool = False) -> dict:
    """The table and its summary from decoded (or kept) halves: every run predicted from its
    half's drafting pass under a calibration on a calibration half's linear runs (the module
    docstring); ``status``: {workload: "fresh" | "seen"}, each out-of-sample row's ``prompts``;
    ``words`` (the tokenizer's word tokens, :func:`prompt_token_ids`; every half holding its
    ``prompt_ids``): the calibration reads the context's text state (decision 11); ``earlier``:
    the model of decisions 1-9 instead (no text state, nodes below an off-chain node never
    accepted), to compare on the same traces."""
    status = status or {}
    costs = load_costs(COSTS)
    workloads = list(dict.fromkeys(w for w, _ in halves))
    # outcomes of the calibration halves' linear runs only
    records = {w: [rec for r in halves[w, "calibration"]["runs"].values() for rec in r["records"]] for w in workloads}
    fitted = {w: fit_confidence(halves[w, "calibration"]["runs"][policy_name(*LINEAR[-1])]["records"], w)
              for w in records}
    # the text state of every round and drafted position, from the context alone (no outcome)
    use_text = words is not None and not earlier and all("prompt_ids" in h for h in halves.values())
    text = {k: text_features(h, h["prompt_ids"], words, policy_name(*LINEAR[-1])) for k, h in halves.items()} \
        if use_text else {}
    runs, keys = _rows(halves, status)
    calibrations, shifts, scales = {}, {}, {}

    def calibration(spec: str, context: bool, with_text: bool):
        """One fit per calibration, shared by its keys; ``a+b``: a's, shifted on a few rounds of b's
        (decision 9, on the calibration without the text state, as it was decided)."""
        key = (spec, context, with_text)
        if key not in calibrations:
            source, _, target = spec.partition("+")
            feature = text[source, "calibration"][0] if with_text else None
            cal = calibration(source, context, False) if target else \
                fit_calibration(records[source], context=context, text=feature)
            if target:
                few = sample_rounds(records[target], SHIFT_SHARE, SHIFT_SEED)
                shift = fit_workload_shift(cal, few, cells=SHIFT_CELLS)
                shifts[spec, context] = {**shift.as_dict(), "rounds": len(few), "of_rounds": len(records[target])}
                cal = shifted_calibration(cal, shift)
            else:   # below an off-chain node (decision 10), from the same linear runs
                scales[key] = fit_off_chain_scale(cal, {} if earlier else {   # each linear run apart
                    name: r["records"] for name, r in halves[source, "calibration"]["runs"].items()}, text=feature)
            calibrations[key] = cal
        return calibrations[key]

    def per_key(context):
        out = {}
        for k in sorted(keys):
            half = tuple(k.split("@")[0].split())
            cal = k.split("@")[1]
            source, _, target = cal.partition("+")
            with_text = use_text and not target
            drafts = text[half][1] if with_text else halves[half]["drafts"]
            use = uses_lookup(records[source], drafts) if context is None else context
            calibration(source, use, with_text)     # the off-chain share: the source's linear runs
            out[k] = transfer_model(calibration(cal, use, with_text), drafts, drafts.workload,
                                    off_chain_scale=scales[source, use, with_text].scale)
        return out
    # the lookup wherever the traces and the drafts carry it (uses_lookup); beside it, each key
    # without it; and whether the calibrating half's own folds say the lookup helps (lookup_cv)
    models = per_key(None)
    folds = {w: {("lookup" if c else "confidence_only"): float(np.mean(e)) for c, e in
                 lookup_cv(records[w], halves[w, "calibration"]["drafts"]).items()} for w in workloads}
    baseline = {k: fitted[k.split("@")[1].partition("+")[0]] for k in keys}
    df = oos_table(models, runs, lambda m, run: predicted_accepted(m, run, costs),
                   extras={"confidence_only": per_key(False), "baseline": baseline})
    return {"table": df, "summary": oos_summary(df), "lossless": {f"{w} {h}": v["lossless"] for (w, h), v in halves.items()},
            "prompts": {f"{w} {h}": v["prompts"] for (w, h), v in halves.items()},
            "models": {k: m.meta for k, m in models.items()}, "calibration_folds": folds,
            "shifts": {f"{spec} {'lookup' if ctx else 'confidence_only'}": v for (spec, ctx), v in shifts.items()},
            "off_chain": {f"{spec} {'lookup' if ctx else 'confidence_only'}{' text' if t else ''}": v.as_dict()
                          for (spec, ctx, t), v in scales.items()},
            "text_terms": {f"{spec} {'lookup' if ctx else 'confidence_only'}": np.round(c.text_terms, 4).tolist()
                           for (spec, ctx, t), c in calibrations.items() if t and c.text_terms is not None}}


def run_oos(model_dir, settings: dict, starts: dict | None, traces=None, reuse_traces=None, say=print,
            earlier: bool = False) -> dict:
    """The table of the command line: each workload's halves (:func:`table_halves` from ``starts``,
    {workload: first index}; None: the development prompts), their prompts loaded once, decoded live
    (:func:`decode_halves`, the traces kept under ``traces``) or read back from the traces an earlier
    run kept under ``reuse_traces`` (:func:`load_halves`: the workloads it holds), then
    :func:`analyse` (``earlier``: the model of decisions 1-9) with each workload's label
    (:func:`table_status`).  Beside the analysis: ``"status"``, ``"halves"``, ``"prompt_texts"``
    ({workload: (calibration texts, test texts)}) and ``"spans"`` ({workload: :func:`half_spans`})."""
    first, sizes = table_halves(settings, starts)
    workloads = kept_workloads(reuse_traces) if reuse_traces else list(first)
    if starts is None:
        spans, texts = {}, {w: development_prompts(w, *half_sizes(settings, w, True)) for w in workloads}
    else:     # each workload's halves found once: their prompts and their held-out ranges
        found = {w: held_out_halves(w, s, *sizes[w]) for w, s in first.items()}
        spans, texts = {w: f[1] for w, f in found.items()}, {w: found[w][0] for w in workloads}
    status = table_status(starts, spans)
    prompt_ids, words = prompt_token_ids(model_dir, texts)
    if reuse_traces:
        halves = load_halves(reuse_traces, settings, prompt_ids)
    else:
        halves = decode_halves(model_dir, settings, prompt_ids, traces, say, {w: first[w] for w in workloads}, spans)
    return {**analyse(halves, status, words, earlier), "status": status, "halves": halves, "prompt_texts": texts,
            "spans": spans}


if __name__ == "__main__":
    # ``python -m simtree.runtime.acceptance_oos``: the command line lives in :mod:`.acceptance_oos_cli`,
    # which imports this module; run as a script, this module hands over to it (no import of it here).
    import runpy
    runpy.run_module("simtree.runtime.acceptance_oos_cli", run_name="__main__", alter_sys=True)
