"""What `simtree plan` plans: every cost bundle (the shipped ones by default) x workloads x
batch sizes, each bundle's choices banded and saved as its policy file, in a folder per
(model, deployment, device) where there are several.  Reports are rendered from the result by
:mod:`simtree.reporting.plan_report`; nothing here draws or writes markdown.

    planned = plan_bundles(cost_paths, workload_specs, batch_sizes, out_dir)
    planned.outputs[0]["result"], planned.outputs[0]["policy"]    # PlanResult, policy.json
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic
from simtree.planning.bands import BAND_MODELS, band_workloads, plan_bands, with_bands
from simtree.planning.planner import DEFAULT_BATCH_SIZES, SearchSpace, check_workload_names, plan

__all__ = ["PlannedBundles", "plan_bundles", "folder_name", "PARTIAL_MARKER", "mark_partial"]

PARTIAL_MARKER = "PARTIAL.md"


@dataclass
class PlannedBundles:
    """One dict per planned bundle: result (PlanResult), bands (DataFrame or None), policy
    (path of the policy file written), policy_data (the Policy), folder (where it went).
    ``index_dir``: the folder whose plans.md lists the bundles' folders (None: one bundle
    planned straight into the output folder); ``notes``: the plan-wide notes."""
    outputs: list[dict]
    index_dir: Path | None = None
    notes: list[str] = field(default_factory=list)


def folder_name(meta) -> str:
    """<model>_<device>, with the deployment's tag between them for several GPUs:
    deepseek-v4-flash_ep8_NVIDIA_H200."""
    from simtree.parallel import parse_deployment

    dep = parse_deployment(str(meta.get("deployment") or "tp=1"))
    parts = [str(meta.get("model", "unknown"))] + ([dep.tag] if dep.gpus > 1 else []) + [str(meta.get("device", "unknown"))]
    return "_".join(parts)


def plan_bundles(cost_paths: Sequence[str] = (), workload_specs: Sequence[str] = (),
                 batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, out_dir: str = "reports/plan",
                 prompt_len: float | None = None, output_len: int | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 space: SearchSpace = SearchSpace(), model: str | None = None, deployment: str | None = None,
                 comm=None, notes: list | None = None, band_models: int = BAND_MODELS,
                 started: Callable[[str, int, int], None] | None = None,
                 finish: Callable[[dict], None] | None = None, machine: str | None = None) -> PlannedBundles:
    """Plan every cost bundle (``cost_paths``, default the shipped ones; ``model`` /
    ``deployment`` pick among them) x workloads (presets or traces, default every preset);
    write policy.json per bundle, into a folder per (model, deployment, device) under
    ``out_dir`` when there are several bundles.  A deployment whose weights and caches (largest
    batch, longest mean context) do not fit its GPUs is refused (one line) before anything is
    planned; ``comm`` replaces the bundles' communication model; ``notes`` (a list) receives
    the plan-wide notes (which default deployments wait for a profile).  ``band_models``
    bootstrap acceptance models per workload put a band on every choice
    (:mod:`simtree.planning.bands`; 0: none).  ``started(folder, i, n)``: before planning the
    i-th (from 0) of n bundles; ``finish(output)``: after its policy file is saved (the caller's
    report of it).  Interrupted (KeyboardInterrupt, which the CLI raises for SIGINT and SIGTERM
    too), it writes PARTIAL.md in ``out_dir`` naming the folders finished and not before the
    exception goes on; a finished plan removes that file.  ``machine`` (h100, h200; default the
    default machine) picks whose shipped bundles are planned when ``cost_paths`` is empty.
    """
    from simtree.acceptance.model import PRESETS, get_workload
    from simtree.deploy.select import select_costs

    workloads = [get_workload(w, prompt_len, output_len) for w in (workload_specs or PRESETS)]
    check_workload_names(workloads, list(workload_specs or PRESETS))
    context = max(w.mean_prompt_len + w.output_len for w in workloads)
    bundles, found = select_costs(cost_paths, model, deployment, max(batch_sizes or [1]), context, comm, machine)
    if notes is not None:
        notes.extend(found)
    names = [folder_name(b.meta) for b in bundles]
    folders = [n.replace("/", "_").replace(" ", "_") for n in names]
    where = list(cost_paths) or [f"bundle {i}" for i in range(len(bundles))]
    for i, f in enumerate(folders):
        if f in folders[:i]:
            j = folders.index(f)
            raise SimtreeError(f"two cost bundles for the same model and device ({where[j]} and {where[i]}: "
                               f"{names[i]}, one deployment) would write the same folder {f}: plan them separately")
    # the embedded default is a set of deployments: a folder each, even while only one ships
    defaults = not cost_paths and model is None and deployment is None and not any(
        b.meta.get("synthetic") for b in bundles)
    specs = list(workload_specs or PRESETS)
    band_sets = {w.name: band_workloads(spec, w, band_models) for spec, w in zip(specs, workloads)} if band_models else {}
    outputs, nested = [], len(bundles) > 1 or defaults
    try:
        for i, (bundle, folder) in enumerate(zip(bundles, folders)):
            if started is not None:
                started(folder, i, len(bundles))
            result = plan(bundle, workloads, batch_sizes, space, progress)
            bands = plan_bands(result.chosen, result.candidates, bundle, band_sets) if band_sets else None
            sub = Path(out_dir) / folder if nested else Path(out_dir)
            policy = with_bands(result.to_policy(), bands)
            policy_path = policy.save(sub / "policy.json")
            output = {"result": result, "bands": bands, "policy": policy_path, "policy_data": policy, "folder": sub}
            if finish is not None:
                finish(output)
            outputs.append(output)
    except KeyboardInterrupt:
        mark_partial(Path(out_dir), folders if nested else ["."], len(outputs))
        raise
    (Path(out_dir) / PARTIAL_MARKER).unlink(missing_ok=True)
    return PlannedBundles(outputs, Path(out_dir) if nested else None, found)


def mark_partial(out: Path, folders: list[str], finished: int) -> Path:
    """PARTIAL.md: which plan folders an interrupted `simtree plan` finished and which not."""
    done = [f"- `{f}`: finished" for f in folders[:finished]]
    left = [f"- `{f}`: not finished (its files are missing, stale or half-written)" for f in folders[finished:]]
    text = "\n".join(["# Partial plan", "", f"`simtree plan` was interrupted after {finished} of {len(folders)} "
                      "plan folders; rerun the same command to complete this folder (it removes this file).", "",
                      *done, *left]) + "\n"
    return write_text_atomic(out / PARTIAL_MARKER, text)
