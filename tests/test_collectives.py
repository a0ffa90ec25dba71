"""The collectives profile stage on CPU: gloo over 2-4 processes, small messages, rank 0 writing
resumable rows; simtree fit turns them into a measured alpha-beta model that plans use."""
import json

import pytest
from typer.testing import CliRunner

from simtree.cli import app
from simtree.costs import profile_table as pt
from simtree.costs.comm import load_comm
from simtree.errors import SimtreeError
from simtree.profiler import sweep as sw
from simtree.profiler.collectives import collective_points

SWEEP = """
name: coll
device: cpu
max_minutes: 2
models: [tiny-v4]
stages:
  - stage: collectives
    ops: [all_reduce, all_to_all, all_gather]
    group_sizes: {groups}
    world_size: {world}
    message_bytes: [1024, 65536]
    repeats: 3
compose: false
"""


def _sweep(tmp_path, groups, world):
    path = tmp_path / "coll.yaml"
    path.write_text(SWEEP.format(groups=groups, world=world))
    return path


def test_points_cover_the_grid_and_the_models_layer_sizes_rounded_to_whole_elements():
    entry = {"ops": ["all_reduce", "all_to_all"], "message_bytes": [1000, 4096], "tokens": [3]}
    pts = collective_points(entry, ["deepseek-v4-flash"], [2, 8], elem_bytes=2)
    assert ("all_reduce", 2, 1000) in pts and ("all_reduce", 8, 1008) in pts   # 8 ranks x 2-byte elements
    assert ("all_reduce", 2, 3 * 4096 * 2) in pts and ("all_to_all", 8, 3 * 6 * 4096 * 2) in pts
    assert all(s % (g * 2) == 0 for _, g, s in pts) and len(pts) == len(set(pts))


def test_bad_entries_are_one_line_errors(tmp_path):
    for text, fragment in (("ops: [broadcast]", "ops must list collectives"), ("group_sizes: [0]", "integers >= 1"),
                           ("message_bytes: {min: 8, max: 4, factor: 2}", "max >= min"), ("colour: red", "unknown key")):
        path = tmp_path / "bad.yaml"
        path.write_text(f"name: b\ndevice: cpu\nmodels: [tiny-v4]\nstages:\n  - stage: collectives\n    {text}\n")
        with pytest.raises(SimtreeError, match=fragment):
            sw.load_sweep(path)


@pytest.mark.slow
def test_gloo_processes_time_each_point_once_and_the_fit_uses_them(tmp_path):
    out = tmp_path / "comm.csv"
    spec = _sweep(tmp_path, "[2, 4]", 4)
    res = sw.run_sweep(spec, out, progress=False, echo=lambda s: None)
    df = pt.load_profile(out)
    assert res.measured == len(df) == 3 * 2 * 2
    assert set(df["deployment"]) == {"tp=2", "tp=4", "ep=2", "ep=4"} and set(df["variant"]) == {"gloo"}
    assert set(df.loc[df["stage"] == "comm_all_to_all", "deployment"]) == {"ep=2", "ep=4"}
    assert (df["latency_us_p10"] <= df["latency_us_median"]).all() and set(df["repeats"]) == {3}
    again = sw.run_sweep(spec, out, progress=False, echo=lambda s: None)   # resumable: nothing left to time
    assert again.measured == 0 and again.skipped_done == len(df) and len(pt.load_profile(out)) == len(df)
    res = CliRunner().invoke(app, ["fit", str(out), "--json"])
    assert res.exit_code == 0, res.output
    model = load_comm(tmp_path / "comm.comm.json")
    assert model.measured and set(model.collectives) == {"all_reduce", "all_to_all", "all_gather"}
    assert set(model.collectives["all_reduce"]) == {2, 4} and json.loads(res.stdout)["measured"] is True
    assert model.source["sha256"] == pt.profile_hash(out)


@pytest.mark.slow
def test_a_one_rank_dry_run_writes_rows_the_fit_leaves_out(tmp_path):
    out = tmp_path / "dry.csv"
    sw.run_sweep(_sweep(tmp_path, "[1]", 1), out, progress=False, echo=lambda s: None)
    df = pt.load_profile(out)
    assert len(df) == 6 and set(df["deployment"]) == {"tp=1"}
    res = CliRunner().invoke(app, ["fit", str(out)])
    assert "groups of one rank only" in str(res.exception)


def test_groups_larger_than_the_processes_are_skipped_and_said(tmp_path):
    lines = []
    res = sw.run_sweep(_sweep(tmp_path, "[8]", 2), tmp_path / "none.csv", progress=False, echo=lines.append)
    assert res.measured == 0 and any("group of 8 skipped" in x for x in lines)
