"""Validate the trace-fitted acceptance model on the runtime's real models (CPU).

    python scripts/validate_acceptance.py --out reports/acceptance          # ~15 min on one core
    python scripts/validate_acceptance.py --quick --out /tmp/acceptance    # the CI version, < 1 min

Per workload (packaged ShareGPT and HumanEval prompts, the shipped tiny default, its MTP layer drafting):

1. decode the prompts with LINEAR speculation (budget 16: 15 drafted tokens, the drafter's
   top-8 logged at every drafted position, trace format v2) and fit
   :func:`simtree.acceptance.fit.fit_confidence` on those traces only;
2. decode the same prompts with EAGLE and best-first trees at D = 4 to 16 and measure their
   accepted tokens per round (bonus included) from their own traces;
3. predict each tree's accepted tokens per round from the linear fit
   (:func:`simtree.acceptance.predict.accepted_per_round`) and compare.

Greedy speculative decoding is lossless, so every policy decodes the same text for a prompt;
counting only the rounds that decode the kept ``max_new_tokens`` of each sequence
(:func:`live_records`) makes the compared text the same too, and the comparison isolates what
the model claims - what trees accept, from a linear run.  ``measured_se`` is the standard error of the measured mean over
sequences (a sequence's rounds are correlated, so whole sequences are resampled);
``rel_err_se`` resamples sequences in the linear fit and the tree run together (paired) and
refits.  Writes ``validation.csv`` (columns: model, workload, policy, budget, measured_accept,
predicted_accept, rel_err, measured_se, rel_err_se, rounds) and ``validation.json`` (settings,
summary) atomically.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from simtree.acceptance.bootstrap import sequence_ids
from simtree.acceptance.fit import fit_confidence
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.traces import read_traces
from simtree.fileio import write_text_atomic
from simtree.planning.simulate import PolicySpec
from simtree.runtime.data import prompts as load_prompts
from simtree.runtime.full.build import build_model
from simtree.runtime.full.generate import generate
from simtree.runtime.live import RUNTIME_MODEL
from simtree.runtime.tokenizer import ByteTokenizer
from simtree.runtime.trace import TraceWriter

FIT_POLICY = ("linear", {"budget": 16})
TREE_POLICIES = [("eagle", {"num_steps": 3, "topk": 2, "budget": 4}),
                 ("eagle", {"num_steps": 4, "topk": 2, "budget": 8}),
                 ("eagle", {"num_steps": 4, "topk": 4, "budget": 12}),
                 ("eagle", {"num_steps": 8, "topk": 2, "budget": 16}),
                 ("best_first", {"budget": 4, "width": 1, "draft_depth": 3}),
                 ("best_first", {"budget": 8, "width": 1, "draft_depth": 5}),
                 ("best_first", {"budget": 12, "width": 1, "draft_depth": 6}),
                 ("best_first", {"budget": 16, "width": 1, "draft_depth": 8})]
FULL = {"workloads": ("sharegpt", "humaneval"), "prompts": 32, "max_new_tokens": 128, "policies": TREE_POLICIES,
        "bootstrap": 20}
QUICK = {"workloads": ("sharegpt",), "prompts": 6, "max_new_tokens": 40,
         "policies": [TREE_POLICIES[1], TREE_POLICIES[5]], "bootstrap": 3}
COLUMNS = ["model", "workload", "policy", "budget", "measured_accept", "predicted_accept", "rel_err",
           "measured_se", "rel_err_se", "rounds"]


def policy_name(mode: str, params: dict) -> str:
    if mode == "eagle":
        return f"eagle_s{params['num_steps']}_k{params['topk']}_d{params['budget']}"
    if mode == "best_first":
        return f"best_first_d{params['budget']}_p{params['draft_depth']}"
    return f"{mode}_d{params['budget']}"


def decode(target, ids, max_new_tokens, mode, params, workload, path: Path):
    """One static batch of all prompts; returns the records of the rounds that began while
    their sequence was still short of ``max_new_tokens`` (:func:`live_records`)."""
    with TraceWriter(path) as trace:
        generate(target, ids, max_new_tokens, PolicySpec.from_dict(mode, dict(params)), workload=workload, trace=trace)
    return live_records(read_traces(path), max_new_tokens)


def live_records(records, max_new_tokens: int):
    """The rounds that decode the text the outputs keep.

    A static batch decodes every sequence until the slowest has ``max_new_tokens``; the rounds
    after a sequence is done decode text nobody keeps, and how much of it depends on the
    policy (a fast policy runs far past the end in a sequence that repeats itself).  Keeping
    the rounds that begin while the sequence is short of ``max_new_tokens`` (as ``simtree
    run`` counts its compared throughput) makes every policy decode the same text.
    """
    seq, made, keep = sequence_ids(records), {}, []
    for rec, s in zip(records, seq):
        if made.get(s, 1) < max_new_tokens:   # the prefill made each sequence's first token
            keep.append(rec)
        made[s] = made.get(s, 1) + rec.num_accepted + 1
    return keep


def _per_sequence(records):
    """(sequence ids [m], accepted tokens per round [m]) of a run's records."""
    return sequence_ids(records), np.array([r.num_accepted + 1 for r in records], np.float64)


def _resample(ids, values, pick):
    return np.concatenate([values[ids == s] for s in pick])


def validate(settings: dict, out: Path, progress=print) -> pd.DataFrame:
    torch.set_num_threads(1)
    target, tok = build_model(RUNTIME_MODEL, device="cpu", dtype=torch.float32), ByteTokenizer()
    rng = np.random.default_rng(settings.get("seed", 0))
    rows = []
    with tempfile.TemporaryDirectory(prefix="simtree-validate-") as scratch:
        for workload in settings["workloads"]:
            ids = [tok.encode(t) for t in load_prompts(workload, settings["prompts"])]
            t0 = time.perf_counter()
            linear = decode(target, ids, settings["max_new_tokens"], *FIT_POLICY, workload,
                            Path(scratch) / f"{workload}_linear.jsonl")
            model = fit_confidence(linear, workload)
            progress(f"{workload}: linear fit run, {len(linear)} rounds x sequences, {time.perf_counter() - t0:.0f}s")
            lin_seq = sequence_ids(linear)
            seqs = np.unique(lin_seq)
            boots = [rng.choice(seqs, seqs.size) for _ in range(settings["bootstrap"])]
            boot_models = [fit_confidence([linear[i] for s in pick for i in np.flatnonzero(lin_seq == s)], workload)
                           for pick in boots]
            for mode, params in settings["policies"]:
                t0 = time.perf_counter()
                recs = decode(target, ids, settings["max_new_tokens"], mode, params, workload,
                              Path(scratch) / f"{workload}_{policy_name(mode, params)}.jsonl")
                seq, acc = _per_sequence(recs)
                measured, predicted = float(acc.mean()), accepted_per_round(model, mode, params)
                se = [_resample(seq, acc, rng.choice(np.unique(seq), np.unique(seq).size)).mean() for _ in range(200)]
                rel = [accepted_per_round(m, mode, params) / _resample(seq, acc, pick).mean() - 1.0
                       for m, pick in zip(boot_models, boots)]
                rows.append({"model": RUNTIME_MODEL, "workload": workload, "policy": policy_name(mode, params),
                             "budget": params["budget"], "measured_accept": measured, "predicted_accept": predicted,
                             "rel_err": predicted / measured - 1.0, "measured_se": float(np.std(se, ddof=1)),
                             "rel_err_se": float(np.std(rel, ddof=1)) if len(rel) > 1 else float("nan"),
                             "rounds": len(recs)})
                progress(f"{workload} {policy_name(mode, params)}: measured {measured:.3f}, predicted {predicted:.3f} "
                         f"({100 * rows[-1]['rel_err']:+.1f}%), {time.perf_counter() - t0:.0f}s")
    return pd.DataFrame(rows, columns=COLUMNS)


def summary(df: pd.DataFrame) -> dict:
    err = df["rel_err"].abs()
    return {"median_abs_rel_err": float(err.median()), "max_abs_rel_err": float(err.max()),
            "median_measured_se_rel": float((df["measured_se"] / df["measured_accept"]).median()),
            "median_rel_err_se": float(df["rel_err_se"].median()) if df["rel_err_se"].notna().any() else None,
            "targets": {"median_abs_rel_err": 0.03, "max_abs_rel_err": 0.06}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/acceptance", help="folder for validation.csv and validation.json")
    ap.add_argument("--quick", action="store_true", help="the reduced CI version (one workload, two trees)")
    args = ap.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    t0 = time.perf_counter()
    df = validate(settings, Path(args.out))
    out = Path(args.out)
    write_text_atomic(out / "validation.csv", df.to_csv(index=False, float_format="%.5f"))
    info = {"command": "python scripts/validate_acceptance.py" + (" --quick" if args.quick else "") + f" --out {out}",
            "fit_policy": policy_name(*FIT_POLICY), "seconds": round(time.perf_counter() - t0, 1),
            "settings": {k: (v if k != "policies" else [policy_name(*p) for p in v]) for k, v in settings.items()},
            "torch_threads": 1, "summary": summary(df)}
    write_text_atomic(out / "validation.json", json.dumps(info, indent=1) + "\n")
    s = info["summary"]
    print(f"wrote {out / 'validation.csv'}: {len(df)} rows; |rel_err| median {100 * s['median_abs_rel_err']:.2f}%, "
          f"worst {100 * s['max_abs_rel_err']:.2f}% (targets 3% / 6%), {info['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
