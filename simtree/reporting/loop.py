"""The closed loop on one machine (its CPU, or its GPU): profile -> fit -> plan -> run,
predicted vs measured.

``scripts/loop.sh`` (``DEVICE=cpu`` is ``scripts/loop_cpu.sh``) drives the CLI commands; this
module holds the two pieces of logic between them (callable from Python, or
``python -m simtree.reporting.loop``):

    contrast_runs(plan_dir, workload, batch_size)  # [(role, policy name, `simtree run` flags)]
    write_loop_report(loop_dir)                    # README.md + predicted_vs_measured.png
    write_repeat_report(loop_dir, "runs_repeat")   # the same plan run twice: run-to-run spread

Layout of a loop folder (every number in the report is read from these files)::

    profile.csv (+ profile.meta.json)  simtree profile --sweep runtime_cpu.yaml (runtime_gpu.yaml)
    costs.json (+ costs.png)     simtree fit
    traces/<mode>/run.json, traces.jsonl; traces.jsonl (all of them)   acceptance traces
    plan/policy.json, candidates.csv, plan.md                         simtree plan
    runs/b<B>_<role>/run.json    simtree run, role = chosen | second | linear | none
    runs_repeat/...              (optional) the same runs again, same plan (PHASES="runs report"
                                 on a copy of the folder), for ``write_repeat_report``
    runs.tgz                     runs/ and runs_repeat/ packed (``pack_runs``, loop.sh's repeat
                                 phase): read in their place where the folders are gone
    timing.tsv                   step, seconds, 1-minute load average after it (the script)
    host_probe.tsv               step, python_us, torch_us, launch_us: the host's speed right
                                 before each step (``simtree.machine.hostprobe``; optional)

Predicted, per run: the planner's numbers for that policy at that batch (candidates.csv:
acceptance fitted from the collected traces, the bundle's cost models) - the end-to-end
prediction; and the run's own ``predicted`` (the same cost models with the acceptance
fitted from that run's traces) - the cost model alone.
"""
from __future__ import annotations

import gzip
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd

from simtree.errors import SimtreeError
from simtree.fileio import write_atomic
from simtree.machine.hostprobe import METRICS as HOST_METRICS
from simtree.planning.modes import MARGINAL_MODES, BestFirstParams, EagleParams, NoneParams, PolicySpec
from simtree.machine.hostprobe import ratio as _probe_ratio

__all__ = ["ROLES", "run_flags", "contrast_runs", "collect_runs", "write_loop_report", "host_probe",
           "host_ratio", "write_repeat_report", "write_lossless_report", "pack_runs", "RUNS_ARCHIVE", "main"]

ROLES = ("chosen", "second", "linear", "none")
RUNS_ARCHIVE = "runs.tgz"   # the run folders packed (one file in place of a folder per run)
RUN_FOLDERS = ("runs", "runs_repeat")
SPIKE = 1.1  # mean / median round latency above which a run is flagged as hit by a load burst


def run_flags(spec: PolicySpec) -> str:
    """`simtree run` flags that select the policy ``spec``."""
    flags = [f"--mode {spec.mode}"]
    if isinstance(spec, EagleParams):
        flags += [f"--steps {spec.num_steps}", f"--topk {spec.topk}"]
    if not isinstance(spec, NoneParams):
        flags.append(f"--budget {spec.max_nodes}")   # the max budget of the adaptive modes
    if isinstance(spec, BestFirstParams):
        flags.append(f"--width {spec.width}")
    if spec.mode in MARGINAL_MODES:
        flags.append(f"--draft-depth {spec.draft_depth}")
    return " ".join(flags)


def _candidates(plan_dir: Path, workload: str, batch_size: int) -> pd.DataFrame:
    path = Path(plan_dir) / "candidates.csv"
    if not path.is_file():
        raise SimtreeError(f"{path} not found: run `simtree plan --out {plan_dir}` first")
    df = pd.read_csv(path)
    df = df[(df["workload"] == workload) & (df["batch_size"] == batch_size)]
    if df.empty:
        raise SimtreeError(f"{path} has no candidates for workload {workload!r} at batch {batch_size}")
    return df.sort_values("tok_s", ascending=False)


def contrast_runs(plan_dir, workload: str, batch_size: int) -> list[tuple[str, str, str]]:
    """Policies to run beside the chosen one at ``batch_size``: the planner's best candidate of
    another family (its second choice), the best linear, and plain decoding; those equal to
    the chosen policy are dropped.  Returns [(role, policy name, run flags)]."""
    from simtree.planning.policy_file import Policy

    entry = Policy.load(Path(plan_dir) / "policy.json").lookup(workload, batch_size)
    chosen = entry.params.name
    df = _candidates(Path(plan_dir), workload, batch_size)
    picks = {"second": df[df["mode"] != entry.mode].head(1), "linear": df[df["mode"] == "linear"].head(1),
             "none": df[df["mode"] == "none"].head(1)}
    out, seen = [], {chosen}
    for role, row in picks.items():
        if row.empty or row["policy"].iloc[0] in seen:
            continue
        seen.add(row["policy"].iloc[0])
        spec = PolicySpec.from_dict(row["mode"].iloc[0], json.loads(row["params"].iloc[0]))
        out.append((role, row["policy"].iloc[0], run_flags(spec)))
    return out


def _run_files(loop_dir: Path, runs: str) -> list[tuple[str, bytes]]:
    """(path relative to ``loop_dir``, bytes) of every ``runs``/*/run.json: from the folder, else
    from its copy in runs.tgz (:func:`pack_runs`)."""
    folder, archive = loop_dir / runs, loop_dir / RUNS_ARCHIVE
    if folder.is_dir() or not archive.is_file():
        return [(str(p.relative_to(loop_dir)), p.read_bytes()) for p in sorted(folder.glob("*/run.json"))]
    with tarfile.open(archive) as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile() and len(Path(m.name).parts) == 3
                       and Path(m.name).parts[0] == runs and Path(m.name).name == "run.json")
        return [(name, tar.extractfile(name).read()) for name in names]


def pack_runs(loop_dir) -> Path:
    """Pack runs/ and runs_repeat/ of ``loop_dir`` (their run.json files) into runs.tgz and remove
    the folders; a folder already packed and gone keeps its copy in the archive."""
    loop_dir = Path(loop_dir)
    files = [f for folder in RUN_FOLDERS for f in _run_files(loop_dir, folder)]
    if not files:
        raise SimtreeError(f"no runs/*/run.json under {loop_dir} to pack")
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, data in files:    # fixed order and metadata: the same runs give the same bytes
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    out = write_atomic(loop_dir / RUNS_ARCHIVE, lambda tmp: Path(tmp).write_bytes(buf.getvalue()))
    for folder in RUN_FOLDERS:
        shutil.rmtree(loop_dir / folder, ignore_errors=True)
    return out


def collect_runs(loop_dir, runs: str = "runs") -> pd.DataFrame:
    """One row per ``runs``/*/run.json (a folder of ``loop_dir``, or its copy in runs.tgz) with
    the planner's and the run's own predictions."""
    loop_dir = Path(loop_dir)
    cands = pd.read_csv(loop_dir / "plan" / "candidates.csv")
    rows = []
    for rel, data in _run_files(loop_dir, runs):
        path, run = loop_dir / rel, json.loads(data)
        role = path.parent.name.split("_", 1)[1] if "_" in path.parent.name else "?"
        b, name = int(run["batch_size"]), PolicySpec.from_dict(run["mode"], run["params"]).name
        plan_row = cands[(cands["batch_size"] == b) & (cands["policy"] == name)
                         & (cands["workload"] == run["workload"])]
        m, own = run["measured"], run.get("predicted") or {}
        rows.append({
            "batch_size": b, "role": role, "policy": name, "mode": run["mode"],
            "measured_tok_s": m["tokens_per_s"], "measured_accepted": m["accepted_tokens_per_round"],
            "measured_nodes": m["mean_nodes_per_seq"], "measured_round_us": m["round_us_median"],
            "planned_tok_s": float(plan_row["tok_s"].iloc[0]) if len(plan_row) else np.nan,
            "planned_accepted": float(plan_row["tokens_per_round"].iloc[0]) if len(plan_row) else np.nan,
            "planned_nodes": float(plan_row["nodes_per_seq"].iloc[0]) if len(plan_row) else np.nan,
            "cost_model_tok_s": own.get("tokens_per_s", np.nan),
            # throughput divides by the summed (mean) round time, the profile keeps medians:
            # under a load with a long tail, mean > median shows up as optimistic predictions
            "round_mean_over_median": m["decode_s"] * 1e6 / max(m["rounds"], 1) / m["round_us_median"],
            "rounds": m["rounds"], "prompts": run["prompts"], "max_new_tokens": run["max_new_tokens"],
            "run_json": rel})
    if not rows:
        raise SimtreeError(f"no {runs}/*/run.json under {loop_dir}")
    df = pd.DataFrame(rows)
    df["err_tok_s"] = df["planned_tok_s"] / df["measured_tok_s"] - 1
    df["err_accepted"] = df["planned_accepted"] / df["measured_accepted"] - 1
    df["err_cost_model"] = df["cost_model_tok_s"] / df["measured_tok_s"] - 1
    order = {r: i for i, r in enumerate(ROLES)}
    return df.sort_values(["batch_size", "role"], key=lambda s: s.map(order) if s.name == "role" else s,
                          ignore_index=True)


def _figure(df: pd.DataFrame, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
    marks = {"chosen": "o", "second": "s", "linear": "^", "none": "x"}
    for ax, (meas, pred, label) in zip(axes, (("measured_tok_s", "planned_tok_s", "throughput (tok/s, batch)"),
                                              ("measured_accepted", "planned_accepted",
                                               "accepted tokens / round (incl. bonus)"))):
        for i, (b, sub) in enumerate(df.groupby("batch_size")):
            for r in sub.itertuples():
                ax.plot(getattr(r, meas), getattr(r, pred), marks.get(r.role, "."), color=f"C{i}", ms=7,
                        label=f"b={b}" if r.role == "chosen" else None)
        lo = float(np.nanmin(df[[meas, pred]].to_numpy())) * 0.8
        hi = float(np.nanmax(df[[meas, pred]].to_numpy())) * 1.2
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="0.9", label="+-20%")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel("predicted by the plan")
        if meas == "measured_tok_s":
            ax.set_xscale("log")
            ax.set_yscale("log")
    axes[0].legend(fontsize=7, title="o chosen, s second, ^ linear, x none", title_fontsize=7)
    fig.suptitle("simtree CPU loop: the planner's prediction vs simtree run, same model, same machine", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pct(x: float) -> str:
    return "-" if not np.isfinite(x) else f"{100 * x:+.0f}%"


HOST_CALM = 0.10   # a run's host probe within this of the profile's: the host ran as profiled


def _num(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if np.isfinite(x) else "-"


def _step(prefix: str, batch_size: int, role: str) -> str:
    """A run's step name in timing.tsv / host_probe.tsv (scripts/loop.sh: run_b<B>_<role>, and
    repeat_b<B>_<role> for the repeat phase)."""
    return f"{prefix}_b{batch_size}_{role}"


def host_probe(loop_dir) -> pd.DataFrame | None:
    """``host_probe.tsv`` as a frame indexed by step (the last line of each step: a phase run
    again appends), or None where the loop wrote none."""
    path = Path(loop_dir) / "host_probe.tsv"
    if not path.exists():
        return None
    df = pd.read_csv(path, sep="\t", names=["step", *HOST_METRICS])
    if df.empty:
        return None
    for col in HOST_METRICS:
        df[col] = pd.to_numeric(df[col], errors="coerce")
    return df.drop_duplicates("step", keep="last").set_index("step")


def host_ratio(probe: pd.DataFrame, step: str, ref: str = "profile") -> float:
    """How much slower (> 1) or faster the host ran before ``step`` than before ``ref``: the
    geometric mean of the probe's time ratios over the metrics both measured (nan if none)."""
    if probe is None or step not in probe.index or ref not in probe.index:
        return float("nan")
    return _probe_ratio(probe.loc[step].astype(float).to_dict(), probe.loc[ref].astype(float).to_dict())


def write_loop_report(loop_dir) -> dict[str, Path]:
    """README.md + predicted_vs_measured.png + loop_results.csv in ``loop_dir``."""
    from simtree.costs.profile_table import read_meta

    loop_dir = Path(loop_dir)
    df = collect_runs(loop_dir)
    probe = host_probe(loop_dir)
    if probe is not None:
        df["host_vs_profile"] = [host_ratio(probe, _step("run", r.batch_size, r.role)) for r in df.itertuples()]
    csv = loop_dir / "loop_results.csv"
    df.to_csv(csv, index=False)
    png = _figure(df, loop_dir / "predicted_vs_measured.png")
    costs = json.loads((loop_dir / "costs.json").read_text())
    pmeta = read_meta(loop_dir / "profile.csv")
    policy = json.loads((loop_dir / "plan" / "policy.json").read_text())
    wl = next(iter(policy["source"].get("workloads", {}).values()), {})
    timing = (pd.read_csv(loop_dir / "timing.tsv", sep="\t", names=["step", "seconds", "load1"])
              if (loop_dir / "timing.tsv").exists() else None)
    gpu = pmeta.get("device_type") == "cuda"
    if gpu:
        machine = (f"{pmeta.get('gpu_name', '?')}, driver {pmeta.get('driver', '?')}, torch "
                   f"{pmeta.get('torch_version', '?')}, triton {pmeta.get('triton_version', '?')}; "
                   f"{pmeta.get('cpu_count', '?')} host cores")
    else:
        machine = (f"{pmeta.get('cpu', '?')}, {pmeta.get('cpu_count', '?')} cores, torch "
                   f"{pmeta.get('torch_version', '?')}, {pmeta.get('torch_threads', '?')} torch thread")
    lines = [f"# simtree {'GPU' if gpu else 'CPU'} loop: profile -> fit -> plan -> run, predicted vs measured", "",
             f"Generated by `{'DEVICE=cuda scripts/loop.sh' if gpu else 'scripts/loop_cpu.sh'}` "
             "(`python -m simtree.reporting.loop report`); every number below is read from the files in this folder.", "",
             f"- model: `{costs['meta'].get('model')}` (the runtime's shipped tiny default: a Qwen3.5 GDN hybrid checkpoint, its MTP layer drafting), "
             f"device `{costs['meta'].get('device')}` ({machine}), "
             f"profile sweep `{pmeta.get('sweep', '?')}` in {pmeta.get('elapsed_s', '?')} s",
             f"- cost fit (held-out median / p90 relative error): C_v "
             f"{_fit_err(costs, 'verify')}, C_d {_fit_err(costs, 'draft')}",
             f"- workload: acceptance fitted from `traces.jsonl` ({wl.get('records', '?')} records, "
             f"{wl.get('source', '?')}), mean prompt {wl.get('mean_prompt_len', float('nan')):.0f} tokens, "
             f"{wl.get('output_len', '?')} new tokens per prompt", "",
             "## Predicted vs measured", "",
             "planned = the planner's analytic prediction for that policy (`plan/candidates.csv`); "
             "cost model only = `simtree run --costs`'s own prediction (same costs, acceptance fitted from "
             "that run's traces). err = predicted / measured - 1.", "",
             "| batch | role | policy | measured tok/s | planned tok/s | err | cost model only | err | "
             "measured acc. | planned acc. | err | rounds | mean/median round |"
             + (" host vs profile |" if probe is not None else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if probe is not None else "")]
    for r in df.itertuples():
        lines.append(f"| {r.batch_size} | {r.role} | {r.policy} | {r.measured_tok_s:.1f} | {r.planned_tok_s:.1f} | "
                     f"{_pct(r.err_tok_s)} | {r.cost_model_tok_s:.1f} | {_pct(r.err_cost_model)} | "
                     f"{r.measured_accepted:.2f} | {r.planned_accepted:.2f} | {_pct(r.err_accepted)} | {r.rounds} | "
                     f"{r.round_mean_over_median:.2f} |" + (f" {_num(r.host_vs_profile)} |" if probe is not None else ""))
    if probe is not None:
        lines += ["", "host vs profile = the host probe's time right before the run over right before the "
                  "profile (`host_probe.tsv`, `simtree.machine.hostprobe`: Python, small torch ops"
                  + (", CUDA launches" if gpu else "") + "; > 1: the host ran the run slower than the "
                  "profile it was planned from)."]
    lines += ["", f"![predicted vs measured]({png.name})", "", "## Was the chosen policy the best measured one?", "",
              "| batch | chosen | best measured | chosen / best measured | chosen's measured rank |",
              "|---|---|---|---|---|"]
    for b, sub in df.groupby("batch_size"):
        best = sub.loc[sub["measured_tok_s"].idxmax()]
        ch = sub[sub["role"] == "chosen"]
        if ch.empty:
            continue
        ch = ch.iloc[0]
        rank = int((sub["measured_tok_s"] > ch["measured_tok_s"]).sum()) + 1
        ratio = ch["measured_tok_s"] / best["measured_tok_s"]
        lines.append(f"| {b} | {ch['policy']} | {best['policy']} | {ratio:.2f} | {rank} of {len(sub)} |")
    abs_err = df["err_tok_s"].abs()
    lines += ["", "## Summary", "",
              f"- throughput: median |err| {100 * abs_err.median():.0f}%, max {100 * abs_err.max():.0f}% over "
              f"{len(df)} runs; cost model alone: median |err| {100 * df['err_cost_model'].abs().median():.0f}%",
              f"- accepted tokens per round: median |err| {100 * df['err_accepted'].abs().median():.0f}%, "
              f"max {100 * df['err_accepted'].abs().max():.0f}%",
              f"- mean / median round latency of the runs: median {df['round_mean_over_median'].median():.2f} "
              "(the runs' throughput pays the mean, the profile's latencies are medians)"]
    spikes = df[df["round_mean_over_median"] > SPIKE]
    if len(spikes):
        calm = df.loc[~df.index.isin(spikes.index), "err_tok_s"].abs()
        lines.append(f"- runs slowed by a load burst (mean round > {SPIKE:g} x median): " + ", ".join(
            f"b={r.batch_size} {r.role} ({_pct(r.err_tok_s)})" for r in spikes.itertuples())
            + f"; without them: median |err| {100 * calm.median():.0f}%, max {100 * calm.max():.0f}%")
    if probe is not None and df["host_vs_profile"].notna().any():
        calm = (df["host_vs_profile"] - 1).abs() <= HOST_CALM
        part = [f"- host speed: runs within {100 * HOST_CALM:.0f}% of the profile's host probe: "
                + (f"median |err| {100 * abs_err[calm].median():.0f}% over {int(calm.sum())} runs"
                   if calm.any() else "none")]
        if (~calm).any():
            part.append(f"; the others (host {df.loc[~calm, 'host_vs_profile'].min():.2f}-"
                        f"{df.loc[~calm, 'host_vs_profile'].max():.2f}x the profile's probe time): median |err| "
                        f"{100 * abs_err[~calm].median():.0f}% over {int((~calm).sum())} runs")
        lines.append("".join(part))
    lines += ["",
              "## Noise and caveats", "",
              ("- The tiny models leave the GPU mostly idle: a round's latency is kernel launches, host syncs "
               "and the host's Python work, so it follows the host CPU's speed and load as much as the GPU. "
               if gpu else
               "- This machine has 2 cores shared with other work; every latency here (profile and runs) "
               "carries that load. ")
              + "The profile's p10-p90 spread per point is in `profile.csv`; a run's round latency "
              "median vs p90 is in its `run.json`.",
              "- The evaluation runs decode the same ShareGPT prompts the traces came from (`simtree run` takes "
              "the first prompts of the workload), so the acceptance model is in-sample.",
              "- The planner predicts with expected values (analytic mode); a run has few rounds, so its "
              "accepted length is itself a noisy sample.",
              "- One run per policy: policies whose planned throughputs lie within ~10-15% of each other (most "
              "contrasts here) cannot be ranked by these runs on a shared machine; a rank above is a sample.", ""]
    if timing is not None:
        lines += ["## Loop wall time and machine load", "",
                  f"load = 1-minute load average right after the step ({pmeta.get('cpu_count', '?')} host "
                  "cores: above that count means this loop shared its cores with other work).", "",
                  "| step | seconds | load |", "|---|---|---|"]
        lines += [f"| {r.step} | {r.seconds:.0f} | {r.load1} |" for r in timing.itertuples()]
        lines += [f"| total | {timing['seconds'].sum():.0f} | |", ""]
    if probe is not None:
        lines += ["## Host probe before each step", "",
                  "Medians of `simtree.machine.hostprobe` right before the step (us; lower is faster); x profile = "
                  "the geometric mean of the ratios to the probe before the profile.", "",
                  "| step | python | torch op | launch | x profile |", "|---|---|---|---|---|"]
        lines += [f"| {st} | {_num(r.python_us, 0)} | {_num(r.torch_us)} | {_num(r.launch_us)} | "
                  f"{_num(host_ratio(probe, st))} |" for st, r in probe.iterrows()]
        lines.append("")
    packed = "" if (loop_dir / "runs").is_dir() else f" (packed in `{RUNS_ARCHIVE}`)"
    lines += [f"Files: `profile.csv`, `costs.json` (+ `costs.png`), `traces.jsonl`, `plan/`, `runs/*/run.json`"
              f"{packed}, `{csv.name}`.", ""]
    md = loop_dir / "README.md"
    md.write_text("\n".join(lines))
    return {"markdown": md, "png": png, "csv": csv}


def write_repeat_report(loop_dir, repeat: str = "runs_repeat") -> dict[str, Path]:
    """The same plan's runs measured twice (``runs/`` and ``repeat``, folders of ``loop_dir``):
    repeat.md + repeat.png + repeat.csv in ``loop_dir``: each run's two throughputs and their
    ratio (run-to-run spread on this machine), the plan's error against each and against
    their mean, and whether the chosen policy measured best in each repetition."""
    loop_dir = Path(loop_dir)
    a, b = collect_runs(loop_dir), collect_runs(loop_dir, repeat)
    keys = ["batch_size", "role", "policy"]
    df = a[keys + ["planned_tok_s", "measured_tok_s"]].merge(
        b[keys + ["measured_tok_s"]], on=keys, suffixes=("_1", "_2"))
    if df.empty:
        raise SimtreeError(f"runs/ and {repeat}/ under {loop_dir} share no (batch, role, policy)")
    df["ratio_2_over_1"] = df["measured_tok_s_2"] / df["measured_tok_s_1"]
    df["measured_mean"] = df[["measured_tok_s_1", "measured_tok_s_2"]].mean(axis=1)
    for col in ("1", "2"):
        df[f"err_{col}"] = df["planned_tok_s"] / df[f"measured_tok_s_{col}"] - 1
    df["err_mean"] = df["planned_tok_s"] / df["measured_mean"] - 1
    # the probes tell the repetitions apart only where loop.sh's repeat phase ran the second
    # (its steps are repeat_*): a second pass run as "runs" again on a copy of the folder
    # re-used the run_* names, and its lines replaced the first pass's
    probe = host_probe(loop_dir) if repeat == "runs_repeat" else None
    if probe is not None:
        for col, pre in (("1", "run"), ("2", "repeat")):
            df[f"host_{col}"] = [host_ratio(probe, _step(pre, r.batch_size, r.role)) for r in df.itertuples()]
    csv = loop_dir / "repeat.csv"
    df.to_csv(csv, index=False)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.6, 4.6))
    for i, (bs, sub) in enumerate(df.groupby("batch_size")):
        ax.plot(sub["measured_tok_s_1"], sub["measured_tok_s_2"], "o", color=f"C{i}", label=f"b={bs}")
        ax.plot(sub["measured_tok_s_1"], sub["planned_tok_s"], "x", color=f"C{i}")
    lo = float(df[["measured_tok_s_1", "measured_tok_s_2", "planned_tok_s"]].min().min()) * 0.8
    hi = float(df[["measured_tok_s_1", "measured_tok_s_2", "planned_tok_s"]].max().max()) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="measured tok/s, repetition 1",
           ylabel="o: repetition 2 (same plan), x: planned")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = loop_dir / "repeat.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)

    lines = ["# The same plan run twice: run-to-run spread", "",
             f"Generated by `python -m simtree.reporting.loop repeat <this folder> {repeat}` from "
             f"`runs/*/run.json` (repetition 1) and `{repeat}/*/run.json` (repetition 2), same "
             "profile, costs and plan. err = planned / measured - 1.", "",
             "| batch | role | policy | tok/s rep. 1 | tok/s rep. 2 | rep. 2 / rep. 1 | planned | "
             "err rep. 1 | err rep. 2 | err vs mean |" + (" host rep. 1 | host rep. 2 |" if probe is not None else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if probe is not None else "")]
    for r in df.itertuples():
        lines.append(f"| {r.batch_size} | {r.role} | {r.policy} | {r.measured_tok_s_1:.1f} | "
                     f"{r.measured_tok_s_2:.1f} | {r.ratio_2_over_1:.2f} | {r.planned_tok_s:.1f} | "
                     f"{_pct(r.err_1)} | {_pct(r.err_2)} | {_pct(r.err_mean)} |"
                     + (f" {_num(r.host_1)} | {_num(r.host_2)} |" if probe is not None else ""))
    if probe is not None:
        lines += ["", "host rep. N = the host probe's time right before that run over right before the "
                  "profile (`host_probe.tsv`; > 1: a slower host than the profile's)."]
    lines += ["", f"![repeat]({png.name})", "", "## Was the chosen policy the best measured one?", "",
              "| batch | chosen | best rep. 1 | best rep. 2 | best of the mean |", "|---|---|---|---|---|"]
    best_all = 0
    groups = list(df.groupby("batch_size"))
    for bs, sub in groups:
        ch = sub[sub["role"] == "chosen"]
        if ch.empty:
            continue
        bests = [sub.loc[sub[c].idxmax(), "policy"] for c in
                 ("measured_tok_s_1", "measured_tok_s_2", "measured_mean")]
        best_all += all(x == ch["policy"].iloc[0] for x in bests[:2])
        lines.append(f"| {bs} | {ch['policy'].iloc[0]} | " + " | ".join(bests) + " |")
    spread = (df["ratio_2_over_1"] - 1).abs()
    lines += ["", "## Summary", "",
              f"- run-to-run: |rep. 2 / rep. 1 - 1| median {100 * spread.median():.0f}%, max "
              f"{100 * spread.max():.0f}% over {len(df)} runs",
              f"- planned vs measured: median |err| {100 * df['err_1'].abs().median():.0f}% (rep. 1), "
              f"{100 * df['err_2'].abs().median():.0f}% (rep. 2), "
              f"{100 * df['err_mean'].abs().median():.0f}% against the mean of the two",
              f"- the chosen policy measured best in both repetitions at {best_all} of {len(groups)} "
              "batch sizes"]
    if probe is not None and df[["host_1", "host_2"]].notna().all(axis=1).any():
        moved = (df["host_2"] / df["host_1"] - 1).abs()
        still = moved <= HOST_CALM
        lines.append(f"- host probe between the repetitions: |host 2 / host 1 - 1| median "
                     f"{100 * moved.median():.0f}%; runs whose host moved <= {100 * HOST_CALM:.0f}%: "
                     + (f"throughput spread median {100 * spread[still].median():.0f}% over {int(still.sum())}"
                        if still.any() else "none")
                     + (f", the others {100 * spread[~still].median():.0f}% over {int((~still).sum())}"
                        if (~still & moved.notna()).any() else ""))
    lines.append("")
    md = loop_dir / "repeat.md"
    md.write_text("\n".join(lines))
    return {"markdown": md, "png": png, "csv": csv}


def write_lossless_report(folder) -> Path:
    """README.md of a folder of ``simtree run --check`` runs (``<name>/run.json`` each): per run
    the mode, batch, prompts, outputs that differ from plain greedy decoding, tok/s."""
    folder = Path(folder)
    runs = sorted(folder.glob("*/run.json"))
    if not runs:
        raise SimtreeError(f"no */run.json under {folder}")
    lines = ["# Lossless check: speculative outputs vs plain greedy decoding", "",
             "Generated by `python -m simtree.reporting.loop lossless` from the `*/run.json` files here "
             "(`simtree run --check`: every prompt is also decoded plain greedy and the token sequences "
             "are compared).", "",
             "| run | device | mode | params | batch | prompts | new tokens | outputs that differ | tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in runs:
        r = json.loads(path.read_text())
        if not r.get("lossless_checked"):
            raise SimtreeError(f"{path} was not run with --check")
        params = ", ".join(f"{k}={v}" for k, v in sorted((r.get("params") or {}).items()))
        lines.append(f"| {path.parent.name} | {r.get('device')} | {r.get('mode')} | {params} | "
                     f"{r.get('batch_size')} | {r.get('prompts')} | {r.get('max_new_tokens')} | "
                     f"{r.get('lossless_mismatches')} | {r['measured']['tokens_per_s']:.1f} |")
    md = folder / "README.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def _fit_err(costs: dict, which: str) -> str:
    info = costs.get(which, {}).get("info", {}) if isinstance(costs.get(which), dict) else {}
    err = (info.get("fit_error") or {})
    ho = (err.get("heldout") or {}).get(err.get("kept"), {})
    if not ho:
        return "-"
    return f"{100 * ho['median']:.0f}% / {100 * ho['p90']:.0f}%"


def main(argv: list[str] | None = None) -> int:
    """``python -m simtree.reporting.loop contrast PLAN_DIR WORKLOAD BATCH`` (tab-separated role, policy,
    flags per line) | ``python -m simtree.reporting.loop report LOOP_DIR`` |
    ``python -m simtree.reporting.loop repeat LOOP_DIR [RUNS_FOLDER]`` (default runs_repeat) |
    ``python -m simtree.reporting.loop pack LOOP_DIR`` (runs/ and runs_repeat/ -> runs.tgz) |
    ``python -m simtree.reporting.loop lossless RUNS_DIR``."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) == 4 and argv[0] == "contrast":
            for row in contrast_runs(argv[1], argv[2], int(argv[3])):
                print("\t".join(row))
            return 0
        if len(argv) == 2 and argv[0] == "report":
            paths = write_loop_report(argv[1])
            print(f"wrote {paths['markdown']} and {paths['png']}")
            return 0
        if len(argv) in (2, 3) and argv[0] == "repeat":
            paths = write_repeat_report(*argv[1:])
            print(f"wrote {paths['markdown']} and {paths['png']}")
            return 0
        if len(argv) == 2 and argv[0] == "pack":
            print(f"wrote {pack_runs(argv[1])}")
            return 0
        if len(argv) == 2 and argv[0] == "lossless":
            print(f"wrote {write_lossless_report(argv[1])}")
            return 0
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
