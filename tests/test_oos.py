"""Throughput out of sample: the GPU-side run on a tiny model on the CPU, and the home-side table."""
import csv
from pathlib import Path

import pytest

from simtree.data import data_path
from simtree.errors import SimtreeError
from simtree.reporting.summary import plan_points
from simtree.runtime.full import oos

BUNDLE = data_path("costs", "h200_qwen3.6-27b_tp1.json")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("oos")
    rc = oos.run("tiny-gdn", str(BUNDLE), out, contexts=(32,), batch_sizes=(2,), device="cpu",
                 max_seconds=120, min_draws=2, rounds=2)
    assert rc == 0
    return out


def test_report_rows_name_the_frozen_bundle(run_dir, tmp_path):
    stats = oos.report([run_dir], tmp_path, {oos.sha256(BUNDLE): str(BUNDLE)})
    rows = list(csv.DictReader(open(tmp_path / "throughput_out_of_sample.csv")))
    assert len(rows) == 2 + len(oos.POLICIES) == stats["runs"]
    assert list(rows[0])[:9] == list(oos.COLUMNS)[:9]
    assert {r["bundle_sha256"] for r in rows} == {oos.sha256(BUNDLE)}
    # context 32 is off the bundle's profile grid (256, 1024, 4096)
    assert {r["on_profile_grid"] for r in rows} == {"False"}
    assert stats["points"] == 1 and stats["min_policies"] == len(rows)
    assert (tmp_path / "summary.md").read_text().count("| tiny-gdn |") == 2
    assert (tmp_path / "predicted_vs_measured.png").stat().st_size > 0


def test_a_failing_report_leaves_the_previous_one_intact(run_dir, tmp_path, monkeypatch):
    bundles = {oos.sha256(BUNDLE): str(BUNDLE)}
    oos.report([run_dir], tmp_path, bundles)
    names = ("throughput_out_of_sample.csv", "summary.md", "predicted_vs_measured.png")
    before = {n: (tmp_path / n).read_bytes() for n in names}

    def fail(table):
        raise RuntimeError("plot failed")
    monkeypatch.setattr(oos, "_plot_png", fail)
    (tmp_path / "throughput_out_of_sample.csv").write_bytes(b"older table\n")   # an earlier report's
    before["throughput_out_of_sample.csv"] = b"older table\n"
    with pytest.raises(RuntimeError):
        oos.report([run_dir], tmp_path, bundles)
    assert {n: (tmp_path / n).read_bytes() for n in names} == before


def test_plan_check_counts_a_choice_within_two_percent():
    rows = [{"model": "m", "batch_size": 1, "context_len": 1, "policy": p, "measured_tok_s": m, "predicted_tok_s": q}
            for p, m, q in (("a", 100.0, 90.0), ("b", 98.5, 95.0), ("c", 80.0, 70.0))]
    (check,) = plan_points(rows)
    assert check["chosen"] == "b" and check["best"] == "a" and check["ok"]
    rows[1]["measured_tok_s"] = 97.0
    assert not plan_points(rows)[0]["ok"]


def test_report_refuses_a_folder_without_runs(tmp_path):
    with pytest.raises(SimtreeError, match="no meta.json"):
        oos.report([tmp_path], tmp_path / "out")


def test_a_later_folder_fills_an_earlier_ones_misses():
    def row(policy, tok_s):
        return {"model": "m", "batch_size": 2, "context_len": 4096, "policy": policy, "measured_tok_s": tok_s}
    first = [row("linear_d4", 10.0), row("eagle", 20.0)]
    missed = [{"model": "m", "batch_size": 2, "context_len": 4096, "policy": p, "why": "skipped"}
              for p in ("block", "tfm")]
    later = [row("linear_d4", 11.0), row("block", 30.0)]
    other = [row("linear_d4", 12.0) | {"deployment": "tp=2"}]       # another deployment: another run
    rows, still, replaced = oos._latest(first + later + other, missed)
    assert sorted((r["policy"], r["measured_tok_s"]) for r in rows) == [
        ("block", 30.0), ("eagle", 20.0), ("linear_d4", 11.0), ("linear_d4", 12.0)]
    assert [m["policy"] for m in still] == ["tfm"]
    assert [(r["policy"], r["measured_tok_s"], r["later_tok_s"]) for r in replaced] == [("linear_d4", 10.0, 11.0)]


def test_a_rank_run_alone_is_labelled_the_rank():
    """A V4 ep=8 rank runs b sequences on its own (the all-to-all not run): its rows say "ep=8 rank",
    the label policy files use, where a one-GPU deployment keeps its name; the summary's words
    say what the rank left out."""
    from simtree.planning.policy_file import deployment_label, rank_collectives
    assert oos._deployment_label("ep=8") == "ep=8 rank" == deployment_label("ep=8 rank")
    assert oos._deployment_label("tp=1") == "tp=1"
    assert rank_collectives("ep=8 rank") == "all-to-all" and rank_collectives("tp=2 rank") == "all-reduce"
    assert rank_collectives("ep=8") is None
    table = Path(__file__).resolve().parents[1] / "reports" / "validation" / "throughput_out_of_sample.csv"
    rows = list(csv.DictReader(open(table)))
    assert {r["deployment"] for r in rows if r["model"] == "deepseek-v4-flash"} == {"ep=8 rank"}


VALIDATION = Path(__file__).resolve().parents[1] / "reports" / "validation"


@pytest.mark.parametrize("bundle", sorted(VALIDATION.glob("frozen_*.json")), ids=lambda p: p.stem)
def test_each_frozen_bundle_finds_the_profile_it_was_fitted_on(bundle):
    """The committed report command works from the tree: each frozen bundle's fitted profile (by the
    sha256 it records) is shipped or committed beside it, even after the shipped one gained rows."""
    grid = oos._grid(bundle)
    assert grid["verify"]["batch_size"] and grid["draft"]["num_steps"]


def test_a_bundle_finds_its_profile_by_sha256_among_those_given(tmp_path):
    """A bundle whose recorded profile has changed or is gone: refused in one line, unless the
    profile of its sha256 is given (--profile) or lies beside it."""
    import json
    shipped = data_path("profiles", "h200", "profile_qwen3.6-27b_tp1.csv")
    lines = shipped.read_text().splitlines(keepends=True)
    fitted = tmp_path / "elsewhere" / "fitted.csv"
    fitted.parent.mkdir()
    fitted.write_text("".join(lines[:-1]))     # the table as it was, one row short of the shipped one
    frozen = json.loads(BUNDLE.read_text())
    for part in ("verify", "draft"):
        frozen[part]["info"]["source"]["sha256"] = "sha256:" + oos.sha256(fitted)
    bundle = tmp_path / "bundles" / "frozen.json"
    bundle.parent.mkdir()
    bundle.write_text(json.dumps(frozen))
    with pytest.raises(SimtreeError, match="is not the one it was fitted on"):
        oos._grid(bundle)
    assert oos._grid(bundle, [fitted]) == oos._grid(bundle, [shipped, fitted])
    (bundle.parent / "frozen.profile.csv").write_text(fitted.read_text())
    assert oos._grid(bundle) == oos._grid(bundle, [fitted])
    assert oos.main(["report", str(tmp_path), "--bundle", str(bundle), "--profile", str(tmp_path / "no.csv")]) == 2
