"""Which prompts the acceptance out-of-sample table calls fresh: a run is "seen" when its prompts
overlap a range a committed table decoded (runtime/acceptance_oos_prompts.py)."""
from __future__ import annotations

import pytest

from simtree.errors import SimtreeError
from simtree.runtime.acceptance_oos_prompts import (CODE_START, CURRENT, DECODED, SEEN_DRAFTER, SHAREGPT_START,
                                                    TRAINING_CONVERSATIONS, _code_block, _held_out_conversations,
                                                    chat_span, code_prompts, code_span, drafter_status,
                                                    prompt_status)


def test_the_recorded_ranges_are_the_spans_of_the_runs_that_decoded_them():
    # (start, prompts) of each committed run, its range by the same selection rule (repeats skipped)
    chat = [(0, 128), (128, 128), (384, 128), (640, 128), (772, 128), (900, 32), (1000, 48), (1200, 48)]
    held_out_loss = (TRAINING_CONVERSATIONS - 200, TRAINING_CONVERSATIONS - 1)   # training_docs' held-out text
    assert DECODED["sharegpt"] == tuple(chat_span(s, n) for s, n in chat) + (held_out_loss,)
    assert CURRENT["mtp_chat"] == (chat_span(SHAREGPT_START, 128),)
    assert CURRENT["drafter_test"] == (chat_span(SEEN_DRAFTER, 48),)
    assert DECODED["sharegpt_code"] == ((0, TRAINING_CONVERSATIONS - 1), code_span(TRAINING_CONVERSATIONS, 128))
    assert CURRENT["mtp_code"] == (code_span(CODE_START, 128),)


def test_a_run_overlapping_a_decoded_range_is_seen():
    # the committed table's own runs, exactly: fresh
    assert prompt_status("sharegpt", SHAREGPT_START, 64) == "fresh"
    assert prompt_status("sharegpt_code", CODE_START, 64) == "fresh"
    assert drafter_status(SEEN_DRAFTER, 0, 48) == "fresh"
    # inside, straddling or a part of a decoded range: seen
    assert prompt_status("sharegpt", 1450, 64) == "seen"                 # inside the fifth table's 1400..1551
    assert prompt_status("sharegpt", SHAREGPT_START, 3) == "seen"       # a part of it (a quick run)
    assert prompt_status("sharegpt", 1390, 8) == "seen"                 # straddling its first index
    assert prompt_status("sharegpt", 1290, 8) == "seen"                 # the block drafters' third test's end
    assert prompt_status("sharegpt", 930, 2) == "seen"                  # the live drafter table's end (932)
    assert prompt_status("sharegpt_code", 2500, 64) == "seen"
    assert prompt_status("sharegpt_code", 1990, 4) == "seen"            # training records
    assert drafter_status(1260, 0, 48) == "seen" == drafter_status(1500, 0, 48)
    # a current range is fresh only for the kind of run that read it: a drafter test on the MTP
    # table's chat prompts is seen
    assert drafter_status(SHAREGPT_START, 0, 128) == "seen"
    # chat prompts open the conversations the code tables took their code from, and 1800..1999 are
    # the target's held-out-loss text: seen for chat too
    assert prompt_status("sharegpt", TRAINING_CONVERSATIONS, 32) == "seen"
    assert prompt_status("sharegpt", CODE_START, 32) == "seen" == drafter_status(CODE_START, 0, 48)
    assert prompt_status("sharegpt", 1850, 8) == "seen"
    # ranges no table decoded: fresh; HumanEval and the development prompts: seen
    assert prompt_status("sharegpt", 263, 4) == "fresh" == prompt_status("sharegpt", 1552, 4)
    assert prompt_status("sharegpt_code", 2882, 2) == "fresh"
    assert prompt_status("humaneval", 0, 64) == "seen" == prompt_status("sharegpt", None, 64)
    with pytest.raises(SimtreeError, match="overlap their calibration prompts 0..47"):
        drafter_status(47, 0, 48)                                       # one shared prompt


def test_code_prompts_skip_a_repeat_of_an_earlier_conversations_prompt():
    """As a chat prompt repeating any earlier one is skipped, a code prompt repeating the code prompt
    of an earlier conversation from TRAINING_CONVERSATIONS on is, though that conversation lies
    before ``start``."""
    convs = _held_out_conversations(CODE_START)
    blocks = [_code_block(c) for c in convs]
    repeats = [i for i in range(TRAINING_CONVERSATIONS, CODE_START)
               if blocks[i] is not None and blocks[i] in blocks[TRAINING_CONVERSATIONS:i]]
    assert repeats                                     # ShareGPT repeats conversations
    i = repeats[0]
    taken, last = code_prompts(1, i)
    assert taken[0] != blocks[i] and last > i and taken[0] == blocks[last]
    # the committed ranges keep their prompts: none of the fifth table's repeats an earlier one
    assert not set(code_prompts(128, CODE_START)[0]) & set(blocks[TRAINING_CONVERSATIONS:])


def test_the_module_runs_its_command_line():
    """python -m simtree.runtime.acceptance_oos runs acceptance_oos_cli.main (same flags): a bad
    --drafters stops in one line, exit 2."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "simtree.runtime.acceptance_oos", "--drafters", "mtp,tfm",
                           "--reuse-traces", "/nonexistent"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("error: --drafters 'mtp,tfm'")


def test_the_summary_names_the_target():
    from simtree.runtime.acceptance_oos_report import header
    res = {"prompts": {"sharegpt test": 2}, "lossless": {"sharegpt test": {"linear_d4": True}},
           "calibration_folds": {"sharegpt": {"confidence_only": 0.01, "lookup": 0.02}}}
    lines = header("cmd", {"model": "qwen3.5-tiny-sharegpt", "seconds": 1.0}, res, {"max_new_tokens": 4}, "P.",
                   ["linear_d4"], 15, 8)
    assert "Target: `qwen3.5-tiny-sharegpt`" in lines[2] and "{" not in lines[2]


def test_the_summary_says_why_chat_prompts_are_fresh_or_seen():
    from types import SimpleNamespace

    from simtree.runtime.acceptance_oos_report import prompts_line

    def line(start, status):
        args = SimpleNamespace(development=False, sharegpt_start=start, code_start=CODE_START, humaneval_start=0)
        return prompts_line(args, 2, {"sharegpt": status, "sharegpt_code": status}, {}, False)
    assert "FRESH (past the first 1400" in line(SHAREGPT_START, "fresh")
    assert "FRESH (in no range a committed table decoded" in line(263, "fresh")     # a range below, never decoded
    assert "SEEN (they overlap prompts a committed table decoded" in line(1450, "seen")
