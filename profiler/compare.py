"""Two profile tables side by side: per (model, stage, variant), the ratio of B's median
latency to A's at the points both measured, and the points only one of them holds.

For the spread between two runs of the same sweep (is a profile reproducible enough to plan
on?), or for what a driver, kernel or software change, or another GPU, moved.  The device is
not part of the match, so tables from two GPUs compare point by point.

    python -m simtree.profiler.compare A/profile.csv B/profile.csv [--csv OUT.csv] [--md OUT.md]
        [--png OUT.png]

Prints a markdown summary; ``--csv`` writes the per-group table, ``--md`` the summary,
``--png`` every matched point's ratio per group (the markdown links it).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pandas as pd

from simtree.errors import SimtreeError
from simtree.fileio import write_atomic, write_text_atomic
from simtree.costs.profile_table import KEY_COLUMNS, load_profile

__all__ = ["compare_profiles", "comparison_markdown", "matched_points", "ratio_figure"]

MATCH = tuple(c for c in KEY_COLUMNS if c != "device")
GROUP = ["model", "stage", "variant"]


def matched_points(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """The points both tables hold, with ``ratio`` = B's median latency / A's."""
    for name, df in (("A", a), ("B", b)):   # the device is not matched: one per table
        if df.device.nunique() > 1:
            raise SimtreeError(f"profile table {name} holds several devices "
                               f"({', '.join(sorted(df.device.unique()))}): compare one device's rows")
    both = a.merge(b, on=list(MATCH), suffixes=("_a", "_b"))
    if both.empty:
        raise SimtreeError("the two profile tables share no point (same stage, model, variant, "
                           "batch, nodes, context, shape, steps, top-k)")
    return both.assign(ratio=both.latency_us_median_b / both.latency_us_median_a)


def compare_profiles(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """(per-group table, totals) for two validated profile tables (``load_profile``).

    Per (model, stage, variant): points in both, the median / p10 / p90 / min / max of
    B's median latency over A's, and the point where the two differ most; rows held by one
    table only are counted per group (``only_a`` / ``only_b``)."""
    both = matched_points(a, b)
    rows = []
    for key, g in both.groupby(GROUP, sort=True):
        r = g.ratio.to_numpy()
        worst = g.loc[(np.log(g.ratio)).abs().idxmax()]
        rows.append(dict(zip(GROUP, key), points=len(g),
                         ratio_median=float(np.median(r)), ratio_p10=float(np.quantile(r, 0.1)),
                         ratio_p90=float(np.quantile(r, 0.9)), ratio_min=float(r.min()),
                         ratio_max=float(r.max()),
                         worst_point=(f"b{worst.batch_size} n{worst.nodes_per_seq} "
                                      f"l{worst.context_len} {worst.tree_shape}"
                                      + (f" s{worst.num_steps} k{worst.topk}"
                                         if worst.stage == "draft_step" else ""))))
    table = pd.DataFrame(rows)
    counts = []
    for side, df, other in (("only_a", a, b), ("only_b", b, a)):
        lone = df.merge(other[list(MATCH)], on=list(MATCH), how="left", indicator=True)
        lone = lone[lone._merge == "left_only"]
        counts.append(lone.groupby(GROUP).size().rename(side))
    table = table.merge(pd.concat(counts, axis=1).reset_index(), on=GROUP, how="outer")
    table[["points", "only_a", "only_b"]] = table[["points", "only_a", "only_b"]].fillna(0).astype(int)
    r = both.ratio.to_numpy()
    totals = dict(points=len(both), only_a=int(table.only_a.sum()), only_b=int(table.only_b.sum()),
                  ratio_median=float(np.median(r)),
                  abs_dev_p50=float(np.quantile(np.abs(r - 1), 0.5)),
                  abs_dev_p90=float(np.quantile(np.abs(r - 1), 0.9)),
                  within_5pct=float(np.mean(np.abs(r - 1) <= 0.05)),
                  devices_a=sorted(a.device.unique()), devices_b=sorted(b.device.unique()),
                  versions_a=sorted(set(a.torch_version + " / " + a.triton_version)),
                  versions_b=sorted(set(b.torch_version + " / " + b.triton_version)))
    return table, totals


def ratio_figure(both: pd.DataFrame, title: str = ""):
    """A matplotlib figure: every matched point's B / A ratio (log scale), one row per
    (model, stage, variant), with each group's median marked and the line at 1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    groups = list(both.groupby(GROUP, sort=True))
    fig, ax = plt.subplots(figsize=(8.5, 0.32 * len(groups) + 1.4))
    rng = np.random.default_rng(0)   # vertical jitter only, so points of a row do not stack
    for i, (_, g) in enumerate(groups):
        ax.scatter(g.ratio, i + rng.uniform(-0.25, 0.25, len(g)), s=6, alpha=0.5, color="tab:blue")
        ax.plot([g.ratio.median()] * 2, [i - 0.35, i + 0.35], color="black", lw=1.5)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ticks = [0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 4.0]
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.tick_params(axis="x", labelsize=7)
    ax.set_yticks(range(len(groups)), [" / ".join(k) for k, _ in groups], fontsize=7)
    ax.set_ylim(-0.7, len(groups) - 0.3)
    ax.set_xlabel("B / A median latency per point (black: group median)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return fig


def comparison_markdown(table: pd.DataFrame, totals: dict, name_a: str = "A",
                        name_b: str = "B", png: str | None = None) -> str:
    from .bench.report_util import markdown_table
    shown = table.copy()
    for c in [c for c in shown.columns if c.startswith("ratio_")]:
        shown[c] = shown[c].map(lambda v: "" if pd.isna(v) else f"{v:.3f}")
    return (f"# Profile comparison: {name_b} / {name_a}\n\n"
            f"- A: `{name_a}` ({', '.join(totals['devices_a'])}; torch / triton "
            f"{', '.join(totals['versions_a'])})\n"
            f"- B: `{name_b}` ({', '.join(totals['devices_b'])}; torch / triton "
            f"{', '.join(totals['versions_b'])})\n"
            f"- {totals['points']} points in both ({totals['only_a']} only in A, "
            f"{totals['only_b']} only in B); B / A median latency: median "
            f"{totals['ratio_median']:.3f}, |B / A - 1| median {totals['abs_dev_p50']:.1%}, "
            f"p90 {totals['abs_dev_p90']:.1%}; {totals['within_5pct']:.0%} of the points within 5%\n\n"
            + markdown_table(shown) + "\n"
            + (f"\n![B / A per point]({png})\n" if png else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="profile table A (the reference)")
    ap.add_argument("b", help="profile table B (ratios are B / A)")
    ap.add_argument("--csv", help="write the per-(model, stage, variant) table here")
    ap.add_argument("--md", help="write the markdown summary here")
    ap.add_argument("--png", help="write the per-point ratio plot here")
    args = ap.parse_args(argv)
    try:
        a, b = load_profile(args.a), load_profile(args.b)
        table, totals = compare_profiles(a, b)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rel_png = None
    if args.png:
        import matplotlib.pyplot as plt
        fig = ratio_figure(matched_points(a, b), f"{args.b} / {args.a}")
        write_atomic(args.png, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
        plt.close(fig)
        # linked relative to the markdown file when both are written
        rel_png = os.path.relpath(args.png, os.path.dirname(os.path.abspath(args.md))) if args.md else args.png
    md = comparison_markdown(table, totals, args.a, args.b, rel_png)
    if args.csv:
        write_text_atomic(args.csv, table.to_csv(index=False, float_format="%.4f"))
    if args.md:
        write_text_atomic(args.md, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
