"""One table of the verify steps against their memory floor: the GDN floor benchmark's rows
(``gdn_floor.py``: floor.csv + floor.json) and the V4 layer's (``v4_floor.py``: floor_v4.csv +
floor_v4.json), in the columns kernel, layer_kind, batch, nodes, context, measured_us,
floor_us, ratio, then the V4 rows' extras (tree_over_linear, compute_floor_us, ...) and each
run's GPU and versions.

    python -m simtree.profiler.bench.floor_table --gdn DIR --v4 DIR --out reports/h100/floor.csv
    python -m simtree.profiler.bench.floor_table --gdn DIR --v4-from reports/h100/floor.csv --out reports/h100/floor.csv

``--v4-from TABLE`` keeps an earlier table's V4 rows as they are (a GDN run that replaces only the
GDN rows; each row keeps its own GPU and versions).  ``--gdn-from TABLE`` keeps an earlier table's
GDN rows where the new GDN run has no row of the same (kernel, variant, batch, nodes): a run of a
few variants adds to the table instead of replacing every GDN row; without --gdn it keeps them all
(a V4 run that replaces only the V4 rows).
    python -m simtree.profiler.bench.floor_table --gdn DIR --gdn-from T --v4-from T --out T
    python -m simtree.profiler.bench.floor_table --v4 DIR --gdn-from T --out T
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic

COLUMNS = ["kernel", "layer_kind", "batch", "nodes", "context", "measured_us", "floor_us", "ratio"]
V4_KEY = ["kernel", "layer_kind", "batch", "nodes", "context", "tree_shape"]   # a V4 row's point
V4_NAMES = {"batch_size": "batch", "nodes_per_seq": "nodes", "context_len": "context"}


def _read(folder: Path, table: str, meta: str) -> tuple[pd.DataFrame, dict]:
    csv, js = folder / table, folder / meta
    if not csv.is_file() or not js.is_file():
        raise SimtreeError(f"{folder}: needs {table} and {meta} (the benchmark's output folder)")
    return pd.read_csv(csv), json.loads(js.read_text())["env"]


def _keyed(df: pd.DataFrame, what: str) -> pd.DataFrame:
    missing = [c for c in GDN_KEY if c not in df.columns]
    if missing:
        raise SimtreeError(f"{what}: no {', '.join(missing)} column (--gdn-from matches rows on {', '.join(GDN_KEY)})")
    return df


def _earlier(path: Path, flag: str) -> pd.DataFrame:
    if not Path(path).is_file():
        raise SimtreeError(f"{path}: no such table ({flag})")
    try:
        old = pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise SimtreeError(f"{path}: not a readable floor table ({type(exc).__name__})") from None
    if "layer_kind" not in old.columns:
        raise SimtreeError(f"{path}: not a floor table (no layer_kind column)")
    return old


GDN_KEY = ["kernel", "variant", "batch", "nodes"]


def _v4_runs(folders) -> pd.DataFrame:
    """The V4 rows of every run folder, in order, column ``run`` its 1-based place: a later run's
    row replaces an earlier one's at the same point (``V4_KEY``)."""
    runs = []
    for i, folder in enumerate(folders, 1):
        df, env = _read(Path(folder), "floor_v4.csv", "floor_v4.json")
        runs.append(df.rename(columns=V4_NAMES).assign(gpu=env["gpu"], torch=env["torch_version"],
                                                       triton=env["triton_version"], run=i))
    out = pd.concat(runs, ignore_index=True)
    key = out.reindex(columns=V4_KEY).astype(str)
    return out[~key.duplicated(keep="last")].reset_index(drop=True)


def floor_table(gdn: Path | None, v4, v4_from: Path | None = None,
                gdn_from: Path | None = None) -> pd.DataFrame:
    """``v4``: one V4 run folder or several (a later one's rows replace an earlier one's at the
    same point, the ``run`` column saying which)."""
    parts = []
    v4 = [v4] if isinstance(v4, (str, Path)) else list(v4 or [])
    if v4 and v4_from is not None:
        raise SimtreeError("give --v4 DIR or --v4-from TABLE, not both")
    if gdn is not None:
        df, env = _read(Path(gdn), "floor.csv", "floor.json")
        bw = json.loads((Path(gdn) / "floor.json").read_text())["bandwidth"]["copy_GBps"]
        parts.append(df[df["layer_kind"] == "gdn"].assign(gpu=env["gpu"], torch=env["torch"], triton=env["triton"],
                                                          bandwidth_gbs=round(float(bw), 1)))
    if v4:
        parts.append(_v4_runs(v4))
    if gdn_from is not None:
        if gdn is None and not v4:
            raise SimtreeError("--gdn-from TABLE keeps an earlier table's GDN rows beside a new run: give --gdn DIR "
                               "or --v4 DIR")
        old = _keyed(_earlier(gdn_from, "--gdn-from"), str(gdn_from))
        old = old[old["layer_kind"] == "gdn"]
        if gdn is not None:
            _keyed(parts[0], str(gdn))
        new = set(map(tuple, parts[0][GDN_KEY].astype(str).values)) if gdn is not None else set()
        parts.insert(0, old[[tuple(r) not in new for r in old[GDN_KEY].astype(str).values]])
    if v4_from is not None:
        old = _earlier(v4_from, "--v4-from")
        parts.append(old[old["layer_kind"] != "gdn"])
    if not parts:
        raise SimtreeError("give --gdn DIR and / or --v4 DIR (or --v4-from TABLE)")
    out = pd.concat(parts, ignore_index=True)
    return out[COLUMNS + [c for c in out.columns if c not in COLUMNS]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gdn", type=Path)
    ap.add_argument("--v4", type=Path, action="append", help="a V4 run folder; again for more runs, a later one's "
                    "rows replacing an earlier one's at the same point (column run)")
    ap.add_argument("--v4-from", type=Path, help="keep this earlier floor table's V4 rows")
    ap.add_argument("--gdn-from", type=Path, help="keep this earlier table's GDN rows the --gdn run does not repeat")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        table = floor_table(args.gdn, args.v4, args.v4_from, args.gdn_from)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, table.to_csv(index=False))   # read before written: --v4-from may be --out
    print(f"{len(table)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
