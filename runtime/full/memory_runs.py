"""The deployment memory check against the H100 runs whose outcome is logged: every run of the
archived full-runtime runs (``summary.json`` of each point) that ran or ran out of memory, what the
check counts for it (the rank alone with all b sequences, at the cache rows the run allocated,
its round's nodes as it ran them, its drafter) and the check's verdict.

    python -m simtree.runtime.full.memory_runs docs/deployments.md     # rewrite its table

A run skipped (the time was up, or a check refused it before it ran) has no outcome and is left
out, as is a run that failed for another reason (the archives hold none).
"""
from __future__ import annotations

import json
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from simtree.errors import SimtreeError
from simtree.fileio import rewrite_marked_block
from simtree.planning.modes import PolicySpec

from .measure import RunConfig, memory_use, run_shape

__all__ = ["ARCHIVES", "LoggedRun", "logged_runs", "check_runs", "disagreements", "runs_table", "write_runs_doc",
           "DOC_START", "DOC_END"]

ARCHIVES = ("reports/validation/oos_runs.tgz", "reports/h100/modes/runs.tgz")
DOC_START, DOC_END = "<!-- memory-runs:start -->", "<!-- memory-runs:end -->"
OOM = "OutOfMemoryError"


@dataclass(frozen=True)
class LoggedRun:
    where: str            # archive:folder of the point
    model: str
    deployment: str       # the rank's deployment (tp=1, ep=8)
    device: str
    context_len: int
    batch_size: int
    spec: PolicySpec
    nodes: int            # verified per sequence as it ran (the bucket, padded where the bundle pads)
    use: dict             # measure.memory_use of the run: its drafter at ``nodes``, its caches' rows per sequence
    out_of_memory: bool


def _deployment(label: str) -> str:
    """The deployment a run's label names: "1 GPU" tp=1, "ep=8 rank" / "ep=8 (all-to-all not run)" ep=8."""
    label = label.split("(")[0].replace(" rank", "").strip()
    return "tp=1" if label in ("1 GPU", "") else label


def logged_runs(root: str | Path = ".", archives=ARCHIVES) -> list[LoggedRun]:
    """Every run of ``archives`` (paths under ``root``) that ran or ran out of memory."""
    out = []
    for archive in archives:
        path = Path(root) / archive
        try:
            with tarfile.open(path) as tar:
                members = sorted((m for m in tar.getmembers() if m.name.endswith("summary.json")), key=lambda m: m.name)
                docs = [(m.name, json.load(tar.extractfile(m))) for m in members]
        except (tarfile.TarError, OSError, ValueError) as exc:
            raise SimtreeError(f"{path}: cannot read its runs ({exc})") from None
        for name, doc in docs:
            cfg = doc.get("config", {})
            for run in doc.get("runs", []):
                error = str(run.get("error", ""))
                if error and OOM not in error:
                    continue             # skipped, or failed otherwise: no memory outcome
                run = {**run, "params": run.get("params") or {}}
                spec, rs, B = PolicySpec.from_dict(run["mode"], run["params"]), run_shape(run), int(run["batch_size"])
                at = RunConfig(int(cfg["context_len"]), int(cfg["rounds"]), int(cfg["warmup_rounds"]),
                               min_draws=int(cfg.get("min_draws") or 0)).for_batch(B)     # as full_run ran it
                out.append(LoggedRun(f"{archive}:{name.lstrip('./').rsplit('/', 1)[0]}", run["model"],
                                     _deployment(str(run.get("deployment", ""))), "h100", at.context_len,
                                     B, spec, int(rs.nodes), memory_use(spec, rs, at), bool(error)))
    return out


ARCHIVED_ATTN_PROJ = "bf16"     # the archives' V4 runs ran the attention's linears in bf16 (before they ran FP8)
ARCHIVED_COMP_PROJ = "fp32"     # and the compressors' projections as fp32 copies (before the form v4_comp "model")


def check_runs(runs: list[LoggedRun]) -> list[tuple[LoggedRun, object]]:
    """(run, RankMemory) of each run: the check as the run allocated it."""
    from simtree.deploy.memory import rank_memory
    from simtree.kernels.layers.forms import forms
    with forms(v4_comp=ARCHIVED_COMP_PROJ, v4_proj=ARCHIVED_ATTN_PROJ):     # the weights as those runs held them
        return [(r, rank_memory(r.model, r.deployment, r.device, r.batch_size, r.context_len, rank_alone=True, **r.use))
                for r in runs]


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}"


def disagreements(checked) -> list[tuple[LoggedRun, object]]:
    """The (run, RankMemory) pairs whose verdict is not the run's outcome."""
    return [(r, m) for r, m in checked if r.out_of_memory == m.fits]


def runs_table(root: str | Path = ".") -> str:
    """Markdown: one row per (model, context, batch) point of the logged runs, with the bytes the
    check counts for the runs that ran and those that ran out of memory (GB, min-max over the
    policies: each run at its own round and cache rows) and the runs whose verdict is wrong."""
    checked = check_runs(logged_runs(root))
    points: dict = {}
    for r, mem in checked:
        points.setdefault((r.model, r.deployment, r.context_len, r.batch_size), []).append((r, mem))
    lines = ["| model | context | batch | ran: runs, counted GB | out of memory: runs, counted GB | usable GB | "
             "check right | check wrong (counted GB) |", "|---|---|---|---|---|---|---|---|"]
    for key in sorted(points):
        group = points[key]
        ran = [m.total_bytes / 1e9 for r, m in group if not r.out_of_memory]
        oom = [m.total_bytes / 1e9 for r, m in group if r.out_of_memory]
        wrong = disagreements(group)
        cell = lambda v: f"{len(v)}, {_span(v)}" if v else "-"  # noqa: E731
        lines.append(f"| {key[0]} {key[1]} | {key[2]} | {key[3]} | {cell(ran)} | {cell(oom)} | "
                     f"{group[0][1].usable_bytes / 1e9:.1f} | {len(group) - len(wrong)} of {len(group)} | " +
                     (", ".join(f"{r.spec.name} {'ran' if not r.out_of_memory else 'out of memory'} "
                                f"({m.total_bytes / 1e9:.1f})" for r, m in wrong) or "-") + " |")
    ooms, wrong = sum(r.out_of_memory for r, _ in checked), disagreements(checked)
    return (f"{len(checked)} runs ({ooms} out of memory, {len(checked) - ooms} ran) at {len(points)} points; the check "
            f"agrees with {len(checked) - len(wrong)}, not with {len(wrong)}:\n\n" + "\n".join(lines) + "\n")


def write_runs_doc(path: str | Path, root: str | Path = ".", write: bool = True) -> bool:
    """Rewrite the table between DOC_START and DOC_END in ``path`` from :func:`runs_table`; True if
    it was current already."""
    return rewrite_marked_block(path, DOC_START, DOC_END, runs_table(root), write)


if __name__ == "__main__":     # python -m simtree.runtime.full.memory_runs [docs/deployments.md]
    doc = sys.argv[1] if len(sys.argv) > 1 else "docs/deployments.md"
    try:
        print(f"{doc}: {'current' if write_runs_doc(doc) else 'table rewritten'}")
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
