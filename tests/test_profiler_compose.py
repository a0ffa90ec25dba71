import numpy as np
import pandas as pd
import pytest

from simtree.costs import profile_table as pt
from simtree.models import get_model
from simtree.profiler.compose import compose_rows, compose_table, validate_stacks

MODEL = "tiny-gdn"   # layers: 2 gdn + 2 attn


def _row(stage, b, n, l, shape, us, variant="torch"):
    return {"stage": stage, "model": MODEL, "device": "cpu", "dtype": "fp32", "variant": variant,
            "batch_size": b, "nodes_per_seq": n, "total_tokens": b * n, "context_len": l,
            "tree_shape": shape, "num_steps": 0, "topk": 0, "latency_us_median": us,
            "latency_us_p10": us * 0.9, "latency_us_p90": us * 1.1, "repeats": 7}


def _parts(rng):
    """Random part latencies as functions of (b, n, l) so the expected sum is known."""
    c = rng.uniform(1, 10, size=6)
    return {"lm_head_step": lambda b, n, l: c[0] * b * n, "mlp_step": lambda b, n, l: c[1] * b * n + 3,
            "gdn_proj_step": lambda b, n, l: c[2] * b * n, "attn_proj_step": lambda b, n, l: c[3] * b * n,
            "gdn_tree_verify": lambda b, n, l: c[4] * b * n + 1,
            "attn_tree_verify": lambda b, n, l: c[5] * b * (n + l / 100)}


def _table(rng, ls=(100, 300)):
    f, rows = _parts(rng), []
    for b in (1, 2):
        for n in (1, 4):
            for s in ("lm_head_step", "mlp_step", "gdn_proj_step", "attn_proj_step"):
                rows.append(_row(s, b, n, 0, "any", f[s](b, n, 0)))
            rows.append(_row("gdn_tree_verify", b, n, 4096, "eagle", f["gdn_tree_verify"](b, n, 0), "torch_ref"))
            for l in ls:
                rows.append(_row("attn_tree_verify", b, n, l, "eagle", f["attn_tree_verify"](b, n, l), "torch_sdpa"))
    return pd.DataFrame(rows), f


def _expected(f, b, n, l):
    per_gdn = f["gdn_tree_verify"](b, n, l) + f["gdn_proj_step"](b, n, l) + f["mlp_step"](b, n, l)
    per_attn = f["attn_tree_verify"](b, n, l) + f["attn_proj_step"](b, n, l) + f["mlp_step"](b, n, l)
    return f["lm_head_step"](b, n, l) + 2 * per_gdn + 2 * per_attn


def test_composed_step_is_the_layer_weighted_sum():
    df, f = _table(np.random.default_rng(0))
    rows = compose_rows(df, MODEL)
    assert len(rows) == 2 * 2 * 2   # (b, n) x measured context lengths
    for r in rows:
        want = _expected(f, r["batch_size"], r["nodes_per_seq"], r["context_len"])
        assert r["latency_us_median"] == pytest.approx(want)
        assert r["latency_us_p10"] <= r["latency_us_median"] <= r["latency_us_p90"]


def test_context_is_interpolated_between_measured_lengths():
    df, f = _table(np.random.default_rng(1))
    rows = compose_rows(df, MODEL, contexts=[200])
    for r in rows:   # attention is linear in l here, so interpolation is exact
        assert r["latency_us_median"] == pytest.approx(_expected(f, r["batch_size"], r["nodes_per_seq"], 200))


def test_a_context_past_a_cores_measured_lengths_is_not_composed():
    """Where one (b, n) had its core timed at fewer contexts (a coarser grid at long contexts),
    no row is made there from the nearest measured length's value."""
    df, f = _table(np.random.default_rng(2))
    extra = [_row("attn_tree_verify", b, 4, 900, "eagle", f["attn_tree_verify"](b, 4, 900), "torch_sdpa") for b in (1, 2)]
    rows = compose_rows(pd.concat([df, pd.DataFrame(extra)], ignore_index=True), MODEL)
    at = {(r["nodes_per_seq"], r["context_len"]) for r in rows}
    assert (4, 900) in at and (1, 900) not in at and {(1, 100), (1, 300), (4, 100), (4, 300)} <= at


def test_missing_part_leaves_no_composed_row():
    df, _ = _table(np.random.default_rng(2))
    df = df[~((df.stage == "mlp_step") & (df.batch_size == 2))]
    rows = compose_rows(df, MODEL)
    assert {r["batch_size"] for r in rows} == {1}


def test_compose_table_is_idempotent_and_validates_stacks(tmp_path):
    rng = np.random.default_rng(3)
    df, f = _table(rng)
    stack = get_model(MODEL).stack(4)
    assert sorted(stack) == ["attn", "attn", "gdn", "gdn"]
    measured = _expected(f, 2, 4, 300) * 1.1
    extra = [_row("stack_verify_step", 2, 4, 300, "eagle", measured, "stack4")]
    path = tmp_path / "p.csv"
    pt.append_rows(path, df.to_dict("records") + extra)
    first = compose_table(path, stack_layers=4)
    second = compose_table(path, stack_layers=4)
    table = pt.load_profile(path)
    assert first["composed_rows"] == second["composed_rows"] == 8
    assert (table.stage == "model_verify_step").sum() == 8       # replaced, not duplicated
    val = second["stack_validation"][f"{MODEL}/stack4"]
    assert val["points"][0]["rel_err"] == pytest.approx(1 / 1.1 - 1, abs=1e-3)
    assert validate_stacks(table)[f"{MODEL}/stack4"]["median_abs_rel_err"] == pytest.approx(0.0909, abs=1e-3)


def test_round_extras_commit_per_gdn_layer_and_metadata_once_where_measured():
    rng = np.random.default_rng(12)
    df, f = _table(rng)
    commit = {(b, n): float(rng.uniform(1, 50)) for b in (1, 2) for n in (1, 4)}
    meta = {(b, n): float(rng.uniform(1, 50)) for b in (1, 2) for n in (1, 4)}
    extra = [_row("gdn_tree_commit", b, n, 0, "eagle", us, "torch_ref") for (b, n), us in commit.items()]
    extra += [_row("gdn_round_meta", b, n, 0, "eagle", us) for (b, n), us in meta.items()]
    full = pd.concat([df, pd.DataFrame(extra)], ignore_index=True)
    rows = compose_rows(full, MODEL)
    assert len(rows) == 8
    for r in rows:   # tiny-gdn: two gdn layers commit once each; the metadata is built once
        b, n = r["batch_size"], r["nodes_per_seq"]   # (not at n = 1: plain decoding, no tree)
        assert r["latency_us_median"] == pytest.approx(
            _expected(f, b, n, r["context_len"]) + 2 * commit[b, n] + (meta[b, n] if n > 1 else 0))
    # the metadata replayed from a CUDA graph is preferred to the eager issue of the same ops
    graph = {key: us / 10 for key, us in meta.items()}
    both = pd.concat([full, pd.DataFrame([_row("gdn_round_meta", b, n, 0, "eagle", us, "torch_graph")
                                          for (b, n), us in graph.items()])], ignore_index=True)
    for r in compose_rows(both, MODEL):
        b, n = r["batch_size"], r["nodes_per_seq"]
        assert r["latency_us_median"] == pytest.approx(
            _expected(f, b, n, r["context_len"]) + 2 * commit[b, n] + (graph[b, n] if n > 1 else 0))
    # without the extras (what a measured verify-only stack is compared with): the old sum
    for r in compose_rows(full, MODEL, round_extras=False):
        assert r["latency_us_median"] == pytest.approx(
            _expected(f, r["batch_size"], r["nodes_per_seq"], r["context_len"]))
    # a table with extra rows composes only the points they were measured at
    for stage in ("gdn_tree_commit", "gdn_round_meta"):
        partial = full[~((full.stage == stage) & (full.batch_size == 2))]
        kept = {(r["batch_size"], r["nodes_per_seq"]) for r in compose_rows(partial, MODEL)}
        assert kept == ({(1, 1), (1, 4), (2, 1)} if stage == "gdn_round_meta" else {(1, 1), (1, 4)})


def test_plain_decoding_takes_the_fused_decode_step_where_measured():
    # n = 1: a GDN decode step (state read and written once) replaces each GDN layer's verify
    # core and commit; n > 1 is unchanged; without decode rows n = 1 keeps verify + commit
    rng = np.random.default_rng(13)
    df, f = _table(rng)
    commit = {(b, n): float(rng.uniform(1, 50)) for b in (1, 2) for n in (1, 4)}
    meta = {(b, n): float(rng.uniform(1, 50)) for b in (1, 2) for n in (1, 4)}
    decode = {b: float(rng.uniform(1, 50)) for b in (1, 2)}
    extra = [_row("gdn_tree_commit", b, n, 0, "eagle", us, "torch_ref") for (b, n), us in commit.items()]
    extra += [_row("gdn_round_meta", b, n, 0, "eagle", us) for (b, n), us in meta.items()]
    with_commit = pd.concat([df, pd.DataFrame(extra)], ignore_index=True)
    full = pd.concat([with_commit, pd.DataFrame([_row("gdn_decode_step", b, 1, 0, "eagle", us, "torch_ref")
                                                 for b, us in decode.items()])], ignore_index=True)
    rows = compose_rows(full, MODEL)
    assert len(rows) == 8
    for r in rows:
        b, n, l = r["batch_size"], r["nodes_per_seq"], r["context_len"]
        if n == 1:
            want = _expected(f, b, n, l) + 2 * (decode[b] - f["gdn_tree_verify"](b, n, l))
        else:
            want = _expected(f, b, n, l) + 2 * commit[b, n] + meta[b, n]
        assert r["latency_us_median"] == pytest.approx(want)
    old = {(r["batch_size"], r["nodes_per_seq"], r["context_len"]): r["latency_us_median"]
           for r in compose_rows(with_commit, MODEL)}
    for r in rows:
        key = (r["batch_size"], r["nodes_per_seq"], r["context_len"])
        if key[1] > 1:
            assert r["latency_us_median"] == pytest.approx(old[key])
        else:
            assert old[key] == pytest.approx(r["latency_us_median"] + 2 * (
                commit[key[:2]] + f["gdn_tree_verify"](*key) - decode[key[0]]))
    # a decode step missing at a batch size leaves that n = 1 point out
    partial = full[~((full.stage == "gdn_decode_step") & (full.batch_size == 2))]
    assert {(r["batch_size"], r["nodes_per_seq"]) for r in compose_rows(partial, MODEL)} == {(1, 1), (1, 4), (2, 4)}
