"""The profile table: one tidy CSV row per measured (stage, shape, implementation) point.

Schema (contract 1; other modules code against these names):

    column             type   meaning
    stage              str    gdn_tree_verify, v4_csa_verify, v4_hca_verify, v4_swa_verify,
                              attn_tree_verify, mlp_step, layer_verify_step,
                              model_verify_step, draft_step (free-form others allowed)
    model              str    model shape name (e.g. qwen3.6-27b, deepseek-v4-flash)
    device             str    GPU name or "cpu"
    dtype              str    e.g. bf16
    variant            str    implementation: triton_tree, recurrent_baseline, fla_chunk,
                              fla_recurrent, flashmla, torch_ref, composed, ...
    batch_size         int    sequences in the batch (>= 1)
    nodes_per_seq      int    tree nodes verified per sequence, n (>= 1)
    total_tokens       int    tokens in the step over the whole batch (usually b * n)
    context_len        int    committed context length per sequence, l (>= 0)
    tree_shape         str    linear, eagle, random, chain, ...
    num_steps          int    draft steps s (0 where not applicable)
    topk               int    draft top-k (0 where not applicable)
    latency_us_median  float  > 0
    latency_us_p10     float  > 0, <= median
    latency_us_p90     float  >= median
    repeats            int    timed repetitions behind the percentiles (>= 1)
    torch_version      str
    triton_version     str    (may be empty where triton is absent)
    timestamp          str    ISO-8601 time of the measurement

Two deployment columns follow (DEPLOYMENT_COLUMNS; a table written before they existed reads
with their defaults):

    deployment         str    the deployment whose rank was timed: "tp=1" (one GPU, the whole
                              model), "tp=2", "ep=8" (simtree.deploy); a row without one takes
                              its model's deployment in the table (a table holds one per model),
                              else "tp=1"
    message_bytes      int    message size of a collective's row (stages comm_*), else 0

A point is identified by KEY_COLUMNS; a table never holds two rows with the same key.
A sidecar ``<stem>.meta.json`` beside ``<stem>.csv`` holds the GPU name, driver, versions,
clocks and sweep id (see :func:`meta_path`, :func:`write_meta`, :func:`read_meta`).

Writers go through :func:`append_rows` (atomic: the whole table is rewritten to a temp file
in the same folder and moved over the old one with ``os.replace``), so an interrupted sweep
leaves either the old or the new table, never half a row; one writer per table at a time.
"""
from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from simtree.parallel import DEFAULT_DEPLOYMENT, parse_deployment
from simtree.errors import SimtreeError
from simtree.fileio import file_sha256, read_json, write_atomic, write_text_atomic

__all__ = [
    "PROFILE_COLUMNS", "KEY_COLUMNS", "INT_COLUMNS", "FLOAT_COLUMNS", "STR_COLUMNS", "DEPLOYMENT_COLUMNS",
    "TABLE_COLUMNS",
    "load_profile", "validate_profile", "append_rows", "measured_keys",
    "row_key", "meta_path", "write_meta", "read_meta", "profile_hash",
]

PROFILE_COLUMNS: tuple[str, ...] = (
    "stage", "model", "device", "dtype", "variant", "batch_size", "nodes_per_seq",
    "total_tokens", "context_len", "tree_shape", "num_steps", "topk", "latency_us_median",
    "latency_us_p10", "latency_us_p90", "repeats", "torch_version", "triton_version",
    "timestamp",
)
DEPLOYMENT_COLUMNS: tuple[str, ...] = ("deployment", "message_bytes")
TABLE_COLUMNS = PROFILE_COLUMNS + DEPLOYMENT_COLUMNS   # what a table holds, in this order
KEY_COLUMNS: tuple[str, ...] = (
    "stage", "model", "device", "dtype", "variant", "batch_size", "nodes_per_seq",
    "context_len", "tree_shape", "num_steps", "topk", "deployment", "message_bytes",
)
INT_COLUMNS = ("batch_size", "nodes_per_seq", "total_tokens", "context_len", "num_steps",
               "topk", "repeats")
FLOAT_COLUMNS = ("latency_us_median", "latency_us_p10", "latency_us_p90")
STR_COLUMNS = tuple(c for c in PROFILE_COLUMNS if c not in INT_COLUMNS + FLOAT_COLUMNS)
# String columns that may be empty (metadata); every other string column must be non-empty.
_OPTIONAL_STR = ("torch_version", "triton_version")
MIN_INT = {"batch_size": 1, "nodes_per_seq": 1, "total_tokens": 1, "context_len": 0,
            "num_steps": 0, "topk": 0, "repeats": 1, "message_bytes": 0}
_KEY_DEFAULTS = {"num_steps": 0, "topk": 0, "deployment": DEFAULT_DEPLOYMENT, "message_bytes": 0}
_MAX_INT = 2**53   # exact in float64, far inside int64 (larger values would wrap)


def _where(path, line: int | None = None) -> str:
    name = Path(path).name if path is not None else "profile"
    return f"{name} line {line}" if line is not None else name


def _show(v) -> str:
    """A cell value as the user wrote it (numpy scalars as plain Python numbers)."""
    return repr(v.item() if isinstance(v, np.generic) else v)


def validate_profile(df: pd.DataFrame, path: str | os.PathLike | None = None,
                     allow_empty: bool = False) -> pd.DataFrame:
    """Check a raw table against the schema and return it with typed columns.

    Rows are reported by their CSV line (header = line 1, first data row = line 2).
    Raises SimtreeError (one line) on: missing columns, empty/NaN cells, non-integer or
    out-of-range integers, latencies <= 0 or percentiles out of order, duplicate keys; and
    on a table without rows unless ``allow_empty`` (a sweep's table whose points were all
    dropped to be measured again).
    """
    missing = [c for c in PROFILE_COLUMNS if c not in df.columns]
    if missing:
        raise SimtreeError(f"{_where(path)}: missing column(s) {', '.join(missing)}")
    if len(df) == 0 and not allow_empty:
        raise SimtreeError(f"{_where(path)}: the table has no rows")
    out = df.loc[:, list(PROFILE_COLUMNS)].copy().reset_index(drop=True)
    line = lambda i: int(i) + 2  # noqa: E731 - CSV line of data row i
    out["deployment"] = _deployments(df, out, path, line)
    mb = df["message_bytes"].reset_index(drop=True) if "message_bytes" in df.columns else pd.Series(0, index=out.index)
    out["message_bytes"] = mb.where(~(mb.isna() | (mb.astype(str).str.strip() == "")), 0)

    for col in STR_COLUMNS:
        values = out[col]
        bad = values.isna() if col in _OPTIONAL_STR else (values.isna() | (values.astype(str).str.strip() == ""))
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise SimtreeError(f"{_where(path, line(i))} column {col}: empty value")
        out[col] = values.astype(str).str.strip()

    for col in INT_COLUMNS + ("message_bytes",) + FLOAT_COLUMNS:
        num = pd.to_numeric(out[col], errors="coerce").astype(float)
        bad = ~np.isfinite(num.to_numpy())
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SimtreeError(f"{_where(path, line(i))} column {col}: "
                               f"not a finite number ({_show(df[col].iloc[i])})")
        if col in INT_COLUMNS or col == "message_bytes":
            arr = num.to_numpy()
            frac = arr != np.round(arr)
            out_of_range = (arr < MIN_INT[col]) | (arr > _MAX_INT)
            if frac.any() or out_of_range.any():
                i = int(np.flatnonzero(frac | out_of_range)[0])
                raise SimtreeError(f"{_where(path, line(i))} column {col}: must be an integer "
                                   f"in [{MIN_INT[col]}, 2^53], got {_show(df[col].iloc[i])}")
            out[col] = arr.astype(np.int64)
        else:
            arr = num.to_numpy()
            if (arr <= 0).any():
                i = int(np.flatnonzero(arr <= 0)[0])
                raise SimtreeError(f"{_where(path, line(i))} column {col}: latency must be > 0, "
                                   f"got {_show(arr[i])}")
            out[col] = arr

    med, p10, p90 = (out[c].to_numpy() for c in FLOAT_COLUMNS)
    # Percentiles of one sample are ordered; a tiny slack tolerates CSV rounding.
    for bad, col in ((p10 > med * (1 + 1e-9), "latency_us_p10"),
                     (med > p90 * (1 + 1e-9), "latency_us_p90")):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SimtreeError(f"{_where(path, line(i))} column {col}: percentiles out of order "
                               f"(p10 {p10[i]:g}, median {med[i]:g}, p90 {p90[i]:g})")

    dup = out.duplicated(list(KEY_COLUMNS), keep=False)
    if dup.any():
        rows = np.flatnonzero(dup.to_numpy())
        first = rows[0]
        key = tuple(out.loc[first, list(KEY_COLUMNS)])
        twin = next(r for r in rows[1:] if tuple(out.loc[r, list(KEY_COLUMNS)]) == key)
        raise SimtreeError(f"{_where(path, line(first))}: duplicate key with line {line(twin)} "
                           f"({', '.join(f'{k}={v}' for k, v in zip(KEY_COLUMNS, key))})")
    extra = [c for c in df.columns if c not in TABLE_COLUMNS]
    for c in extra:  # unknown columns are kept (free-form annotations), after the schema
        out[c] = df[c].to_numpy()
    return out


def _deployments(df: pd.DataFrame, out: pd.DataFrame, path, line) -> pd.Series:
    """The deployment column, canonical ("tp=2", "ep=8"); a blank cell takes its model's one
    deployment in the table (rows a writer added without the column, e.g. composed ones), else
    the default: one GPU."""
    if "deployment" not in df.columns:
        return pd.Series(DEFAULT_DEPLOYMENT, index=out.index, dtype=object)
    raw = df["deployment"].reset_index(drop=True)
    blank = raw.isna() | (raw.astype(str).str.strip() == "")
    names = pd.Series(DEFAULT_DEPLOYMENT, index=out.index, dtype=object)
    given = raw[~blank].astype(str)
    canonical = {}
    for text in given.unique():   # a table holds a handful of distinct deployments
        try:
            canonical[text] = parse_deployment(text).name
        except SimtreeError as exc:
            i = int(given.index[given == text][0])
            raise SimtreeError(f"{_where(path, line(i))} column deployment: {exc}") from None
    names[~blank] = given.map(canonical)
    if blank.any():
        models = out["model"].astype(str)
        for model in models[blank].unique():
            known = set(names[~blank & (models == model)])
            if len(known) == 1:
                names[blank & (models == model)] = known.pop()
    return names


def _read_raw(path: Path) -> pd.DataFrame:
    try:
        # Everything as text first so that validation, not pandas, decides what is a number.
        return pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[])
    except FileNotFoundError:
        raise SimtreeError(f"profile table not found: {path}") from None
    except IsADirectoryError:
        raise SimtreeError(f"profile table expected, got a folder: {path}") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SimtreeError(f"{path.name}: not a readable CSV ({first})") from None


def load_profile(path: str | os.PathLike, allow_empty: bool = False) -> pd.DataFrame:
    """Read and validate a profile table; columns in PROFILE_COLUMNS order, typed.

    Raises SimtreeError with one line naming the line and column of the first problem.
    """
    path = Path(path)
    raw = _read_raw(path)
    # Text columns: blank cells stay ""; numeric columns: blank means missing (NaN).
    for col in INT_COLUMNS + FLOAT_COLUMNS + ("message_bytes",):
        if col in raw.columns:
            raw[col] = raw[col].replace({"": np.nan, "nan": np.nan, "NaN": np.nan})
    for col in STR_COLUMNS:
        if col in raw.columns and col not in _OPTIONAL_STR:
            raw[col] = raw[col].replace({"nan": "", "NaN": ""})
    return validate_profile(raw, path, allow_empty)


def row_key(row: dict) -> tuple:
    """The key tuple of one row (KEY_COLUMNS order; ints as int, strings stripped)."""
    out = []
    for c in KEY_COLUMNS:
        v = row.get(c, _KEY_DEFAULTS.get(c))
        if v is None:
            raise SimtreeError(f"row is missing key column {c}")
        if c == "deployment":
            v = parse_deployment(str(v)).name
        out.append(int(v) if c in INT_COLUMNS or c == "message_bytes" else str(v).strip())
    return tuple(out)


def _row_keys(df: pd.DataFrame) -> list[tuple]:
    """Each row's key (:func:`row_key`)."""
    return [row_key(dict(zip(KEY_COLUMNS, r)))
            for r in df.loc[:, list(KEY_COLUMNS)].itertuples(index=False, name=None)]


def measured_keys(path: str | os.PathLike) -> set[tuple]:
    """Keys (as :func:`row_key` builds them) already in the table; empty if it does not exist."""
    path = Path(path)
    if not path.exists():
        return set()
    return set(_row_keys(load_profile(path, allow_empty=True)))


def drop_rows(path: str | os.PathLike, keys: set[tuple]) -> int:
    """Remove the rows with these keys from the table (atomic rewrite) so that a sweep measures
    them again; returns how many were removed (0 and no write if none, or no table)."""
    path = Path(path)
    if not path.exists():
        return 0
    df = load_profile(path, allow_empty=True)
    keep = [k not in keys for k in _row_keys(df)]
    dropped = len(df) - sum(keep)
    if dropped:
        write_table(path, df[keep].reset_index(drop=True))
    return dropped


def _versions() -> tuple[str, str]:
    """Installed torch/triton versions without importing them (importing torch takes seconds)."""
    import sys
    from importlib import metadata

    out = []
    for name in ("torch", "triton"):
        module = sys.modules.get(name)
        try:
            out.append(str(module.__version__) if module is not None else metadata.version(name))
        except (metadata.PackageNotFoundError, AttributeError):
            out.append("")
    return out[0], out[1]


def _complete(row: dict, versions: tuple[str, str], now: str) -> dict:
    unknown = [k for k in row if k not in TABLE_COLUMNS]
    if unknown:
        raise SimtreeError(f"append_rows: unknown column(s) {', '.join(unknown)}")
    r = dict(row)
    r.setdefault("num_steps", 0)
    r.setdefault("topk", 0)
    if "total_tokens" not in r and "batch_size" in r and "nodes_per_seq" in r:
        r["total_tokens"] = int(r["batch_size"]) * int(r["nodes_per_seq"])
    r.setdefault("torch_version", versions[0])
    r.setdefault("triton_version", versions[1])
    r.setdefault("timestamp", now)
    r.setdefault("message_bytes", 0)
    if "deployment" in r:
        r["deployment"] = parse_deployment(str(r["deployment"])).name
    missing = [c for c in PROFILE_COLUMNS if c not in r]
    if missing:
        raise SimtreeError(f"append_rows: row is missing column(s) {', '.join(missing)}")
    for c in FLOAT_COLUMNS:
        v = r[c]
        if v is None or not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(float(v)):
            raise SimtreeError(f"append_rows: column {c} must be a finite number, got {v!r}")
    return r


def write_table(path: str | os.PathLike, df: pd.DataFrame) -> None:
    """Write ``df`` as CSV atomically: temp file in the same folder, fsync, os.replace.

    An interrupted write leaves the previous file intact (a sweep never loses measured rows).
    """
    write_atomic(path, lambda tmp: df.to_csv(tmp, index=False, float_format="%.7g"))


def append_rows(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Append measured rows to the table at ``path`` atomically (creates it if absent).

    Each row is a dict over PROFILE_COLUMNS; ``num_steps``/``topk`` default to 0,
    ``total_tokens`` to batch_size * nodes_per_seq, versions to the installed torch/triton,
    ``timestamp`` to now (UTC), ``message_bytes`` to 0 and ``deployment`` to the model's one in
    the table, else one GPU. The merged table is validated (a duplicate key, NaN or
    latency <= 0 raises SimtreeError and leaves the file untouched), written to a temp file
    in the same folder and moved into place with os.replace. Returns the new row count.
    """
    path = Path(path)
    rows = list(rows)
    versions = _versions()
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    new = pd.DataFrame([_complete(r, versions, now) for r in rows], columns=list(TABLE_COLUMNS))
    if path.exists():
        old = load_profile(path, allow_empty=True)
        merged = pd.concat([old, new], ignore_index=True)
    else:
        merged = new
    if len(merged) == 0:
        raise SimtreeError(f"append_rows: nothing to write to {path.name}")
    merged = validate_profile(merged, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_table(path, merged)
    return len(merged)


SIDE_FILES = ("meta.json", "compose.json", "points.jsonl")   # a sweep's files beside its table


def side_path(path: str | os.PathLike, kind: str) -> Path:
    """A file beside a table: ``reports/x/profile.csv``, "compose.json" ->
    ``reports/x/profile.compose.json`` (one of SIDE_FILES)."""
    path = Path(path)
    return path.with_name(f"{path.stem if path.suffix == '.csv' else path.name}.{kind}")


def meta_path(path: str | os.PathLike) -> Path:
    """Sidecar of a table: ``reports/x/profile.csv`` -> ``reports/x/profile.meta.json``."""
    return side_path(path, "meta.json")


def write_meta(path: str | os.PathLike, meta: dict) -> Path:
    """Write the sidecar (GPU name, driver, versions, clocks, sweep id...) atomically."""
    target = meta_path(path)
    write_text_atomic(target, json.dumps(meta, indent=2, sort_keys=True, default=str))
    return target


def read_meta(path: str | os.PathLike) -> dict:
    """The sidecar's dict, or {} if there is none (also accepts ``profile.csv.meta.json``)."""
    for candidate in (meta_path(path), Path(str(path) + ".meta.json")):
        if candidate.exists():
            meta = read_json(candidate, "profile metadata")
            if not isinstance(meta, dict):
                raise SimtreeError(f"{candidate.name}: profile metadata must be a JSON object")
            return meta
    return {}


def profile_hash(path: str | os.PathLike) -> str:
    """sha256 of the table file's bytes (the 'source profile hash' stored with a fit)."""
    return "sha256:" + file_sha256(path)
