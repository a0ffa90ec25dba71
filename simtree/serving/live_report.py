"""The live run's report: measured TPOT per phase against the serving benchmark's prediction
(``scripts/serve_live.py`` writes the CSV), as the ``## Live run`` section of the benchmark's
README (``simtree bench-serve`` keeps that section when it rewrites the README).

    python -m simtree.serving.live_report OUT/serve_live.csv --readme reports/bench_serve/README.md

A full-scale run (``scripts/serve_live_full_gpu.sh``: replayed acceptance, a frozen shipped bundle)
is its own section, ``## Live run at full scale, out of sample`` (``--full-scale``):

    python -m simtree.serving.live_report OUT/serve_live_full.csv --full-scale --readme reports/bench_serve/README.md

A CSV that ``scripts/serve_live_reprice.py`` priced again on a bundle refitted from the run's own
profile (CPU replay, the measured columns as measured) carries the run's own prediction
(``REPRICE_COLUMNS``); the section then gives both.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from simtree.data import data_path
from simtree.deploy.shipped import shipped_machine_for
from simtree.errors import SimtreeError
from simtree.fileio import archived_by_sha, file_sha256, write_text_atomic

__all__ = ["COLUMNS", "CATCH_UP_COLUMNS", "REPRICE_COLUMNS", "FULL_COLUMNS", "TOLERANCE", "live_section", "read_full_run",
           "full_section", "merge_section", "existing_section", "experts", "SECTION", "FULL_SECTION"]

COLUMNS = ["phase", "batch_size", "new_tokens", "rounds", "switches", "tiers", "measured_tpot_ms",
           "predicted_tpot_ms", "predicted_model_tpot_ms", "tokens_per_round", "wall_s", "prefill_ms", "device",
           "costs", "prompts", "controller_steps", "controller_switches", "switch_bound"]
CATCH_UP_COLUMNS = ["catch_ups", "measured_catchup_ms", "predicted_catchup_ms"]   # absent from earlier runs' CSVs
REPRICE_COLUMNS = ["run_predicted_tpot_ms", "run_costs"]   # a re-priced run's own prediction and bundle
FULL_COLUMNS = ["model", "dtype", "acceptance"]   # the target, its dtype, live or replay:<workload> (later runs)
FROZEN_COLUMNS = ["weights", "costs_sha256", "costs_device"]   # random or the checkpoint read; the bundle's bytes, device
REPRICE_SCRIPT = "scripts/serve_live_reprice.py"
TOLERANCE = 0.10   # the target: measured TPOT within 10% of the benchmark's prediction
SECTION = "## Live run"
FULL_SECTION = "## Live run at full scale, out of sample"
SHIPPED_COSTS = "simtree/data/costs/"   # where the frozen bundles are shipped


def _read(path: str | Path) -> pd.DataFrame:
    try:
        df = pd.read_csv(path)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise SimtreeError(f"{path}: cannot read the live run's CSV ({type(exc).__name__})") from None
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing or df.empty:
        raise SimtreeError(f"{path}: not a live run's CSV (scripts/serve_live.py): "
                           f"{'missing ' + ', '.join(missing) if missing else 'no rows'}")
    return df


def tpot_errors(df: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per phase, predicted over measured TPOT - 1: the step prediction's, and the expected-acceptance one's."""
    return (df.predicted_tpot_ms / df.measured_tpot_ms - 1, df.predicted_model_tpot_ms / df.measured_tpot_ms - 1)


def _table(df: pd.DataFrame, repriced: bool) -> tuple[list[str], pd.Series, pd.Series]:
    """The phase table's lines, and the errors of the prediction and of the expected-acceptance one."""
    err, model_err = tpot_errors(df)
    caught = all(c in df.columns for c in CATCH_UP_COLUMNS)
    lines = ["| phase | batch | rounds | tiers run | measured ms/token | predicted | error | predicted (expected acceptance) |"
             + (" run's own prediction (error) |" if repriced else "")
             + (" catch-ups | measured catch-up ms | predicted |" if caught else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if repriced else "") + ("---|---|---|" if caught else "")]
    for (_, r), e, m in zip(df.iterrows(), err, model_err):
        lines.append(f"| {int(r.phase)} | {int(r.batch_size)} | {int(r.rounds)} | {r.tiers} | "
                     f"{r.measured_tpot_ms:.3f} | {r.predicted_tpot_ms:.3f} | {e:+.1%} | "
                     f"{r.predicted_model_tpot_ms:.3f} ({m:+.1%}) |"
                     + (f" {r.run_predicted_tpot_ms:.3f} ({r.run_predicted_tpot_ms / r.measured_tpot_ms - 1:+.1%}) |"
                        if repriced else "")
                     + (f" {int(r.catch_ups)} | {r.measured_catchup_ms:.3f} | {r.predicted_catchup_ms:.3f} |"
                        if caught else ""))
    return lines, err, model_err


def _verdict(df: pd.DataFrame, err: pd.Series, model_err: pd.Series) -> str:
    last = df.iloc[-1]
    ok = bool((err.abs() <= TOLERANCE).all())
    return (f"Measured TPOT within {TOLERANCE:.0%} of the benchmark's step prediction at every phase: "
            f"{'yes' if ok else 'NO'} ({int((err.abs() <= TOLERANCE).sum())} of {len(err)} phases; worst "
            f"{err.abs().max():.1%}); with the controller's expected acceptance instead of the accepted tokens: worst "
            f"{model_err.abs().max():.1%}. Switches: {int(last.controller_switches)} in {int(last.controller_steps)} "
            f"steps (bound {int(last.switch_bound)}).")


def live_section(path: str | Path, command: str, later: str | Path | None = None,
                 later_costs: str | None = None) -> str:
    """The README section: one row per phase, the worst error, the controller's switches; with
    ``later``, a later session's run predicted by ``later_costs`` (a bundle fitted on the first
    run's profile, committed before the later run): out of sample."""
    df = _read(path)
    last = df.iloc[-1]
    repriced = all(c in df.columns for c in REPRICE_COLUMNS)
    if repriced:
        run_err = df.run_predicted_tpot_ms / df.measured_tpot_ms - 1
        costs = (f"`{last.costs}` (this checkout's `simtree fit` of the run's own profile, replayed on CPU and priced "
                 f"by `{REPRICE_SCRIPT}`; the run itself predicted with `{last.run_costs}`, the archive's costs.json, "
                 f"worst {run_err.abs().max():.1%}, column run_predicted_tpot_ms): in sample, both fitted on this "
                 "session's own profile")
    else:
        costs = f"the bundle fitted to this runtime on this device (`{last.costs}`): in sample, the costs are " \
                "fitted on this session's own profile"
    table, err, model_err = _table(df, repriced)
    lines = [SECTION, "",
             f"The controller live in simtree's runtime (a tiny model) on {last.device}, the batch changing phase by phase "
             f"({', '.join(str(b) for b in df.batch_size)}), {int(df.new_tokens.iloc[0])} tokens per sequence per "
             f"phase, prompts: {last.prompts}; costs: {costs}. Report: `{command}`; run: "
             "`scripts/serve_live_gpu.sh`" + (f", then `{REPRICE_SCRIPT}`" if repriced else "") + ".", "",
             _verdict(df, err, model_err), "", *table]
    if later is not None:
        ldf = _read(later)
        llast = ldf.iloc[-1]
        ltable, lerr, lmodel = _table(ldf, False)
        bias = lerr[ldf.tiers.str.startswith("none")]
        lines += ["", "### The same schedule again in a later session", "",
                  f"The same phases and prompts served again in a later session on {llast.device}, predicted with "
                  f"`{later_costs or llast.costs}`: `simtree fit` of the run above's profile (its archive's "
                  "profile.csv), fitted by committed code from that committed profile before the phases ran (this "
                  "checkout refits it to the same bundle). No measurement of this run went into the costs, but it "
                  "repeats the schedule above (the same tiers and rounds, so the same predictions) and the form kept "
                  "for plain decoding's curve, grid_mono, was added after the run above's batch-2 phases were seen "
                  "to miss: a new measurement of the same schedule, not a test of the fit on new points."
                  + (f" Its plain phases are predicted {bias.min():+.1%} to {bias.max():+.1%} (too fast), as the run "
                     "above's are." if len(bias) and (bias < 0).all() else ""),
                  "", _verdict(ldf, lerr, lmodel), "", *ltable]
    return "\n".join(lines) + "\n"


FROZEN_ARCHIVE = "frozen_bundles.tgz"   # the refitted bundles' committed copies, one archive beside the runs


def frozen_bundle(path: str | Path, costs: str, sha: str) -> Path:
    """The committed bundle a full-scale run predicted with: this installation's shipped file of that
    name where its bytes are the run's, else the copy kept beside the run's CSV as ``frozen_<name>``
    (or that member of :data:`FROZEN_ARCHIVE` there) once the shipped one was refitted (the run's
    bundle, still committed); neither -> one line."""
    name = Path(costs).name
    for candidate in (data_path("costs", name), Path(path).parent / f"frozen_{name}"):
        if candidate.is_file() and file_sha256(candidate) == sha:
            return candidate
    kept = archived_by_sha(Path(path).parent / FROZEN_ARCHIVE, sha, f"frozen_{name}")
    if kept is not None:
        return kept
    raise SimtreeError(f"{path}: the run's bundle (sha256 {sha[:12]}) is neither the committed {SHIPPED_COSTS}{name} "
                       f"nor a frozen_{name} beside the run (or in its {FROZEN_ARCHIVE}): not frozen")


def read_full_run(path: str | Path) -> tuple[pd.DataFrame, Path]:
    """(the phases, the frozen bundle that priced them: :func:`frozen_bundle`) of a run of
    ``scripts/serve_live_full_gpu.sh``, checked: acceptance replayed, costs a frozen shipped
    bundle fitted on the run's kind of device, one run on one bundle; one line otherwise."""
    df = _read(path)
    last = df.iloc[-1]
    missing = [c for c in FULL_COLUMNS + FROZEN_COLUMNS if c not in df.columns]
    if missing or not str(last.acceptance).startswith("replay") or SHIPPED_COSTS not in Path(str(last.costs)).as_posix():
        raise SimtreeError(f"{path}: not a full-scale run (replayed acceptance, a bundle shipped in {SHIPPED_COSTS}): "
                           + (f"missing {', '.join(missing)}" if missing else f"acceptance {last.acceptance}, "
                              f"costs {last.costs}"))
    for col in ("costs", "costs_sha256", "costs_device", "device", "acceptance"):   # one run: every phase alike
        if df[col].astype(str).nunique() != 1:
            raise SimtreeError(f"{path}: its phases name {df[col].astype(str).nunique()} different {col} values: "
                               "not one run on one frozen bundle")
    shipped = frozen_bundle(path, str(last.costs), str(last.costs_sha256))
    kinds = [shipped_machine_for(str(d), "") for d in (last.costs_device, last.device)]   # h100, h200; "" unknown
    if not kinds[0] or kinds[0] != kinds[1]:
        raise SimtreeError(f"{path}: costs fitted on {last.costs_device}, the run on {last.device}: another device's "
                           "costs")
    return df, shipped


def full_section(path: str | Path | list, command: str) -> str:
    """The full-scale section: a run of ``scripts/serve_live_full_gpu.sh`` (acceptance replayed,
    costs a frozen shipped bundle: the committed file's bytes, fitted on the run's kind of
    device), one row per phase; several runs (a list of CSVs, e.g. one per model family): one
    subsection each, headed by its model."""
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    runs = [read_full_run(p) for p in paths]
    if len(runs) == 1:
        return "\n".join([FULL_SECTION, "", *_full_lines(*runs[0], command)]) + "\n"
    models = [str(df.iloc[-1]["model"]) for df, _ in runs]
    if len(set(models)) != len(models):
        raise SimtreeError(f"{', '.join(map(str, paths))}: two runs of one model ({', '.join(models)}): one per model")
    lines = [FULL_SECTION]
    for (df, shipped), model in zip(runs, models):
        lines += ["", f"### {model}", "", *_full_lines(df, shipped, command)]
    return "\n".join(lines) + "\n"


def _kept_as(shipped: Path) -> str:
    """A frozen copy's name beside the run: the file, or ``archive:member``."""
    return f"{FROZEN_ARCHIVE}:{shipped.name}" if shipped.parent.name == FROZEN_ARCHIVE else shipped.name


def _full_lines(df: pd.DataFrame, shipped: Path, command: str) -> list[str]:
    """One full-scale run's paragraph, verdict and phase table (:func:`full_section`)."""
    last = df.iloc[-1]
    weights = "random weights" if str(last.weights) == "random" else f"weights from {last.weights}"
    why = ": random weights accept nothing" if str(last.weights) == "random" else ""
    table, err, model_err = _table(df, False)
    return [f"OUT OF SAMPLE: the controller live in simtree's full runtime on {last['model']} ({last['dtype']}"
            f"{experts(str(last['model']))}, {weights}) on {last.device}, the batch changing phase by phase ({', '.join(str(b) for b in df.batch_size)}), "
            f"{int(df.new_tokens.iloc[0])} tokens per sequence per phase, prompts: {last.prompts}. Acceptance "
            f"replayed ({last.acceptance}{why}; each drafted tier's rounds accept as the modes runs replay them, a "
            "fresh draw each phase, and the controller's running estimate sees that). Costs frozen: the shipped "
            f"bundle `{last.costs}` (sha256 {str(last.costs_sha256)[:12]}, the committed file"
            + ("" if shipped.parent == data_path("costs") else f", kept as `{_kept_as(shipped)}` beside the run since "
               "the shipped one was refitted") + "), fitted in an earlier "
            "GPU session on this kind of device; nothing in this run was profiled or fitted. Predicted: every round "
            "priced as `simtree bench-serve` prices a step (C_d of the tier run + C_v at the round's batch, nodes and "
            "context, plus the catch-up after plain rounds) over the tokens the round accepted; the expected-acceptance "
            "column divides by the tokens the controller expected instead (its running estimate, learned in the run). "
            f"Report: `{command}`; run: `scripts/serve_live_full_gpu.sh`" + (
                "" if str(last["model"]) == "qwen3.6-27b" else f" with MODEL={last['model']}") + ".", "",
            _verdict(df, err, model_err), "", *table]


def experts(model: str) -> str:
    """', FP8 experts' where the model's routed experts run in FP8 (V4-Flash: its checkpoint's
    block-scaled FP8), '' otherwise or for a model this installation does not know."""
    from simtree.models import get_model
    from simtree.quant import expert_dtype
    try:
        mlp = get_model(model).mlp
    except SimtreeError:
        return ""
    return ", FP8 experts" if mlp and expert_dtype(mlp) == "fp8" else ""


def _split(text: str, heading: str = SECTION) -> tuple[str, str, str]:
    """(before, the section headed by the line ``heading`` up to the next ``## `` heading, after)."""
    found = re.search(f"^{re.escape(heading)}$", text, re.M)
    if found is None:
        return text, "", ""
    at = found.start()
    after = text.find("\n## ", at + len(heading))
    end = len(text) if after < 0 else after + 1
    return text[:at], text[at:end], text[end:]


def merge_section(readme: str, section: str, heading: str = SECTION) -> str:
    """``readme`` with its section headed ``heading`` replaced by ``section``, or it appended."""
    head, old, tail = _split(readme, heading)
    if not old:
        return readme.rstrip("\n") + "\n\n" + section
    return head + section + ("\n" + tail if tail else "")


def existing_section(readme_path: Path) -> str:
    """The live sections (``## Live run``, the full-scale one) of an existing README, in their
    order ("" if none), for a rewrite to keep."""
    text = readme_path.read_text() if readme_path.is_file() else ""
    found = sorted((len(head), part) for head, part, _ in (_split(text, h) for h in (SECTION, FULL_SECTION)) if part)
    return "".join(part for _, part in found)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="The live run's CSV as the benchmark README's live section")
    ap.add_argument("csv", nargs="+", help="the run's CSV (with --full-scale: one per model, in order)")
    ap.add_argument("--readme", default="reports/bench_serve/README.md")
    ap.add_argument("--later", default=None, help="a later session's run (serve_live.py CSV), predicted out of sample")
    ap.add_argument("--later-costs", default=None, help="the committed copy of the bundle that later run predicted with")
    ap.add_argument("--full-scale", action="store_true",
                    help="a full-scale run (scripts/serve_live_full_gpu.sh): its own section, out of sample")
    args = ap.parse_args(argv)
    if args.full_scale and args.later:
        raise SimtreeError("--later belongs to the tiny model's section, not to --full-scale")
    if not args.full_scale and len(args.csv) != 1:
        raise SimtreeError(f"{' '.join(args.csv)}: one CSV for the live section (several only with --full-scale)")
    csvs = " ".join(args.csv)
    command = f"python -m simtree.serving.live_report {csvs} --readme {args.readme}" + (
        f" --later {args.later}" + (f" --later-costs {args.later_costs}" if args.later_costs else "") if args.later else "")
    if args.full_scale:
        command = f"python -m simtree.serving.live_report {csvs} --full-scale --readme {args.readme}"
    section = full_section(args.csv, command) if args.full_scale else \
        live_section(args.csv[0], command, args.later, args.later_costs)
    path = Path(args.readme)
    if not path.is_file():
        raise SimtreeError(f"{path}: no README to add the live run to (run simtree bench-serve first)")
    write_text_atomic(path, merge_section(path.read_text(), section, FULL_SECTION if args.full_scale else SECTION))
    print(section)


if __name__ == "__main__":
    try:
        main()
    except SimtreeError as exc:
        raise SystemExit(f"error: {exc}") from None
