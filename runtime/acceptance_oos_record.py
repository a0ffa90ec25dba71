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

from .acceptance_oos_prompts import chat_span, code_span

__all__ = ["half_records", "drafter_records", "check_reuse", "DRAFTER_WORKLOAD"]

DRAFTER_WORKLOAD = "sharegpt"
_SPAN = {"sharegpt": chat_span, "sharegpt_code": code_span, "humaneval": lambda s, n: (s, s + n - 1)}


def half_records(workload: str, start: int | None, n: int) -> dict:
    """{"calibration": record, "test": record} of a workload's two halves of ``n`` prompts from
    ``start`` (:func:`.acceptance_oos_prompts.held_out_prompts`: the first ``n`` then the next ``n``);
    ``start`` None: the development prompts (no span)."""
    if start is None:
        return {h: {"workload": workload, "start": None, "prompts": n, "span": None} for h in ("calibration", "test")}
    span = _SPAN[workload]
    cal = span(start, n)
    test = (span(start, n + 1)[1], span(start, 2 * n)[1])    # the (n + 1)-th prompt's index to the 2n-th's
    return {"calibration": {"workload": workload, "start": start, "prompts": n, "span": list(cal)},
            "test": {"workload": workload, "start": start, "prompts": n, "span": list(test)}}


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


def check_reuse(traces, starts: dict, n: int, drafters: tuple[dict, int] | None) -> list[str]:
    """Compare what the kept folder ``traces`` records with the command's prompts (``starts``:
    {workload: first index, None for the development prompts}, ``n`` prompts a half; ``drafters``:
    ({half: first index}, prompts a half) when the table adds the block drafters' rows): a
    differing record stops the table (:class:`SimtreeError`, one line naming both).  Returns the
    halves that record none (folders kept before the record): their starts come from the command."""
    traces, unrecorded = Path(traces), []
    lossless = traces / "lossless.json"
    kept = read_json(lossless, "kept run") if lossless.is_file() else {}
    if not kept:
        unrecorded.append("the MTP halves")
    for key, info in kept.items():
        rec = info.get("decoded") if isinstance(info, dict) else None
        workload = key.split()[0]
        if rec is None:
            unrecorded.append(key)
        elif workload in starts:
            _compare(f"{lossless}: the kept {key} half", rec, {"workload": workload, "start": starts[workload],
                                                                "prompts": n})
    path = traces / "drafters" / "drafters.json"
    if drafters is not None and path.is_file():
        half_starts, count = drafters
        recs = read_json(path, "kept drafter runs").get("decoded") or {}
        for half, start in half_starts.items():
            if half not in recs:
                unrecorded.append(f"block drafters {half}")
            else:
                _compare(f"{path}: the kept block drafters' {half} runs", recs[half],
                         {"workload": DRAFTER_WORKLOAD, "start": start, "prompts": count})
    return unrecorded
