"""scripts/check_verify_step_gpu.py's two report modes on H200 data kept in tests/data/verify_step/:
the table values are the TSVs' medians, the ratio column is profile_events / engine_wall."""
import runpy
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "verify_step"


def _run(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["check_verify_step_gpu.py", *args])
    runpy.run_path(str(ROOT / "scripts" / "check_verify_step_gpu.py"), run_name="__main__")


def test_report_ratios_come_from_the_tsvs(tmp_path, monkeypatch):
    src = DATA / "calls"
    for f in src.glob("*.tsv"):
        (tmp_path / f.name).write_text(f.read_text())
    _run(monkeypatch, "--report", str(tmp_path))
    df = runpy.run_path(str(ROOT / "scripts" / "check_verify_step_gpu.py"))["load_calls"](src)
    assert set(df["threads"]) == {1, 16}   # call1 (first form, no column) ran at 1 thread
    text = (tmp_path / "README.md").read_text()
    for (call, thr, b, n), g in df.groupby(["call", "threads", "batch", "nodes"]):
        us = g.set_index("variant")["us"]
        line = next(x for x in text.splitlines() if x.startswith(f"| {call} | {thr} | {b} | {n} |"))
        assert line.rstrip(" |").endswith(f"{us['profile_events'] / us['engine_wall']:.2f}")


def test_report_ab_tabulates_the_engine_round(tmp_path, monkeypatch):
    src = DATA / "ab.tsv"
    (tmp_path / "ab.tsv").write_text(src.read_text())
    _run(monkeypatch, "--report-ab", str(tmp_path / "ab.tsv"))
    d = pd.read_csv(src, sep="\t")
    want = d[(d.variant == "engine_wall") & (d.batch == 8) & (d.nodes == 16)]
    line = next(x for x in (tmp_path / "table.md").read_text().splitlines() if x.startswith("| 8 | 16 |"))
    for us in want["us"]:
        assert f" {us:.0f} " in line


def test_report_needs_tsvs(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="no .tsv"):
        _run(monkeypatch, "--report", str(tmp_path))
