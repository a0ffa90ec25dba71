"""bench_gdn --resume: a cut run is finished without timing its finished shapes again."""
from __future__ import annotations

import json
import sys

import pandas as pd
import pytest

from simtree.profiler.bench import bench_gdn

ARGS = ["--tiny", "--device", "cpu", "--max-copies", "1", "--replays", "1", "--skip-correctness",
        "--tree-configs", "", "--commit-configs", ""]


def _run(monkeypatch, out, *extra):
    monkeypatch.setattr(sys, "argv", ["bench_gdn", "--out", str(out), *ARGS, *extra])
    bench_gdn.main()
    return pd.read_csv(out / "bench_gdn.csv")


def test_resume_keeps_finished_shapes_and_times_the_rest(tmp_path, monkeypatch):
    first = _run(monkeypatch, tmp_path, "--bs", "1", "--ns", "4,8")
    assert set(first.status) == {"ok"}
    # the run was cut inside (1, 8): one of its variants never got its turn
    cut = first.copy()
    row = cut.index[(cut.nodes_per_seq == 8) & (cut.variant == "triton_commit")][0]
    cut.loc[row, ["status", "latency_us_median"]] = ["skipped: --max-seconds", float("nan")]
    cut.to_csv(tmp_path / "bench_gdn.csv", index=False)
    out = _run(monkeypatch, tmp_path, "--bs", "1,2", "--ns", "4,8", "--resume")
    assert set(out.status) == {"ok"}
    assert sorted({(b, n) for b, n in zip(out.batch_size, out.nodes_per_seq)}) == \
        [(1, 4), (1, 8), (2, 4), (2, 8)]
    key = ["variant", "batch_size", "nodes_per_seq"]
    kept = first[first.nodes_per_seq == 4].set_index(key).latency_us_median
    again = out.set_index(key).latency_us_median
    assert (again.loc[kept.index] == kept).all()           # (1, 4) kept as measured
    assert again.loc[("triton_commit", 1, 8)] > 0          # (1, 8) timed again, whole
    assert len(out) == len(out.drop_duplicates(key))


def test_resume_refuses_another_machine_or_nothing(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="no bench_gdn.csv"):
        _run(monkeypatch, tmp_path, "--bs", "1", "--ns", "4", "--resume")
    _run(monkeypatch, tmp_path, "--bs", "1", "--ns", "4")
    meta = json.loads((tmp_path / "bench_gdn.json").read_text())
    meta["env"]["gpu"] = "another GPU"
    (tmp_path / "bench_gdn.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match="was measured with"):
        _run(monkeypatch, tmp_path, "--bs", "1", "--ns", "4", "--resume")


@pytest.mark.parametrize("resume", [False, True])
def test_fla_recurrent_results_survive_a_resume_only(tmp_path, resume):
    # the child processes append one line per shape ("started", then the result); a resumed
    # run keeps the results and drops the cut run's started-only line (not a crash)
    import time
    from types import SimpleNamespace
    lines = [dict(b=1, n=4, status="started"), dict(b=1, n=4, status="ok", median=3.0, p10=2.9,
                                                    p90=3.1, repeats=5),
             dict(b=1, n=8, status="started")]
    path = tmp_path / "fla_recurrent.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = SimpleNamespace(out=str(tmp_path), resume=resume, deadline=time.time())   # no child
    rows = bench_gdn.fla_recurrent_all(args, [(1, 4), (1, 8)], lambda msg: None)
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    if resume:
        assert [(r["batch_size"], r["nodes_per_seq"], r["latency_us_median"]) for r in rows] == \
            [(1, 4, 3.0)]
        assert kept == [lines[1]]
    else:
        assert rows == [] and kept == []


def test_tree_rows_record_the_launch_that_ran(tmp_path, monkeypatch):
    # a tree row's cfg_ columns: the launch asked for, with the switches the launch took in
    # their place (GDNTreeCache.launch) - e.g. the Triton walk where the CUDA one cannot run
    from types import SimpleNamespace
    asked = dict(block_v=128, cuda_walk=2, kside_cuda=2, l2_prefetch=19)
    ran = SimpleNamespace(launch=dict(cuda_walk=0, kside_cuda=0, l2_prefetch=0))
    assert bench_gdn.launch_columns(asked, lambda: (None, ran)) == dict(
        cfg_block_v=128, cfg_cuda_walk=0, cfg_kside_cuda=0, cfg_l2_prefetch=0)
    # end to end on the CPU: the rows carry what the verify reported
    out = _run(monkeypatch, tmp_path, "--bs", "2", "--ns", "8")
    tree = out[out.variant == "triton_tree"].iloc[0]
    assert tree.cfg_cuda_walk == 0 and tree.cfg_kside_cuda == 0 and tree.cfg_l2_prefetch == 0
    assert tree.cfg_block_v > 0 and "cfg_transposed" in out


def test_retime_times_chosen_finished_shapes_again(tmp_path, monkeypatch):
    # --resume --retime 1:8: (1, 4) kept as measured, (1, 8) timed again (here by a timer
    # that answers 123 us), one row per variant; --retime without --resume is refused
    first = _run(monkeypatch, tmp_path, "--bs", "1", "--ns", "4,8")
    monkeypatch.setattr(bench_gdn, "graph_time_us", lambda fns, **k: dict(
        median=123.0, p10=123.0, p90=123.0, repeats=1, timer="cpu_wall"))
    out = _run(monkeypatch, tmp_path, "--bs", "1", "--ns", "4,8", "--resume", "--retime", "1:8")
    key = ["variant", "batch_size", "nodes_per_seq"]
    assert len(out) == len(out.drop_duplicates(key)) == len(first)
    again = out.set_index(key).latency_us_median
    kept = first[first.nodes_per_seq == 4].set_index(key).latency_us_median
    assert (again.loc[kept.index] == kept).all()
    timed = out[(out.nodes_per_seq == 8) & out.variant.str.startswith("triton_")]
    assert len(timed) and (timed.latency_us_median == 123.0).all()
    with pytest.raises(SystemExit, match="needs --resume"):
        _run(monkeypatch, tmp_path / "x", "--bs", "1", "--ns", "4", "--retime", "1:4")
    with pytest.raises(SystemExit, match="B:N pairs"):
        bench_gdn.parse_shapes("16x128")
