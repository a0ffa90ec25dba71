"""The prompts of the acceptance out-of-sample table (:mod:`.acceptance_oos`), per workload.

- ``sharegpt`` (chat): held-out ShareGPT prompts (:func:`.data.prompts` order: the first human
  turn of the odd records) from an index on, a prompt repeating an earlier one's text skipped.
- ``sharegpt_code`` (code): code from held-out ShareGPT conversations (:func:`code_prompts`):
  from held-out conversation ``CODE_START`` on (the odd records past the first 4000, which the
  target's training read: its even records trained, the last 200 odd ones measured its held-out
  loss), the first fenced block (```) of an assistant turn whose body holds at least
  ``2 * PROMPT_CHARS`` characters on at least 4 lines; the prompt is the block's first
  ``PROMPT_CHARS`` characters from its opening fence (the fence line names the language), a
  prompt repeating an earlier one's text (from conversation ``TRAINING_CONVERSATIONS`` on, where the
  code tables read) skipped.  No earlier version of the model read these.
- ``humaneval`` (code): HumanEval problems from an index on; every one is seen (0..131 are in
  the target's training text, 132..163 were development, 0..127 earlier tables' test).

Which ranges earlier tables read, and when each became development data: docs/acceptance.md,
section 5; a run overlapping one is labelled "seen" (``DECODED``, ``CURRENT``, :func:`prompt_status`).
"""
from __future__ import annotations

import re
from functools import lru_cache

from simtree.errors import SimtreeError, check_whole

from .data import (HELD_OUT_RECORDS, PROMPT_CHARS, held_out_conversations, humaneval_problems, opening_human_turn,
                   prompts as load_prompts, training_docs, training_records)

__all__ = ["OOS_WORKLOADS", "DEVELOPMENT_WORKLOADS", "CODE_WORKLOADS", "held_out_prompts", "distinct_chat_prompts",
           "distinct_chat", "code_prompts", "development_prompts", "development_sizes", "prompt_status",
           "status_of_test_half", "drafter_status", "drafter_test_status", "training_overlap", "SEEN_SHAREGPT",
           "SEEN_DRAFTER", "DECODED", "CURRENT", "chat_span", "held_out_loss_span", "held_out_loss_prompts",
           "held_out_loss_indices", "code_span", "half_spans", "held_out_halves", "span_of_test_half",
           "SHAREGPT_START", "CODE_START", "SEEN_CODE", "HUMANEVAL_START", "TRAINING_CONVERSATIONS", "HALVES"]

OOS_WORKLOADS = ("sharegpt", "sharegpt_code", "humaneval")
DEVELOPMENT_WORKLOADS = ("sharegpt", "humaneval")      # those with development prompts (development_prompts)
CODE_WORKLOADS = ("sharegpt_code", "humaneval")        # predicted from chat too (the transfer rows)
# Where the current table's prompts start (docs/acceptance.md, section 5, says which ranges each
# earlier table read and when each became development data, and fixed these before the test halves
# were decoded).  Each workload's halves: the first HALVES[w][0] prompts from its start (calibration),
# then the next HALVES[w][1] (test).  ShareGPT chat: calibration the 128 distinct held-out prompts from
# SHAREGPT_START (1400..1551, the fifth table's, seen), test the next 128 (from SEEN_SHAREGPT: every
# chat range decoded before lies below it); ShareGPT code: calibration the 256 from held-out
# conversation CODE_START (2000..2881, the fourth and fifth tables', seen), test the next 128 (from
# SEEN_CODE); HumanEval: 64 + 64 from 0 (seen).  The block drafters: calibration on the first 192
# distinct development prompts from 0 (seen), test on the first 96 distinct from SEEN_DRAFTER.  Which
# runs are fresh: DECODED and CURRENT below.
SEEN_SHAREGPT = 1552
SHAREGPT_START = 1400
CODE_START = 2000
SEEN_CODE = 2882
SEEN_DRAFTER = 1682
HALVES = {"sharegpt": (128, 128), "sharegpt_code": (256, 128), "humaneval": (64, 64)}
# The ranges a committed table decoded, (first, last) index per workload (a run's range:
# :func:`chat_span`, :func:`code_span`): a run overlapping one is "seen" (:func:`prompt_status`).
# ShareGPT chat (held-out prompts; the MTP tables' 2 x 64, the block drafters' 48 a half, the live
# drafter table's 32): the development prompts 0..127 (the block drafters' calibration 0..47
# among them), the first five out-of-sample tables', the live drafter table's (docs/drafters.md,
# 32 from 900), the block drafters' first three tests' (48 from 1000, 1200, 1251).
# ShareGPT code (held-out conversations): those among the records the target's training read
# (0..1999), the fourth and fifth tables' (128 from 2000, 128 from 2473).
# Chat also counts the prompts whose conversations the target's held-out loss read (:func:`held_out_loss_span`,
# computed from the records: 1783..1981), but not for a current range, labelled when it was recorded (:func:`_status`).
DECODED = {"sharegpt": ((0, 127), (128, 262), (384, 513), (640, 771), (772, 911), (900, 932), (1000, 1049),
                        (1200, 1250), (1251, 1301), (1400, 1551)),
           "sharegpt_code": ((0, 1999), (2000, 2472), (2473, 2881))}
# The current table's test ranges (reports/validation/acceptance_out_of_sample.csv), recorded before
# they were decoded and read by that table alone: fresh for a run of exactly that range, seen for any
# other run overlapping it.  Chat: the sixth table's test half (128 from SEEN_SHAREGPT) and the block
# drafters' fourth test (96 from SEEN_DRAFTER); code: the sixth table's test half (128 from SEEN_CODE).
# Keyed by the run that read it: only a run of that kind and exactly that range is fresh there (a
# block-drafter test on the MTP table's chat prompts is seen).
CURRENT = {"mtp_chat": ((1552, 1681),), "drafter_test": ((1682, 1783),), "mtp_code": ((2882, 3299),)}
_RUN_WORKLOAD = {"mtp_chat": "sharegpt", "drafter_test": "sharegpt", "mtp_code": "sharegpt_code"}
TRAINING_CONVERSATIONS = 2000     # target_train's default: the first 2 x 2000 ShareGPT records
HUMANEVAL_START = 0
_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.S)
_CODE_LINES = 4


@lru_cache(maxsize=None)
def held_out_loss_span(conversations: int = TRAINING_CONVERSATIONS) -> tuple[int, int]:
    """(first, last) held-out prompt index (:func:`.data.prompts` order) of the conversations whose text
    the target's held-out loss read: the last ``HELD_OUT_RECORDS`` odd records of the first 2 x
    ``conversations`` (:func:`.data.training_docs`; evaluated, never trained on).  Prompt i opens the
    i-th odd record with a human turn, so the odd records without one shift the range below the
    records' 1800..1999."""
    odd = training_records(conversations)[1::2]
    prompt_index, index = [], -1
    for conv in odd:
        has_prompt = opening_human_turn(conv) is not None
        index += has_prompt
        prompt_index.append(index if has_prompt else None)
    held = [i for i in prompt_index[-HELD_OUT_RECORDS:] if i is not None]
    if len(odd) < conversations or not held:
        raise SimtreeError(f"the packaged ShareGPT file holds {len(odd)} odd records, {conversations} needed")
    return held[0], held[-1]


def held_out_loss_prompts(start: int, count: int, skip: int = 0) -> list[int]:
    """The indices, among the first ``count`` distinct held-out prompts from ``start`` on
    (:func:`distinct_chat_prompts`) less the first ``skip`` (a calibration half), of those whose
    conversations the target's held-out loss read (:func:`held_out_loss_span`)."""
    return held_out_loss_indices(distinct_chat(start, count)[1][skip:])


def held_out_loss_indices(indices) -> list[int]:
    """Those of the held-out prompt ``indices`` whose conversations the target's held-out loss
    read (:func:`held_out_loss_span`)."""
    lo, hi = held_out_loss_span()
    return [i for i in indices if lo <= i <= hi]


def _code_block(conv: list[dict]) -> str | None:
    """The prompt of a conversation (:data:`__doc__`'s rule), or None when it has no such block."""
    for turn in conv:
        if turn.get("from") != "gpt":
            continue
        for m in _FENCE.finditer(turn["value"]):
            body = m.group(1)
            if len(body) >= 2 * PROMPT_CHARS and body.count("\n") >= _CODE_LINES:
                return turn["value"][m.start():m.start() + PROMPT_CHARS]
    return None


def code_prompts(count: int, start: int) -> tuple[list[str], int]:
    """(the first ``count`` distinct code prompts of held-out conversations ``start`` on, the index
    of the last conversation taken); the module docstring's rule, a prompt repeating the code
    prompt of an earlier conversation from ``TRAINING_CONVERSATIONS`` on (where the code tables
    read) skipped as well, as the chat prompts skip any earlier prompt's text."""
    out, indices = _code_prompts(count, start)
    return out, indices[-1]


def _code_prompts(count: int, start: int) -> tuple[list[str], list[int]]:
    """(:func:`code_prompts`' prompts, the held-out conversation of each)."""
    start = check_whole(start, "code start", 0)
    scan = start + 4 * count
    while True:
        convs = held_out_conversations(scan)
        out, indices = [], []
        seen = {p for p in map(_code_block, convs[min(TRAINING_CONVERSATIONS, start):start]) if p is not None}
        for i in range(start, len(convs)):
            p = _code_block(convs[i])
            if p is not None and p not in seen:
                out.append(p)
                seen.add(p)
                indices.append(i)
                if len(out) == count:
                    return out, indices
        if len(convs) < scan:
            raise SimtreeError(f"only {len(out)} ShareGPT code prompts from held-out conversation {start} on, "
                               f"{count} asked for")
        scan *= 2


def held_out_prompts(workload: str, start: int, n: int, n_test: int | None = None) -> tuple[list[str], list[str]]:
    """(calibration half of ``n`` prompts, test half of the next ``n_test``, default ``n``):
    ShareGPT held-out prompts from index ``start`` on (:func:`.data.prompts` order; a prompt
    repeating an earlier prompt's text is skipped), ShareGPT code prompts of held-out conversations
    ``start`` on (:func:`code_prompts`), HumanEval problems ``start``..``start`` + n + n_test - 1
    (the last 160 characters of the prompt, as :func:`.data.prompts` cuts them)."""
    return held_out_halves(workload, start, n, n_test)[0]


def held_out_halves(workload: str, start: int, n: int,
                    n_test: int | None = None) -> tuple[tuple[list[str], list[str]], dict]:
    """(:func:`held_out_prompts`, :func:`half_spans`) of the same halves, the prompts found once."""
    start = check_whole(start, f"{workload} start", 0)
    n_test = n if n_test is None else n_test
    total = n + n_test
    if workload == "sharegpt":
        out, indices = distinct_chat(start, total)
    elif workload == "sharegpt_code":
        out, indices = _code_prompts(total, start)
    elif workload == "humaneval":
        out = [p["prompt"][-PROMPT_CHARS:] for p in humaneval_problems()[start:start + total]]
        indices = range(start, start + len(out))
    else:
        raise SimtreeError(f"unknown workload {workload!r}: expected one of {', '.join(OOS_WORKLOADS)}")
    if len(out) < total:
        raise SimtreeError(f"only {len(out)} {workload} prompts from index {start} on, {total} asked for")
    return (out[:n], out[n:total]), _spans(start, indices, n, total)


def _spans(start: int, indices, n: int, total: int) -> dict:
    return {"calibration": (start, indices[n - 1]) if n else None, "test": (indices[n], indices[total - 1])}


def distinct_chat_prompts(start: int, count: int) -> tuple[list[str], int]:
    """(the first ``count`` distinct held-out ShareGPT prompts from index ``start`` on, the index of
    the last): a prompt repeating an earlier one's text, before ``start`` too, is skipped.  The one
    rule of the out-of-sample halves, the drafters' tables and :func:`chat_span`."""
    out, indices = distinct_chat(start, count)
    return out, indices[-1]


def distinct_chat(start: int, count: int) -> tuple[list[str], list[int]]:
    """(:func:`distinct_chat_prompts`' prompts, the held-out prompt index of each)."""
    every = load_prompts("sharegpt", start + 2 * count)
    seen, out, indices = set(every[:start]), [], []
    for i in range(start, len(every)):
        if every[i] not in seen:
            out.append(every[i])
            indices.append(i)
            if len(out) == count:
                return out, indices
        seen.add(every[i])
    raise SimtreeError(f"only {len(out)} ShareGPT prompts from index {start} on, {count} asked for")


def chat_span(start: int, count: int) -> tuple[int, int]:
    """(first, last) held-out ShareGPT prompt index of the first ``count`` distinct prompts from
    ``start`` on (:func:`distinct_chat_prompts`)."""
    return start, distinct_chat_prompts(start, count)[1]


def code_span(start: int, count: int) -> tuple[int, int]:
    """(first, last) held-out conversation of the first ``count`` code prompts from ``start`` on."""
    return start, code_prompts(count, start)[1]


_SPANNED = ("sharegpt", "sharegpt_code")      # the workloads whose test half may be fresh (HumanEval: all seen)


def _status(run: str, span: tuple[int, int]) -> str:
    """"fresh" when ``span`` (held-out conversation indices: chat prompt i opens conversation i, whose
    code blocks the code prompts take) overlaps no range a committed table decoded (``DECODED``: its
    own workload's; for chat the code tables' conversations past the training records and the
    held-out-loss conversations, :func:`held_out_loss_span`) and, of the current tables' ranges
    (``CURRENT``), at most its own kind's exactly; else "seen".  A current range keeps the label it
    was recorded with: the block drafters' test 1682..1783 was recorded before its last prompt was
    found to be held-out-loss text, which its summary discloses (:func:`held_out_loss_prompts`)."""
    first, last = span
    workload = _RUN_WORKLOAD[run]
    decoded = list(DECODED[workload])
    if workload == "sharegpt":       # a chat prompt opens the conversation a code table took its code from
        decoded += [r for r in DECODED["sharegpt_code"] if r[0] >= TRAINING_CONVERSATIONS]
        if span not in CURRENT[run]:
            decoded.append(held_out_loss_span())
    checks = [(decoded, None)] + [(ranges, kind) for kind, ranges in CURRENT.items()]
    for ranges, kind in checks:
        for lo, hi in ranges:
            if lo <= last and first <= hi and not (kind == run and (lo, hi) == span):
                return "seen"
    return "fresh"


def drafter_status(test_start: int, calibration_start: int, prompts: int, calibration_prompts: int | None = None) -> str:
    """"fresh" for the block drafters' ``prompts`` test prompts from ``test_start`` when they
    overlap no ShareGPT chat range a committed table decoded (:func:`prompt_status`), else
    "seen"; test prompts that overlap the ``calibration_prompts`` (default ``prompts``)
    calibration prompts stop the table (one line)."""
    cal = prompts if calibration_prompts is None else calibration_prompts
    return drafter_test_status(chat_span(test_start, prompts), chat_span(calibration_start, cal))


def drafter_test_status(test: tuple[int, int], cal: tuple[int, int]) -> str:
    """:func:`drafter_status` from the (first, last) held-out index of the test prompts and of the
    calibration prompts (:func:`chat_span`)."""
    if test[0] <= cal[1] and cal[0] <= test[1]:
        raise SimtreeError(f"the block drafters' test prompts {test[0]}..{test[1]} overlap their "
                           f"calibration prompts {cal[0]}..{cal[1]}: give --drafter-start past them")
    return _status("drafter_test", test)


def half_spans(workload: str, start: int, n: int, n_test: int | None = None) -> dict:
    """{"calibration": (first, last), "test": (first, last)} held-out index (ShareGPT chat: prompt,
    :func:`chat_span`; ShareGPT code: conversation, :func:`code_span`; HumanEval: problem) of the
    halves of :func:`held_out_prompts` (``n`` calibration prompts from ``start``, then ``n_test``,
    default ``n``), the prompts found once: the calibration half from ``start`` to its last
    prompt's (None when ``n`` is 0), the test half from its first prompt's to its last's."""
    start = check_whole(start, f"{workload} start", 0)
    total = n + (n if n_test is None else n_test)
    if workload == "humaneval":       # problem indices: nothing to find
        return _spans(start, range(start, start + total), n, total)
    return held_out_halves(workload, start, n, n_test)[1]


def span_of_test_half(workload: str, start: int, n: int, n_test: int | None = None) -> tuple[int, int]:
    """(first, last) index of the test half of :func:`held_out_prompts` (``n`` calibration
    prompts from ``start``, then ``n_test``, default ``n``): the (n + 1)-th prompt's to the last's."""
    return half_spans(workload, start, n, n_test)["test"]


def prompt_status(workload: str, start: int | None, n: int, n_test: int | None = None) -> str:
    """"fresh" for the test half (``n_test`` prompts, default ``n``, after ``n`` calibration
    prompts from ``start``; :func:`held_out_prompts`) of ShareGPT chat (or ShareGPT code) when it
    overlaps no range a committed table decoded (``DECODED``; a current table's range,
    ``CURRENT``, only when it is exactly that range), else "seen" (every HumanEval problem;
    ``start`` None: the development prompts).  The calibration half may be seen: its outcomes are
    fitted, its runs labelled seen whatever their prompts."""
    if start is None or workload not in _SPANNED:
        return "seen"
    return status_of_test_half(workload, span_of_test_half(workload, start, n, n_test))


def status_of_test_half(workload: str, test: tuple[int, int]) -> str:
    """:func:`prompt_status` from the test half's (first, last) index (:func:`half_spans`)."""
    if workload not in _SPANNED:
        return "seen"
    return _status("mtp_chat" if workload == "sharegpt" else "mtp_code", test)


DEVELOPMENT = {"sharegpt": (128, 64), "humaneval": (32, 16)}   # (prompts the model was developed on, most a half)


def development_sizes(workload: str, n: int, n_test: int | None = None) -> tuple[int, int]:
    """(calibration prompts, test prompts) that :func:`development_prompts` gives for halves of
    ``n`` and ``n_test`` (default ``n``) asked: at most half the development prompts each."""
    if workload not in DEVELOPMENT:
        raise SimtreeError(f"{workload} has no development prompts")
    cap = DEVELOPMENT[workload][1]
    return min(n, cap), min(n if n_test is None else n_test, cap)


def development_prompts(workload: str, n: int, n_test: int | None = None) -> tuple[list[str], list[str]]:
    """(calibration half, test half) of the prompts the model was first developed on: the first
    128 held-out ShareGPT prompts (up to 64 a half) and HumanEval 132..163 (up to 16 a half),
    :func:`development_sizes` of them.  ShareGPT code has no development prompts: the code
    workload there is HumanEval's alone."""
    cal, test = development_sizes(workload, n, n_test)
    total, cap = DEVELOPMENT[workload]
    every = load_prompts(workload, total)
    return every[:cal], every[cap:cap + test]


def training_overlap(texts: list[str], conversations: int = TRAINING_CONVERSATIONS) -> int:
    """How many of ``texts`` occur verbatim in the target's training text (the ShareGPT
    conversations of :func:`.data.training_docs` and HumanEval 0..131): ShareGPT repeats
    conversations, so a held-out record may repeat a trained one."""
    corpus = "\n".join(training_docs(conversations)[0])
    return sum(t in corpus for t in texts)
