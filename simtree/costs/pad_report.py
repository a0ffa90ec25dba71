"""Markdown summary of a bucket profile: per batch the measured verify step over n, its lower
envelope, the pad map (:mod:`simtree.costs.verify_pad`) and, at each padded node count, the
layer piece that makes it slow.

The table is a sweep of the runtime's layer pieces (variant ``layers``) with the composed
``model_verify_step`` rows (profiler/compose.py).  A piece's share of a round is its latency
times the number of layers that run it (the model's layer counts; the LM head and round metadata
once); at a spike n -> n' the slowest piece is the one whose share at n most exceeds its share at
n' (a piece normally costs less at fewer nodes).

    python -m simtree.costs.pad_report simtree/data/profiles/h100/buckets_qwen3.6-27b_tp1.csv

``--merge-into DST`` appends the table's composed verify rows at the node counts the rank profile
DST lacks inside its node range (per batch and context, at DST's contexts; same model, deployment
and device) to DST,
atomically (``profile_table.append_rows``: a repeated key is refused): the shipped H100 Qwen profile
took the bucket rows this way,

    python -m simtree.costs.pad_report simtree/data/profiles/h100/buckets_qwen3.6-27b_tp1.csv \\
        --merge-into simtree/data/profiles/h100/profile_qwen3.6-27b_tp1.csv
"""
from __future__ import annotations

import argparse
import sys

import pandas as pd

from simtree.costs.profile_table import load_profile
from simtree.costs.verify_pad import PAD_MIN_SAVING, pad_map, pad_sends
from simtree.errors import SimtreeError
from simtree.models import get_model

__all__ = ["bucket_summary", "merge_verify_rows"]

VERIFY = "model_verify_step"
ONCE = ("lm_head_step", "round_meta_step")


def _weights(model: str, stages) -> dict:
    """Layers that run each piece in one round."""
    counts = get_model(model).layer_counts
    counts = counts() if callable(counts) else counts
    out = {}
    for s in stages:
        if s in ONCE:
            out[s] = 1
        elif s in ("mlp_step",):
            out[s] = sum(counts.values())
        else:
            kind = next((k for k in counts if s.startswith(f"{k}_") or s.startswith(f"v4_{k}_")), None)
            out[s] = counts.get(kind, 0) if kind else 0
    return out


def _shares(df: pd.DataFrame, model: str, b: int, n: int) -> dict:
    """{piece: its ms in one round} at (b, n): the context-free pieces and the smallest context's cores."""
    rows = df[(df["batch_size"] == b) & (df["nodes_per_seq"] == n) & (df["stage"] != VERIFY)]
    rows = rows[rows["context_len"] == rows.groupby("stage")["context_len"].transform("min")]
    lat = rows.groupby("stage")["latency_us_median"].median()
    w = _weights(model, lat.index)
    return {s: w[s] * float(v) / 1000 for s, v in lat.items() if w[s]}


def bucket_summary(path, min_saving: float = PAD_MIN_SAVING) -> str:
    """The markdown section (module doc) of the profile table at ``path``."""
    df = load_profile(path)
    v = df[df["stage"] == VERIFY]
    if v.empty:
        raise SimtreeError(f"{path}: no {VERIFY} rows to summarise")
    if v["model"].nunique() != 1 or v["deployment"].nunique() != 1:
        raise SimtreeError(f"{path}: one model and deployment per bucket table")
    model, dep, device = v["model"].iloc[0], v["deployment"].iloc[0], v["device"].iloc[0]
    l0 = v["context_len"].max()
    v = v[v["context_len"] == l0]
    rec = pad_map(v, min_saving)
    lines = [f"{model} ({dep}) on {device}: `{VERIFY}` composed of the runtime's layer pieces at context {l0:g}, "
             f"ms. Padded: a round of n nodes verified at the larger measured n' where that saves more than "
             f"{100 * min_saving:g}% (simtree.costs.verify_pad); envelope: the cost the padded runtime pays.", ""]
    for b, sub in v.groupby("batch_size"):
        sub = sub.sort_values("nodes_per_seq")
        pads = pad_sends(rec, b)
        saving = rec["saving"].get(str(int(b)), {})
        ns = [int(n) for n in sub["nodes_per_seq"]]
        ms = dict(zip(ns, sub["latency_us_median"].astype(float) / 1000))
        lines += [f"### batch {int(b)}", "",
                  "| n | tokens | measured | envelope | padded to | saving |", "|---|---|---|---|---|---|"]
        for n in ns:
            m = pads.get(str(n))
            lines.append(f"| {n} | {n * int(b)} | {ms[n]:.2f} | {ms[m] if m else ms[n]:.2f} | {m if m else '-'} | "
                         f"{f'{100 * saving[str(n)]:.1f}%' if m else '-'} |")
        lines.append("")
        if not pads:
            lines += ["Pad map: none (no larger measured node count is clearly cheaper).", ""]
            continue
        lines.append("Pad map: " + ", ".join(f"{n} -> {m}" for n, m in sorted(pads.items(), key=lambda x: int(x[0]))) + ".")
        for n, m in sorted(pads.items(), key=lambda x: int(x[0])):
            at, to = _shares(df, model, int(b), int(n)), _shares(df, model, int(b), int(m))
            excess = {s: at[s] - to.get(s, 0.0) for s in at}
            worst = max(excess, key=excess.get)
            lines.append(f"- n = {n} ({int(n) * int(b)} tokens): {ms[int(n)]:.2f} ms against {ms[int(m)]:.2f} at n = {m}; "
                         f"slowest piece {worst}: {at[worst]:.2f} ms a round against {to.get(worst, 0.0):.2f} "
                         f"({excess[worst]:+.2f} ms; the others together {sum(excess.values()) - excess[worst]:+.2f} ms).")
        lines.append("")
    return "\n".join(lines)


def merge_verify_rows(src, dst) -> int:
    """Append ``src``'s composed verify rows at (batch, context, nodes) cells ``dst`` lacks, at the
    contexts ``dst`` times, to ``dst`` (module doc); the rows added."""
    from simtree.costs.profile_table import append_rows

    new, old = load_profile(src), load_profile(dst)
    ov = old[old["stage"] == VERIFY]
    if ov.empty:
        raise SimtreeError(f"{dst}: no {VERIFY} rows to merge into")
    keys = ("model", "deployment", "device", "dtype", "variant")
    want = {k: ov[k].iloc[0] for k in keys}
    rows = new[(new["stage"] == VERIFY) & (new["context_len"].isin(set(ov["context_len"])))]
    for k, val in want.items():
        rows = rows[rows[k] == val]
    rows = rows[rows["nodes_per_seq"] <= ov["nodes_per_seq"].max()]   # inside its node range: no extrapolation moved
    have = set(zip(ov["batch_size"], ov["context_len"], ov["nodes_per_seq"]))
    rows = rows[[(b, l, n) not in have for b, l, n in zip(rows["batch_size"], rows["context_len"], rows["nodes_per_seq"])]]
    if rows.empty:
        raise SimtreeError(f"{src}: no {VERIFY} rows of {want['model']} ({want['deployment']}, {want['device']}) "
                           f"at cells {dst} lacks")
    append_rows(dst, rows.to_dict("records"))
    return len(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Markdown summary of a bucket profile (envelope, pad map, spikes).")
    ap.add_argument("table")
    ap.add_argument("--min-saving", type=float, default=PAD_MIN_SAVING)
    ap.add_argument("--merge-into", default=None, help="a rank profile: append the table's verify rows at its missing cells")
    args = ap.parse_args(argv)
    try:
        if args.merge_into:
            print(f"{merge_verify_rows(args.table, args.merge_into)} rows added to {args.merge_into}")
            return 0
        sys.stdout.write(bucket_summary(args.table, args.min_saving) + "\n")
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
