"""Acceptance predicted out of sample on the trained Qwen3.5-architecture target (CPU).

    python -m simtree.runtime.acceptance_oos --out reports/validation            # the shipped table
    python -m simtree.runtime.acceptance_oos --quick --out /tmp/oos              # a small check

With the checkpoint ``--model`` (default: the shipped ``qwen3.5-tiny-sharegpt``, its MTP layer
the drafter) and its tokenizer, live on the full runtime (:mod:`.target_trace`):

1. the held-out ShareGPT prompts (:func:`simtree.runtime.data.prompts`: odd records, which the
   target never trained on) split in two: ``fit`` (the first half) and ``heldout``; HumanEval
   prompts 132+ (never trained on) are ``heldout`` too;
2. every split decoded with every policy (linear, EAGLE and best-first trees, cost_aware and
   batch_alloc deciding with the shipped H200 Qwen3.6-27B bundle: ``COSTS``) and traced;
3. every split's prompts decoded once more as a drafting pass (:func:`.target_trace.draft_confidences`):
   plain greedy decoding, the MTP layer drafting its 15-position chain at every generated
   position, its top-8 probabilities kept and nothing of the target's verdict on them;
4. the drafter calibrated on ONE run's outcomes: the linear chain (``FIT_POLICY``, the drafter's
   top-8 logged at each drafted position) on the ``fit`` prompts
   (:func:`simtree.acceptance.fit.fit_calibration`: P(target takes a candidate | its draft
   probability, depth, rank));
5. each split's acceptance model: that calibration applied to the split's own drafting pass
   (:func:`simtree.acceptance.transfer.transfer_model`), and every run's mean accepted tokens
   per round predicted from it and compared (:mod:`simtree.planning.acceptance_oos`): trees
   are out of sample in the policy, the ``heldout`` rows in the prompts as well (HumanEval in
   the workload too); the calibrating run is ``in_sample``.  No acceptance outcome of a
   ``heldout`` split enters any prediction.  Beside it (``baseline_*``): the outcome-fitted
   model of the calibrating run alone (:func:`simtree.acceptance.fit.fit_confidence`), the same
   for every split.

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
from simtree.acceptance.transfer import parse_drafts, transfer_model
from simtree.planning.acceptance_oos import oos_summary, oos_table, summary_markdown
from simtree.costs.model import load_costs
from simtree.data import data_path
from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic

from .bpe import BpeTokenizer
from .data import prompts as load_prompts
from .full.build import build_model
from .target_trace import draft_confidences, policy_name, trace_policies

__all__ = ["run_oos", "DEFAULT_MODEL", "FIT_POLICY", "POLICIES", "COSTS"]

DEFAULT_MODEL = data_path("models", "qwen3.5-tiny-sharegpt")
FIT_POLICY = ("linear", {"budget": 16})
POLICIES = [("linear", {"budget": 4}), ("linear", {"budget": 8}),
            ("eagle", {"num_steps": 3, "topk": 2, "budget": 4}), ("eagle", {"num_steps": 4, "topk": 2, "budget": 8}),
            ("eagle", {"num_steps": 4, "topk": 4, "budget": 12}), ("eagle", {"num_steps": 6, "topk": 3, "budget": 16}),
            ("best_first", {"budget": 4, "width": 1, "draft_depth": 3}),
            ("best_first", {"budget": 8, "width": 1, "draft_depth": 5}),
            ("best_first", {"budget": 12, "width": 1, "draft_depth": 6}),
            ("best_first", {"budget": 16, "width": 1, "draft_depth": 8}),
            ("cost_aware", {"max_budget": 16, "draft_depth": 6}),
            ("batch_alloc", {"max_budget_per_seq": 8, "draft_depth": 6})]
# the bundle cost_aware and batch_alloc weigh tree size against verify cost with (measured and
# predicted alike): the shipped H200 Qwen3.6-27B one
COSTS = data_path("costs", "h200_qwen3.6-27b_tp1.json")
FULL = {"prompts": 64, "max_new_tokens": 64, "policies": POLICIES}   # HumanEval holds 32 held-out prompts
QUICK = {"prompts": 3, "max_new_tokens": 16, "policies": [POLICIES[3], POLICIES[7], POLICIES[10]]}


def _splits(tok: BpeTokenizer, n: int) -> list[tuple[str, str, list[list[int]]]]:
    share = [tok.encode(p) for p in load_prompts("sharegpt", 2 * n)]
    if len(share) < 2 * n:
        raise SimtreeError(f"only {len(share)} ShareGPT prompts in the packaged text, {2 * n} asked for")
    code = [tok.encode(p) for p in load_prompts("humaneval", n)]
    return [("sharegpt", "fit", share[:n]), ("sharegpt", "heldout", share[n:]), ("humaneval", "heldout", code)]


def run_oos(model_dir, settings: dict, traces=None, say=print) -> dict:
    torch.set_num_threads(1)
    model_dir = Path(model_dir)
    model = build_model(str(model_dir), device="cpu", dtype=torch.float32)
    tok = BpeTokenizer.from_file(model_dir)
    costs = load_costs(COSTS)
    fit_name = policy_name(*FIT_POLICY)
    chain = FIT_POLICY[1]["budget"] - 1
    runs, lossless, counts, drafts, fit_records = [], {}, {}, {}, None
    for workload, split, ids in _splits(tok, settings["prompts"]):
        key = f"{workload} {split}"
        counts[key] = len(ids)
        t0 = time.perf_counter()
        out = None if traces is None else Path(traces) / split
        done = trace_policies(model, ids, [("none", {}), FIT_POLICY, *settings["policies"]],
                              settings["max_new_tokens"], workload, out=out, say=say, costs=costs)
        plain = done.pop("none")["outputs"]
        # the drafter alone on the split's prompts: its confidences, no acceptance outcome
        pass_ = draft_confidences(model, ids, chain, settings["max_new_tokens"], workload, out=out)
        lossless[key] = {name: r["outputs"] == plain for name, r in done.items()}
        lossless[key]["drafting_pass"] = pass_["outputs"] == plain
        drafts[key] = parse_drafts(pass_["records"], f"{key} drafting pass")
        if split == "fit":
            fit_records = done[fit_name]["records"]
        for name, r in done.items():
            in_sample = split == "fit" and name == fit_name
            runs.append({"drafter": "mtp", "policy": name, "mode": r["mode"], "params": r["params"],
                         "workload": workload, "split": "in_sample" if in_sample else split, "records": r["records"],
                         "batch_size": len(ids), "context_len": r["context_len"], "drafts": key})
        if say is not None:
            say(f"{key}: {len(done)} policies and the drafting pass, {time.perf_counter() - t0:.0f}s")
    # outcomes of the fit run only: the calibration (and the old, outcome-fitted model beside it)
    calibration = fit_calibration(fit_records)                     # by confidence and the context lookup
    plain_cal = fit_calibration(fit_records, context=False)        # by confidence alone
    models = {key: transfer_model(calibration, d, key.split()[0]) for key, d in drafts.items()}
    confidence_only = {key: transfer_model(plain_cal, d, key.split()[0]) for key, d in drafts.items()}
    fitted = fit_confidence(fit_records, "sharegpt")
    df = oos_table(models, runs, costs, extras={"confidence_only": confidence_only, "baseline": fitted})
    return {"table": df, "summary": oos_summary(df), "lossless": lossless, "prompts": counts,
            "models": {k: m.meta for k, m in models.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="qwen3_5_text folder with its tokenizer.json")
    ap.add_argument("--out", default="reports/validation", help="folder for the table and its summary")
    ap.add_argument("--traces", default=None, help="keep the traces in this folder")
    ap.add_argument("--quick", action="store_true", help="3 prompts per split, two trees (a check, not a result)")
    args = ap.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    t0 = time.perf_counter()
    try:
        res = run_oos(args.model, settings, args.traces)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out, df, s = Path(args.out), res["table"], res["summary"]
    cmd = "python -m simtree.runtime.acceptance_oos" + (" --quick" if args.quick else "") + f" --out {args.out}"
    if args.model != str(DEFAULT_MODEL):
        cmd += f" --model {args.model}"
    info = {"command": cmd, "model": Path(args.model).name, "fit_run": f"{policy_name(*FIT_POLICY)} on sharegpt fit",
            "settings": {**settings, "policies": [policy_name(*p) for p in settings["policies"]]},
            "prompts": res["prompts"], "seconds": round(time.perf_counter() - t0, 1), "torch_threads": 1, "summary": s,
            "lossless": res["lossless"], "models": res["models"]}
    header = ["# Acceptance predicted out of sample", "",
              f"Generated by `{cmd}` ({info['seconds']:.0f} s, CPU). Target: `{info['model']}` (Qwen3.5 architecture, "
              "trained on the ShareGPT training split), drafter: its MTP layer. Prompts per split: "
              + ", ".join(f"{k} {v}" for k, v in res["prompts"].items())
              + f"; {settings['max_new_tokens']} new tokens each, one static batch per split and policy.",
              f"Greedy decoding lossless in every run and drafting pass: "
              f"{all(all(v.values()) for v in res['lossless'].values())}.", "",
              "What each prediction used (`predicted_accepted`; simtree.acceptance.transfer):", "",
              f"- acceptance outcomes: one run only, {info['fit_run']} (the `in_sample` row): the drafter's "
              "calibration, P(target takes a candidate | its draft probability, depth, rank);",
              "- sharegpt fit: that calibration and the drafting pass on the fit prompts;",
              "- sharegpt heldout: that calibration and the drafting pass on the held-out ShareGPT prompts; no "
              "accept/reject outcome of these prompts;",
              "- humaneval heldout: that calibration and the drafting pass on the HumanEval prompts; no accept/reject "
              "outcome of HumanEval.",
              "", "A drafting pass decodes the split's prompts as plain greedy decoding (the text every policy "
              "reproduces token for token) and at each generated position keeps the MTP layer's top-8 "
              f"probabilities along its {FIT_POLICY[1]['budget'] - 1}-position greedy chain and, at each chain "
              "position, the rank among them of the token a lookup of the context proposes (the token that followed "
              "the latest earlier occurrence of the last 3 tokens of the prompt, the text before the position and "
              "the chain's own top-1 tokens): what the drafter and the engine hold before any verification, no "
              "token of the target's after the position. `baseline_predicted`: the previous predictor, the model fitted on "
              "the same run's outcomes (its text states and confidence distribution are the fit prompts'), one model "
              "for every split.", "",
              "The transferred model's settings (states, levels, window, the lookup's 3-grams: "
              "simtree.acceptance.transfer defaults) were fixed on the fit split; the held-out and HumanEval rows "
              "of earlier development runs of this command were seen (docs/acceptance.md, section 5, says which and "
              "what changed after them). `confidence_only_*`: the same calibration without the context lookup."]
    write_text_atomic(out / "acceptance_out_of_sample.csv", df.to_csv(index=False, float_format="%.5f"))
    settings_block = "\n## Settings\n\n```json\n" + json.dumps(info, indent=1) + "\n```\n"
    write_text_atomic(out / "acceptance_out_of_sample.md", summary_markdown(df, s, header).rstrip("\n") + "\n"
                      + settings_block)
    o = s["out_of_sample"]
    print(f"wrote {out / 'acceptance_out_of_sample.csv'}: {len(df)} rows; out of sample |rel_err| median "
          f"{100 * o['median_abs_rel_err']:.2f}%, worst {100 * o['max_abs_rel_err']:.2f}% (targets 3% / 8%), "
          f"{info['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
