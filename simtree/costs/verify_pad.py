"""Padding a verify round to a cheaper bucket: the lower envelope of the measured C_v in n.

The bf16 GEMMs of a verify step (projections, MLP, LM head over M = batch x nodes tokens) pick
kernels by M, and some M are slow: Qwen3.6-27B on an H100 verifies 32 x 14 nodes in 61.8 ms and
32 x 16 in 49.8 ms (simtree/data/profiles/h100/buckets_qwen3.6-27b_tp1.csv).  A runtime that
verifies n nodes per sequence may pad the round to n' > n nodes (padding nodes are leaves under
the root that are never accepted, ``runtime/full/drafting.py``), so the verify cost it can reach
is the lower envelope min_{n' >= n} C(b, n').

:func:`pad_map` reads a profile table's verify rows (one model, deployment, device: the rows
``simtree fit`` picked) and gives, per batch size, the pad map n -> n': n is padded to the
measured n' > n of least cost where that saves at least ``min_saving`` (default 2%, above the
profiler's repeat-to-repeat noise; it must be > 0, so equal costs never pad) at every context n
was measured at - n' must have been timed at each of them, since the map takes no context and
the runtime pads at any; the saving's smallest ratio over those contexts decides between
candidates (ties: the smaller n').  Plain decoding (n = 1) is its own step and is never
padded, nor padded into.  A batch size is padded only at the node counts measured at that
batch: the kernel choice depends on M exactly, so no map is carried to batch sizes or node
counts the table did not time.  The fitted C_v surface between measured batch sizes (and
node counts) interpolates envelope rows, so there it is optimistic where the runtime, which
pads only at the measured (b, n), does not pad.

:func:`envelope_rows` replaces the latency of each row the map pads with its target's at the same
context (no other row changes, so the fit and the runtime pad the same cells):
the rows ``simtree fit`` fits C_v on, so the planner and simulator price a budget n at what the
padded runtime pays.  The map is stored in the bundle as ``verify.info["verify_pad"]``
(:data:`PAD_KEY`): ``{"min_saving": s, "by_batch": {"32": {"14": 16, ...}}, "saving": {...}}``
(JSON keys are strings; ``saving`` the smallest relative saving over contexts).  A bundle
without the key pads nothing.
"""
from __future__ import annotations

import pandas as pd

from simtree.errors import SimtreeError

__all__ = ["PAD_KEY", "PAD_MIN_SAVING", "check_min_saving", "pad_map", "envelope_rows", "padded_nodes",
           "pad_sends", "padded_into", "check_pad_record"]

PAD_KEY = "verify_pad"
PAD_MIN_SAVING = 0.02
LATENCY = "latency_us_median"


def _cells(rows: pd.DataFrame) -> dict:
    """{batch: {context: {nodes: median latency}}} over the rows with n >= 2 (tree shapes merged by median)."""
    agg = rows[rows["nodes_per_seq"] >= 2].groupby(["batch_size", "context_len", "nodes_per_seq"])[LATENCY].median()
    out: dict = {}
    for (b, l, n), v in agg.items():
        out.setdefault(int(b), {}).setdefault(float(l), {})[int(n)] = float(v)
    return out


def check_min_saving(min_saving: float) -> float:
    """``min_saving`` as a float in (0, 1), else one line."""
    if not 0 < min_saving < 1:      # NaN fails it too
        raise SimtreeError(f"verify padding: the minimum saving must be in (0, 1), got {min_saving}")
    return float(min_saving)


def pad_map(rows: pd.DataFrame, min_saving: float = PAD_MIN_SAVING) -> dict:
    """The pad record (module doc) of verify ``rows``; ``by_batch`` empty where nothing pays."""
    check_min_saving(min_saving)
    by_batch: dict = {}
    saving: dict = {}
    for b, by_l in sorted(_cells(rows).items()):
        nodes = sorted({n for cell in by_l.values() for n in cell})
        for n in nodes:
            best = None
            for m in (m for m in nodes if m > n):
                # the map is context-free: n' must be timed wherever n is, and save at every one
                ratios = [cell[m] / cell[n] if m in cell else float("inf") for cell in by_l.values() if n in cell]
                if max(ratios) > 1 - min_saving:
                    continue
                if best is None or max(ratios) < best[1]:
                    best = (m, max(ratios))
            if best is not None:
                by_batch.setdefault(str(b), {})[str(n)] = best[0]
                saving.setdefault(str(b), {})[str(n)] = round(1 - best[1], 4)
    return {"min_saving": min_saving, "by_batch": by_batch, "saving": saving}


def envelope_rows(rows: pd.DataFrame, record: dict) -> pd.DataFrame:
    """``rows`` with every row the pad map pads (its (b, n) in ``by_batch``) priced at its target
    n' at the same context: latency median, p10, p90 (the map pads n only where n' was timed at
    every context n was, so every padded row has its target; no other row changes)."""
    if not record.get("by_batch"):
        return rows
    out = rows.copy()
    cols = [c for c in (LATENCY, "latency_us_p10", "latency_us_p90") if c in out.columns]
    target = out.groupby(["batch_size", "context_len", "nodes_per_seq"])[cols].median()
    for i, r in out.iterrows():
        m = pad_sends(record, r["batch_size"]).get(str(int(r["nodes_per_seq"])))
        if m is None:
            continue
        key = (r["batch_size"], r["context_len"], m)
        if key not in target.index:
            raise SimtreeError(f"verify padding: the pad map sends {int(r['nodes_per_seq'])} nodes to {m} at batch "
                               f"{int(r['batch_size'])}, which was not timed at context {r['context_len']:g}")
        out.loc[i, cols] = target.loc[key].values
    return out


def pad_sends(record: dict | None, batch_size) -> dict:
    """The pad map at ``batch_size``: {str(n): n'} ({} where nothing pads or no record)."""
    return ((record or {}).get("by_batch") or {}).get(str(int(batch_size)), {})


def padded_nodes(record: dict | None, nodes: int, batch_size: int) -> int:
    """The node count a round of ``nodes`` per sequence at ``batch_size`` is verified at."""
    m = pad_sends(record, batch_size).get(str(int(nodes)))
    return int(nodes) if m is None else int(m)


def padded_into(record: dict | None, target, batch_size) -> list[int]:
    """The node counts the pad map sends to ``target`` at ``batch_size`` (the map inverted): the
    cells whose envelope rows are copies of ``target``'s (:func:`envelope_rows`)."""
    return [int(n) for n, t in pad_sends(record, batch_size).items() if float(t) == float(target)]


def check_pad_record(record, where: str) -> None:
    """One line for a malformed pad record (a bundle's ``verify.info["verify_pad"]``)."""
    ok = isinstance(record, dict) and isinstance(record.get("by_batch"), dict)
    if ok:
        for b, m in record["by_batch"].items():
            ok = ok and isinstance(m, dict) and str(b).isdigit() and all(
                str(n).isdigit() and isinstance(t, int) and not isinstance(t, bool) and t > int(n) >= 2
                for n, t in m.items())
    if not ok:
        raise SimtreeError(f"{where}: {PAD_KEY} must be {{'by_batch': {{batch: {{nodes: padded nodes > nodes}}}}}}")
