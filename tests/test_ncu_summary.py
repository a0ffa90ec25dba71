"""scripts/ncu_summary.py reads the Nsight Compute CSV pages scripts/ncu_gdn.sh writes (the
H200 pages kept in tests/data/ncu/) into one table per shape, the values as the pages hold them."""
import csv
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "data" / "ncu" / "run53"


def _detail(shape: str, kernel: str, metric: str) -> str:
    rows = list(csv.reader((RUN / f"verify_{shape}.details.csv").open()))
    h = rows[0]
    k, m, v = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value")
    return next(r[v] for r in rows[1:] if len(r) > v and r[k] == kernel and r[m] == metric)


def test_summary_tables_hold_the_pages_values(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ncu_summary.py", str(RUN)])
    runpy.run_path(str(ROOT / "scripts" / "ncu_summary.py"), run_name="__main__")
    out = capsys.readouterr().out
    shapes = [line[3:] for line in out.splitlines() if line.startswith("## ")]
    assert shapes == ["b1_n128", "b16_n64", "b16_n128", "b64_n128"]   # by batch, then nodes
    for shape in shapes:
        block = out.split(f"## {shape}\n")[1].split("\n## ")[0]
        dur = next(line for line in block.splitlines() if line.startswith("| Duration |"))
        assert dur.split(" | ")[2].startswith(_detail(shape, "_tree_verify_kernel", "Duration"))
        assert "| top stalls" in block and "HMMA" in block


def test_summary_refuses_a_folder_without_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ncu_summary.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="no verify_b"):
        runpy.run_path(str(ROOT / "scripts" / "ncu_summary.py"), run_name="__main__")


def test_summary_reads_the_transposed_walk(monkeypatch, capsys):
    # run 82: b64 n128 launches the transposed walk (_tree_verify_t_kernel): its duration and
    # its SASS loop bodies are summarised like the untransposed walk's (b16 n128, no SASS page)
    run = ROOT / "tests" / "data" / "ncu" / "run82"
    monkeypatch.setattr(sys, "argv", ["ncu_summary.py", str(run)])
    runpy.run_path(str(ROOT / "scripts" / "ncu_summary.py"), run_name="__main__")
    out = capsys.readouterr().out
    b64 = out.split("## b64_n128\n")[1]
    assert "| metric | _qk_prenorm_kernel | _tree_kside_kernel | _tree_verify_t_kernel |" in b64
    assert "SASS by loop body" in b64 and "HMMA" in b64
    stalled = [float(line[2:].split("%")[0]) for line in b64.splitlines()
               if line.startswith("- ") and "% x " in line]
    assert len(stalled) == 6 and stalled == sorted(stalled, reverse=True) and stalled[0] < 100
    b16 = out.split("## b16_n128\n")[1].split("\n## ")[0]
    assert "_tree_verify_kernel |" in b16 and "SASS" not in b16
    assert out == (run / "summary.md").read_text()


def test_the_header_names_the_launch_the_logs_record(tmp_path):
    # the summary says which launch was profiled: ncu_gdn_verify.py's log line per shape
    launches = runpy.run_path(str(ROOT / "scripts" / "ncu_summary.py"))["launches"]
    assert launches(tmp_path) == "the default launch"   # no logs
    (tmp_path / "verify_b16_n128.log").write_text("x\nb16 n128: three verifies done (default launch)\n")
    assert launches(tmp_path) == "the default launch"
    (tmp_path / "verify_b64_n128.log").write_text("b64 n128: three verifies done ({'cuda_walk': 2})\n")
    assert launches(tmp_path) == "the launch `default launch` / `{'cuda_walk': 2}`"
    assert "the launch `{'transposed': 1, 'cuda_walk': 2}`" in (
        ROOT / "tests/data/ncu/run90_v2/summary.md").read_text()
