"""The command line of :mod:`.acceptance_oos` (``python -m simtree.runtime.acceptance_oos``, whose
docstring lists its uses): the arguments, the prompts' labels, the block drafters' runs, the
table and its generated summary written atomically under ``--out``."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from simtree.acceptance.out_of_sample import oos_summary, summary_markdown
from simtree.costs.model import load_costs
from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic

from . import acceptance_oos as oos

from .acceptance_oos import CHAIN, COSTS, DEFAULT_MODEL, FULL, LINEAR, QUICK, SHIFT_SHARE, run_oos, table_halves
from .acceptance_oos_drafters import decode_drafters, drafter_table, load_drafters
from .acceptance_oos_record import check_reuse
from .acceptance_oos_prompts import (CODE_START, HUMANEVAL_START, OOS_WORKLOADS, SEEN_CODE, SEEN_DRAFTER, SEEN_SHAREGPT,
                                     SHAREGPT_START, distinct_chat, drafter_test_status, held_out_loss_indices,
                                     held_out_loss_prompts, training_overlap)
from .acceptance_oos_report import adaptive_grid_note, drafters_line, header, prompts_line
from .target_trace import policy_name

__all__ = ["main", "parse_halves", "DRAFTER_START", "DRAFTER_CALIBRATION_START", "DRAFTER_PROMPTS",
           "DRAFTER_CALIBRATION_PROMPTS"]

# the block drafters' rows: DRAFTER_CALIBRATION_PROMPTS development prompts from DRAFTER_CALIBRATION_START
# (calibration), DRAFTER_PROMPTS fresh ones from DRAFTER_START (test): docs/acceptance.md, section 5;
# 64 new tokens
DRAFTER_START, DRAFTER_CALIBRATION_START, DRAFTER_PROMPTS, DRAFTER_CALIBRATION_PROMPTS = SEEN_DRAFTER, 0, 96, 192


def parse_halves(values) -> dict:
    """{workload: (calibration prompts, test prompts)} from ``--prompts`` values ``WORKLOAD=CAL:TEST``
    (each a workload of :data:`OOS_WORKLOADS`, at most once); a malformed one: one line."""
    out = {}
    for value in values or ():
        workload, _, sizes = value.partition("=")
        cal, _, test = sizes.partition(":")
        if workload not in OOS_WORKLOADS or not (cal.isdigit() and test.isdigit()) or min(int(cal), int(test)) < 1:
            raise SimtreeError(f"--prompts {value!r}: expected WORKLOAD=CALIBRATION:TEST, the workload one of "
                               f"{', '.join(OOS_WORKLOADS)}, each count a whole number >= 1 (e.g. sharegpt=128:128)")
        if workload in out:
            raise SimtreeError(f"--prompts gives {workload} twice")
        out[workload] = (int(cal), int(test))
    return out


def _drafter_runs(args, drafters, settings) -> tuple[dict, str, tuple[list[str], list[int]]]:
    """(the block drafters' runs, their test half's status, its prompts and their held-out indices):
    the runs read back from ``--reuse-traces``/drafters where it holds them, else decoded (their
    traces kept under ``--traces``/drafters, else in a scratch folder); each half's prompts found
    once, for the status (:func:`.acceptance_oos_prompts.drafter_test_status`: test prompts that
    overlap the calibration prompts stop the table, before any decoding) and the decode."""
    kept = Path(args.reuse_traces) / "drafters" if args.reuse_traces else None
    runs = load_drafters(kept, drafters) if kept is not None and (kept / "drafters.json").is_file() else None
    n = _drafter_counts(args) if runs is None else {h: int(k) for h, k in runs["prompts"].items()}
    starts = {"calibration": args.drafter_calibration_start, "test": args.drafter_start}
    chat = {h: distinct_chat(starts[h], n[h]) for h in ("calibration", "test")}
    status = drafter_test_status(*((starts[h], chat[h][1][-1]) for h in ("test", "calibration")))
    if runs is None:
        tokens = 16 if args.quick else settings["max_new_tokens"]
        where = Path(args.traces) / "drafters" if args.traces else Path(tempfile.mkdtemp(prefix="drafters_"))
        runs = decode_drafters(args.model, drafters, {h: texts for h, (texts, _) in chat.items()}, tokens, where,
                               starts=starts)
    return runs, status, chat["test"]


def _drafter_counts(args) -> dict:
    """{"calibration": prompts, "test": prompts} of the block drafters' runs (``--quick``: 2 each)."""
    if args.quick:
        return {"calibration": 2, "test": 2}
    return {"calibration": args.drafter_calibration_prompts, "test": args.drafter_prompts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simtree.runtime.acceptance_oos",
                                 description=oos.__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="qwen3_5_text folder with its tokenizer.json")
    ap.add_argument("--out", default="reports/validation", help="folder for the table and its summary")
    ap.add_argument("--traces", default=None, help="keep the traces in this folder")
    ap.add_argument("--reuse-traces", default=None,
                    help="analyse the traces an earlier run kept (--traces) instead of decoding (same settings)")
    ap.add_argument("--quick", action="store_true", help="3 prompts per half, three trees (a check, not a result)")
    ap.add_argument("--sharegpt-start", type=int, default=SHAREGPT_START,
                    help=f"first held-out ShareGPT prompt index (fresh from {SEEN_SHAREGPT})")
    ap.add_argument("--code-start", type=int, default=CODE_START,
                    help=f"first held-out ShareGPT conversation searched for code (fresh from {SEEN_CODE})")
    ap.add_argument("--humaneval-start", type=int, default=HUMANEVAL_START, help="first HumanEval problem")
    ap.add_argument("--prompts", action="append", metavar="WORKLOAD=CAL:TEST",
                    help="prompts in a workload's calibration and test halves (repeatable; default "
                         + ", ".join(f"{w}={c}:{t}" for w, (c, t) in FULL["halves"].items()) + ")")
    ap.add_argument("--drafters", default="mtp",
                    help="drafters whose rows the table holds: mtp (always), block, dspark (comma-separated)")
    ap.add_argument("--drafter-start", type=int, default=DRAFTER_START,
                    help="first fresh ShareGPT prompt of the block drafters' test runs")
    ap.add_argument("--drafter-calibration-start", type=int, default=DRAFTER_CALIBRATION_START,
                    help="first ShareGPT prompt of the block drafters' calibration runs (development prompts)")
    ap.add_argument("--drafter-prompts", type=int, default=DRAFTER_PROMPTS, help="test prompts, block drafters")
    ap.add_argument("--drafter-calibration-prompts", type=int, default=DRAFTER_CALIBRATION_PROMPTS,
                    help="calibration prompts, block drafters")
    ap.add_argument("--earlier-model", action="store_true",
                    help="the model of decisions 1-9 (no text state, no off-chain share): a comparison on the same traces")
    ap.add_argument("--development", action="store_true",
                    help="the prompts the model was first developed on (ShareGPT 0..127, HumanEval 132..163)")
    args = ap.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    block_drafters = tuple(d for d in args.drafters.split(",") if d and d != "mtp")
    t0 = time.perf_counter()
    starts = {"sharegpt": args.sharegpt_start, "sharegpt_code": args.code_start, "humaneval": args.humaneval_start}
    try:
        if args.prompts and args.quick:
            raise SimtreeError("--prompts and --quick: a quick run has 3 prompts a half")
        if not args.quick:
            settings["halves"] = {**FULL["halves"], **parse_halves(args.prompts)}
        if min(args.drafter_prompts, args.drafter_calibration_prompts) < 1:
            raise SimtreeError("--drafter-prompts and --drafter-calibration-prompts: whole numbers >= 1")
        kept_starts, sizes = table_halves(settings, None if args.development else starts)   # run_oos decodes these
        if "mtp" not in args.drafters.split(",") or set(block_drafters) - {"block", "dspark"}:
            raise SimtreeError(f"--drafters {args.drafters!r}: expected mtp and any of block, dspark (TfM traces carry "
                               "no marginal ranks)")
        # a kept folder decoded from other prompts stops here; one that records none: the command's starts
        unrecorded = [] if not args.reuse_traces else check_reuse(
            args.reuse_traces, kept_starts, sizes,
            ({"calibration": args.drafter_calibration_start, "test": args.drafter_start},
             _drafter_counts(args)) if block_drafters else None)
        res = run_oos(args.model, settings, None if args.development else starts, args.traces, args.reuse_traces,
                      earlier=args.earlier_model)
        status, halves = res["status"], res["halves"]
        overlap = {} if args.development else {      # ShareGPT repeats conversations: held-out text in training
            w: dict(zip(("calibration", "test"), map(training_overlap, res["prompt_texts"][w])))
            for w in ("sharegpt", "sharegpt_code") if (w, "test") in halves}
        if "sharegpt" in overlap:                    # the test half's prompts the target's held-out loss read
            cal, test = sizes["sharegpt"]
            overlap["sharegpt"]["held_out_loss"] = held_out_loss_prompts(args.sharegpt_start, cal + test, skip=cal)
        line = prompts_line(args, sizes, status, overlap, ("sharegpt_code", "test") in halves, res["spans"])
        line += " " + adaptive_grid_note(halves, load_costs(COSTS).verify.valid_range)
        if block_drafters:
            res["drafters"], d_status, (test_texts, test_indices) = _drafter_runs(args, block_drafters, settings)
            res["table"] = pd.concat([res["table"], drafter_table(res["drafters"], d_status)], ignore_index=True)
            res["summary"] = oos_summary(res["table"])
            overlap["drafters"] = {"test": training_overlap(test_texts),
                                   "held_out_loss": held_out_loss_indices(test_indices)}
            line += " " + drafters_line(args, res["drafters"], d_status, overlap["drafters"])
        out, df, s = Path(args.out), res["table"], res["summary"]
        csv_text, md_text, info = _report(args, res, settings, status, starts, overlap, unrecorded, line,
                                          block_drafters, t0)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # both built before either is written: a failure leaves the previous pair as it was
    write_text_atomic(out / "acceptance_out_of_sample.csv", csv_text)
    write_text_atomic(out / "acceptance_out_of_sample.md", md_text)
    print(f"wrote {out / 'acceptance_out_of_sample.csv'}: {len(df)} rows, {info['seconds']:.0f}s")
    for name, f in s["families"].items():
        print(f"  {name} ({f['prompts']} prompts): {f['rows']} rows, median {100 * f['median_abs_rel_err']:.2f}%, "
              f"worst {100 * f['max_abs_rel_err']:.2f}% (targets 3% / 8%: {'met' if f['meets_targets'] else 'not met'})")
    return 0


def _report(args, res, settings, status, starts, overlap, unrecorded, line, block_drafters, t0):
    """(the CSV's text, the summary's text, the settings) of the table, nothing written."""
    df, s = res["table"], res["summary"]
    cmd = ("python -m simtree.runtime.acceptance_oos" + (" --quick" if args.quick else "")
           + (" --development" if args.development else
              f" --sharegpt-start {args.sharegpt_start} --code-start {args.code_start} "
              f"--humaneval-start {args.humaneval_start}")
           + ("" if args.quick else "".join(f" --prompts {w}={c}:{t}" for w, (c, t) in settings["halves"].items()))
           + (f" --drafters {args.drafters} --drafter-start {args.drafter_start} --drafter-calibration-start "
              f"{args.drafter_calibration_start} --drafter-prompts {args.drafter_prompts} --drafter-calibration-prompts "
              f"{args.drafter_calibration_prompts}" if block_drafters else "")
           + (f" --reuse-traces {args.reuse_traces}" if args.reuse_traces else "")
           + f" --out {args.out}")
    if args.model != str(DEFAULT_MODEL):
        cmd += f" --model {args.model}"
    if args.earlier_model:
        cmd += " --earlier-model"
    info = {"command": cmd, "model": Path(args.model).name, "calibration": [policy_name(*p) for p in LINEAR],
            "settings": {**settings, "trees": [policy_name(*p) for p in settings["trees"]]},
            "prompts": res["prompts"], "prompt_status": status, "prompt_starts": None if args.development else starts,
            "training_overlap": overlap, "seconds": round(time.perf_counter() - t0, 1), "torch_threads": 1,
            "summary": s, "lossless": res["lossless"], "calibration_folds": res["calibration_folds"],
            "workload_shifts": res["shifts"], "off_chain_scales": res["off_chain"], "text_terms": res["text_terms"],
            "models": res["models"]}
    if args.reuse_traces:
        info["reused_traces"] = True
        info["prompt_starts_from"] = {"command": unrecorded} if unrecorded else "traces"
    if block_drafters:
        d = res["drafters"]
        info["block_drafters"] = {"drafters": list(block_drafters), "prompts": d["prompts"], "lossless": d["lossless"],
                                  "max_new_tokens": d["max_new_tokens"], "calibration_start": args.drafter_calibration_start,
                                  "test_start": args.drafter_start}
    settings_block = "\n## Settings\n\n```json\n" + json.dumps(info, indent=1) + "\n```\n"
    head = header(cmd, info, res, settings, line, [policy_name(*p) for p in LINEAR], CHAIN, SHIFT_SHARE)
    return (df.to_csv(index=False, float_format="%.5f"),
            summary_markdown(df, s, head).rstrip("\n") + "\n" + settings_block, info)


if __name__ == "__main__":
    sys.exit(main())
