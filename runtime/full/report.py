"""The full-scale run's files: summary.csv (the required columns, then the error split and
context), summary.md (the table, the error statistics, the plan's choice against the best
measured policy, the notes) and predicted_vs_measured.png.  All written atomically."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np

from simtree.fileio import write_atomic, write_text_atomic
from simtree.planning.policy_file import RANK_SUFFIX, rank_collectives
from simtree.reporting.summary import PLAN_TOLERANCE, plan_standing

# summary.csv: the columns issue-level comparisons read, then the error split and context
SUMMARY_COLUMNS = ("model", "deployment", "policy", "batch_size", "acceptance", "measured_tok_s", "predicted_tok_s",
                   "rel_err", "measured_round_ms", "predicted_round_ms", "draft_ms", "verify_ms", "commit_ms", "host_ms")
EXTRA_COLUMNS = ("cost_rel_err", "accept_rel_err", "measured_accepted", "predicted_accepted", "speedup_vs_plain",
                 "host_share", "nodes", "context_len", "rounds", "graphs", "note")

__all__ = ["write_summary", "error_stats", "plan_check", "SUMMARY_COLUMNS", "EXTRA_COLUMNS"]


def _fmt(v) -> str:
    if isinstance(v, float):
        return "" if not math.isfinite(v) else f"{v:.6g}"
    return str(v)


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    cols = SUMMARY_COLUMNS + EXTRA_COLUMNS
    w.writerow(cols)
    for r in rows:
        w.writerow([_fmt(r.get(c, "")) for c in cols])
    return buf.getvalue()


def error_stats(rows: list[dict], key: str = "rel_err") -> dict:
    """Median and worst |error| over the rows that ran."""
    e = np.abs([r[key] for r in rows if isinstance(r.get(key), float) and math.isfinite(r[key])])
    return {"n": int(e.size), "median": float(np.median(e)) if e.size else float("nan"),
            "worst": float(e.max()) if e.size else float("nan")}


def plan_check(rows: list[dict], others=()) -> list[str]:
    """Per model and batch size: the plan's choice against the best measured policy (among
    ``rows`` and ``others``, runs measured besides the reported ones)."""
    lines = []
    for model, B, plan, best, gap in plan_standing(list(rows) + list(others)):
        verdict = "best" if gap <= 0 else (f"within {PLAN_TOLERANCE:.0%}" if gap <= PLAN_TOLERANCE else f"{gap:.1%} below")
        lines.append(f"{model} batch {B}: plan {plan['policy']} {plan['measured_tok_s']:.1f} tok/s, best measured "
                     f"{best['policy']} {best['measured_tok_s']:.1f} tok/s: {verdict}")
    return lines


def _markdown(rows: list[dict], notes: list[str], others=()) -> str:
    cols = ("policy", "batch_size", "acceptance", "measured_tok_s", "predicted_tok_s", "rel_err",
            "measured_round_ms", "predicted_round_ms", "cost_rel_err", "accept_rel_err", "draft_ms", "verify_ms",
            "commit_ms", "host_ms", "speedup_vs_plain")
    models = list(dict.fromkeys((r["model"], r["deployment"]) for r in rows)) or [("?", "?")]
    if len(models) > 1:   # several models in one report: say which row is which
        cols = ("model",) + cols
    title = ", ".join(f"{m} ({dep}" + (f", the {rank_collectives(dep)} not run)" if str(dep).endswith(RANK_SUFFIX)
                                       else ")") for m, dep in models)     # a rank run alone: what it left out
    out = [f"# simtree run: {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            if c.endswith("rel_err") and isinstance(v, float) and math.isfinite(v):
                cells.append(f"{v:+.1%}")
            elif isinstance(v, float):
                cells.append("-" if not math.isfinite(v) else f"{v:.2f}")
            else:
                cells.append(str(v))
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Errors are (predicted - measured) / measured.  rel_err: throughput (cost x acceptance); "
            "cost_rel_err: round time from the cost models for the trees built; accept_rel_err: accepted "
            "tokens per round (bonus included).", ""]
    for key in ("rel_err", "cost_rel_err", "accept_rel_err"):
        s = error_stats(rows, key)
        out.append(f"- |{key}|: median {s['median']:.1%}, worst {s['worst']:.1%} over {s['n']} runs"
                   if s["n"] else f"- |{key}|: no runs")
    shares = [r["host_share"] for r in rows if isinstance(r.get("host_share"), float) and math.isfinite(r["host_share"])]
    if shares:
        out.append(f"- host share of the round (host_ms / measured_round_ms): median {np.median(shares):.1%}, "
                   f"worst {max(shares):.1%}")
    out += [f"- {line}" for line in plan_check(rows, others)]
    failed = [r for r in rows if str(r.get("note", "")).startswith(("failed", "skipped"))]
    out += [f"- {r['policy']} batch {r['batch_size']}: {r['note']}" for r in failed]
    out += ["", "## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(out)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if math.isfinite(r["measured_tok_s"]) and math.isfinite(r["predicted_tok_s"])]
    fig, ax = plt.subplots(figsize=(6, 5))
    for kind, marker in (("plain", "o"), ("linear_d4", "s"), ("plan", "^")):
        pts = [r for r in ran if r["policy"].split(":")[0] == kind]
        if pts:
            ax.scatter([r["measured_tok_s"] for r in pts], [r["predicted_tok_s"] for r in pts], marker=marker,
                       label=kind)
            several = len({r["model"] for r in ran}) > 1
            for r in pts:
                tag = f"{r['model'][:6]} b{r['batch_size']}" if several else f"b{r['batch_size']}"
                ax.annotate(tag, (r["measured_tok_s"], r["predicted_tok_s"]), fontsize=7)
    if ran:
        lo = min(min(r["measured_tok_s"], r["predicted_tok_s"]) for r in ran) * 0.8
        hi = max(max(r["measured_tok_s"], r["predicted_tok_s"]) for r in ran) * 1.25
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        for f in (0.95, 1.05):
            ax.plot([lo, hi], [lo * f, hi * f], ":", color="grey", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("measured tok/s")
    ax.set_ylabel("predicted tok/s")
    ax.set_title(f"{', '.join(dict.fromkeys(r['model'] for r in rows))}: predicted vs measured (dotted: +-5%)",
                 fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:   # nothing predicted (no cost bundle): say so on the plot
        ax.text(0.5, 0.5, "no predictions (no cost bundle)", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)


def write_summary(rows: list[dict], notes: list[str], out: Path, others=()) -> dict:
    """summary.csv, summary.md and predicted_vs_measured.png under ``out``; their paths.
    ``others``: runs measured besides ``rows`` (the plan's choice is checked against them too)."""
    out = Path(out)
    files = {"csv": out / "summary.csv", "md": out / "summary.md", "png": out / "predicted_vs_measured.png"}
    write_text_atomic(files["csv"], _csv(rows))
    write_text_atomic(files["md"], _markdown(rows, notes, others))
    _plot(rows, files["png"])
    return {k: str(v) for k, v in files.items()}
