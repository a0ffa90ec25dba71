"""A kept trace folder of the acceptance table records which prompts it decoded; a reuse with other
flags stops in one line, and one kept before the record says its starts come from the command."""
from __future__ import annotations

import json

import pytest

from simtree.errors import SimtreeError
from simtree.runtime import acceptance_oos as oos
from simtree.runtime.acceptance_oos_cli import main
from simtree.runtime.acceptance_oos_record import check_reuse, half_records
from simtree.runtime.acceptance_oos_report import _starts_note
from simtree.runtime.acceptance_oos_prompts import held_out_prompts
from simtree.runtime.data import prompts as load_prompts

STARTS = {"sharegpt": 1400, "sharegpt_code": 2473, "humaneval": 0}
SIZES = {w: (64, 64) for w in STARTS}          # prompts in each workload's (calibration, test) halves
DRAFTED = {"calibration": 48, "test": 48}


def _folder(tmp_path, records: dict | None, drafters: dict | None = None):
    """A kept folder's records alone (lossless.json, drafters/drafters.json): what the check reads."""
    keys = [f"{w} {h}" for w in STARTS for h in ("calibration", "test")]
    kept = {k: {"lossless": {"linear_d4": True}, "prompts": 64} for k in keys}
    for k, rec in (records or {}).items():
        kept[k]["decoded"] = rec
    (tmp_path / "drafters").mkdir(parents=True)
    (tmp_path / "lossless.json").write_text(json.dumps(kept))
    d = {"lossless": {}, "prompts": {"calibration": 48, "test": 48}, "max_new_tokens": 64}
    if drafters:
        d["decoded"] = drafters
    (tmp_path / "drafters" / "drafters.json").write_text(json.dumps(d))
    return tmp_path


def _rec(workload, start, n=64):
    return {"workload": workload, "start": start, "prompts": n, "span": [start, start + n]}


def test_a_record_that_differs_from_the_command_stops_in_one_line(tmp_path):
    folder = _folder(tmp_path, {"sharegpt test": _rec("sharegpt", 1000)})
    with pytest.raises(SimtreeError) as exc:
        check_reuse(folder, STARTS, SIZES, None)
    msg = str(exc.value)
    assert "\n" not in msg and "sharegpt test" in msg and "from 1000" in msg and "from 1400" in msg
    with pytest.raises(SimtreeError, match="32 prompts"):          # the count differs
        check_reuse(_folder(tmp_path / "n", {"humaneval test": _rec("humaneval", 0)}), STARTS,
                    {**SIZES, "humaneval": (64, 32)}, None)
    # the block drafters' record is checked too
    drafted = {"calibration": _rec("sharegpt", 0, 48), "test": _rec("sharegpt", 1200, 48)}
    folder = _folder(tmp_path / "d", {}, drafted)
    with pytest.raises(SimtreeError, match="block drafters' test runs was decoded from sharegpt from 1200"):
        check_reuse(folder, STARTS, SIZES, ({"calibration": 0, "test": 1251}, DRAFTED))


def test_the_command_line_refuses_before_writing(tmp_path, capsys):
    folder = _folder(tmp_path / "kept", {"sharegpt calibration": _rec("sharegpt", 900)})
    out = tmp_path / "out"
    assert main(["--reuse-traces", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.strip().count("\n") == 0 and "from 900" in err
    assert not out.exists()


def test_matching_records_pass_and_an_older_folder_is_named_in_the_header(tmp_path):
    recs = {f"{w} {h}": _rec(w, s) for w, s in STARTS.items() for h in ("calibration", "test")}
    drafted = {"calibration": _rec("sharegpt", 0, 48), "test": _rec("sharegpt", 1251, 48)}
    assert check_reuse(_folder(tmp_path / "a", recs, drafted), STARTS, SIZES,
                       ({"calibration": 0, "test": 1251}, DRAFTED)) == []
    assert "match the command's" in _starts_note({"prompt_starts_from": "traces"})
    # a folder kept before the record (as the committed table's): every half named, the table goes on
    unrecorded = check_reuse(_folder(tmp_path / "b", None), STARTS, SIZES, ({"calibration": 0, "test": 1251}, DRAFTED))
    assert unrecorded == [f"{w} {h}" for w in STARTS for h in ("calibration", "test")] + \
        ["block drafters calibration", "block drafters test"]
    note = _starts_note({"prompt_starts_from": {"command": unrecorded}})
    assert "record no prompt starts" in note and "come from this command's flags, not from the traces" in note
    assert check_reuse(tmp_path / "missing", STARTS, SIZES, None) == ["the MTP halves"]


def test_the_records_span_the_prompts_each_half_decoded():
    cal, test = held_out_prompts("sharegpt", 263, 4)
    rec = half_records("sharegpt", 263, 4)
    every = load_prompts("sharegpt", 300)
    assert every[rec["calibration"]["span"][0]] == cal[0] and every[rec["calibration"]["span"][1]] == cal[-1]
    assert every[rec["test"]["span"][0]] == test[0] and every[rec["test"]["span"][1]] == test[-1]
    assert half_records("humaneval", 10, 4)["test"]["span"] == [14, 17]
    assert half_records("sharegpt", None, 4)["test"] == {"workload": "sharegpt", "start": None, "prompts": 4,
                                                         "span": None}


def test_decoding_records_the_starts_the_reuse_check_reads(tmp_path, monkeypatch):
    """decode_halves writes each half's record into lossless.json (the decode itself stubbed)."""
    monkeypatch.setattr(oos, "build_model", lambda *a, **k: None)
    monkeypatch.setattr(oos, "load_costs", lambda *a: None)
    monkeypatch.setattr(oos, "_decode_half", lambda model, ids, *a: {"lossless": {"linear_d4": True},
                                                                      "prompts": len(ids)})
    ids = lambda n, n_test: {"humaneval": ([[1, 2]] * n, [[1, 3]] * n_test)}    # noqa: E731
    oos.decode_halves("m", {"prompts": 3, "trees": []}, ids(3, 3), tmp_path, say=None, starts={"humaneval": 5})
    kept = json.loads((tmp_path / "lossless.json").read_text())
    assert kept["humaneval test"]["decoded"] == {"workload": "humaneval", "start": 5, "prompts": 3, "span": [8, 10]}
    assert check_reuse(tmp_path, {"humaneval": 5}, {"humaneval": (3, 3)}, None) == []
    with pytest.raises(SimtreeError, match="from 5, 3 prompts"):
        check_reuse(tmp_path, {"humaneval": 0}, {"humaneval": (3, 3)}, None)
    # halves of their own sizes (``halves``: 4 calibration prompts, 2 test): each recorded, each checked
    oos.decode_halves("m", {"prompts": 3, "halves": {"humaneval": (4, 2)}, "trees": []}, ids(4, 2), tmp_path,
                      say=None, starts={"humaneval": 5})
    kept = json.loads((tmp_path / "lossless.json").read_text())
    assert kept["humaneval calibration"]["decoded"] == {"workload": "humaneval", "start": 5, "prompts": 4,
                                                        "span": [5, 8]}
    assert kept["humaneval test"]["decoded"] == {"workload": "humaneval", "start": 5, "prompts": 2, "span": [9, 10]}
    assert check_reuse(tmp_path, {"humaneval": 5}, {"humaneval": (4, 2)}, None) == []
    with pytest.raises(SimtreeError, match="the kept humaneval test half was decoded from humaneval from 5, 2 prompts"):
        check_reuse(tmp_path, {"humaneval": 5}, {"humaneval": (4, 3)}, None)


def test_the_block_drafters_decode_records_its_starts(tmp_path, monkeypatch):
    """decode_drafters writes each half's record into drafters.json (the decode itself stubbed)."""
    import simtree.runtime.bpe as bpe
    import simtree.runtime.full.build as build
    import simtree.runtime.full.decode as decode
    from simtree.runtime import acceptance_oos_drafters as drafters
    from simtree.runtime.acceptance_oos_prompts import chat_span

    class Tok:
        def encode(self, text):
            return [1, 2]
    monkeypatch.setattr(bpe.BpeTokenizer, "from_file", staticmethod(lambda *a: Tok()))
    monkeypatch.setattr(build, "build_model", lambda *a, **k: None)
    monkeypatch.setattr(decode, "decode_prompts", lambda model, ids, *a, **k: {
        "notes": [], "outputs": [[3]] * len(ids), "accepted_tokens_per_round": 1.0})
    monkeypatch.setattr(drafters, "load_drafters", lambda traces, d: None)
    drafters.decode_drafters("m", ("block",), {"calibration": ["a", "b", "e"], "test": ["c", "d"]}, 4, tmp_path,
                             say=None, starts={"calibration": 0, "test": 1251})
    kept = json.loads((tmp_path / "drafters.json").read_text())
    assert kept["decoded"]["test"] == {"workload": "sharegpt", "start": 1251, "prompts": 2,
                                       "span": list(chat_span(1251, 2))}
    assert kept["decoded"]["calibration"]["prompts"] == 3 and kept["prompts"] == {"calibration": 3, "test": 2}
    (tmp_path / "drafters").mkdir()
    (tmp_path / "drafters.json").rename(tmp_path / "drafters" / "drafters.json")
    halves = {"calibration": 0, "test": 1251}
    assert check_reuse(tmp_path, STARTS, SIZES, (halves, {"calibration": 3, "test": 2})) == ["the MTP halves"]
    with pytest.raises(SimtreeError, match="the command asks for sharegpt from 1300, 2 prompts"):
        check_reuse(tmp_path, STARTS, SIZES, ({"calibration": 0, "test": 1300}, {"calibration": 3, "test": 2}))
    with pytest.raises(SimtreeError, match="calibration runs was decoded from sharegpt from 0, 3 prompts"):
        check_reuse(tmp_path, STARTS, SIZES, (halves, {"calibration": 2, "test": 2}))   # the calibration differs


def test_a_table_that_fails_to_build_leaves_the_previous_pair(tmp_path, monkeypatch):
    """The CSV and the summary are both built before either is written (the analysis stubbed, the
    summary's header failing)."""
    import pandas as pd

    from simtree.runtime import acceptance_oos_cli as cli
    folder = _folder(tmp_path / "kept", None)
    res = {"table": pd.DataFrame({"a": [1.0]}), "summary": {"families": {}}, "prompts": {}, "lossless": {},
           "calibration_folds": {}, "shifts": {}, "off_chain": {}, "text_terms": {}, "models": {},
           "status": {}, "halves": {}, "prompt_texts": {}, "spans": {}}
    monkeypatch.setattr(cli, "run_oos", lambda *a, **k: res)
    monkeypatch.setattr(cli, "prompts_line", lambda *a: "P.")

    def fail(*a):
        raise RuntimeError("header failed")
    monkeypatch.setattr(cli, "header", fail)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("acceptance_out_of_sample.csv", "acceptance_out_of_sample.md"):
        (out / name).write_text("older\n")
    with pytest.raises(RuntimeError, match="header failed"):
        cli.main(["--development", "--reuse-traces", str(folder), "--out", str(out)])
    assert [p.read_text() for p in sorted(out.iterdir())] == ["older\n", "older\n"]
    monkeypatch.setattr(cli, "header", lambda *a: ["# T"])           # the same run, built: both written
    monkeypatch.setattr(cli, "summary_markdown", lambda df, s, head: "\n".join(head))
    assert cli.main(["--development", "--reuse-traces", str(folder), "--out", str(out)]) == 0
    assert (out / "acceptance_out_of_sample.csv").read_text() == "a\n1.00000\n"
    settings = json.loads((out / "acceptance_out_of_sample.md").read_text().split("```json\n")[1].split("```")[0])
    assert settings["prompt_starts_from"]["command"][0] == "sharegpt calibration"    # the folder records none


def test_a_development_table_reuses_its_own_traces(tmp_path, monkeypatch, capsys):
    """The development prompts hold fewer than the full halves (ShareGPT 64 a half, HumanEval 16):
    the sizes the command checks a kept folder against are those it decoded, so a development run's
    own traces are taken back (they were refused: 64 prompts recorded, 128 asked for); the CLI hands
    run_oos no starts and the kept folder."""
    import pandas as pd

    from simtree.runtime import acceptance_oos_cli as cli
    from simtree.runtime.acceptance_oos_prompts import DEVELOPMENT_WORKLOADS, development_prompts
    sizes = {w: oos.half_sizes(oos.FULL, w, development=True) for w in DEVELOPMENT_WORKLOADS}
    assert sizes == {"sharegpt": (64, 64), "humaneval": (16, 16)}
    assert oos.half_sizes(oos.FULL, "sharegpt") == (128, 128)                   # the full halves, uncapped
    assert [len(h) for h in development_prompts("humaneval", *oos.half_sizes(oos.FULL, "humaneval"))] == [16, 16]
    with pytest.raises(SimtreeError, match="sharegpt_code has no development prompts"):
        oos.half_sizes(oos.FULL, "sharegpt_code", development=True)
    folder = tmp_path / "kept"
    folder.mkdir()
    kept = {f"{w} {h}": {"lossless": {"linear_d4": True}, "prompts": n, "decoded": rec}   # as decode_halves records
            for w in DEVELOPMENT_WORKLOADS for (h, rec), n in zip(half_records(w, None, *sizes[w]).items(), sizes[w])}
    (folder / "lossless.json").write_text(json.dumps(kept))
    seen = {}
    res = {"table": pd.DataFrame({"a": [1.0]}), "summary": {"families": {}}, "prompts": {}, "lossless": {},
           "calibration_folds": {}, "shifts": {}, "off_chain": {}, "text_terms": {}, "models": {},
           "status": {}, "halves": {}, "prompt_texts": {}, "spans": {}}
    monkeypatch.setattr(cli, "run_oos", lambda model, settings, starts, traces, reuse, **k: seen.update(
        starts=starts, reuse=reuse) or res)
    monkeypatch.setattr(cli, "header", lambda *a: ["# T"])
    monkeypatch.setattr(cli, "summary_markdown", lambda df, s, head: "\n".join(head))
    out = tmp_path / "out"
    assert cli.main(["--development", "--reuse-traces", str(folder), "--out", str(out)]) == 0
    assert seen == {"starts": None, "reuse": str(folder)}
    assert '"prompt_starts_from": "traces"' in (out / "acceptance_out_of_sample.md").read_text()   # records matched
    kept["sharegpt test"]["decoded"]["prompts"] = 128          # a record of other halves still stops the table
    (folder / "lossless.json").write_text(json.dumps(kept))
    capsys.readouterr()
    assert cli.main(["--development", "--reuse-traces", str(folder), "--out", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "128 prompts" in err[0] and "64 prompts" in err[0]
    assert not (tmp_path / "out2" / "acceptance_out_of_sample.csv").exists()
