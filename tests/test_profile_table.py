"""Profile table: schema, validation with one-line errors naming line and column, atomic append."""
import numpy as np
import pandas as pd
import pytest

from simtree.errors import SimtreeError
from simtree.costs.profile_table import (KEY_COLUMNS, PROFILE_COLUMNS, append_rows, load_profile,
                                   measured_keys, read_meta, row_key, write_meta)


def random_rows(rng, count=12, stage="gdn_tree_verify"):
    rows = []
    for i in range(count):
        med = float(rng.uniform(5, 5000))
        rows.append(dict(stage=stage, model="qwen3.6-27b", device="NVIDIA H200", dtype="bf16",
                         variant="triton_tree", batch_size=int(rng.choice([1, 4, 16, 64])),
                         nodes_per_seq=i + 1, context_len=int(rng.choice([4096, 32768])),
                         tree_shape="eagle", latency_us_median=med, latency_us_p10=med * 0.9,
                         latency_us_p90=med * 1.2, repeats=50))
    return rows


def write_csv(path, rows):
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def one_line_error(path, match):
    with pytest.raises(SimtreeError, match=match) as info:
        load_profile(path)
    assert "\n" not in str(info.value)


def test_append_then_load_round_trips_typed_rows(tmp_path):
    rng = np.random.default_rng(0)
    rows = random_rows(rng)
    path = tmp_path / "sub" / "profile.csv"
    append_rows(path, rows[:5])
    assert append_rows(path, rows[5:]) == len(rows)
    df = load_profile(path)
    assert tuple(df.columns) == PROFILE_COLUMNS + ("deployment", "message_bytes")
    assert (df["deployment"] == "tp=1").all() and (df["message_bytes"] == 0).all()
    assert df["batch_size"].dtype == np.int64 and df["latency_us_median"].dtype == np.float64
    assert np.allclose(df["latency_us_median"], [r["latency_us_median"] for r in rows], rtol=1e-6)
    assert (df["total_tokens"] == df["batch_size"] * df["nodes_per_seq"]).all()
    assert (df["num_steps"] == 0).all() and (df["topk"] == 0).all()


def test_measured_keys_lets_a_sweep_resume(tmp_path):
    rng = np.random.default_rng(1)
    rows = random_rows(rng)
    path = tmp_path / "profile.csv"
    assert measured_keys(path) == set()
    append_rows(path, rows[:7])
    done = measured_keys(path)
    assert all(len(k) == len(KEY_COLUMNS) for k in done)
    assert [row_key(r) in done for r in rows] == [True] * 7 + [False] * 5


def test_failed_append_leaves_file_untouched(tmp_path):
    rng = np.random.default_rng(2)
    rows = random_rows(rng)
    path = tmp_path / "profile.csv"
    append_rows(path, rows)
    before = path.read_bytes()
    with pytest.raises(SimtreeError, match="duplicate key"):
        append_rows(path, [rows[3]])
    with pytest.raises(SimtreeError, match="latency_us_median"):
        append_rows(path, [{**rows[0], "nodes_per_seq": 99, "latency_us_median": float("nan")}])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.csv"]   # no temp files left


def test_missing_column_is_named(tmp_path):
    rows = random_rows(np.random.default_rng(3))
    df = pd.DataFrame([{**r, "total_tokens": 1, "num_steps": 0, "topk": 0, "torch_version": "2.11",
                        "triton_version": "3.6", "timestamp": "t"} for r in rows])
    path = tmp_path / "p.csv"
    df.drop(columns=["context_len"]).to_csv(path, index=False)
    one_line_error(path, r"missing column\(s\) context_len")


@pytest.mark.parametrize("column, value, match", [
    ("latency_us_median", "", "line 4 column latency_us_median: not a finite number"),
    ("latency_us_median", "nan", "line 4 column latency_us_median: not a finite number"),
    ("latency_us_p10", "0", "line 4 column latency_us_p10: latency must be > 0"),
    ("latency_us_p90", "-3", "line 4 column latency_us_p90: latency must be > 0"),
    ("batch_size", "2.5", r"line 4 column batch_size: must be an integer in \[1, 2\^53\], got '2.5'"),
    # beyond int64: would wrap to a huge negative number if cast unchecked
    ("context_len", "99999999999999999999999", "line 4 column context_len: must be an integer in"),
    ("batch_size", "18446744073709551617", "line 4 column batch_size: must be an integer in"),
    ("device", "", "line 4 column device: empty value"),
])
def test_bad_cell_names_line_and_column(tmp_path, column, value, match):
    path = tmp_path / "profile.csv"
    append_rows(path, random_rows(np.random.default_rng(4)))
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    df.loc[2, column] = value
    df.to_csv(path, index=False)
    one_line_error(path, match)


def test_duplicate_key_names_both_lines(tmp_path):
    path = tmp_path / "profile.csv"
    append_rows(path, random_rows(np.random.default_rng(5)))
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    df = pd.concat([df, df.iloc[[1]]], ignore_index=True)
    df.to_csv(path, index=False)
    one_line_error(path, "line 3: duplicate key with line 14")


def test_percentiles_out_of_order_are_rejected(tmp_path):
    rows = random_rows(np.random.default_rng(6), count=3)
    rows[1]["latency_us_p10"] = rows[1]["latency_us_median"] * 2
    with pytest.raises(SimtreeError, match="line 3 column latency_us_p10: percentiles out of order"):
        append_rows(tmp_path / "p.csv", rows)


def test_unknown_column_in_append_is_rejected(tmp_path):
    rows = random_rows(np.random.default_rng(7), count=2)
    rows[0]["latency_ms"] = 1.0
    with pytest.raises(SimtreeError, match="unknown column"):
        append_rows(tmp_path / "p.csv", rows)


def test_meta_sidecar_round_trips(tmp_path):
    path = tmp_path / "profile.csv"
    meta = {"gpu": "NVIDIA H200", "driver": "580", "sweep": "default", "clocks": {"sm": 1980}}
    assert write_meta(path, meta).name == "profile.meta.json"
    assert read_meta(path) == meta
    assert read_meta(tmp_path / "other.csv") == {}


def test_header_only_table_is_empty_for_a_sweep_but_not_for_a_fit(tmp_path):
    path = tmp_path / "profile.csv"
    append_rows(path, random_rows(np.random.default_rng(5)))
    pd.read_csv(path).iloc[0:0].to_csv(path, index=False)
    assert measured_keys(path) == set()
    one_line_error(path, "the table has no rows")
    assert append_rows(path, random_rows(np.random.default_rng(6), count=2)) == 2


@pytest.mark.parametrize("content, match", [("[1, 2]", "must be a JSON object"),
                                            (b"\xff\xfe\x00", "not a text file")])
def test_bad_sidecar_is_one_line_error(tmp_path, content, match):
    path = tmp_path / "profile.csv"
    side = tmp_path / "profile.meta.json"
    side.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SimtreeError, match=match):
        read_meta(path)


def test_folder_as_table_is_one_line_error(tmp_path):
    (tmp_path / "t.csv").mkdir()
    one_line_error(tmp_path / "t.csv", "profile table expected, got a folder")
