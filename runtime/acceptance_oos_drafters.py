"""Out-of-sample acceptance rows for the trained block drafters (``block``, ``dspark``).

``python -m simtree.runtime.acceptance_oos --drafters mtp,block,dspark ...`` adds them to the
table.  Per drafter, on the shipped target's trained drafters (its ``drafters/`` folder), live
on the full runtime (CPU, float32, one batch per run; :func:`.full.decode.decode_prompts`):

1. the calibration run (``CALIBRATION``: the block drafter's best-first tree from marginals at 8
   nodes; DSpark's chain of 7, every position verified) on development prompts (ShareGPT chat, the
   first ``--drafter-calibration-prompts`` distinct held-out prompts from ``--drafter-calibration-start``):
   the only outcomes read, a :func:`simtree.acceptance.fit.fit_calibration` (a block drafter's
   records observed at every position their ``marginal_ranks`` cover);
2. the test runs (``TESTS``: trees from marginals at 4, 8 and 16 nodes; DSpark's chain of 3 and
   of 7, with and without a survival threshold) on fresh prompts (``--drafter-prompts`` from
   ``--drafter-start``);
3. every run predicted round by round from what the drafter held before verifying (its tree,
   marginals and, for DSpark, confidence head) under the model fitted on the calibrating run
   (:func:`simtree.acceptance.drafted_rounds.fit_drafted_model`: a calibration curve per parent
   state, the margin and confidence features, the depth shift); ``baseline_*``: the second
   test's model (the calibration and its depth shift alone; docs/acceptance.md section 5).

``split``: ``prompts`` (the calibrating shape on fresh prompts), ``policies`` (other shapes on
fresh prompts), ``in_sample`` (the calibrating run).  TfM is left out: its traces carry no
marginal ranks (its adapter re-ranks candidates per prefix, so its positions are not observed
independently of the drafted path).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from simtree.acceptance.drafted_rounds import drafted_accepted_per_round, fit_drafted_model
from simtree.acceptance.out_of_sample import oos_table
from simtree.acceptance.traces import read_traces
from simtree.errors import SimtreeError
from simtree.fileio import read_json, write_text_atomic

__all__ = ["DRAFTERS", "CALIBRATION", "TESTS", "policy_label", "decode_drafters", "load_drafters", "drafter_table"]

DRAFTERS = ("block", "dspark")
CALIBRATION = {"block": ("block", {"budget": 8}), "dspark": ("dspark", {"threshold": 0.0})}
TESTS = {"block": [("block", {"budget": 4}), ("block", {"budget": 8}), ("block", {"budget": 16})],
         "dspark": [("dspark", {"block_len": 3, "threshold": 0.0}), ("dspark", {"threshold": 0.0}),
                    ("dspark", {"threshold": 0.3}), ("dspark", {"threshold": 0.6})]}
WORKLOAD = "sharegpt"


def policy_label(mode: str, params: dict) -> str:
    """block_b8; dspark_l7 (chain of 7, every position verified), dspark_l7_s0.3 (survival >= 0.3)."""
    if mode == "block":
        return f"block_b{params['budget']}"
    label = f"dspark_l{params.get('block_len', 7)}"
    return label + (f"_s{params['threshold']:g}" if params.get("threshold", 0.0) > 0 else "")


def _runs(drafters) -> list[tuple[str, str, str, dict]]:
    """(drafter, half, mode, params) of every run, the plain decode of each half first."""
    out = []
    for half in ("calibration", "test"):
        out.append(("none", half, "none", {}))
        for d in drafters:
            out += [(d, half, *CALIBRATION[d])] if half == "calibration" else [(d, half, m, p) for m, p in TESTS[d]]
    return out


def decode_drafters(model_dir, drafters, prompts: dict, new_tokens: int, traces, say=print,
                    starts: dict | None = None) -> dict:
    """Decode every run of ``drafters`` (``prompts``: {half: [text]}, the distinct ShareGPT prompts
    from ``starts``: {half: first index}); each run's traces under ``traces/<half>/<label>/`` and
    ``traces/drafters.json`` (the lossless check, the prompt counts and, given ``starts``, what each
    half decoded: :mod:`.acceptance_oos_record`), which :func:`load_drafters` reads back."""
    from .acceptance_oos_record import drafter_records
    from .bpe import BpeTokenizer
    from .full.build import build_model
    from .full.decode import decode_prompts
    from simtree.planning.simulate import PolicySpec
    torch.set_num_threads(1)
    model = build_model(str(model_dir), device="cpu", dtype=torch.float32)
    tok = BpeTokenizer.from_file(model_dir)
    ids = {h: [tok.encode(p) for p in text] for h, text in prompts.items()}
    decoded = {} if starts is None else {"decoded": drafter_records(starts, {h: len(v) for h, v in ids.items()})}
    traces, plain, lossless = Path(traces), {}, {}
    for drafter, half, mode, params in _runs(drafters):
        t0 = time.perf_counter()
        label = "plain" if mode == "none" else policy_label(mode, params)
        rep = decode_prompts(model, ids[half], PolicySpec.from_dict(mode, params), new_tokens,
                             out=traces / half / label)
        if rep["notes"]:
            raise SimtreeError(f"{label} ({half}): {rep['notes'][0]}")
        if mode == "none":
            plain[half] = rep["outputs"]
        else:
            lossless[f"{half} {label}"] = rep["outputs"] == plain[half]
        if say is not None:
            say(f"drafters {half} {label}: {rep['accepted_tokens_per_round']:.3f} tokens/round, "
                f"{time.perf_counter() - t0:.0f}s")
    write_text_atomic(traces / "drafters.json", json.dumps(
        {"lossless": lossless, "prompts": {h: len(v) for h, v in ids.items()}, "max_new_tokens": new_tokens,
         **decoded}))
    return load_drafters(traces, drafters)


def load_drafters(traces, drafters) -> dict:
    """{"runs": [(drafter, half, mode, params, records)], "lossless", "prompts"} from a folder
    :func:`decode_drafters` wrote."""
    traces = Path(traces)
    if not (traces / "drafters.json").is_file():
        raise SimtreeError(f"{traces} holds no block drafters' runs (drafters.json)")
    kept = read_json(traces / "drafters.json", "kept drafter runs")
    runs = [(d, h, m, p, read_traces(traces / h / policy_label(m, p) / "traces.jsonl"))
            for d, h, m, p in _runs(drafters) if d != "none"]
    return {"runs": runs, "lossless": kept["lossless"], "prompts": kept["prompts"],
            "max_new_tokens": kept.get("max_new_tokens")}


def drafter_table(decoded: dict, status: str = "fresh"):
    """The rows of :data:`simtree.acceptance.out_of_sample.COLUMNS` (and the table's other
    columns) for the block drafters' runs: each drafter's model fitted on its calibration run's
    outcomes alone, every run predicted round by round (module docstring)."""
    import pandas as pd
    tables = []
    for drafter in dict.fromkeys(d for d, *_ in decoded["runs"]):
        runs = [r for r in decoded["runs"] if r[0] == drafter]
        fitted = [rec for d, h, m, p, recs in runs if h == "calibration" for rec in recs]
        model = fit_drafted_model(fitted)
        baseline = fit_drafted_model(fitted, parent_states=False, features=())
        rows = []
        for d, half, mode, params, recs in runs:
            split = ("in_sample" if half == "calibration" else
                     "prompts" if (mode, params) == CALIBRATION[d] else "policies")
            rows.append({"drafter": d, "policy": policy_label(mode, params), "mode": mode, "params": params,
                         "workload": WORKLOAD, "split": split, "records": recs, "calibrated_on": WORKLOAD,
                         "prompts": "seen" if split == "in_sample" else status})
        # one table per drafter: the joint s.e. reads that drafter's calibrating run
        tables.append(oos_table(model, rows, lambda m, run: drafted_accepted_per_round(m, run["records"]),
                                extras={"baseline": baseline}))
    return pd.concat(tables, ignore_index=True)
