"""Inputs a user gets wrong at the command line: each is one `error:` line (exit 2) naming the
problem, never a traceback or a silently ignored option; outputs stay out of the package."""
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _simtree(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "simtree", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def _one_line_error(proc, fragment: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert fragment in proc.stderr, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_full_scale_run_on_cuda_without_a_gpu(tmp_path):
    _one_line_error(_simtree("run", "--model", "tiny-gdn", "--device", "cuda", "--acceptance", "gsm8k",
                             "--out", str(tmp_path)), "device cuda is not available here")


@pytest.mark.parametrize("args, fragment", [
    (["--replay", "t.jsonl"], "--replay: a full-scale option: it needs --model"),
    (["--acceptance", "gsm8k", "--rounds", "5"], "--acceptance, --rounds: full-scale options: they need --model"),
    (["--sampling", "iid"], "--sampling: a full-scale option"),
    (["--min-draws", "8"], "--min-draws: a full-scale option"),
])
def test_full_scale_options_without_a_model_are_refused(tmp_path, args, fragment):
    _one_line_error(_simtree("run", *args, "--out", str(tmp_path)), fragment)


def test_plan_modes_without_trees_plans_linear_only(tmp_path):
    import pandas as pd
    proc = _simtree("plan", "--modes", "linear", "--model", "qwen3.6-27b", "--deployment", "tp=1", "--workload",
                    "gsm8k", "--batch-sizes", "1,64", "--band-models", "0", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    cands = pd.read_csv(tmp_path / "candidates.csv")
    assert set(cands["mode"]) == {"none", "linear"}
    assert pd.read_csv(tmp_path / "tree_vs_linear.csv").empty
    md = (tmp_path / "plan.md").read_text()
    note = md.index("searched the families none, linear only (--modes)")
    assert md.index("## Chosen policy") < note                 # beside the choice it limits,
    assert "## Extrapolated costs" not in md or note < md.index("## Extrapolated costs")   # not among the ranges
    assert md.count("searched the families") == 1


def test_plan_modes_outside_the_families_are_one_line(tmp_path):
    _one_line_error(_simtree("plan", "--modes", "eagle,tree", "--out", str(tmp_path)),
                    "plan modes tree: choose among none, linear, eagle")


def test_full_scale_unknown_device_and_sampling(tmp_path):
    _one_line_error(_simtree("run", "--model", "tiny-gdn", "--device", "tpu", "--acceptance", "gsm8k",
                             "--out", str(tmp_path)), "unknown device 'tpu'")
    _one_line_error(_simtree("run", "--model", "tiny-gdn", "--device", "cpu", "--acceptance", "gsm8k",
                             "--sampling", "sobol", "--out", str(tmp_path)), "replay sampling 'sobol' unknown")
    _one_line_error(_simtree("run", "--model", "tiny-gdn", "--device", "cpu", "--acceptance", "gsm8k",
                             "--min-draws", "-1", "--out", str(tmp_path)), "--min-draws must be an integer >= 0")


def test_report_write_needs_summary():
    _one_line_error(_simtree("report", "--write"), "--write rewrites README.md's results table")


def test_a_communication_model_for_one_gpu_is_refused():
    _one_line_error(_simtree("simulate", "--model", "qwen3.6-27b", "--comm", "x.comm.json"),
                    "run(s) on one GPU and send no collectives")


def test_profile_of_an_unknown_or_unswept_model(tmp_path):
    _one_line_error(_simtree("profile", "--model", "nosuch", "--out", str(tmp_path / "p.csv")), "unknown model 'nosuch'")
    _one_line_error(_simtree("profile", "--model", "qwen3.6-27b", "--out", str(tmp_path / "p.csv")),
                    "no grid points for --model qwen3.6-27b (the sweep's models: tiny-gdn, tiny-v4")


def test_fit_of_a_shipped_table_writes_under_reports_fit_not_the_package(tmp_path):
    shipped = ROOT / "simtree" / "data" / "profiles" / "h200" / "profile_qwen3.6-27b_tp2.csv"
    before = sorted(p.name for p in shipped.parent.iterdir())
    proc = _simtree("fit", str(shipped), "--model", "qwen3.6-27b", "--deployment", "tp=2", "--draft-from-verify",
                    "--form", "basis", "--folds", "2", "--no-png", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "reports" / "fit" / "profile_qwen3.6-27b_tp2.costs.json").exists()
    assert sorted(p.name for p in shipped.parent.iterdir()) == before


def test_a_query_at_the_range_edge_by_round_off_is_not_extrapolation():
    from simtree.costs.model import load_costs
    from simtree.errors import ExtrapolationWarning

    costs = load_costs(ROOT / "simtree" / "data" / "costs" / "h200_qwen3.6-27b_tp1.json")
    lo = costs.verify.surface.valid_range["nodes_per_seq"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExtrapolationWarning)
        costs.verify.predict(lo * (1 - 1e-15), 1024.0, 8)
    with pytest.warns(ExtrapolationWarning):
        costs.verify.predict(lo * 0.5, 1024.0, 8)


def test_a_policy_for_another_model_is_named_as_such():
    policy = ROOT / "reports" / "h200" / "plan" / "deepseek-v4-flash_ep8_NVIDIA_H200" / "policy.json"
    _one_line_error(_simtree("simulate", "--model", "qwen3.6-27b", "--policy", str(policy)),
                    "is a plan for deepseek-v4-flash, not qwen3.6-27b")


def test_report_renders_every_good_plan_folder_and_names_the_broken_one(tmp_path):
    import shutil

    src = ROOT / "reports" / "h200" / "plan" / "qwen3.6-27b_NVIDIA_H200"
    for name in ("good", "bad"):
        shutil.copytree(src, tmp_path / name)
    (tmp_path / "good" / "plan.md").unlink()
    (tmp_path / "bad" / "policy.json").write_text("{bad")
    _one_line_error(_simtree("report", str(tmp_path)), "1 of 2 plan folders not rendered")
    assert (tmp_path / "good" / "plan.md").exists()


@pytest.mark.parametrize("command", [
    ["plan", "--model", "qwen3.6-27b", "--deployment", "tp=1", "--workload", "gsm8k", "--batch-sizes", "1",
     "--band-models", "0"],
    ["bench-serve", "--requests", "5", "--loads", "0.5", "--arrivals", "poisson"],
])
def test_an_out_that_is_a_file_is_refused_before_the_work(tmp_path, command):
    """plan and bench-serve found out at their first write, after the search (progress lines, then
    the operating system's 'file exists')."""
    taken = tmp_path / "taken"
    taken.write_text("x")
    for out in (taken, taken / "sub"):
        _one_line_error(_simtree(*command, "--out", str(out)), f"--out {out}: {taken} is a file, not a folder")
    assert taken.read_text() == "x"


@pytest.mark.parametrize("args, fragment", [
    (["--context-len", "0"], "--context-len must be an integer in [1, 1048576], got 0"),       # was the default's
    (["--context-len", "100000000"], "--context-len must be an integer in [1, 1048576]"),    # ran on for ever
    (["--rounds", "0"], "--rounds must be an integer >= 1, got 0"),
    (["--batch-size", "1,0"], "--batch-size entry 0 must be an integer in [1, 1000000]"),     # a failed row b0
    (["--batch-size", "1,,4"], "--batch-size must be comma-separated integers with no empty entry"),
    (["--dtype", "float8"], "--dtype 'float8': use float32, bfloat16 or float64"),            # was ignored
])
def test_full_scale_bad_numbers_are_one_line_and_run_nothing(tmp_path, args, fragment):
    out = tmp_path / "out"
    _one_line_error(_simtree("run", "--model", "tiny-gdn", "--device", "cpu", "--acceptance", "gsm8k", *args,
                             "--out", str(out)), fragment)
    assert not out.exists()


def test_full_scale_runs_take_the_dtype_asked_for(tmp_path, monkeypatch):
    """--dtype reached --prompt-ids decoding only; the measured runs built the model in the default."""
    from typer.testing import CliRunner

    from simtree.cli import app
    from simtree.errors import SimtreeError
    from simtree.runtime.full import measure
    seen = {}

    def fake_run(model, **kw):
        seen.update(kw)
        raise SimtreeError("stop here")
    monkeypatch.setattr(measure, "full_run", fake_run)
    r = CliRunner().invoke(app, ["run", "--model", "tiny-gdn", "--device", "cpu", "--acceptance", "gsm8k",
                                 "--dtype", "float64", "--out", str(tmp_path / "out")])
    assert str(r.exception) == "stop here" and seen["dtype"] is torch.float64
