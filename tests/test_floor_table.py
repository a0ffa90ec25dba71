"""profiler/bench/floor_table.py: the GDN and V4 floor benchmarks' outputs in one table, the
issue's columns first, each row with its run's GPU and versions; a folder without the
benchmark's files is one line."""
import json

import pandas as pd
import pytest

from simtree.errors import SimtreeError
from simtree.profiler.bench.floor_table import COLUMNS, floor_table, main


def _bench(tmp_path):
    gdn, v4 = tmp_path / "gdn", tmp_path / "v4"
    gdn.mkdir(), v4.mkdir()
    pd.DataFrame([{"kernel": "gdn_verify+commit", "layer_kind": "gdn", "batch": 16, "nodes": 4, "context": 0,
                   "measured_us": 70.0, "floor_us": 35.0, "ratio": 2.0},
                  {"kernel": "other", "layer_kind": "csa", "batch": 1, "nodes": 1, "context": 0,
                   "measured_us": 1.0, "floor_us": 1.0, "ratio": 1.0}]).to_csv(gdn / "floor.csv", index=False)
    (gdn / "floor.json").write_text(json.dumps({"env": {"gpu": "G1", "torch": "t1", "triton": "r1"},
                                                "bandwidth": {"copy_GBps": 3000.04}}))
    pd.DataFrame([{"kernel": "block_current", "layer_kind": "csa", "batch_size": 4, "nodes_per_seq": 16,
                   "context_len": 4096, "measured_us": 300.0, "floor_us": 100.0, "ratio": 3.0,
                   "tree_over_linear": 1.01}]).to_csv(v4 / "floor_v4.csv", index=False)
    (v4 / "floor_v4.json").write_text(json.dumps({"env": {"gpu": "G2", "torch_version": "t2",
                                                          "triton_version": "r2"}}))
    return gdn, v4


def test_one_table_with_the_issue_columns_first(tmp_path):
    gdn, v4 = _bench(tmp_path)
    t = floor_table(gdn, v4)
    assert list(t.columns[:len(COLUMNS)]) == COLUMNS
    assert t["kernel"].tolist() == ["gdn_verify+commit", "block_current"]   # the GDN file's own rows only
    assert t.loc[1, ["batch", "nodes", "context"]].tolist() == [4, 16, 4096]
    assert t["gpu"].tolist() == ["G1", "G2"] and t.loc[0, "bandwidth_gbs"] == 3000.0
    out = tmp_path / "floor.csv"
    assert main(["--gdn", str(gdn), "--v4", str(v4), "--out", str(out)]) == 0
    assert len(pd.read_csv(out)) == 2


def test_a_folder_without_the_benchmarks_files_is_one_line(tmp_path):
    with pytest.raises(SimtreeError, match="floor.csv and floor.json"):
        floor_table(tmp_path, None)
    with pytest.raises(SimtreeError, match="--gdn"):
        floor_table(None, None)


def test_a_gdn_run_replaces_only_the_gdn_rows_of_an_earlier_table(tmp_path):
    gdn, v4 = _bench(tmp_path)
    out = tmp_path / "floor.csv"
    assert main(["--gdn", str(gdn), "--v4", str(v4), "--out", str(out)]) == 0
    new = pd.read_csv(gdn / "floor.csv")
    new.loc[0, "measured_us"] = 60.0
    new.to_csv(gdn / "floor.csv", index=False)
    assert main(["--gdn", str(gdn), "--v4-from", str(out), "--out", str(out)]) == 0   # in place
    t = pd.read_csv(out)
    assert t["kernel"].tolist() == ["gdn_verify+commit", "block_current"]
    assert t["measured_us"].tolist() == [60.0, 300.0] and t["gpu"].tolist() == ["G1", "G2"]
    with pytest.raises(SimtreeError, match="not both"):
        floor_table(gdn, v4, out)
    with pytest.raises(SimtreeError, match="no such table"):
        floor_table(gdn, None, tmp_path / "missing.csv")


def test_an_unreadable_earlier_table_is_one_line(tmp_path):
    gdn, _ = _bench(tmp_path)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(SimtreeError, match="not a readable floor table"):
        floor_table(gdn, None, empty)


def test_gdn_from_keeps_the_earlier_gdn_rows_the_new_run_does_not_repeat(tmp_path):
    gdn, v4 = _bench(tmp_path)
    out = tmp_path / "floor.csv"
    rows = pd.read_csv(gdn / "floor.csv").assign(variant="default")
    rows.to_csv(gdn / "floor.csv", index=False)
    assert main(["--gdn", str(gdn), "--v4", str(v4), "--out", str(out)]) == 0
    old = pd.read_csv(out)
    extra = old.iloc[[0]].assign(variant="bv32", measured_us=80.0)   # a variant the next run leaves out
    pd.concat([old, extra]).to_csv(out, index=False)
    rows.loc[0, "measured_us"] = 65.0                                  # the next run repeats "default"
    rows.to_csv(gdn / "floor.csv", index=False)
    assert main(["--gdn", str(gdn), "--gdn-from", str(out), "--v4-from", str(out), "--out", str(out)]) == 0
    t = pd.read_csv(out)
    g = t[t["layer_kind"] == "gdn"]
    assert len(t) == 3 and t[t["layer_kind"] != "gdn"]["measured_us"].tolist() == [300.0]
    assert dict(zip(g["variant"], g["measured_us"])) == {"bv32": 80.0, "default": 65.0}
    only_v4 = floor_table(None, v4, gdn_from=out)                      # a V4 run keeps every earlier GDN row
    assert sorted(only_v4["kernel"]) == ["block_current", "gdn_verify+commit", "gdn_verify+commit"]


def test_the_headline_names_the_current_path_and_every_fusion():
    from simtree.reporting.summary import floor_headline
    rows = [dict(kernel=k, layer_kind=kind, batch=b, nodes=n, context=4096, measured_us=r * 10, floor_us=10.0,
                 ratio=r, tree_over_linear=tl, variant=None)
            for k, kind, b, n, r, tl in (("block_current", "csa", 16, 16, 9.8, 1.01), ("block_current", "hca", 1, 4, 3.0, 1.0),
                                         ("block_fused_all", "csa", 16, 16, 6.7, 1.02), ("block_current", "csa", 64, 16, 20.0, 1.0),
                                         ("block_fused_live", "hca", 16, 16, 3.9, 1.0))]
    text = floor_headline(pd.DataFrame(rows))
    assert "V4 layer verify (the path before the fusions) at most CSA 9.8x, HCA 3.0x" in text   # batch 64: outside
    assert "with the fusions (variant fused_all: v4_topk, v4_hc, v4_comp) at most CSA 6.7x" in text
    assert "padding rows skipped (variant fused_live) at most HCA 3.9x" in text
    assert "fused_pool" not in text and "FP8" not in text                    # not timed: no line
    fp8 = dict(kernel="block_fused_bf16", layer_kind="csa", batch=16, nodes=16, context=4096, measured_us=50.0,
               floor_us=10.0, ratio=5.0, tree_over_linear=1.0, variant=None, run=4)
    text = floor_headline(pd.DataFrame([{**r, "run": 1} for r in rows] + [fp8]))
    assert "V4 points of run 4 (column run) with the attention's linears in FP8" in text
    assert "linears in bf16 against the bf16 floor (variant fused_bf16) at most CSA 5.0x" in text


def test_gdn_from_names_a_missing_key_column_and_needs_a_new_run(tmp_path):
    gdn, v4 = _bench(tmp_path)
    out = tmp_path / "floor.csv"
    assert main(["--gdn", str(gdn), "--v4", str(v4), "--out", str(out)]) == 0
    with pytest.raises(SimtreeError, match="no variant column"):        # the GDN run's rows carry no variant
        floor_table(gdn, None, gdn_from=out)
    with pytest.raises(SimtreeError, match="give --gdn DIR or --v4 DIR"):
        floor_table(None, None, gdn_from=out)


def test_later_v4_runs_replace_the_points_they_repeat(tmp_path):
    """Several V4 runs: a later run's row replaces an earlier one's at the same point (kernel,
    kind, batch, nodes, context, tree shape), the others are kept, column run says whose."""
    _, v4 = _bench(tmp_path)
    rows = pd.read_csv(v4 / "floor_v4.csv").assign(tree_shape="random")
    first = pd.concat([rows, rows.assign(nodes_per_seq=4, measured_us=200.0),
                       rows.assign(tree_shape="chain", measured_us=290.0)])
    first.to_csv(v4 / "floor_v4.csv", index=False)
    later = tmp_path / "v4b"
    later.mkdir()
    rows.assign(measured_us=250.0, ratio=2.5).to_csv(later / "floor_v4.csv", index=False)
    (later / "floor_v4.json").write_text((v4 / "floor_v4.json").read_text())
    t = floor_table(None, [v4, later]).sort_values(["nodes", "tree_shape"])
    assert t[["nodes", "tree_shape", "measured_us", "run"]].values.tolist() == [
        [4, "random", 200.0, 1], [16, "chain", 290.0, 1], [16, "random", 250.0, 2]]
    out = tmp_path / "floor.csv"
    assert main(["--v4", str(v4), "--v4", str(later), "--out", str(out)]) == 0 and len(pd.read_csv(out)) == 3
