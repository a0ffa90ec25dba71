"""Given prompts decoded live on a full-scale model: the contract outside checks call.

    report = decode_prompts("path/to/checkpoint", [[1, 2, 3], [4, 5]], PolicySpec.from_dict("eagle", {...}),
                            max_new_tokens=32, device="cpu", dtype=torch.float32, out="reports/run")
    report["outputs"]     # the generated token ids per prompt (greedy; the same for every mode)

``simtree run --model PATH --prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens N --mode
plain|linear|eagle --json`` calls it.  The prompts form one batch; the engine's rounds run until
every prompt has ``max_new_tokens`` outputs (greedy speculative decoding is lossless: every mode
gives plain decoding's tokens).  ``run.json`` (written atomically under ``out``) holds the
outputs, the mode, the accepted tokens per round and the load notes (a checkpoint without MTP
weights drafts with a random MTP layer).  A block drafter's run (block, tfm, dspark) also writes
``traces.jsonl`` (``simtree.trace/2``, workload ``prompts``): every round's tree and accepted
path with its marginals' ranks, confidences and verified prefix (``round_trace.round_records``).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from simtree.errors import SimtreeError, check_int
from simtree.fileio import write_text_atomic

from .block_engine import drafter_note
from .build import DTYPES, build_model, dtype_name
from .drafting import round_shape
from .engine import OUT_CAP
from .generate import generate
from .round_trace import RecordList

__all__ = ["decode_prompts", "parse_prompt_ids", "parse_dtype"]

TRACE_WORKLOAD = "prompts"   # the workload name of a given-prompts run's traces
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float64": "fp64", **{k: k for k in DTYPES}}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPE_NAMES:
        raise SimtreeError(f"--dtype {name!r}: use float32, bfloat16 or float64")
    return DTYPES[_DTYPE_NAMES[name]]


def parse_prompt_ids(texts: list[str], vocab: int) -> list[list[int]]:
    """'1,2,3' per prompt -> token ids, each in [0, vocab)."""
    prompts = []
    for text in texts:
        try:
            ids = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise SimtreeError(f"--prompt-ids {text!r}: a comma list of token ids, e.g. 1,2,3") from None
        if not ids:
            raise SimtreeError("--prompt-ids: an empty prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise SimtreeError(f"--prompt-ids {text!r}: token {bad[0]} outside the vocabulary [0, {vocab})")
        prompts.append(ids)
    return prompts


@torch.no_grad()
def decode_prompts(model, prompt_ids: list[str] | list[list[int]], spec, max_new_tokens: int, device="cpu",
                   dtype: torch.dtype | None = None, out: str | Path | None = None, say=None, costs=None) -> dict:
    """Decode the prompts live (see the module docstring) -> the report run.json holds; ``costs``:
    the bundle an adaptive mode (cost_aware, batch_alloc, DSpark's schedule) decides with."""
    max_new_tokens = check_int(max_new_tokens, "--max-new-tokens", 1, OUT_CAP)
    built = build_model(model, device=device, dtype=dtype) if isinstance(model, str) else model
    prompts = ([list(map(int, p)) for p in prompt_ids] if prompt_ids and not isinstance(prompt_ids[0], str)
               else parse_prompt_ids(list(prompt_ids), built.vocab))
    rs = round_shape(spec)
    notes = [] if rs.plain else list(getattr(built, "load_notes", []))
    if rs.block_drafter:    # a block drafter: the MTP layer's note is not about it, a missing trained drafter is
        notes = [n for n in [drafter_note(built, rs.drafter)] if n]
    for line in notes:
        if say is not None:
            say(line)
    # a block drafter's rounds' marginals and confidences, for the acceptance model
    traces = RecordList() if rs.block_drafter and out is not None else None
    res = generate(built, prompts, max_new_tokens, spec, costs=costs, workload=TRACE_WORKLOAD, trace=traces)
    rounds, outputs = len(res.rounds), res.outputs
    accepted = 1.0 + float(np.mean([r.accepted for r in res.rounds])) if res.rounds else float("nan")
    report = {"model": built.shape.name, "source": built.shape.source, "mode": spec.mode, "params": spec.to_dict(),
              "policy": rs.name, "device": str(built.device), "dtype": dtype_name(built.dtype),
              "prompts": prompts, "max_new_tokens": max_new_tokens, "outputs": outputs, "rounds": rounds,
              "accepted_tokens_per_round": accepted, "notes": notes}
    if out is not None:
        path = Path(out) / "run.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        report["files"] = {"report": str(path)}
        if traces is not None:
            trace_path = Path(out) / "traces.jsonl"
            write_text_atomic(trace_path, "".join(json.dumps(r) + "\n" for r in traces))
            report["files"]["traces"] = str(trace_path)
        write_text_atomic(path, json.dumps(report, indent=1) + "\n")
    return report
