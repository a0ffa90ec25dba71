"""Acceptance predicted out of sample on the trained Qwen3.5-architecture target (CPU).

    python -m simtree.runtime.acceptance_oos --out reports/validation            # the shipped table
    python -m simtree.runtime.acceptance_oos --quick --out /tmp/oos              # a small check

With the checkpoint ``--model`` (default: the shipped ``qwen3.5-tiny-sharegpt``, its MTP layer
the drafter) and its tokenizer, live on the full runtime (:mod:`.target_trace`), per workload
(ShareGPT chat, HumanEval code) on prompts no earlier development looked at (:func:`fresh_prompts`),
split in two halves:

1. the ``calibration`` half decoded with the linear policies (``LINEAR``): the only acceptance
   outcomes any prediction reads - the drafter's calibration on that workload
   (:func:`simtree.acceptance.fit.fit_calibration`: P(target takes a candidate | its draft
   probability, depth, rank), and the context lookup's agreement where it calibrates another
   workload (:func:`simtree.acceptance.transfer.uses_lookup`)), what an engine's linear
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
   (``confidence_only_*`` / ``lookup_*``: the calibration without / with the lookup everywhere;
   ``baseline_*``: the outcome-fitted model of the calibrating workload's linear D = 16 run,
   :func:`simtree.acceptance.fit.fit_confidence`).

Writes ``acceptance_out_of_sample.csv`` and ``acceptance_out_of_sample.md`` (a generated summary
ending in the run's settings, summary and the decode's lossless check as a JSON block: every
policy's outputs equal plain decoding's) atomically under ``--out``; ``--traces DIR`` keeps
the traces.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from simtree.acceptance.fit import fit_calibration, fit_confidence
from simtree.acceptance.transfer import parse_drafts, transfer_model, uses_lookup
from simtree.costs.model import load_costs
from simtree.data import data_path
from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic
from simtree.planning.acceptance_oos import oos_summary, oos_table, summary_markdown

from .bpe import BpeTokenizer
from .data import HUMANEVAL_TRAIN, PROMPT_CHARS, humaneval_problems, prompts as load_prompts
from .full.build import build_model
from .target_trace import draft_confidences, policy_name, trace_policies

__all__ = ["run_oos", "fresh_prompts", "development_prompts", "DEFAULT_MODEL", "LINEAR", "TREES", "COSTS", "SEEN_SHAREGPT", "CHAIN"]

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
# prompts earlier development of this table looked at: the first 128 held-out ShareGPT prompts
# and HumanEval 132..163 (docs/acceptance.md, section 5); the table's prompts are others
SEEN_SHAREGPT = 128
FULL = {"prompts": 64, "max_new_tokens": 64, "trees": TREES}     # prompts per half
QUICK = {"prompts": 3, "max_new_tokens": 16, "trees": [TREES[1], TREES[5], TREES[8]]}


def fresh_prompts(workload: str, n: int) -> tuple[list[str], list[str]]:
    """(calibration half, test half) of ``n`` prompts each that no earlier development read:
    ShareGPT held-out prompts past the first ``SEEN_SHAREGPT`` (none repeating an earlier
    prompt's text), HumanEval problems 0..2n-1 (the last 160 characters of the prompt, as
    :func:`.data.prompts` cuts them; problems 132+ were seen)."""
    if workload == "sharegpt":
        every = load_prompts("sharegpt", SEEN_SHAREGPT + 4 * n)
        seen, out = set(every[:SEEN_SHAREGPT]), []
        for p in every[SEEN_SHAREGPT:]:
            if p not in seen:
                out.append(p)
            seen.add(p)
    elif workload == "humaneval":
        out = [p["prompt"][-PROMPT_CHARS:] for p in humaneval_problems()[:2 * n]]
    else:
        raise SimtreeError(f"unknown workload {workload!r}")
    if len(out) < 2 * n or (workload == "humaneval" and 2 * n > HUMANEVAL_TRAIN):
        raise SimtreeError(f"only {min(len(out), HUMANEVAL_TRAIN)} fresh {workload} prompts, {2 * n} asked for")
    return out[:n], out[n:2 * n]


def development_prompts(workload: str, n: int) -> tuple[list[str], list[str]]:
    """(calibration half, test half) of the prompts the model was developed on: the first
    ``SEEN_SHAREGPT`` held-out ShareGPT prompts (up to 64 a half) and HumanEval 132..163 (up to
    16 a half)."""
    if workload == "sharegpt":
        every = load_prompts("sharegpt", SEEN_SHAREGPT)
        half = min(n, SEEN_SHAREGPT // 2)
        return every[:half], every[SEEN_SHAREGPT // 2:SEEN_SHAREGPT // 2 + half]
    every, half = load_prompts("humaneval", 32), min(n, 16)
    return every[:half], every[16:16 + half]


def _decode_half(model, ids, policies, settings, workload, half, traces, costs, say) -> dict:
    t0 = time.perf_counter()
    out = None if traces is None else Path(traces) / f"{workload}_{half}"
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


def _run_row(r: dict, name: str, workload: str, split: str, key: str, batch: int) -> dict:
    return {"drafter": "mtp", "policy": name, "mode": r["mode"], "params": r["params"], "workload": workload,
            "split": split, "records": r["records"], "batch_size": batch, "context_len": r["context_len"],
            "drafts": key, "calibrated_on": key.split("@")[1]}


def run_oos(model_dir, settings: dict, traces=None, say=print, prompts=fresh_prompts) -> dict:
    torch.set_num_threads(1)
    model_dir = Path(model_dir)
    model = build_model(str(model_dir), device="cpu", dtype=torch.float32)
    tok = BpeTokenizer.from_file(model_dir)
    costs = load_costs(COSTS)
    linear = {policy_name(*p) for p in LINEAR}
    halves, counts, lossless = {}, {}, {}
    for workload in ("sharegpt", "humaneval"):
        cal_text, test_text = prompts(workload, settings["prompts"])
        for half, text, policies in (("calibration", cal_text, LINEAR), ("test", test_text, [*LINEAR, *settings["trees"]])):
            ids = [tok.encode(p) for p in text]
            halves[workload, half] = _decode_half(model, ids, policies, settings, workload, half, traces, costs, say)
            counts[f"{workload} {half}"] = len(ids)
            lossless[f"{workload} {half}"] = halves[workload, half]["lossless"]
    # outcomes of the calibration halves' linear runs only
    records = {w: [rec for r in halves[w, "calibration"]["runs"].values() for rec in r["records"]]
               for w in ("sharegpt", "humaneval")}
    fitted = {w: fit_confidence(halves[w, "calibration"]["runs"][policy_name(*LINEAR[-1])]["records"], w)
              for w in records}
    runs, keys = [], set()
    for (workload, half), h in halves.items():
        key = f"{workload} {half}@{workload}"
        for name, r in h["runs"].items():
            split = "in_sample" if half == "calibration" else ("prompts" if name in linear else "policies")
            runs.append(_run_row(r, name, workload, split, key, h["prompts"]))
        keys.add(key)
        if workload == "humaneval" and half == "test":      # chat -> code: every policy
            key = f"{workload} {half}@sharegpt"
            runs += [_run_row(r, name, workload, "workload", key, h["prompts"]) for name, r in h["runs"].items()]
            keys.add(key)

    def per_key(context):
        out = {}
        for k in sorted(keys):
            drafts = halves[tuple(k.split("@")[0].split())]["drafts"]
            recs = records[k.split("@")[1]]
            use = uses_lookup(recs, drafts) if context is None else context
            out[k] = transfer_model(fit_calibration(recs, context=use), drafts, drafts.workload)
        return out
    # the lookup where calibration and drafts are of different workloads (uses_lookup); beside
    # it, each key without and with the lookup
    models = per_key(None)
    baseline = {k: fitted[k.split("@")[1]] for k in keys}
    df = oos_table(models, runs, costs, extras={"confidence_only": per_key(False), "lookup": per_key(True),
                                                "baseline": baseline})
    return {"table": df, "summary": oos_summary(df), "lossless": lossless, "prompts": counts,
            "models": {k: m.meta for k, m in models.items()}}


def _header(cmd: str, info: dict, res: dict, settings: dict, development: bool) -> list[str]:
    return ["# Acceptance predicted out of sample", "",
            f"Generated by `{cmd}` ({info['seconds']:.0f} s, CPU). Target: `{info['model']}` (Qwen3.5 architecture, "
            "trained on the ShareGPT training split and HumanEval 0..131), drafter: its MTP layer. Prompts per half: "
            + ", ".join(f"{k} {v}" for k, v in res["prompts"].items())
            + f"; {settings['max_new_tokens']} new tokens each, one static batch per half and policy. "
            + ("DEVELOPMENT prompts (the first 128 held-out ShareGPT prompts, HumanEval 132..163), which the model "
               "was developed on: not out of sample." if development else
               f"The prompts are fresh: ShareGPT held-out prompts past the first {SEEN_SHAREGPT} and HumanEval "
               f"problems 0..{2 * settings['prompts'] - 1} (earlier development saw the first 128 ShareGPT prompts "
               "and HumanEval 132..163; HumanEval 0..131 are in the target's training text)."),
            f"Greedy decoding lossless in every run and drafting pass: "
            f"{all(all(v.values()) for v in res['lossless'].values())}.", "",
            "What each prediction used (`predicted_accepted`; simtree.acceptance.transfer), by `split`:", "",
            "- acceptance outcomes: only the linear runs (" + ", ".join(policy_name(*p) for p in LINEAR)
            + ") of a workload's calibration half (`calibrated_on`): the drafter's calibration, P(target takes a "
            "candidate | its draft probability, depth, rank), and the context lookup's agreement where it calibrates "
            "another workload (`workload` rows);",
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
            "`confidence_only_*` / `lookup_*`: the same calibration without / with the lookup on every row; "
            "`baseline_*`: the model fitted on the "
            "calibrating workload's linear D = 16 run (its text states and confidences), one per calibration.",
            "", "Every modelling setting was fixed on development runs (other prompts) before these prompts were "
            "decoded (docs/acceptance.md, section 5)."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="qwen3_5_text folder with its tokenizer.json")
    ap.add_argument("--out", default="reports/validation", help="folder for the table and its summary")
    ap.add_argument("--traces", default=None, help="keep the traces in this folder")
    ap.add_argument("--quick", action="store_true", help="3 prompts per half, three trees (a check, not a result)")
    ap.add_argument("--development", action="store_true",
                    help="the prompts the model was developed on instead of fresh ones (not out of sample)")
    args = ap.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    t0 = time.perf_counter()
    try:
        res = run_oos(args.model, settings, args.traces,
                      prompts=development_prompts if args.development else fresh_prompts)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out, df, s = Path(args.out), res["table"], res["summary"]
    cmd = ("python -m simtree.runtime.acceptance_oos" + (" --quick" if args.quick else "")
           + (" --development" if args.development else "") + f" --out {args.out}")
    if args.model != str(DEFAULT_MODEL):
        cmd += f" --model {args.model}"
    info = {"command": cmd, "model": Path(args.model).name, "calibration": [policy_name(*p) for p in LINEAR],
            "settings": {**settings, "trees": [policy_name(*p) for p in settings["trees"]]},
            "prompts": res["prompts"], "seconds": round(time.perf_counter() - t0, 1), "torch_threads": 1, "summary": s,
            "lossless": res["lossless"], "models": res["models"]}
    write_text_atomic(out / "acceptance_out_of_sample.csv", df.to_csv(index=False, float_format="%.5f"))
    settings_block = "\n## Settings\n\n```json\n" + json.dumps(info, indent=1) + "\n```\n"
    write_text_atomic(out / "acceptance_out_of_sample.md",
                      summary_markdown(df, s, _header(cmd, info, res, settings, args.development)).rstrip("\n") + "\n" + settings_block)
    print(f"wrote {out / 'acceptance_out_of_sample.csv'}: {len(df)} rows, {info['seconds']:.0f}s")
    for name, f in s["families"].items():
        print(f"  {name}: {f['rows']} rows, median {100 * f['median_abs_rel_err']:.2f}%, worst "
              f"{100 * f['max_abs_rel_err']:.2f}% (targets 3% / 8%: {'met' if f['meets_targets'] else 'not met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
