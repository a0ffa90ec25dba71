"""The deployments simtree ships defaults for (``simtree/data/deployments.yaml``) and their
cost bundles (``simtree/data/costs/<machine>_<model>_<tag>.json``).

    shipped_deployments()              # [("deepseek-v4-flash", ep=8), ("qwen3.6-27b", tp=1), ...]
    bundle_name("h200", "qwen3.6-27b", parse_deployment("tp=2"))   # "h200_qwen3.6-27b_tp2.json"
    waiting()                          # the listed deployments that have no bundle yet
"""
from __future__ import annotations

from pathlib import Path

from simtree.data import data_path
from simtree.deploy.deployment import Deployment, parse_deployment
from simtree.errors import SimtreeError
from simtree.fileio import read_yaml

__all__ = ["DEFAULT_MACHINE", "shipped_deployments", "bundle_name", "shipped_bundle", "waiting"]

DEFAULT_MACHINE = "h200"


def shipped_deployments(machine: str = DEFAULT_MACHINE) -> list[tuple[str, Deployment]]:
    """(model, deployment) of every default the machine's entry lists, in its order."""
    path = data_path("deployments.yaml")
    table = read_yaml(path, "deployments table") or {}
    entries = table.get(machine, []) if isinstance(table, dict) else None
    if not isinstance(entries, list):
        raise SimtreeError(f"{path.name}: {machine} must list {{model, deployment}} entries")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("model"), str) or "deployment" not in e:
            raise SimtreeError(f"{path.name}: {machine} entry {i} needs a model and a deployment")
        out.append((e["model"], parse_deployment(str(e["deployment"]))))
    return out


def bundle_name(machine: str, model: str, deployment: Deployment) -> str:
    return f"{machine}_{model}_{deployment.tag}.json"


def shipped_bundle(model: str, deployment: Deployment, machine: str = DEFAULT_MACHINE) -> Path:
    """Where the shipped bundle of (model, deployment) is, or would be."""
    return data_path("costs", bundle_name(machine, model, deployment))


def waiting(machine: str = DEFAULT_MACHINE) -> list[tuple[str, Deployment]]:
    """The listed defaults that have no shipped bundle yet (their rank's profile is not measured)."""
    return [(m, d) for m, d in shipped_deployments(machine) if not shipped_bundle(m, d, machine).is_file()]
