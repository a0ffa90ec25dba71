"""The serving benchmark's report: its README (the targets counted over the points, in sample and
out of sample, the switch bound checked run by run, the controller at each point) and its plot."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from simtree.control.controller import MIN_DWELL_STEPS, SWITCH_BURST
from simtree.fileio import write_atomic
from simtree.serving.sim import MAX_BATCH

__all__ = ["readme", "plot", "target_lines", "summary_lines", "switch_bound_use", "paired_line"]


def _run_values(column: pd.Series) -> list[np.ndarray]:
    return [np.array(str(x).split(), float) for x in column]


def switch_bound_use(df: pd.DataFrame) -> tuple[bool, float]:
    """(every controller run, replica by replica, within switches <= steps // MIN_DWELL_STEPS; the
    largest share of its bound a run used)."""
    ctl = df[df.policy == "controller"]
    sw = np.concatenate(_run_values(ctl.switches_runs))
    steps = np.concatenate(_run_values(ctl.steps_runs))
    bound = steps // MIN_DWELL_STEPS
    return bool(np.all(sw <= bound)), float(np.max(sw / np.maximum(bound, 1))) if sw.size else 0.0


def readme(df: pd.DataFrame, command: str, num_requests: int, workload: str, lengths_source: str, replicas: int = 1,
           out_of_sample=None) -> str:
    """The README of ``df`` (bench.csv): the command, the setup (``lengths_source``: where the traces' lengths
    came from), the switch bound checked run by run,
    the targets in sample and on each ``out_of_sample`` seed's frame, the controller at each point."""
    ctl = df[df.policy == "controller"]
    within, used = switch_bound_use(df)
    oos = out_of_sample or {}
    lines = ["# Serving benchmark (simulated on the shipped H200 costs)", "",
             f"Regenerate: `{command}` (written by that command; docs/controller.md describes the model). In sample: "
             "the controller's settings (switch credits, margin, tail ranking) were chosen on these traces and "
             "acceptance seeds (`bench.csv`); `--out-of-sample S,...` serves the same points on other seeds, "
             "where no adopted setting was chosen (the rejected `tail_hold` option was compared on seeds 100 and 200 once: "
             "they are not untouched; docs/controller.md) (`bench_oos.csv`, column `seed`; their counts below).", "",
             f"{num_requests} requests per trace, ShareGPT lengths ({lengths_source}), acceptance: "
             f"{workload}; up to {MAX_BATCH} live sequences; loads are multiples of the request rate that "
             "saturates plain decoding at batch 64. `bench.csv` has one row per (model, arrivals, load, policy); "
             "`detail` names the best static tier; `sglang_dspark` sets a verify budget every step by design, "
             f"so its switches are not counted. Every trace is served under {replicas} acceptance seed(s), the same "
             "for every policy (common random numbers: a request's n-th round draws the same numbers under every "
             "policy): `tok_s` is the replicas' mean (each in `tok_s_runs`), `best_static` is the fixed tier "
             "fastest on that mean, the TPOT percentiles pool the replicas' requests, so a p99 over "
             f"{replicas * num_requests} requests is set by its {max(1, -(-replicas * num_requests // 100))} "
             "slowest. A policy that runs plain and drafted steps (threshold, the controller) pays the drafter's "
             "catch-up in the drafted step after plain ones (`catch_ups`, `catch_up_s`; docs/controller.md); SGLang's "
             "adaptive steps (`sglang_adaptive`, `sglang_adaptive_simtree`, `sglang_controller`) run the drafter over "
             "each step-0 round's rows instead, as SGLang does by default. `switches_runs` and `steps_runs` give each replica's (their sums are "
             "the totals). `tpot_p99_diff_lo_ms` and `tpot_p99_diff_hi_ms`: the 95% paired bootstrap band of the "
             "policy's TPOT p99 minus best_static's (every policy serves the same requests on the same draws: "
             "the requests are resampled together for both).", "",
             f"Controller switch bound: one switch's credit per {MIN_DWELL_STEPS} steps, at most {SWITCH_BURST} "
             f"held (switches <= steps // {MIN_DWELL_STEPS} after any step; at most {SWITCH_BURST} + W // "
             f"{MIN_DWELL_STEPS} in any W steps), checked in every run (each acceptance seed's); every controller "
             f"run within it: {'yes' if within else 'NO'}; the most of its bound a run used: "
             f"{used:.0%}; {ctl.switches_per_min.max():.1f} switches/min at most.", "",
             "In sample (the seeds the controller's settings were chosen on): " + " ".join(target_lines(df)), "",
             *[f"Out of sample, arrivals seed {s}, acceptance seeds {s} .. {s + replicas - 1} (`bench_oos.csv`, seed {s}; "
               f"frozen settings, reported as they came; switch bound held in every run: "
               f"{'yes' if switch_bound_use(o)[0] else 'NO'}): " + " ".join(target_lines(o)) + "\n"
               for s, o in oos.items()],
             *sglang_controller_lines(df, oos),
             "The controller against the best other policy at each point (TPOT p99 of best_static with its 95% "
             "bootstrap band over requests; the paired band of the difference):", ""]
    lines += [f"- {line}" for line in summary_lines(df)]
    return "\n".join(lines) + "\n"


def _points(df: pd.DataFrame):
    for (model, kind, load), h in df.groupby(["model", "arrivals", "load"], sort=False):
        by = h.set_index("policy")
        others = by.drop(index="controller")
        yield model, kind, load, by.loc["controller"], others.loc[others.tok_s.idxmax()], by.loc["best_static"]


def target_lines(df: pd.DataFrame) -> list[str]:
    """The issue's targets, counted over the points: throughput >= every other policy; TPOT p99
    <= the best static's (a miss inside the best static's bootstrap band named as such)."""
    pts = list(_points(df))
    tok_miss = [f"{m} {k} {ld} ({c.tok_s / o.tok_s - 1:+.3%} vs {o.name})" for m, k, ld, c, o, _ in pts
                if c.tok_s < o.tok_s]
    wins = [_replica_wins(c, o) for *_, c, o, _ in pts]
    p99_miss = [(m, k, ld, c, b) for m, k, ld, c, _, b in pts if c.tpot_p99_ms > b.tpot_p99_ms]
    inside = sum(c.tpot_p99_ms <= b.tpot_p99_hi_ms for *_, c, b in p99_miss)
    hair = sum(c.tpot_p99_ms <= 1.001 * b.tpot_p99_ms for *_, c, b in p99_miss)
    return [f"Targets over {len(pts)} points: controller throughput >= every other policy at "
            f"{len(pts) - len(tok_miss)}" + (f" (short: {'; '.join(tok_miss)})" if tok_miss else "") +
            f"; TPOT p99 <= best_static's at {len(pts) - len(p99_miss)}" +
            (f" (above at {len(p99_miss)}, by at most "
             f"{max(c.tpot_p99_ms / b.tpot_p99_ms - 1 for *_, c, b in p99_miss):.1%}; {hair} of them by under 0.1%; "
             f"{inside} inside best_static's own 95% bootstrap band)" if p99_miss else "") + ". Replica by replica (the same "
            f"seeds), the controller's tok/s >= the best other policy's in {sum(w for w, _ in wins)} of "
            f"{sum(n for _, n in wins)} runs. " + paired_line(pts)]


def sglang_controller_lines(df: pd.DataFrame, oos: dict) -> list[str]:
    """What simtree's controller keeps inside SGLang (policy ``sglang_controller``, where served):
    its tok/s and TPOT p99 against the controller's and against SGLang's own adaptive steps on the
    same candidate steps, over every point of every seed."""
    frames = [df, *oos.values()]
    if not all({"sglang_controller", "sglang_adaptive_simtree"} <= set(f.policy) for f in frames):
        return []
    by = pd.concat(frames).set_index(["seed", "model", "arrivals", "load", "policy"])
    sc = by.xs("sglang_controller", level="policy")

    def ratio(col, other):
        r = sc[col] / by.xs(other, level="policy")[col] - 1
        return f"{r.min():+.2%} to {r.max():+.2%} (median {r.median():+.2%})"

    return [f"simtree's controller inside SGLang (`sglang_controller`: SGLang's adaptive loop over "
            f"`SimtreeAdaptiveParams`, what simtree's SGLang plugin runs: the exported chains, every step priced at "
            f"one context, every request counted as new; docs/controller.md), over the {len(sc)} points of the "
            f"{len(frames)} seeds pooled (the controller's settings chosen on the first, in sample; the others out of "
            f"sample): tok/s against the controller's {ratio('tok_s', 'controller')}, TPOT p99 "
            f"{ratio('tpot_p99_ms', 'controller')}; against SGLang's own adaptive steps on the same candidate steps "
            f"(`sglang_adaptive_simtree`) tok/s {ratio('tok_s', 'sglang_adaptive_simtree')}, TPOT p99 "
            f"{ratio('tpot_p99_ms', 'sglang_adaptive_simtree')}.", ""]


def paired_line(pts) -> str:
    """The controller's TPOT p99 minus best_static's, paired (the same requests resampled for both):
    at how many points its 95% band lies above 0, contains 0, lies below 0 (beside the strict count)."""
    lo = np.array([c.tpot_p99_diff_lo_ms for *_, c, _, _ in pts])
    hi = np.array([c.tpot_p99_diff_hi_ms for *_, c, _, _ in pts])
    return (f"Paired with best_static (the same requests resampled for both), the 95% band of the controller's "
            f"TPOT p99 minus best_static's lies above 0 at {int((lo > 0).sum())} points, contains 0 at "
            f"{int(((lo <= 0) & (hi >= 0)).sum())}, lies below 0 at {int((hi < 0).sum())}.")


def _replica_wins(c, o) -> tuple[int, int]:
    """(replicas where the controller's tok/s >= ``o``'s on the same seed, replicas)."""
    cr, orr = _run_values(pd.Series([c.tok_s_runs, o.tok_s_runs]))
    return int((cr >= orr).sum()), int(cr.size)


def summary_lines(df: pd.DataFrame) -> list[str]:
    """Per model and arrivals: the controller against the best other policy at each load."""
    return [f"{model} {kind} {load}: controller {c.tok_s:.0f} tok/s vs best other {o.name} {o.tok_s:.0f} "
            f"({c.tok_s / o.tok_s - 1:+.3%}; >= in {'/'.join(map(str, _replica_wins(c, o)))} replicas); "
            f"TPOT p99 {c.tpot_p99_ms:.2f} ms vs best_static {b.tpot_p99_ms:.2f} "
            f"[{b.tpot_p99_lo_ms:.2f}, {b.tpot_p99_hi_ms:.2f}] ({c.tpot_p99_ms / b.tpot_p99_ms - 1:+.1%}; paired "
            f"difference [{c.tpot_p99_diff_lo_ms:+.2f}, {c.tpot_p99_diff_hi_ms:+.2f}] ms); p50 "
            f"{c.tpot_p50_ms:.2f} vs {b.tpot_p50_ms:.2f}; {c.switches_per_min:.1f} switches/min"
            for model, kind, load, c, o, b in _points(df)]


def plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(df.groupby(["model", "arrivals"], sort=False))
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 7), squeeze=False)
    for col, ((model, kind), g) in enumerate(groups):
        loads = list(dict.fromkeys(g["load"]))
        none = g[g.policy == "none"].set_index("load").loc[loads, "tok_s"].to_numpy()
        for policy in dict.fromkeys(g.policy):
            h = g[g.policy == policy].set_index("load").loc[loads]
            style = dict(lw=2.5, color="k") if policy == "controller" else dict(lw=1, marker="o", ms=3)
            axes[0, col].plot(loads, h["tok_s"].to_numpy() / none, label=policy, **style)
            axes[1, col].plot(loads, h["tpot_p99_ms"], label=policy, **style)
        axes[0, col].set_title(f"{model}, {kind}", fontsize=9)
        axes[0, col].set_ylabel("tok/s over plain decoding's")
        axes[1, col].set_ylabel("TPOT p99 (ms)")
        axes[1, col].set_xlabel("load (x plain decoding's capacity at batch 64)")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)
