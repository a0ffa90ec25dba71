"""tune_gdn / bench_gdn helpers that turn benchmark CSVs into the committed summaries."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from simtree.profiler.bench.bench_gdn import _COMMIT_KEYS, commit_name, config_name, parse_configs
from simtree.profiler.bench.tune_gdn import commit_summary, summarize


def test_config_letters_round_trip_for_verify_and_commit():
    for text in ("t32v64w4q1", "o0", "t16v128w4r168p1q1"):
        assert [config_name(c) for c in parse_configs(text)] == [text]
    cfgs = parse_configs("p1v64,p0t64w2", _COMMIT_KEYS, "commit")
    assert cfgs == [dict(path=1, block_v=64), dict(path=0, block_t=64, num_warps=2)]
    assert [commit_name(c) for c in cfgs] == ["triton_commit_p1v64", "triton_commit_p0t64w2"]
    with pytest.raises(SystemExit, match="bad commit config 'q1'"):
        parse_configs("q1", _COMMIT_KEYS, "commit")


def _rows(rng, variants, shapes):
    return pd.DataFrame([dict(variant=v, batch_size=b, nodes_per_seq=n, status="ok",
                              latency_us_median=float(rng.uniform(1, 500)), gpu="G")
                         for v in variants for b, n in shapes])


def test_commit_summary_tabulates_every_commit_variant_and_nothing_else(tmp_path):
    rng = np.random.default_rng(5)
    shapes = [(1, 16), (64, 128)]
    df = _rows(rng, ["triton_commit", "triton_commit_p0", "triton_tree", "round_meta"], shapes)
    df.loc[len(df)] = dict(variant="triton_commit_p1", batch_size=1, nodes_per_seq=16,
                           status="error: boom", latency_us_median=np.nan, gpu="G")
    df.to_csv(tmp_path / "bench_gdn.csv", index=False)
    text = commit_summary(str(tmp_path / "bench_gdn.csv"))
    header = next(line for line in text.splitlines() if line.startswith("| batch_size"))
    assert header == "| batch_size | nodes_per_seq | triton_commit | triton_commit_p0 |"
    for r in df[df.variant.str.startswith("triton_commit") & (df.status == "ok")].itertuples():
        row = next(line for line in text.splitlines()
                   if line.startswith(f"| {r.batch_size} | {r.nodes_per_seq} |"))
        assert f"{r.latency_us_median:.1f}" in row


def test_sweep_summary_picks_the_fastest_config_per_shape(tmp_path):
    rng = np.random.default_rng(6)
    df = _rows(rng, ["t16v128w4", "t32v64w8"], [(1, 128), (16, 32)]).rename(columns={"variant": "config"})
    df.to_csv(tmp_path / "tune_gdn.csv", index=False)
    fastest = summarize(str(tmp_path / "tune_gdn.csv")).splitlines()[-1]
    want = df.loc[df.groupby(["nodes_per_seq", "batch_size"]).latency_us_median.idxmin()]
    want = want.sort_values(["nodes_per_seq", "batch_size"]).config.tolist()
    assert fastest == "| " + " | ".join(want) + " |"


def test_renumber_cost_times_every_shape_and_profile_from_rewrites_the_rows(tmp_path, monkeypatch,
                                                                          capsys):
    # tune_gdn --renumber-cost: one row per (n, b) with a positive host time, written as CSV;
    # bench_gdn --profile-from: profile_gdn.csv rebuilt from a run's bench_gdn.csv / .json
    import json
    import sys

    from simtree.costs import profile_table as pt
    from simtree.profiler.bench import bench_gdn, tune_gdn
    out = tmp_path / "renumber.csv"
    rng = np.random.default_rng(6)
    bench = _rows(rng, ["triton_tree", "triton_tree_bfs"], [(1, 40), (3, 40)])
    bench.to_csv(tmp_path / "saving.csv", index=False)
    monkeypatch.setattr(sys, "argv", ["tune_gdn", "--renumber-cost", str(out), "--bs", "1,3",
                                      "--ns", "5,40", "--saving-from", str(tmp_path / "saving.csv")])
    tune_gdn.main()
    df = pd.read_csv(out)
    assert sorted(zip(df.nodes_per_seq, df.batch_size)) == [(5, 1), (5, 3), (40, 1), (40, 3)]
    assert (df.renumber_us_median > 0).all() and "nodes_per_seq" in capsys.readouterr().out
    us = bench.set_index(["variant", "batch_size"]).latency_us_median
    for r in df[df.nodes_per_seq == 40].itertuples():   # 48 GDN layers x (bfs - dfs), where measured
        want = 48 * (us["triton_tree_bfs", r.batch_size] - us["triton_tree", r.batch_size])
        assert r.kernel_saving_us_per_round == pytest.approx(want, abs=0.06)
        assert r.pays == (want > r.renumber_us_median)
    assert df[df.nodes_per_seq == 5].kernel_saving_us_per_round.isna().all()
    rows = _rows(rng, ["triton_tree", "round_meta", "triton_tree_bfs", "memory_floor"], [(1, 8), (4, 8)])
    rows = rows.assign(total_tokens=rows.batch_size * 8, tree_shape="eagle", num_steps=3, topk=4,
                       latency_us_p10=1.0, latency_us_p90=999.0, repeats=20, H=16)
    rows.to_csv(tmp_path / "bench_gdn.csv", index=False)
    (tmp_path / "bench_gdn.json").write_text(json.dumps(
        {"env": dict(gpu="G", torch="t", triton="tr", timestamp="now")}))
    monkeypatch.setattr(sys, "argv", ["bench_gdn", "--profile-from", str(tmp_path)])
    bench_gdn.main()
    table = pt.load_profile(tmp_path / "profile_gdn.csv")
    assert sorted(set(zip(table.stage, table.variant))) == [("gdn_round_meta", "torch_graph"),
                                                            ("gdn_tree_verify", "triton_tree")]
    assert set(table.model) == {"qwen3.6-27b"} and len(table) == 4


def test_kside_correctness_cases_launch_the_kside_kernel(monkeypatch):
    # the GPU correctness cases meant for the K-side launches must get them under the rule
    # (a rule change must not turn them into repeats of the small cases), the 16-sequence one
    # with the K-side register cap, the 64-sequence one walking breadth-first trees heavy-first
    from simtree.kernels.gdn import _launch as gdn_launch
    from simtree.kernels.gdn._launch import verify_launch_config
    from simtree.profiler.bench.bench_gdn import KSIDE_CASES
    monkeypatch.setattr(gdn_launch, "sm_count", lambda device: 132)   # the H200 the cases were set for
    for b, n in KSIDE_CASES:
        for depth_first in (False, True):
            assert verify_launch_config(b, 48, 128, "cuda", n, depth_first, 16).kside == 1
    assert verify_launch_config(16, 48, 128, "cuda", 128, True, 16).kside_registers == 128
    assert any(verify_launch_config(b, 48, 128, "cuda", n, False, 16).heavy_first
               for b, n in KSIDE_CASES)


def test_configs_not_applicable_at_a_case_are_timed_where_checked():
    # a switch the launch at a correctness case cannot take (the transposed walk without the
    # K-side kernel) is recorded as not applicable there, not as a failure; a config is timed
    # only if it was correct wherever it launched and checked at one case at least
    from simtree.profiler.bench.bench_gdn import TINY
    from simtree.profiler.bench.tune_gdn import checked_configs, correctness
    configs = [dict(transposed=1), dict(kside=1, transposed=1), dict(block_t=16)]
    corr = correctness(configs, TINY, "cpu", 0)
    by = {(r["config"], r["case"]): r for r in corr}
    assert {by["x1", case]["ok"] for case in ("b2_n128_bf16", "b3_n23_bf16")} == {None}
    assert "not applicable" in by["x1", "b2_n128_bf16"]["error"]
    assert by["k1x1", "b2_n128_bf16"]["ok"] and by["t16", "b3_n23_bf16"]["ok"]
    assert checked_configs(configs, corr) == configs[1:]
    corr.append(dict(config="t16", case="extra", ok=False))
    assert checked_configs(configs, corr) == configs[1:2]


def test_heads_option_and_gpu_cases_in_both_dtypes(monkeypatch, tmp_path):
    # --heads sets the key / value heads of the sweep (Qwen3-Next: 16, 32), bad pairs are
    # one-line errors; on a GPU the K-side cases are checked in bf16 and fp32 (fp32 at the
    # rule's exact-fp32 launch: eight warps, untransposed), and at Qwen3-Next's heads those
    # cases still launch the K-side kernel in bf16, one of them the transposed walk
    from simtree.kernels.gdn import _launch as gdn_launch
    from simtree.kernels.gdn._launch import verify_launch_config
    from simtree.profiler.bench.bench_gdn import KSIDE_CASES
    from simtree.profiler.bench.tune_gdn import correctness_cases, parse_heads
    assert parse_heads("16,32") == dict(H=16, HV=32)
    for bad in ("16", "16,x", "16,40", "0,4", "8,4"):
        with pytest.raises(SystemExit, match="--heads"):
            parse_heads(bad)
    # --model takes the heads and dims from the model files
    from simtree.profiler.bench.gdn_util import QWEN36, model_dims
    assert model_dims("qwen3-next-80b") == dict(H=16, HV=32, K=128, V=128)
    assert QWEN36 == model_dims("qwen3.6-27b") == dict(H=16, HV=48, K=128, V=128)
    from simtree.errors import SimtreeError
    with pytest.raises(SimtreeError, match="no GDN layers"):
        model_dims("deepseek-v4-flash")
    import sys

    from simtree.profiler.bench import tune_gdn
    for argv, msg in ((["--model", "nosuch"], "--model: unknown model 'nosuch'"),
                      (["--model", "qwen3-next-80b", "--heads", "16,32"], "give one")):
        monkeypatch.setattr(sys, "argv", ["tune_gdn", "--out", str(tmp_path), *argv])
        with pytest.raises(SystemExit, match=msg):
            tune_gdn.main()
    cpu, gpu = correctness_cases(False), correctness_cases(True)
    assert {c[2][2] for c in cpu} == {"bf16"} and not {(b, n) for b, n, _ in cpu} & set(KSIDE_CASES)
    assert sorted((b, n, d[2]) for b, n, d in gpu if (b, n) in KSIDE_CASES) == sorted(
        (b, n, s) for b, n in KSIDE_CASES for s in ("bf16", "fp32"))
    monkeypatch.setattr(gdn_launch, "sm_count", lambda device: 132)
    cfgs = [verify_launch_config(b, 32, 128, "cuda", n, True, 16) for b, n in KSIDE_CASES]
    assert all(c.kside == 1 for c in cfgs) and any(c.transposed for c in cfgs)
    fp32 = [verify_launch_config(b, 48, 128, "cuda", n, True, 16, ieee=True) for b, n in KSIDE_CASES]
    assert all(c.kside == 1 and c.num_warps == 8 and not c.transposed for c in fp32)


def test_summary_of_several_calls_refuses_a_shape_timed_twice(tmp_path):
    # several calls' CSVs make one table; the same shape in two calls is refused (a config
    # name such as q1, the rule, may have meant different launches in each)
    row = dict(config="q1", status="ok", latency_us_median=1.0, gpu="g")
    for name, shapes in (("a", [(8, 96), (8, 128)]), ("b", [(12, 96)]), ("c", [(8, 128)])):
        pd.DataFrame([dict(row, batch_size=b, nodes_per_seq=n, latency_us_median=b + n / 1000)
                      for b, n in shapes]).to_csv(tmp_path / f"{name}.csv", index=False)
    out = summarize(str(tmp_path / "a.csv"), str(tmp_path / "b.csv"))
    assert "| q1 | 8.1 | 12.1 | 8.1 |" in out
    with pytest.raises(SystemExit, match="both time"):
        summarize(str(tmp_path / "a.csv"), str(tmp_path / "c.csv"))


def test_several_tree_sets_give_the_median_and_each_configs_range(tmp_path):
    # tune_gdn --seed 1,2,3: every shape timed on each tree set (seed column); the summary's
    # table holds the median over the sets, then each config's min-max
    from simtree.profiler.bench.tune_gdn import parse_seeds
    assert parse_seeds("1,2,3") == [1, 2, 3] and parse_seeds(0) == [0]
    for bad in ("1,x", "2,2"):
        with pytest.raises(SystemExit, match="--seed"):
            parse_seeds(bad)
    rng = np.random.default_rng(8)
    lat = {(c, s): float(rng.uniform(50, 90)) for c in ("a2f2", "a2f19") for s in (1, 2, 3)}
    pd.DataFrame([dict(config=c, seed=s, batch_size=16, nodes_per_seq=128, status="ok",
                       latency_us_median=v, gpu="g") for (c, s), v in lat.items()]).to_csv(
        tmp_path / "t.csv", index=False)
    out = summarize(str(tmp_path / "t.csv"))
    for c in ("a2f2", "a2f19"):
        v = [lat[c, s] for s in (1, 2, 3)]
        assert f"| {c} | {np.median(v):.1f} |" in out
        assert f"| {c} | {min(v):.1f}-{max(v):.1f} |" in out
    assert "min-max over 3 tree sets (seeds 1, 2, 3)" in out
