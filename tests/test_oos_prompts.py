"""Which prompts the acceptance out-of-sample table calls fresh: a run is "seen" when its prompts
overlap a range a committed table decoded (runtime/acceptance_oos_prompts.py)."""
from __future__ import annotations

import pytest

from simtree.errors import SimtreeError
from simtree.runtime.acceptance_oos_prompts import (CODE_START, CURRENT, DECODED, HALVES, SEEN_CODE, SEEN_DRAFTER,
                                                    SEEN_SHAREGPT, SHAREGPT_START, TRAINING_CONVERSATIONS,
                                                    _code_block, chat_span, code_prompts,
                                                    code_span, drafter_status, half_spans, held_out_loss_prompts,
                                                    held_out_loss_span, held_out_prompts, prompt_status,
                                                    span_of_test_half)
from simtree.runtime.data import held_out_conversations, prompts


def test_the_recorded_ranges_are_the_spans_of_the_runs_that_decoded_them():
    # (start, prompts) of each committed run, its range by the same selection rule (repeats skipped)
    chat = [(0, 128), (128, 128), (384, 128), (640, 128), (772, 128), (900, 32), (1000, 48), (1200, 48), (1251, 48),
            (1400, 128)]
    assert DECODED["sharegpt"] == tuple(chat_span(s, n) for s, n in chat)
    assert DECODED["sharegpt_code"] == ((0, TRAINING_CONVERSATIONS - 1), code_span(TRAINING_CONVERSATIONS, 128),
                                        code_span(2473, 128))
    # the current table's test halves (the calibration halves are the decoded ranges just below them)
    assert CURRENT["mtp_chat"] == (span_of_test_half("sharegpt", SHAREGPT_START, *HALVES["sharegpt"]),)
    assert CURRENT["mtp_chat"][0][0] == SEEN_SHAREGPT == DECODED["sharegpt"][-1][1] + 1
    assert CURRENT["mtp_code"] == (span_of_test_half("sharegpt_code", CODE_START, *HALVES["sharegpt_code"]),)
    assert CURRENT["mtp_code"][0][0] == SEEN_CODE == DECODED["sharegpt_code"][-1][1] + 1
    assert (CODE_START, SEEN_CODE - 1) == span_of_test_half("sharegpt_code", CODE_START, 0, HALVES["sharegpt_code"][0])
    assert CURRENT["drafter_test"] == (chat_span(SEEN_DRAFTER, 96),)
    assert CURRENT["drafter_test"][0][0] == CURRENT["mtp_chat"][0][1] + 1


def test_the_held_out_loss_prompts_are_found_by_record():
    # training_docs' held-out text is odd records 1800..1999; 17 odd records before them have no
    # human turn, so prompt i is odd record i + 17 there: the range starts at prompt 1783
    assert held_out_loss_span() == (1783, 1981)
    # the block drafters' test, recorded before this was found, ends on it: disclosed, not relabelled
    assert CURRENT["drafter_test"][0][1] == 1783 and held_out_loss_prompts(SEEN_DRAFTER, 96) == [1783]
    assert drafter_status(SEEN_DRAFTER, 0, 96, 192) == "fresh"
    assert held_out_loss_prompts(SHAREGPT_START, 256, skip=128) == []       # the MTP chat test half: none
    # any other chat run over it is seen; past it (1982..1999, below the code conversations) fresh
    assert prompt_status("sharegpt", 1784, 1, 1) == "seen" == drafter_status(1900, 0, 8)
    assert prompt_status("sharegpt", 1982, 1, 2) == "fresh"


def test_a_run_overlapping_a_decoded_range_is_seen():
    # the committed table's own runs, exactly: fresh (their test halves; the calibration halves are seen)
    assert prompt_status("sharegpt", SHAREGPT_START, *HALVES["sharegpt"]) == "fresh"
    assert prompt_status("sharegpt_code", CODE_START, *HALVES["sharegpt_code"]) == "fresh"
    assert drafter_status(SEEN_DRAFTER, 0, 96, 192) == "fresh"
    # inside, straddling or a part of a decoded range: seen
    assert prompt_status("sharegpt", 1450, 64) == "seen"                 # inside the fifth table's 1400..1551
    assert prompt_status("sharegpt", 1400, 64) == "seen"                 # the fifth table's own run, read since
    assert prompt_status("sharegpt", SHAREGPT_START, 128, 3) == "seen"  # a part of the current test (a quick run)
    assert prompt_status("sharegpt", 1390, 8) == "seen"                 # straddling the fifth's first index
    assert prompt_status("sharegpt", 1290, 8) == "seen"                 # the block drafters' third test's end
    assert prompt_status("sharegpt_code", 2473, 64) == "seen"           # the fifth table's code, read since
    assert prompt_status("sharegpt", 929, 2) == "seen"                  # test half 932..933: the live drafter table's end (932)
    assert prompt_status("sharegpt_code", 2500, 64) == "seen"
    assert prompt_status("sharegpt_code", 1990, 4) == "seen"            # training records
    assert drafter_status(1260, 0, 48) == "seen" == drafter_status(1500, 0, 48) == drafter_status(1251, 0, 48)
    # a current range is fresh only for the kind of run that read it: a drafter test on the MTP
    # table's chat prompts is seen
    assert drafter_status(SEEN_SHAREGPT, 0, 128) == "seen"
    # chat prompts open the conversations the code tables took their code from, and prompts 1783..1981 are
    # the target's held-out-loss text: seen for chat too
    assert prompt_status("sharegpt", TRAINING_CONVERSATIONS, 32) == "seen"
    assert prompt_status("sharegpt", CODE_START, 32) == "seen" == drafter_status(CODE_START, 0, 48)
    assert prompt_status("sharegpt", 1850, 8) == "seen"
    # ranges no table decoded: fresh; HumanEval and the development prompts: seen
    assert prompt_status("sharegpt", 263, 4) == "fresh" == prompt_status("sharegpt", 1302, 4)
    assert prompt_status("sharegpt_code", 3300, 2) == "fresh"
    # the status is the test half's: a seen calibration half before a fresh test half is fresh
    assert chat_span(500, 14) == (500, 513)                             # the end of the second table's 384..513
    assert prompt_status("sharegpt", 500, 14, 4) == "fresh" != prompt_status("sharegpt", 500, 13, 4)
    assert prompt_status("humaneval", 0, 64) == "seen" == prompt_status("sharegpt", None, 64)
    with pytest.raises(SimtreeError, match="overlap their calibration prompts 0..47"):
        drafter_status(47, 0, 48)                                       # one shared prompt
    with pytest.raises(SimtreeError, match="overlap their calibration prompts 0..193"):
        drafter_status(150, 0, 8, 192)                                  # inside a larger calibration


def test_code_prompts_skip_a_repeat_of_an_earlier_conversations_prompt():
    """As a chat prompt repeating any earlier one is skipped, a code prompt repeating the code prompt
    of an earlier conversation from TRAINING_CONVERSATIONS on is, though that conversation lies
    before ``start``."""
    convs = held_out_conversations(2473)
    blocks = [_code_block(c) for c in convs]
    repeats = [i for i in range(TRAINING_CONVERSATIONS, 2473)
               if blocks[i] is not None and blocks[i] in blocks[TRAINING_CONVERSATIONS:i]]
    assert repeats                                     # ShareGPT repeats conversations
    i = repeats[0]
    taken, last = code_prompts(1, i)
    assert taken[0] != blocks[i] and last > i and taken[0] == blocks[last]
    # the committed ranges keep their prompts: none of the fifth table's repeats an earlier one
    assert not set(code_prompts(128, 2473)[0]) & set(blocks[TRAINING_CONVERSATIONS:])


def test_a_held_out_prompt_opens_its_held_out_conversation():
    """One reader of the held-out ShareGPT conversations (runtime/data.py) for the prompts and the
    code prompts: prompt i is the first non-blank human turn of conversation i, cut to 160
    characters; a longer list (past the 572 the file's first 8 MB hold) extends a shorter one."""
    convs = held_out_conversations(600)
    assert len(convs) == 600 and convs[:300] == held_out_conversations(300)
    firsts = [next(t["value"] for t in c if t["from"] == "human" and t["value"].strip()) for c in convs]
    assert prompts("sharegpt", 600) == [f.strip()[:160] for f in firsts]


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
        sizes = {"sharegpt": (2, 3), "sharegpt_code": (2, 2), "humaneval": (2, 2)}
        spans = {"sharegpt": half_spans("sharegpt", start, *sizes["sharegpt"])}
        return prompts_line(args, sizes, {"sharegpt": status, "sharegpt_code": status}, {}, False, spans)
    assert "test FRESH (past index 1552" in line(1550, "fresh")
    assert "test FRESH (in no range a committed table decoded" in line(263, "fresh")     # a range below, never decoded
    assert "test SEEN (it overlaps prompts a committed table" in line(1450, "seen")
    assert "calibration the first 2 distinct held-out prompts from 263 on (263..264" in line(263, "fresh")
    assert "test the next 3 (265..267)" in line(263, "fresh")


def test_the_summary_gives_each_halfs_overlap_and_where_the_adaptive_modes_decide():
    from types import SimpleNamespace

    from simtree.runtime.acceptance_oos_report import adaptive_grid_note, prompts_line
    args = SimpleNamespace(development=False, sharegpt_start=1550, code_start=CODE_START, humaneval_start=0)
    sizes = {"sharegpt": (2, 3), "sharegpt_code": (2, 2), "humaneval": (2, 2)}
    overlap = {"sharegpt": {"calibration": 1, "test": 2, "held_out_loss": [1783]}}
    spans = {"sharegpt": half_spans("sharegpt", 1550, *sizes["sharegpt"])}
    line = prompts_line(args, sizes, {"sharegpt": "fresh", "sharegpt_code": "fresh"}, overlap, False, spans)
    assert ("(2 of 3 test prompts occur verbatim in the target's training text, calibration 1 of 2; 1 of 3 test "
            "prompts (1783) is text the target's held-out loss read (evaluated, never trained on))") in line
    grid = {"batch_size": [1, 64], "context_len": [256, 4096]}
    runs = {"cost_aware": {"mode": "cost_aware", "context_len": 70.0}, "linear": {"mode": "linear", "context_len": 9.0}}
    halves = {("sharegpt", "calibration"): {"runs": runs, "prompts": 96}, ("sharegpt", "test"): {"runs": runs, "prompts": 128}}
    assert ("(sharegpt batch 128, mean context 70 tokens), all outside the shipped bundle's measured grid (batch 1-64, "
            "context 256-4096 tokens; the bundle extrapolates") in adaptive_grid_note(halves, grid)
    inside = {("humaneval", "test"): {"runs": {"c": {"mode": "batch_alloc", "context_len": 300.0}}, "prompts": 8}}
    assert "300 tokens), inside the shipped bundle's measured grid" in adaptive_grid_note(inside, grid)


def test_the_halves_may_differ_in_size_and_the_flag_reads_them():
    from simtree.runtime.acceptance_oos_cli import main, parse_halves
    from simtree.runtime.acceptance_oos_record import half_records
    cal, test = held_out_prompts("humaneval", 10, 3, 5)
    assert len(cal) == 3 and len(test) == 5 and not set(cal) & set(test)
    assert half_records("humaneval", 10, 3, 5)["test"] == {"workload": "humaneval", "start": 10, "prompts": 5,
                                                           "span": [13, 17]}
    assert half_records("sharegpt", 263, 3, 2)["calibration"]["span"] == list(chat_span(263, 3))
    assert parse_halves(["sharegpt=128:96", "humaneval=64:64"]) == {"sharegpt": (128, 96), "humaneval": (64, 64)}
    for bad in (["sharegpt=128"], ["chat=1:1"], ["sharegpt=0:4"], ["sharegpt=1:1", "sharegpt=2:2"]):
        with pytest.raises(SimtreeError, match="--prompts"):
            parse_halves(bad)
    assert main(["--prompts", "sharegpt=x:1", "--reuse-traces", "/nonexistent"]) == 2


def test_the_halves_and_their_ranges_are_worked_out_once_as_each_caller_did():
    """table_halves gives the starts and sizes the command line and run_oos each built (the
    development prompts capped, a workload's halves of their own sizes, run_oos on the workloads a
    kept folder holds); half_spans finds each half's range in one pass where the table scanned the
    prompts again for every range (chat_span, code_span, HumanEval's problem indices), and the
    records and labels read from it are those."""
    from simtree.runtime import acceptance_oos as oos
    from simtree.runtime.acceptance_oos_prompts import DEVELOPMENT_WORKLOADS, OOS_WORKLOADS
    from simtree.runtime.acceptance_oos_record import half_records
    starts = {"sharegpt": 263, "sharegpt_code": 3300, "humaneval": 10}
    settings = {"prompts": 3, "halves": {"sharegpt": (4, 2)}, "max_new_tokens": 4, "trees": []}
    for development, workloads in ((False, OOS_WORKLOADS), (True, DEVELOPMENT_WORKLOADS)):
        first, sizes = oos.table_halves(settings, None if development else starts)
        assert sizes == {w: oos.half_sizes(settings, w, development) for w in workloads}
        assert first == {w: None if development else starts[w] for w in workloads}
    assert oos.table_halves(settings, starts, ["humaneval"]) == ({"humaneval": 10}, {"humaneval": (3, 3)})
    first, sizes = oos.table_halves(settings, starts)
    assert sizes == {"sharegpt": (4, 2), "sharegpt_code": (3, 3), "humaneval": (3, 3)}
    spans = {w: half_spans(w, s, *sizes[w]) for w, s in first.items()}
    for w, (n, n_test) in sizes.items():
        s = starts[w]
        last = (lambda k: s + k - 1) if w == "humaneval" else (lambda k: (chat_span if w == "sharegpt" else
                                                                         code_span)(s, k)[1])
        want = {"calibration": (s, last(n)), "test": (last(n + 1), last(n + n_test))}
        assert spans[w] == want
        assert span_of_test_half(w, s, n, n_test) == want["test"]
        records = half_records(w, s, n, n_test, spans=spans[w])
        assert records == half_records(w, s, n, n_test)
        assert [records[h]["span"] for h in ("calibration", "test")] == [list(want[h]) for h in ("calibration", "test")]
    assert spans["humaneval"] == {"calibration": (10, 12), "test": (13, 15)}
    # 263.. and 3300.. lie in no decoded range; HumanEval is always seen
    assert oos.table_status(starts, spans) == {"sharegpt": "fresh", "sharegpt_code": "fresh", "humaneval": "seen"}
    assert oos.table_status(starts, spans) == {w: prompt_status(w, s, *sizes[w]) for w, s in starts.items()}
    assert set(oos.table_status(None, {}).values()) == {"seen"}


def test_run_oos_finds_each_workloads_halves_once(monkeypatch, tmp_path):
    """run_oos scans each workload's held-out prompts once for both their texts and their ranges
    (held_out_halves: what held_out_prompts and half_spans give apart), the texts of the workloads
    it decodes, the ranges of all (their labels); a kept folder's workloads alone are decoded."""
    from simtree.runtime import acceptance_oos as oos
    from simtree.runtime import acceptance_oos_prompts as p
    scans = []
    for name in ("distinct_chat", "_code_prompts"):
        real = getattr(p, name)
        monkeypatch.setattr(p, name, lambda *a, _real=real, _name=name: scans.append((_name, a)) or _real(*a))
    monkeypatch.setattr(oos, "prompt_token_ids", lambda model_dir, texts: (texts, None))
    monkeypatch.setattr(oos, "decode_halves", lambda model_dir, settings, ids, *a: {"decoded": ids, "spans": a[-1]})
    monkeypatch.setattr(oos, "load_halves", lambda traces, settings, ids: {"decoded": ids})
    monkeypatch.setattr(oos, "analyse", lambda halves, status, words, earlier: {"analysed": halves})
    starts = {"sharegpt": 263, "sharegpt_code": 3300, "humaneval": 10}
    settings = {"prompts": 3, "halves": {"sharegpt": (4, 2)}, "max_new_tokens": 4, "trees": []}
    res = oos.run_oos("model", settings, starts, say=None)
    assert sorted(name for name, _ in scans) == ["_code_prompts", "distinct_chat"]
    sizes = {"sharegpt": (4, 2), "sharegpt_code": (3, 3), "humaneval": (3, 3)}
    for w, (n, n_test) in sizes.items():
        assert p.held_out_halves(w, starts[w], n, n_test) == (res["prompt_texts"][w], res["spans"][w])
        assert res["prompt_texts"][w] == held_out_prompts(w, starts[w], n, n_test)
        assert res["spans"][w] == half_spans(w, starts[w], n, n_test)
    assert res["analysed"]["decoded"] == res["prompt_texts"] and res["analysed"]["spans"] == res["spans"]
    assert res["status"] == {"sharegpt": "fresh", "sharegpt_code": "fresh", "humaneval": "seen"}
    (tmp_path / "humaneval_calibration").mkdir()
    (tmp_path / "humaneval_test").mkdir()
    kept = oos.run_oos("model", settings, starts, reuse_traces=tmp_path)
    assert list(kept["prompt_texts"]) == ["humaneval"] and set(kept["spans"]) == set(starts)
    with pytest.raises(SimtreeError, match="only 3 humaneval prompts from index 161 on, 6 asked for"):
        p.held_out_halves("humaneval", 161, 3)
