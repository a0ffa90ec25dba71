"""report_gdn: the generated GDN benchmark report, targets classified from the ratios."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from simtree.profiler.bench import report_gdn


def _bench(rng, shapes, variants):
    rows = [dict(batch_size=b, nodes_per_seq=n, variant=v, status="ok",
                 latency_us_median=float(rng.uniform(1, 100)))
            for b, n in shapes for v in variants]
    rows.append(dict(batch_size=shapes[0][0], nodes_per_seq=shapes[0][1], variant="triton_tree",
                     status="error: boom", latency_us_median=np.nan))   # not an ok row: ignored
    return pd.DataFrame(rows)


def test_targets_follow_the_ratios(tmp_path):
    rng = np.random.default_rng(3)
    shapes = [(b, n) for b in (1, 16, 64) for n in (8, 128)]
    bench = _bench(rng, shapes, ["triton_tree", "recurrent_baseline", "fla_chunk", "memory_floor"])
    bench.to_csv(tmp_path / "bench_gdn.csv", index=False)
    (tmp_path / "bench_gdn.json").write_text(json.dumps({"env": {"gpu": "G"}, "correctness": [
        dict(case="b1_n8", variant="triton_tree", rel_err=1e-3, tol=2e-2, ok=True),
        dict(case="b1_n8", variant="triton_tree_x1", rel_err=float("nan"), tol=2e-2, ok=None),
        dict(case="b1_n8", variant="triton_tree_k0", rel_err=5e-2, tol=2e-2, ok=False)]}))
    text = report_gdn.write_report(tmp_path).read_text()
    # a launch the case cannot take is "n/a", a failed check FAIL, a passed one its error
    assert "| b1_n8 | 1.0e-03 [0.02] | 5.0e-02 [0.02] FAIL | n/a |" in text
    assert (tmp_path / "gdn_verify.png").stat().st_size > 0
    ok = bench[bench.status == "ok"].pivot_table(index=["batch_size", "nodes_per_seq"],
                                                 columns="variant", values="latency_us_median")
    lines = {line.split(":")[0]: line for line in text.splitlines() if line.startswith("- ")}
    for (b, n), r in ok.iterrows():
        checks = [("- baseline/tree >= 10 at n = 128", n == 128,
                   r.recurrent_baseline / r.triton_tree, r.recurrent_baseline / r.triton_tree >= 10),
                  ("- tree/best_fla <= 2 at every shape", True, r.triton_tree / r.fla_chunk,
                   r.triton_tree / r.fla_chunk <= 2),
                  ("- tree/floor <= 3 at batch >= 16", b >= 16, r.triton_tree / r.memory_floor,
                   r.triton_tree / r.memory_floor <= 3)]
        for key, applies, value, met in checks:
            line = lines[key]
            shape = f"b{b} n{n}: {value:.2f}"
            if not applies:
                assert f"b{b} n{n}:" not in line
            elif "MET everywhere" in line:
                assert met
            else:
                missed, _, met_part = line.partition("; met at ")
                assert (shape in met_part) if met else (shape in missed), (key, shape, line)


def test_missing_column_is_reported_not_guessed(tmp_path):
    rng = np.random.default_rng(4)
    bench = _bench(rng, [(16, 32), (1, 128)], ["triton_tree", "recurrent_baseline", "fla_chunk"])
    bench.to_csv(tmp_path / "bench_gdn.csv", index=False)
    (tmp_path / "bench_gdn.json").write_text("{}")
    text = report_gdn.write_report(tmp_path).read_text()
    assert "- tree/floor <= 3 at batch >= 16: not measured (this run has no `tree/floor` ratio)" in text
    # the other two targets are still classified from the columns that are there
    assert "- baseline/tree >= 10 at n = 128: M" in text
    assert "- tree/best_fla <= 2 at every shape: M" in text


def test_benchmark_rows_become_profile_rows_of_their_own_stage(tmp_path):
    # bench_gdn's profile_gdn.csv: each measured variant lands in its profile stage (the round
    # metadata as gdn_round_meta / torch_graph, the commit as gdn_tree_commit); tuning variants,
    # the floor and failed rows stay out
    from simtree.costs import profile_table as pt
    from simtree.profiler.bench.bench_gdn import PROFILE_STAGES, write_profile_rows
    rng = np.random.default_rng(4)
    variants = list(PROFILE_STAGES) + ["triton_tree_bfs", "triton_commit_p0", "memory_floor"]
    rows = [dict(variant=v, batch_size=b, nodes_per_seq=8, total_tokens=8 * b, tree_shape="eagle",
                 num_steps=3, topk=4, status="ok", latency_us_median=float(rng.uniform(5, 50)),
                 latency_us_p10=1.0, latency_us_p90=60.0, repeats=20) for v in variants for b in (1, 4)]
    rows.append(dict(rows[0], status="error: boom"))
    env = dict(gpu="G", torch="t", triton="tr", timestamp="now")
    table = pt.load_profile(write_profile_rows(str(tmp_path), rows, env))
    got = sorted(set(zip(table.stage, table.variant)))
    assert got == sorted(set(PROFILE_STAGES.values()))
    assert len(table) == 2 * len(PROFILE_STAGES)
    meta = table[table.stage == "gdn_round_meta"].sort_values("batch_size").latency_us_median.tolist()
    assert meta == pytest.approx([r["latency_us_median"] for r in rows if r["variant"] == "round_meta"],
                                 rel=1e-5)
