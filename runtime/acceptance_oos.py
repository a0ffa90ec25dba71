"""Acceptance predicted out of sample on the trained Qwen3.5-architecture target (CPU).

    python -m simtree.runtime.acceptance_oos --sharegpt-start 640 --humaneval-start 0 --out reports/validation
    python -m simtree.runtime.acceptance_oos --quick --out /tmp/oos              # a small check
    python -m simtree.runtime.acceptance_oos --reuse-traces T --out DIR          # analyse kept traces again

With the checkpoint ``--model`` (default: the shipped ``qwen3.5-tiny-sharegpt``, its MTP layer
the drafter) and its tokenizer, live on the full runtime (:mod:`.target_trace`), per workload
(ShareGPT chat, HumanEval code) on held-out prompts from a given index on (:func:`held_out_prompts`;
ShareGPT's from ``SHAREGPT_START``, past every prompt earlier versions of the model were developed
on; no HumanEval problem is unseen, :func:`prompt_status`), split in two halves:

1. the ``calibration`` half decoded with the linear policies (``LINEAR``): the only acceptance
   outcomes any prediction reads - the drafter's calibration on that workload
   (:func:`simtree.acceptance.fit.fit_calibration`: P(target takes a candidate | its draft
   probability, depth, rank, and what the context lookup proposes (:func:`simtree.acceptance.fit.lookup_states`):
   :func:`simtree.acceptance.transfer.uses_lookup`), what an engine's linear
   acceptance metrics give a user;
2. the ``test`` half decoded with the linear policies and every tree policy (``TREES``: EAGLE
   and best-first trees, cost_aware and batch_alloc deciding with the shipped H200 Qwen3.6-27B
   bundle ``COSTS``) and traced;
3. each half decoded once more as a drafting pass (:func:`.target_trace.draft_confidences`):
   plain greedy decoding, the MTP layer drafting its 15-position chain at every generated
   position, its top-8 probabilities and the lookup's rank kept, nothing of the target's verdict;
4. every run's mean accepted tokens per round predicted from a calibration and the drafting
   pass of the run's own prompts (:func:`simtree.acceptance.transfer.transfer_model`) and
   compared (:mod:`simtree.planning.acceptance_oos`).  ``split`` says what is out of sample:
   ``policies`` (the test half's trees, calibrated on the same workload's linear runs of the
   other half: new policies on new prompts), ``prompts`` (the test half's linear runs, same
   calibration: new prompts), ``workload`` (HumanEval's test half, every policy, calibrated on
   ShareGPT's linear runs: new prompts of another workload), ``in_sample`` (the calibrating runs).
   No acceptance outcome of a test half enters any prediction.  Beside it
   (``confidence_only_*``: the calibration without the lookup;
   ``baseline_*``: the outcome-fitted model of the calibrating workload's linear D = 16 run,
   :func:`simtree.acceptance.fit.fit_confidence`).

Writes ``acceptance_out_of_sample.csv`` and ``acceptance_out_of_sample.md`` (a generated summary
ending in the run's settings, summary and the decode's lossless check as a JSON block: every
policy's outputs equal plain decoding's) atomically under ``--out``; ``--traces DIR`` keeps
the traces, which ``--reuse-traces DIR`` analyses again without decoding.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import numpy as np

from simtree.acceptance.fit import fit_calibration, fit_confidence
from simtree.acceptance.lookup_folds import lookup_cv
from simtree.acceptance.traces import read_traces
from simtree.acceptance.transfer import parse_drafts, read_drafts, transfer_model, uses_lookup
from simtree.costs.model import load_costs
from simtree.data import data_path
from simtree.errors import SimtreeError, check_whole
from simtree.fileio import read_json, write_text_atomic
from simtree.planning.acceptance_oos import oos_summary, oos_table, summary_markdown

from .bpe import BpeTokenizer
from .data import PROMPT_CHARS, WORKLOADS, humaneval_problems, prompts as load_prompts
from .full.build import build_model
from .target_trace import draft_confidences, policy_name, trace_policies

__all__ = ["run_oos", "analyse", "decode_halves", "load_halves", "held_out_prompts", "development_prompts",
           "prompt_status", "DEFAULT_MODEL", "LINEAR", "TREES", "COSTS", "SEEN_SHAREGPT", "SHAREGPT_START",
           "HUMANEVAL_START", "CHAIN"]

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
# held-out ShareGPT prompts (:func:`.data.prompts` order) earlier versions of the model read: 0..127
# (development), 128..262 (the first out-of-sample table's 128, repeats skipped) and 384..513 (the
# second table's, first decoded for it, then read to find why the lookup calibration missed its own
# runs), all development data since (docs/acceptance.md, section 5).  The table's prompts begin at
# SHAREGPT_START, past them (a later version that develops on them raises SEEN_SHAREGPT and takes a
# range past the table's; 263..383 and 514..639 have not been decoded).
# Every HumanEval problem has been read: 0..131 are in the target's training text, 132..163 were
# development, 0..127 the first table's test: HumanEval rows are labelled "seen", never "fresh".
SEEN_SHAREGPT = 514
SHAREGPT_START = 640
HUMANEVAL_START = 0
FULL = {"prompts": 64, "max_new_tokens": 64, "trees": TREES}     # prompts per half
QUICK = {"prompts": 3, "max_new_tokens": 16, "trees": [TREES[1], TREES[5], TREES[8]]}


def held_out_prompts(workload: str, n: int, start: int) -> tuple[list[str], list[str]]:
    """(calibration half, test half) of ``n`` prompts each: ShareGPT held-out prompts from index
    ``start`` on (:func:`.data.prompts` order; a prompt repeating an earlier prompt's text is
    skipped), HumanEval problems ``start``..``start`` + 2n - 1 (the last 160 characters of the
    prompt, as :func:`.data.prompts` cuts them)."""
    start = check_whole(start, f"{workload} start", 0)
    if workload == "sharegpt":
        every = load_prompts("sharegpt", start + 4 * n)
        seen, out = set(every[:start]), []
        for p in every[start:]:
            if p not in seen:
                out.append(p)
            seen.add(p)
    elif workload == "humaneval":
        out = [p["prompt"][-PROMPT_CHARS:] for p in humaneval_problems()[start:start + 2 * n]]
    else:
        raise SimtreeError(f"unknown workload {workload!r}")
    if len(out) < 2 * n:
        raise SimtreeError(f"only {len(out)} {workload} prompts from index {start} on, {2 * n} asked for")
    return out[:n], out[n:2 * n]


def prompt_status(workload: str, start: int | None) -> str:
    """"fresh" for ShareGPT prompts from past the seen ones (``SEEN_SHAREGPT``), else "seen"
    (every HumanEval problem; ``start`` None: the development prompts)."""
    return "fresh" if workload == "sharegpt" and start is not None and start >= SEEN_SHAREGPT else "seen"


def development_prompts(workload: str, n: int) -> tuple[list[str], list[str]]:
    """(calibration half, test half) of the prompts the model was first developed on: the first
    128 held-out ShareGPT prompts (up to 64 a half) and HumanEval 132..163 (up to 16 a half)."""
    if workload == "sharegpt":
        every = load_prompts("sharegpt", 128)
        half = min(n, 64)
        return every[:half], every[64:64 + half]
    every, half = load_prompts("humaneval", 32), min(n, 16)
    return every[:half], every[16:16 + half]


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
            "lossless": lossless, "prompts": len(ids)}


def _half_policies(settings: dict, half: str) -> list:
    return LINEAR if half == "calibration" else [*LINEAR, *settings["trees"]]


def decode_halves(model_dir, settings: dict, prompts, traces=None, say=print) -> dict:
    """{(workload, half): {"runs", "drafts", "lossless", "prompts"}}: each workload's two halves
    (``prompts(workload, n)``) decoded live, the calibration half with ``LINEAR``, the test half
    with ``LINEAR`` and the trees, each once more as a drafting pass; ``traces``: keep the traces
    there (with ``lossless.json``, which :func:`load_halves` reads back)."""
    torch.set_num_threads(1)
    model_dir = Path(model_dir)
    model = build_model(str(model_dir), device="cpu", dtype=torch.float32)
    tok = BpeTokenizer.from_file(model_dir)
    costs = load_costs(COSTS)
    halves = {}
    for workload in WORKLOADS:
        cal_text, test_text = prompts(workload, settings["prompts"])
        for half, text in (("calibration", cal_text), ("test", test_text)):
            ids = [tok.encode(p) for p in text]
            halves[workload, half] = _decode_half(model, ids, _half_policies(settings, half), settings, workload, half,
                                                  traces, costs, say)
    if traces is not None:
        write_text_atomic(Path(traces) / "lossless.json", json.dumps(
            {f"{w} {h}": {"lossless": v["lossless"], "prompts": v["prompts"]} for (w, h), v in halves.items()}))
    return halves


def load_halves(traces, settings: dict) -> dict:
    """The halves of :func:`decode_halves` read back from the traces it kept (no decoding): to
    analyse a run again."""
    traces = Path(traces)
    kept = read_json(traces / "lossless.json", "kept run") if (traces / "lossless.json").is_file() else {}
    halves = {}
    for workload in WORKLOADS:
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
    return halves


def _run_row(r: dict, name: str, workload: str, split: str, key: str, batch: int, status: str) -> dict:
    return {"drafter": "mtp", "policy": name, "mode": r["mode"], "params": r["params"], "workload": workload,
            "split": split, "records": r["records"], "batch_size": batch, "context_len": r["context_len"],
            "drafts": key, "calibrated_on": key.split("@")[1], "prompts": status}


def analyse(halves: dict, status: dict | None = None) -> dict:
    """The table and its summary from decoded (or kept) halves: every run predicted from its
    half's drafting pass under a calibration on a calibration half's linear runs (the module
    docstring); ``status``: {workload: "fresh" | "seen"}, each row's ``prompts``."""
    status = status or {}
    costs = load_costs(COSTS)
    linear = {policy_name(*p) for p in LINEAR}
    # outcomes of the calibration halves' linear runs only
    records = {w: [rec for r in halves[w, "calibration"]["runs"].values() for rec in r["records"]] for w in WORKLOADS}
    fitted = {w: fit_confidence(halves[w, "calibration"]["runs"][policy_name(*LINEAR[-1])]["records"], w)
              for w in records}
    runs, keys = [], set()
    for (workload, half), h in halves.items():
        key, seen = f"{workload} {half}@{workload}", status.get(workload, "seen")
        for name, r in h["runs"].items():
            split = "in_sample" if half == "calibration" else ("prompts" if name in linear else "policies")
            runs.append(_run_row(r, name, workload, split, key, h["prompts"], seen))
        keys.add(key)
        if workload == "humaneval" and half == "test":      # chat -> code: every policy
            key = f"{workload} {half}@sharegpt"
            runs += [_run_row(r, name, workload, "workload", key, h["prompts"], seen) for name, r in h["runs"].items()]
            keys.add(key)
    calibrations = {}

    def calibration(workload: str, context: bool):
        if (workload, context) not in calibrations:      # one fit per calibration, shared by its keys
            calibrations[workload, context] = fit_calibration(records[workload], context=context)
        return calibrations[workload, context]

    def per_key(context):
        out = {}
        for k in sorted(keys):
            drafts = halves[tuple(k.split("@")[0].split())]["drafts"]
            cal = k.split("@")[1]
            use = uses_lookup(records[cal], drafts) if context is None else context
            out[k] = transfer_model(calibration(cal, use), drafts, drafts.workload)
        return out
    # the lookup wherever the traces and the drafts carry it (uses_lookup); beside it, each key
    # without it; and whether the calibrating half's own folds say the lookup helps (lookup_cv)
    models = per_key(None)
    folds = {w: {("lookup" if c else "confidence_only"): float(np.mean(e)) for c, e in
                 lookup_cv(records[w], halves[w, "calibration"]["drafts"]).items()} for w in WORKLOADS}
    baseline = {k: fitted[k.split("@")[1]] for k in keys}
    df = oos_table(models, runs, costs, extras={"confidence_only": per_key(False), "baseline": baseline})
    return {"table": df, "summary": oos_summary(df), "lossless": {f"{w} {h}": v["lossless"] for (w, h), v in halves.items()},
            "prompts": {f"{w} {h}": v["prompts"] for (w, h), v in halves.items()},
            "models": {k: m.meta for k, m in models.items()}, "calibration_folds": folds}


def run_oos(model_dir, settings: dict, traces=None, say=print, prompts=None, status: dict | None = None) -> dict:
    """:func:`decode_halves` then :func:`analyse`; ``prompts`` (default: ShareGPT from
    ``SHAREGPT_START``, HumanEval from ``HUMANEVAL_START``)."""
    if prompts is None:
        starts = {"sharegpt": SHAREGPT_START, "humaneval": HUMANEVAL_START}
        prompts = lambda w, n: held_out_prompts(w, n, starts[w])     # noqa: E731
        status = status or {w: prompt_status(w, s) for w, s in starts.items()}
    return analyse(decode_halves(model_dir, settings, prompts, traces, say), status)


def _prompts_line(args, settings: dict, status: dict) -> str:
    n = settings["prompts"]
    if args.development:
        return ("DEVELOPMENT prompts (the first 128 held-out ShareGPT prompts, HumanEval 132..163), which the model "
                "was developed on: not out of sample.")
    she = args.sharegpt_start
    return (f"ShareGPT: the first {2 * n} distinct held-out prompts from index {she} on, "
            + ("FRESH (past the first " + str(SEEN_SHAREGPT) + " that earlier versions of the model were developed on; "
               "none of them decoded before this table)" if status["sharegpt"] == "fresh" else
               "SEEN (earlier versions of the model were developed on prompts up to " + str(SEEN_SHAREGPT - 1) + ")")
            + f". HumanEval: problems {args.humaneval_start}..{args.humaneval_start + 2 * n - 1}, SEEN: no HumanEval "
            "problem is unseen (0..131 are in the target's training text, 132..163 were development, 0..127 the "
            "first table's test), so its rows are labelled `seen` and are not fresh out-of-sample evidence.")


def _header(cmd: str, info: dict, res: dict, settings: dict, prompts_line: str) -> list[str]:
    return ["# Acceptance predicted out of sample", "",
            f"Generated by `{cmd}` ({info['seconds']:.0f} s, CPU). Target: `{info['model']}` (Qwen3.5 architecture, "
            "trained on the ShareGPT training split and HumanEval 0..131), drafter: its MTP layer. Prompts per half: "
            + ", ".join(f"{k} {v}" for k, v in res["prompts"].items())
            + f"; {settings['max_new_tokens']} new tokens each, one static batch per half and policy. " + prompts_line
            + " Each row's `prompts` column says `fresh` or `seen`.",
            f"Greedy decoding lossless in every run and drafting pass: "
            f"{all(all(v.values()) for v in res['lossless'].values()) if all(res['lossless'].values()) else 'not rechecked (kept traces)'}"
            + (" (as checked when the kept traces were decoded, not rechecked here)" if info.get("reused_traces") else "")
            + ".", "",
            "What each prediction used (`predicted_accepted`; simtree.acceptance.transfer), by `split`:", "",
            "- acceptance outcomes: only the linear runs (" + ", ".join(policy_name(*p) for p in LINEAR)
            + ") of a workload's calibration half (`calibrated_on`): the drafter's calibration, P(target takes a "
            "candidate | its draft probability, depth, rank, and what the context lookup proposes: this candidate, "
            "another of the drafter's, or none of them);",
            "- `policies`: every tree policy on the test half, calibrated on the same workload's calibration half "
            "(new policies on new prompts: what a user's linear acceptance metrics predict about trees);",
            "- `prompts`: the linear policies on the test half, same calibration (new prompts);",
            "- `workload`: every policy on HumanEval's test half, calibrated on ShareGPT's calibration half "
            "(chat -> code); ShareGPT's `policies` and `prompts` rows are chat -> held-out chat;",
            "- `in_sample`: the calibrating runs themselves, not out of sample.",
            "", "Each run is predicted from the drafting pass of its own prompts: plain greedy decoding (the text "
            "every policy reproduces token for token) with, at each generated position, the MTP layer's top-8 "
            f"probabilities along its {CHAIN}-position greedy chain and, at each chain position, the rank among them "
            "of the token a lookup of the context proposes (the token that followed the latest earlier occurrence "
            "of the last 3 tokens): what the drafter and the engine hold before any verification. "
            "`confidence_only_*`: the same calibration without the lookup; "
            "`baseline_*`: the model fitted on the "
            "calibrating workload's linear D = 16 run (its text states and confidences), one per calibration. "
            "`err_in_se`: the error in standard errors of the measured mean (`measured_se`); `err_in_joint_se`: "
            "in the standard error of measured against predicted, the calibrating runs' relative s.e. (the median of "
            "the calibrating half's) added in quadrature: both sides are means over sampled prompts.",
            "", "The calibrating halves' own check (4 folds of their sequences, each predicted from the others: "
            "mean |log error| of the linear runs without / with the lookup): "
            + "; ".join(f"{w} {100 * v['confidence_only']:.1f}% / {100 * v['lookup']:.1f}%"
                        for w, v in res["calibration_folds"].items()) + ".",
            "", "Every modelling setting was fixed on development runs (other prompts) before the fresh prompts were "
            "decoded (docs/acceptance.md, section 5)."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="qwen3_5_text folder with its tokenizer.json")
    ap.add_argument("--out", default="reports/validation", help="folder for the table and its summary")
    ap.add_argument("--traces", default=None, help="keep the traces in this folder")
    ap.add_argument("--reuse-traces", default=None,
                    help="analyse the traces an earlier run kept (--traces) instead of decoding (same settings)")
    ap.add_argument("--quick", action="store_true", help="3 prompts per half, three trees (a check, not a result)")
    ap.add_argument("--sharegpt-start", type=int, default=SHAREGPT_START,
                    help=f"first held-out ShareGPT prompt index (fresh from {SEEN_SHAREGPT})")
    ap.add_argument("--humaneval-start", type=int, default=HUMANEVAL_START, help="first HumanEval problem")
    ap.add_argument("--development", action="store_true",
                    help="the prompts the model was first developed on (ShareGPT 0..127, HumanEval 132..163)")
    args = ap.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    t0 = time.perf_counter()
    starts = {"sharegpt": args.sharegpt_start, "humaneval": args.humaneval_start}
    status = {w: "seen" if args.development else prompt_status(w, s) for w, s in starts.items()}
    try:
        if args.reuse_traces:
            halves = load_halves(args.reuse_traces, settings)
        else:
            prompts = development_prompts if args.development else (lambda w, n: held_out_prompts(w, n, starts[w]))
            halves = decode_halves(args.model, settings, prompts, args.traces)
        res = analyse(halves, status)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out, df, s = Path(args.out), res["table"], res["summary"]
    cmd = ("python -m simtree.runtime.acceptance_oos" + (" --quick" if args.quick else "")
           + (" --development" if args.development else
              f" --sharegpt-start {args.sharegpt_start} --humaneval-start {args.humaneval_start}") + f" --out {args.out}")
    if args.model != str(DEFAULT_MODEL):
        cmd += f" --model {args.model}"
    info = {"command": cmd, "model": Path(args.model).name, "calibration": [policy_name(*p) for p in LINEAR],
            "settings": {**settings, "trees": [policy_name(*p) for p in settings["trees"]]},
            "prompts": res["prompts"], "prompt_status": status, "prompt_starts": None if args.development else starts,
            "seconds": round(time.perf_counter() - t0, 1), "torch_threads": 1, "summary": s,
            "lossless": res["lossless"], "calibration_folds": res["calibration_folds"], "models": res["models"]}
    if args.reuse_traces:
        info["reused_traces"] = True
    write_text_atomic(out / "acceptance_out_of_sample.csv", df.to_csv(index=False, float_format="%.5f"))
    settings_block = "\n## Settings\n\n```json\n" + json.dumps(info, indent=1) + "\n```\n"
    head = _header(cmd, info, res, settings, _prompts_line(args, settings, status))
    write_text_atomic(out / "acceptance_out_of_sample.md", summary_markdown(df, s, head).rstrip("\n") + "\n" + settings_block)
    print(f"wrote {out / 'acceptance_out_of_sample.csv'}: {len(df)} rows, {info['seconds']:.0f}s")
    for name, f in s["families"].items():
        print(f"  {name} ({f['prompts']} prompts): {f['rows']} rows, median {100 * f['median_abs_rel_err']:.2f}%, worst "
              f"{100 * f['max_abs_rel_err']:.2f}% (targets 3% / 8%: {'met' if f['meets_targets'] else 'not met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
