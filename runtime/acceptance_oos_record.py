"""What a kept trace folder of :mod:`.acceptance_oos` says it decoded, and the check that a reuse
(``--reuse-traces``) asks for the same prompts.

When decoding, each half of :func:`.acceptance_oos.decode_halves` (``lossless.json``, its
``"<workload> <half>"`` entry) and of :func:`.acceptance_oos_drafters.decode_drafters`
(``drafters/drafters.json``) records ``"decoded"``: the workload, the first prompt index the
command asked for (``start``; None for the development prompts), the prompts in the half and
their span, (first, last) held-out index (:func:`.acceptance_oos_prompts.chat_span`,
:func:`.acceptance_oos_prompts.code_span`; HumanEval: problem indices).  On a reuse,
:func:`check_reuse` stops where a record differs from the command's flags; folders kept before
the record existed read as "no record", and the table then says its starts come from the command.
"""
from __future__ import annotations

from pathlib import Path

from simtree.errors import SimtreeError
from simtree.fileio import read_json

from .acceptance_oos_prompts import chat_span, half_spans

__all__ = ["half_records", "drafter_records", "check_reuse", "DRAFTER_WORKLOAD"]

DRAFTER_WORKLOAD = "sharegpt"
def half_records(workload: str, start: int | None, n: int, n_test: int | None = None,
                 spans: dict | None = None) -> dict:
    """{"calibration": record, "test": record} of a workload's halves: ``n`` prompts from ``start``
    then ``n_test`` (default ``n``; :func:`.acceptance_oos_prompts.held_out_prompts`); ``spans``:
    their :func:`.acceptance_oos_prompts.half_spans`, found here when not given; ``start`` None:
    the development prompts (no span)."""
    n_test = n if n_test is None else n_test
    if start is None:
        return {h: {"workload": workload, "start": None, "prompts": k, "span": None}
                for h, k in (("calibration", n), ("test", n_test))}
    spans = half_spans(workload, start, n, n_test) if spans is None else spans
    return {h: {"workload": workload, "start": start, "prompts": k, "span": list(spans[h])}
            for h, k in (("calibration", n), ("test", n_test))}


def drafter_records(starts: dict, counts: dict) -> dict:
    """{half: record} of the block drafters' runs: ``counts[half]`` distinct ShareGPT prompts from
    each half's start (``starts``: {"calibration": i, "test": j})."""
    return {h: {"workload": DRAFTER_WORKLOAD, "start": s, "prompts": counts[h], "span": list(chat_span(s, counts[h]))}
            for h, s in starts.items()}


def _said(rec: dict) -> str:
    span = rec.get("span")
    return (f"{rec.get('workload')} from {'the development prompts' if rec.get('start') is None else rec['start']}, "
            f"{rec.get('prompts')} prompts" + (f" ({span[0]}..{span[1]})" if span else ""))


def _compare(where: str, recorded: dict, expected: dict) -> None:
    if any(recorded.get(k) != v for k, v in expected.items()):
        raise SimtreeError(f"{where} was decoded from {_said(recorded)}, the command asks for {_said(expected)}: "
                           "give the flags it was decoded with (or decode again)")


def check_reuse(traces, starts: dict, sizes: dict, drafters: tuple[dict, dict] | None) -> list[str]:
    """Compare what the kept folder ``traces`` records with the command's prompts (``starts``:
    {workload: first index, None for the development prompts}; ``sizes``: {workload: (calibration
    prompts, test prompts)}, :func:`.acceptance_oos.half_sizes`; ``drafters``: ({half: first index},
    {half: prompts}) when the table adds the block drafters' rows): a differing record stops the
    table (:class:`SimtreeError`, one line naming both).  Returns the halves that record none
    (folders kept before the record): their starts come from the command."""
    traces, unrecorded = Path(traces), []
    lossless = traces / "lossless.json"
    kept = read_json(lossless, "kept run") if lossless.is_file() else {}
    if not kept:
        unrecorded.append("the MTP halves")
    for key, info in kept.items():
        rec = info.get("decoded") if isinstance(info, dict) else None
        workload, _, half = key.partition(" ")
        if rec is None:
            unrecorded.append(key)
        elif workload in starts:
            n = sizes[workload][0 if half == "calibration" else 1]
            _compare(f"{lossless}: the kept {key} half", rec, {"workload": workload, "start": starts[workload],
                                                                "prompts": n})
    path = traces / "drafters" / "drafters.json"
    if drafters is not None and path.is_file():
        half_starts, counts = drafters
        recs = read_json(path, "kept drafter runs").get("decoded") or {}
        for half, start in half_starts.items():
            if half not in recs:
                unrecorded.append(f"block drafters {half}")
            else:
                _compare(f"{path}: the kept block drafters' {half} runs", recs[half],
                         {"workload": DRAFTER_WORKLOAD, "start": start, "prompts": counts[half]})
    return unrecorded
