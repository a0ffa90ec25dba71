"""The report of :mod:`modes_gpu`'s runs: every mode measured at full scale beside the plan's choice.

    python -m simtree.runtime.full.modes_gpu report DIR_OR_TGZ [...] --out reports/h100/modes [--gpu NAME]

Each input is a run folder (``modes_gpu --out DIR``: modes.csv, lossless.csv, log.txt,
plan/, measure/summary.csv) or a .tgz holding one (at its top) or several (one folder each).
Written atomically into ``--out``, after every input has been read:

- ``modes.csv``: every measured run of every model and batch size: its mode, whether it is the
  plan's choice, measured and predicted tok/s (the error split into cost and acceptance parts
  from measure/summary.csv), its measured rank, the best measured run and the plan's choice's
  throughput over it (``plan_over_best``), accepted tokens and round time, the GPU, the run folder;
- ``lossless.csv``: every mode's live greedy check against plain decoding, with the near-tie
  flag (a difference where the plain top-2 margin is within twice the verify-vs-decode deviation);
- ``modes.png``: per model and batch size, every run's measured tok/s as a bar (the plan's
  choice marked), its prediction as a dot;
- ``README.md``: what ran, the command that regenerates it, and the tables, with the modes that
  failed or were not run and the log lines that say why.

One model may come from several run folders at batch sizes that do not overlap (a (model, batch)
point measured twice is refused); each row's ``run`` column names the folder it came from.

The GPU a run used comes from its record (a ``gpu`` column, a ``gpu:`` log line, or the
nvidia-smi line ``scripts/modes_gpu.sh`` logs); ``--gpu`` names it for runs without one.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tarfile
import tempfile
from pathlib import Path

import pandas as pd

from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic
from simtree.reporting.summary import PLAN_TOLERANCE, plan_standing, plans_counted

from .modes_readme import plans_other_batch

__all__ = ["MODE_SHAPES", "COLUMNS", "LOSSLESS_COLUMNS", "run_dirs", "load", "report", "main"]

COLUMNS = ("model", "batch_size", "policy", "mode", "plan_choice", "measured_tok_s", "predicted_tok_s", "rel_err",
           "cost_rel_err", "accept_rel_err", "measured_rank", "best_measured", "plan_over_best",
           "measured_accepted", "predicted_accepted", "round_ms", "gpu", "plan_of_run", "run")
LOSSLESS_COLUMNS = ("model", "policy", "mode", "batch_size", "dtype", "match", "near_tie", "margin", "deviation",
                    "first_diff", "plain_token", "spec_token", "accepted_tokens_per_round", "run")
# longest first: a shape's name starts with its mode's ("best_first_d8_w1_p3", "none", "linear_d4")
MODE_PREFIXES = ("batch_alloc", "best_first", "cost_aware", "dspark", "block", "eagle", "linear", "tfm", "none")
PROBLEM = re.compile(r"FAILED|skipped|not run|exited with|no C_d|no drafter rows")

# one shape of every mode the full runtime builds (plain and linear D=4 run anyway)
MODE_SHAPES = [("eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
               ("best_first", {"budget": 8, "draft_depth": 3}),
               ("cost_aware", {"max_budget": 16, "draft_depth": 3}),
               ("batch_alloc", {"max_budget_per_seq": 16, "draft_depth": 3}),
               ("block", {"budget": 8, "block_len": 7}),
               ("block", {"budget": 16, "block_len": 7}),
               ("tfm", {"budget": 16, "width": 4, "block_len": 7}),
               ("dspark", {"block_len": 7}),
               ("dspark", {"block_len": 7, "threshold": 0.3})]


def mode_of(policy: str) -> str:
    """The mode of a run's policy label (``plan:block_d8_p7`` -> ``block``)."""
    shape = str(policy).split(":", 1)[-1]
    return next((m for m in MODE_PREFIXES if shape.startswith(m)), shape)


def run_dirs(inputs: list[Path], scratch: Path) -> list[Path]:
    """The run folders (each with a modes.csv) of folders and .tgz archives (unpacked under ``scratch``)."""
    out = []
    for i, path in enumerate(inputs):
        path = Path(path)
        if path.is_file() and path.name.endswith((".tgz", ".tar.gz")):
            dest = scratch / f"in{i}" / path.name.removesuffix(".tgz").removesuffix(".tar.gz")   # a root-level run: the archive's name
            try:
                with tarfile.open(path) as tar:
                    tar.extractall(dest, filter="data")
            except (tarfile.TarError, OSError) as exc:
                raise SimtreeError(f"{path}: not a readable .tgz ({exc})") from None
            path = dest
        elif not path.is_dir():
            raise SimtreeError(f"{path}: no such run folder or .tgz")
        found = [path] if (path / "modes.csv").is_file() else sorted(p.parent for p in path.glob("*/modes.csv"))
        if not found:
            raise SimtreeError(f"{inputs[i]}: no modes.csv (give the --out folder of "
                               f"`python -m simtree.runtime.full.modes_gpu`, or a .tgz of it)")
        out += found
    return out


def _gpu(modes: pd.DataFrame, log: list[str], given: str | None) -> tuple[str, bool]:
    """(the GPU the run used, whether ``given`` named it because the run did not record it)."""
    if "gpu" in modes and modes["gpu"].notna().any():
        return str(modes["gpu"].dropna().iloc[0]), False
    for line in log:
        m = re.search(r"\] gpu: (.+)$", line)
        if m:
            return m.group(1).strip(), False
        if re.match(r"^(NVIDIA|AMD|Tesla)", line):       # nvidia-smi's csv row: name, driver, memory
            return line.split(",")[0].strip(), False
    return (given, True) if given else ("not recorded", False)


def load(d: Path, gpu: str | None = None) -> dict:
    """One run folder: its measured runs (COLUMNS), lossless checks, and what did not run and why."""
    from simtree.planning.modes import PolicySpec

    modes = pd.read_csv(d / "modes.csv")
    missing_cols = {"model", "batch_size", "policy", "measured_tok_s", "predicted_tok_s"} - set(modes.columns)
    if missing_cols or modes.empty:
        raise SimtreeError(f"{d / 'modes.csv'}: no runs or no {', '.join(sorted(missing_cols))} column")
    log = (d / "log.txt").read_text().splitlines() if (d / "log.txt").is_file() else []
    model, (gpu_name, gpu_named) = str(modes["model"].iloc[0]), _gpu(modes, log, gpu)
    run = d.resolve().name     # the run's label in every table and line (a folder given as "." too)
    parts = d / "measure" / "summary.csv"
    if parts.is_file():
        extra = pd.read_csv(parts)[["batch_size", "policy", "cost_rel_err", "accept_rel_err", "predicted_accepted"]]
        modes = modes.drop(columns=[c for c in extra.columns[2:] if c in modes]).merge(
            extra, on=["batch_size", "policy"], how="left")
    runs = [r for r in modes.to_dict("records") if math.isfinite(float(r["measured_tok_s"]))]
    policy = _plan_policy(d / "plan" / "policy.json")
    deployment = _policy_field(policy, "deployment")      # the deployment the run's plan priced
    plan_of_run = not plans_other_batch(deployment)
    standing = {(m, b): (plan, best) for m, b, plan, best, _ in plan_standing(runs)}
    rows = []
    for b in sorted({int(r["batch_size"]) for r in runs}):
        group = [r for r in runs if int(r["batch_size"]) == b]
        plan, best = standing.get((model, b), (None, max(group, key=lambda r: r["measured_tok_s"])))
        for r in group:
            rows.append({"model": model, "batch_size": b, "policy": r["policy"], "mode": mode_of(r["policy"]),
                         "plan_choice": r is plan, "measured_tok_s": r["measured_tok_s"],
                         "predicted_tok_s": r["predicted_tok_s"], "rel_err": r.get("rel_err", float("nan")),
                         "cost_rel_err": r.get("cost_rel_err", float("nan")),
                         "accept_rel_err": r.get("accept_rel_err", float("nan")),
                         "measured_rank": 1 + sum(o["measured_tok_s"] > r["measured_tok_s"] for o in group),
                         "best_measured": best["policy"],
                         "plan_over_best": plan["measured_tok_s"] / best["measured_tok_s"] if plan else float("nan"),
                         "measured_accepted": r.get("measured_accepted", float("nan")),
                         "predicted_accepted": r.get("predicted_accepted", float("nan")),
                         "round_ms": r.get("round_ms", float("nan")), "gpu": gpu_name, "plan_of_run": plan_of_run,
                         "run": run})
    problems = [line for line in log if PROBLEM.search(line)]
    shapes = [PolicySpec.from_dict(m, p) for m, p in MODE_SHAPES]
    wanted = ["plain:none", "linear_d4:linear_d4"] + [f"{s.mode}:{s.name}" for s in shapes]
    absent = []
    for b in sorted({int(x) for x in modes["batch_size"]}):
        ran = {r["policy"] for r in rows if r["batch_size"] == b}
        for w in wanted:
            if w not in ran:
                absent.append({"model": model, "batch_size": b, "what": w, "why": _why(w.split(":")[1], log)})
        if not any(p.startswith("plan:") for p in ran):
            absent.append({"model": model, "batch_size": b, "what": "the plan's choice",
                           "why": _why("plan", log)})
    lossless = pd.read_csv(d / "lossless.csv") if (d / "lossless.csv").is_file() else pd.DataFrame()
    checked = set(lossless["policy"]) if "policy" in lossless else set()
    absent += [{"model": model, "batch_size": "lossless", "what": s.name, "why": _why(s.name, log)}
               for s in shapes if s.name not in checked]
    if not lossless.empty:
        lossless.insert(0, "model", model)
        lossless["mode"] = [mode_of(p) for p in lossless["policy"]]
        if "dtype" not in lossless:      # modes_gpu builds the model in bf16 on CUDA (build_model's default)
            lossless["dtype"] = "bf16"
        if "near_tie" not in lossless:
            lossless["near_tie"] = False
        lossless["run"] = run
        lossless = lossless.reindex(columns=list(LOSSLESS_COLUMNS))
    summary = pd.read_csv(parts) if parts.is_file() else pd.DataFrame()
    meta = {"acceptance": ", ".join(sorted(map(str, summary["acceptance"].unique()))) if "acceptance" in summary else "",
            "graphs": bool(summary["graphs"].astype(str).eq("True").all()) if "graphs" in summary else None,
            "rounds": int(summary["rounds"].max()) if "rounds" in summary else None}
    meta["gpu_named"] = gpu_named
    meta["plan_deployment"] = deployment
    return {"run": run, "model": model, "gpu": gpu_name, "meta": meta, "rows": rows, "lossless": lossless, "problems": problems,
            "absent": absent, "note": "; ".join(filter(None, [costs_note(modes, log, _policy_field(policy, "created")),
                                                          *bundle_caveat(policy)]))}


def costs_note(modes: pd.DataFrame, log: list[str], created: str | None) -> str:
    """What the run priced with: its note (modes.csv's ``note`` column, else the log line naming
    the drafters' profile).  A note that names the drafters' profile by its path alone (runs
    before the note named the sweep's variant, contexts and days) gets the time the run planned
    (``plan/policy.json``'s ``created``): the table at that path then, not the one there now."""
    notes = [str(n) for n in modes["note"].dropna()] if "note" in modes else []
    note = next((n for n in notes if "drafters' C_d from" in n), "") or \
        next((line.split("] ", 1)[-1] for line in log if "drafters' C_d from" in line), "")
    m = re.match(r"(drafters' C_d from \S+)( \(([^)]*)\))?", note)
    if not m or "variant" in (m.group(3) or ""):
        return note
    when = (f"the sweep at that path when the run planned, {created[:16].replace('T', ' ')} UTC" if created
            else "the sweep at that path when the run planned, a date the run did not record")
    inside = f"{m.group(3)}; " if m.group(3) else ""
    return f"{m.group(1)} ({inside}{when}){note[m.end():]}"


def _plan_policy(path: Path) -> dict:
    """The run's ``plan/policy.json``; {} where absent, unreadable, not JSON or not an object."""
    if not path.is_file():
        return {}
    try:
        policy = json.loads(path.read_text())
    except (ValueError, OSError):
        return {}
    return policy if isinstance(policy, dict) else {}


def bundle_caveat(policy: dict) -> list[str]:
    """What to say of the cost bundle the run's plan recorded: that it was fitted on a shipped
    profile (by sha256) no longer at its path - the predictions are that bundle's, not today's -
    and the caveat the bundle carried then; [] where neither."""
    src = policy.get("source") if isinstance(policy.get("source"), dict) else {}
    costs = src.get("costs") if isinstance(src.get("costs"), dict) else {}
    prof = costs.get("source") if isinstance(costs.get("source"), dict) else {}
    parts = []
    path, sha = str(prof.get("profile") or ""), str(prof.get("sha256") or "")
    if path.startswith("simtree/data/profiles/") and sha:
        from simtree.data import data_path
        from simtree.fileio import file_sha256
        here = data_path(*Path(path).parts[2:])
        if not here.is_file() or file_sha256(here) != sha.removeprefix("sha256:"):
            parts.append(f"that bundle was fitted on a profile ({path}, {sha.removeprefix('sha256:')[:12]}) replaced "
                         "since: these predictions are the bundle of the run's time, not the one shipped now")
    if costs.get("caveat"):
        parts.append(f"that bundle's caveat then: {costs['caveat']}")
    return parts


def _policy_field(policy: dict, key: str) -> str | None:
    """``key`` of the run's policy as a string, None where absent or empty."""
    return str(policy.get(key) or "") or None


def _why(name: str, log: list[str]) -> str:
    said = [line.split("] ", 1)[-1] for line in log if name in line and PROBLEM.search(line)]
    return "; ".join(said) if said else "no run in its files (the log says nothing of it)"


def report(inputs: list[Path], out: Path, gpu: str | None = None, command: str | None = None) -> dict:
    """Read every input, then write out/modes.csv, lossless.csv, modes.png and README.md."""
    from .modes_readme import plot_modes, readme

    with tempfile.TemporaryDirectory() as scratch:
        runs = sorted((load(d, gpu) for d in run_dirs(inputs, Path(scratch))),
                      key=lambda r: (r["model"], min(x["batch_size"] for x in r["rows"]) if r["rows"] else 0))
    _refuse_overlap(runs)
    table = pd.DataFrame([row for r in runs for row in r["rows"]], columns=list(COLUMNS))
    table = table.sort_values(["model", "batch_size"], kind="stable", ignore_index=True)   # a model's runs interleave
    if table.empty:
        raise SimtreeError("no measured run in the inputs' modes.csv")
    lossless = pd.concat([r["lossless"] for r in runs if not r["lossless"].empty] or
                         [pd.DataFrame(columns=list(LOSSLESS_COLUMNS))], ignore_index=True)
    command = command or ("python -m simtree.runtime.full.modes_gpu report " + " ".join(map(str, inputs))
                          + (f' --gpu "{gpu}"' if gpu else "") + f" --out {out}")
    text = readme(table, lossless, runs, command)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "modes.csv", table.to_csv(index=False, float_format="%.6g"))
    write_text_atomic(out / "lossless.csv", lossless.to_csv(index=False, float_format="%.6g"))
    plot_modes(table, out / "modes.png")
    write_text_atomic(out / "README.md", text)
    points, _ = plans_counted(table)
    return {"runs": len(table), "points": len(points),
            "plan_ok": int((1 - points["plan_over_best"] <= PLAN_TOLERANCE).sum()),
            "checks": len(lossless), "match": int((lossless["match"].astype(str) == "True").sum())}


def _refuse_overlap(runs: list[dict]) -> None:
    """One model may come from several run folders, each at its own batch sizes: a (model, batch)
    point measured by two folders (or two folders of one name) is refused."""
    seen: dict[tuple[str, int], str] = {}
    names = [r["run"] for r in runs]
    if len(set(names)) < len(names):
        raise SimtreeError(f"two run folders of one name among the inputs ({', '.join(sorted(names))}): "
                           "name each run's folder apart")
    for r in runs:
        for b in sorted({x["batch_size"] for x in r["rows"]}):
            other = seen.setdefault((r["model"], b), r["run"])
            if other != r["run"]:
                raise SimtreeError(f"two runs of {r['model']} at batch {b} ({other}, {r['run']}): "
                                   "give each (model, batch) point once")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simtree.runtime.full.modes_gpu report",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", type=Path, help="run folders of modes_gpu, or .tgz archives of them")
    ap.add_argument("--out", type=Path, default=Path("reports/h100/modes"))
    ap.add_argument("--gpu", default=None, help="the GPU that ran the runs that do not record it")
    args = ap.parse_args(argv)
    try:
        s = report(args.inputs, args.out, args.gpu)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{s['runs']} runs; the plan's choice best or within {100 * PLAN_TOLERANCE:.0f}% at {s['plan_ok']} of "
          f"{s['points']} points; lossless {s['match']} of {s['checks']} checks match -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
