"""The prompts of the acceptance out-of-sample table (:mod:`.acceptance_oos`), per workload.

- ``sharegpt`` (chat): held-out ShareGPT prompts (:func:`.data.prompts` order: the first human
  turn of the odd records) from an index on, a prompt repeating an earlier one's text skipped.
- ``sharegpt_code`` (code): code from held-out ShareGPT conversations (:func:`code_prompts`):
  from held-out conversation ``CODE_START`` on (the odd records past the first 4000, which the
  target's training read: its even records trained, the last 200 odd ones measured its held-out
  loss), the first fenced block (```) of an assistant turn whose body holds at least
  ``2 * PROMPT_CHARS`` characters on at least 4 lines; the prompt is the block's first
  ``PROMPT_CHARS`` characters from its opening fence (the fence line names the language), a
  prompt repeating an earlier one's text skipped.  No earlier version of the model read these.
- ``humaneval`` (code): HumanEval problems from an index on; every one is seen (0..131 are in
  the target's training text, 132..163 were development, 0..127 earlier tables' test).

Which ranges earlier tables read, and when each became development data: docs/acceptance.md,
section 5.
"""
from __future__ import annotations

import re

from simtree.errors import SimtreeError, check_whole

from .data import PROMPT_CHARS, humaneval_problems, prompts as load_prompts, sharegpt_records, training_docs

__all__ = ["OOS_WORKLOADS", "CODE_WORKLOADS", "held_out_prompts", "code_prompts", "development_prompts",
           "prompt_status", "drafter_status", "training_overlap", "SEEN_SHAREGPT", "SEEN_DRAFTER", "SHAREGPT_START", "CODE_START", "SEEN_CODE",
           "HUMANEVAL_START", "TRAINING_CONVERSATIONS"]

OOS_WORKLOADS = ("sharegpt", "sharegpt_code", "humaneval")
CODE_WORKLOADS = ("sharegpt_code", "humaneval")        # predicted from chat too (the transfer rows)
# held-out ShareGPT prompts earlier versions of the model read: 0..127 (development), 128..262 (the
# first out-of-sample table's 128, repeats skipped), 384..513 (the second table's, then read to find
# why the lookup calibration missed its own runs) and 640..771 (the third table's, read once it was
# written); all development data since (docs/acceptance.md, section 5).  263..383 and 514..639 have
# never been decoded.  772..911 are the fourth table's (fresh when decoded for it, development data
# since: decisions 10 and 11 were chosen on them among others).  The block drafters' tests read
# 1000.. and 1200.. (below), the live drafter table 900..931; the fifth table's are the first 128
# distinct from 1400 (fresh when decoded for it; a version that develops on them raises
# SEEN_SHAREGPT past them and takes a range past the table's).
SEEN_SHAREGPT = 1400
SHAREGPT_START = 1400
# ShareGPT code: held-out conversations from CODE_START on (past the training records, below);
# none read by any earlier version (SEEN_CODE: the first index a table may call fresh); the fourth
# table's are 2000..2472 (development data since), the fifth table's from 2473 (to 2881)
CODE_START = 2473
SEEN_CODE = 2473
# the block drafters' rows (runtime/acceptance_oos_drafters.py): calibration on ShareGPT prompts from 0
# (development), test prompts from index SEEN_DRAFTER on.  Their first test read 1000..1049 and the
# second 1200..1250 (48 distinct prompts each, repeats skipped; seen since: the third test's model was
# chosen on them); the third test's are the first 48 distinct from 1251 (1251..1301), recorded here
# before they were decoded (docs/drafters.md's live table read 900..931)
SEEN_DRAFTER = 1251
TRAINING_CONVERSATIONS = 2000     # target_train's default: the first 2 x 2000 ShareGPT records
HUMANEVAL_START = 0
_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.S)
_CODE_LINES = 4


def _held_out_conversations(count: int) -> list[list[dict]]:
    """The first ``count`` held-out ShareGPT conversations, in :func:`.data.prompts` order (the odd
    records with a human turn): conversation i is the one held-out prompt i opens."""
    records = sharegpt_records(8 * count + 8, max_bytes=max(8 << 20, count * (24 << 10)))
    out = [conv for conv in records[1::2]
           if any(c.get("from") == "human" and c["value"].strip() for c in conv)]
    return out[:count]


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
    of the last conversation taken); the module docstring's rule."""
    start = check_whole(start, "code start", 0)
    out, seen, scan = [], set(), start + 4 * count
    while True:
        convs = _held_out_conversations(scan)
        last = None
        for i in range(start, len(convs)):
            p = _code_block(convs[i])
            if p is not None and p not in seen:
                out.append(p)
                seen.add(p)
                last = i
                if len(out) == count:
                    return out, last
        if len(convs) < scan:
            raise SimtreeError(f"only {len(out)} ShareGPT code prompts from held-out conversation {start} on, "
                               f"{count} asked for")
        out, seen, scan = [], set(), 2 * scan


def held_out_prompts(workload: str, n: int, start: int) -> tuple[list[str], list[str]]:
    """(calibration half, test half) of ``n`` prompts each: ShareGPT held-out prompts from index
    ``start`` on (:func:`.data.prompts` order; a prompt repeating an earlier prompt's text is
    skipped), ShareGPT code prompts of held-out conversations ``start`` on (:func:`code_prompts`),
    HumanEval problems ``start``..``start`` + 2n - 1 (the last 160 characters of the prompt, as
    :func:`.data.prompts` cuts them)."""
    start = check_whole(start, f"{workload} start", 0)
    if workload == "sharegpt":
        every = load_prompts("sharegpt", start + 4 * n)
        seen, out = set(every[:start]), []
        for p in every[start:]:
            if p not in seen:
                out.append(p)
            seen.add(p)
    elif workload == "sharegpt_code":
        out = code_prompts(2 * n, start)[0]
    elif workload == "humaneval":
        out = [p["prompt"][-PROMPT_CHARS:] for p in humaneval_problems()[start:start + 2 * n]]
    else:
        raise SimtreeError(f"unknown workload {workload!r}: expected one of {', '.join(OOS_WORKLOADS)}")
    if len(out) < 2 * n:
        raise SimtreeError(f"only {len(out)} {workload} prompts from index {start} on, {2 * n} asked for")
    return out[:n], out[n:2 * n]


def drafter_status(test_start: int, calibration_start: int, prompts: int) -> str:
    """"fresh" for the block drafters' test prompts from ``SEEN_DRAFTER`` on, else "seen"; test
    prompts that overlap the calibration prompts stop the table (one line)."""
    if test_start < calibration_start + prompts and calibration_start < test_start + prompts:
        raise SimtreeError(f"the block drafters' test prompts {test_start}..{test_start + prompts - 1} overlap their "
                           f"calibration prompts {calibration_start}..{calibration_start + prompts - 1}: "
                           f"give --drafter-start past them")
    return "fresh" if test_start >= SEEN_DRAFTER else "seen"


def prompt_status(workload: str, start: int | None) -> str:
    """"fresh" for ShareGPT prompts past the seen ones (``SEEN_SHAREGPT``) and ShareGPT code past
    ``SEEN_CODE``, else "seen" (every HumanEval problem; ``start`` None: the development prompts)."""
    if start is None:
        return "seen"
    if workload == "sharegpt":
        return "fresh" if start >= SEEN_SHAREGPT else "seen"
    if workload == "sharegpt_code":
        return "fresh" if start >= SEEN_CODE else "seen"
    return "seen"


def development_prompts(workload: str, n: int) -> tuple[list[str], list[str]]:
    """(calibration half, test half) of the prompts the model was first developed on: the first
    128 held-out ShareGPT prompts (up to 64 a half) and HumanEval 132..163 (up to 16 a half).
    ShareGPT code has no development prompts: the code workload there is HumanEval's alone."""
    if workload == "sharegpt":
        every = load_prompts("sharegpt", 128)
        half = min(n, 64)
        return every[:half], every[64:64 + half]
    if workload == "humaneval":
        every, half = load_prompts("humaneval", 32), min(n, 16)
        return every[:half], every[16:16 + half]
    raise SimtreeError(f"{workload} has no development prompts")


def training_overlap(texts: list[str], conversations: int = TRAINING_CONVERSATIONS) -> int:
    """How many of ``texts`` occur verbatim in the target's training text (the ShareGPT
    conversations of :func:`.data.training_docs` and HumanEval 0..131): ShareGPT repeats
    conversations, so a held-out record may repeat a trained one."""
    corpus = "\n".join(training_docs(conversations)[0])
    return sum(t in corpus for t in texts)
