"""Which cost models a plan or a simulation uses, checked against memory first.

    costs, notes = select_costs(model="qwen3.6-27b", deployment="tp=2", batch_size=64, context_len=2048)

``cost_paths`` (default: the shipped bundles of ``machine``, the default machine when None - one
machine's, never several mixed -, else the SYNTHETIC roofline) filtered by model
and deployment; every chosen bundle of a registry model whose machine is known is checked to
fit (weights + caches of ``batch_size`` sequences at ``context_len``), and a model asked for at
a deployment that cannot hold it is refused with the shortfall before any bundle is looked for
(``simtree plan --model deepseek-v4-flash --deployment tp=1``).  Bundles of several GPUs come
back composed with their communication (:func:`simtree.deploy.costs.deployment_costs`).
"""
from __future__ import annotations

import math
from typing import Sequence

from simtree.costs.model import Costs, load_costs
from simtree.costs.synthetic import synthetic_costs
from simtree.costs.comm import CommModel
from simtree.costs.runtime_path import path_note
from simtree.deploy.costs import bundle_deployment, deployment_costs
from simtree.parallel import parse_deployment
from simtree.machine.machines import get_machine, machine_for_device
from simtree.deploy.memory import check_fits
from simtree.deploy import shipped as shipped_defaults   # read through the module: tests stand in for its shipped_cost_paths
from simtree.deploy.shipped import DEFAULT_MACHINE, check_machine, shipped_deployments, waiting
from simtree.errors import SimtreeError
from simtree.models import list_models

__all__ = ["select_costs"]


def _label(b: Costs) -> str:
    return f"{b.meta.get('model', '?')} at {bundle_deployment(b)}"


def select_costs(cost_paths: Sequence[str] = (), model: str | None = None, deployment: str | None = None,
                 batch_size: int = 1, context_len: float = 0, comm: CommModel | str | None = None,
                 machine: str | None = None) -> tuple[list[Costs], list[str]]:
    """(the deployments' costs, notes); see the module docstring."""
    ctx = int(math.ceil(context_len))
    dep = parse_deployment(deployment) if deployment else None
    shipped = not cost_paths
    if machine is not None and not shipped:
        raise SimtreeError(f"--machine {machine} picks that machine's shipped bundles; --costs names its own: "
                           "give one of them")
    named_machine, machine = machine is not None, check_machine(machine or DEFAULT_MACHINE)
    paths = [str(p) for p in cost_paths] or [str(p) for p in shipped_defaults.shipped_cost_paths(machine)]
    bundles = [load_costs(p) for p in paths]
    where = ", ".join(paths) if not shipped else f"the shipped {machine} bundles"
    registry = set(list_models())
    if model is not None and dep is not None and model in registry:
        device = next((str(b.meta.get("device")) for b in bundles if b.meta.get("model") == model), None)
        gpu = (machine_for_device(device) if device else None) or get_machine(machine)
        check_fits(model, dep, gpu, batch_size, ctx)
    if not bundles:   # nothing ships: the analytic roofline, marked SYNTHETIC everywhere
        if named_machine:
            raise SimtreeError(f"no cost bundle ships for {machine} yet: its defaults wait for measured profiles "
                               "(scripts/ship_defaults.sh)")
        if model is not None or dep is not None:
            raise SimtreeError("no cost bundle ships with this installation: give one with --costs")
        return [synthetic_costs()], []
    chosen = [b for b in bundles if (model is None or b.meta.get("model") == model)
              and (dep is None or bundle_deployment(b) == dep)]
    if not chosen:
        want = " at ".join(x for x in (model, dep.name if dep else None) if x)
        wait = [f"{m} at {d}" for m, d in waiting(machine)
                if (model is None or m == model) and (dep is None or d == dep)] if shipped else []
        later = f"; {', '.join(wait)} wait(s) for its rank's measured profile (docs/deployments.md)" if wait else ""
        raise SimtreeError(f"no cost bundle for {want} in {where} (it has: {', '.join(map(_label, bundles))}){later}")
    notes = []
    for b in chosen:
        gpu = machine_for_device(str(b.meta.get("device", "")))
        if gpu is not None and b.meta.get("model") in registry:
            check_fits(str(b.meta["model"]), bundle_deployment(b), gpu, batch_size, ctx)
    if shipped and model is None and dep is None:
        for m, d in waiting(machine):
            notes.append(f"{m} at {d}: no shipped cost bundle yet, it waits for the measured profile of its rank "
                         "(scripts/ship_defaults.sh, docs/deployments.md); not planned")
    listed = {(m, d.name) for m, d in shipped_deployments(machine)}
    for b in chosen:
        key = (str(b.meta.get("model")), bundle_deployment(b).name)
        if shipped and key not in listed:
            notes.append(f"{key[0]} at {key[1]}: a shipped bundle no default deployment lists")
    for b in chosen:        # a bundle timed on a path the runtime no longer runs
        note = path_note(b.meta)
        if note:
            notes.append(f"{note} ({_label(b)})")
    if comm is not None and all(bundle_deployment(b).gpus == 1 for b in chosen):
        raise SimtreeError(f"--comm: {', '.join(map(_label, chosen))} run(s) on one GPU and send no collectives; "
                           "a communication model applies to deployments of several GPUs")
    return [deployment_costs(b, comm) for b in chosen], notes
