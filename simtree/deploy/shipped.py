"""The deployments simtree ships defaults for (``simtree/data/deployments.yaml``) and their
cost bundles (``simtree/data/costs/<machine>_<model>_<tag>.json``).

    shipped_deployments()              # [("deepseek-v4-flash", ep=8), ("qwen3.6-27b", tp=1), ...]
    bundle_name("h200", "qwen3.6-27b", parse_deployment("tp=2"))   # "h200_qwen3.6-27b_tp2.json"
    waiting()                          # the listed deployments that have no bundle yet
    default_deployment("deepseek-v4-flash")   # ep=8: the model's first listed deployment
    shipped_machines()                 # ["h100", "h200"]: the machines deployments.yaml lists
    check_machine("h100")              # "h100"; a machine with no section is a one-line error
    shipped_machine_for("NVIDIA H100 80GB HBM3")   # "h100": whose defaults a plan of that GPU used
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from simtree.data import data_path
from simtree.parallel import Deployment, parse_deployment
from simtree.errors import SimtreeError
from simtree.fileio import read_yaml

__all__ = ["shipped_cost_paths", "caveat_for", "stamp_caveat", "DEFAULT_MACHINE", "shipped_machines", "check_machine", "shipped_machine_for", "shipped_deployments", "default_deployment", "bundle_name", "shipped_bundle", "waiting",
           "profile_for"]

DEFAULT_MACHINE = "h200"


def _table() -> dict:
    path = data_path("deployments.yaml")
    table = read_yaml(path, "deployments table") or {}
    if not isinstance(table, dict):
        raise SimtreeError(f"{path.name}: must map each machine to its {{model, deployment}} entries")
    return table


def shipped_machines() -> list[str]:
    """The machines simtree ships default deployments for (the sections of deployments.yaml)."""
    return sorted(str(k) for k in _table())


def shipped_cost_paths(machine: str | None = None) -> list[Path]:
    """The cost bundles that ship with simtree for one machine (``simtree/data/costs/<machine>_*.json``,
    default the default machine's: bundles of several machines are never mixed), by file name; a
    machine with no shipped defaults is a one-line error."""
    machine = check_machine(machine or DEFAULT_MACHINE)
    return sorted(data_path("costs").glob(f"{machine}_*.json"), key=str)


def check_machine(machine: str) -> str:
    """``machine`` if deployments.yaml has a section for it, else a one-line error naming those it has."""
    if machine not in _table():
        raise SimtreeError(f"no shipped defaults for machine {machine!r}: simtree ships them for "
                           f"{', '.join(shipped_machines())} (simtree/data/deployments.yaml)")
    return machine


def shipped_machine_for(device: str | None, default: str = DEFAULT_MACHINE) -> str:
    """The machine with shipped defaults whose GPU ``device`` is (a profile's or a plan's device
    name, e.g. "NVIDIA H100 80GB HBM3" -> "h100"); ``default`` for an unknown or missing device."""
    from simtree.machine.machines import machine_for_device

    found = machine_for_device(device) if device else None
    return found.key if found is not None and found.key in _table() else default


class _Entry(NamedTuple):
    model: str
    deployment: Deployment
    profile: str | None     # the profile table it names
    caveat: str | None      # what a plan from its bundle must say about where its profile came from


def _entries(machine: str) -> list[_Entry]:
    """Every entry of the machine, in its order."""
    path = data_path("deployments.yaml")
    entries = _table().get(check_machine(machine))
    if not isinstance(entries, list):
        raise SimtreeError(f"{path.name}: {machine} must list {{model, deployment}} entries")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("model"), str) or "deployment" not in e:
            raise SimtreeError(f"{path.name}: {machine} entry {i} needs a model and a deployment")
        out.append(_Entry(e["model"], parse_deployment(str(e["deployment"])),
                          None if e.get("profile") is None else str(e["profile"]),
                          " ".join(str(e["caveat"]).split()) if e.get("caveat") else None))
    return out


def _entry(model: str, deployment: Deployment, machine: str) -> _Entry | None:
    """The machine's entry of (model, deployment), if it lists one."""
    return next((e for e in _entries(machine) if e.model == model and e.deployment.name == deployment.name), None)


def caveat_for(model: str, deployment: Deployment, machine: str = DEFAULT_MACHINE) -> str | None:
    """The ``caveat`` its deployments.yaml entry states for (model, deployment) on ``machine``:
    what a plan from that shipped bundle must say about where its profile came from."""
    entry = _entry(model, deployment, machine)
    return None if entry is None else entry.caveat


def stamp_caveat(bundle_path: Path, machine: str) -> str | None:
    """Write the entry's caveat into the bundle's meta (``meta.caveat``; removed where the entry
    has none): ship_defaults.sh stamps each bundle it ships, and plans of it carry the caveat."""
    from simtree.costs.model import load_costs
    from simtree.deploy.costs import bundle_deployment

    bundle = load_costs(bundle_path)
    text = caveat_for(str(bundle.meta.get("model")), bundle_deployment(bundle), machine)
    bundle.meta.pop("caveat", None)
    if text:
        bundle.meta["caveat"] = text
    bundle.save(bundle_path)
    return text


def shipped_deployments(machine: str = DEFAULT_MACHINE) -> list[tuple[str, Deployment]]:
    """(model, deployment) of every default the machine's entry lists, in its order."""
    return [(e.model, e.deployment) for e in _entries(machine)]


def default_deployment(model: str, machine: str = DEFAULT_MACHINE, fallback: Deployment | None = None) -> Deployment:
    """The model's shipped default deployment: the first the machine's entry lists for it (its
    runtime rank: DeepSeek-V4-Flash ep=8, Qwen3.6-27B tp=1), else ``fallback`` (one GPU)."""
    return next((d for m, d in shipped_deployments(machine) if m == model), fallback or parse_deployment("tp=1"))


def bundle_name(machine: str, model: str, deployment: Deployment) -> str:
    return f"{machine}_{model}_{deployment.tag}.json"


def shipped_bundle(model: str, deployment: Deployment, machine: str = DEFAULT_MACHINE) -> Path:
    """Where the shipped bundle of (model, deployment) is, or would be."""
    return data_path("costs", bundle_name(machine, model, deployment))


def waiting(machine: str = DEFAULT_MACHINE) -> list[tuple[str, Deployment]]:
    """The listed defaults that have no shipped bundle yet (their rank's profile is not measured)."""
    return [(m, d) for m, d in shipped_deployments(machine) if not shipped_bundle(m, d, machine).is_file()]


def profile_for(model: str, deployment: Deployment, folder: Path, machine: str = DEFAULT_MACHINE) -> Path | None:
    """The profile table in ``folder`` that holds ``model``'s rows at ``deployment`` (its
    composed verify step): the one its deployments.yaml entry names, else the one table that
    holds them; None if none does; two such tables and no name are a one-line error."""
    from simtree.costs.profile_table import load_profile

    entry = _entry(model, deployment, machine)
    named = None if entry is None else entry.profile
    if named is not None:
        path = Path(folder) / named
        if not path.is_file():
            raise SimtreeError(f"deployments.yaml names {named} for {model} at {deployment}: no such table in {folder}")
        df = load_profile(path)
        if not ((df["model"] == model) & (df["deployment"] == deployment.name)
                & (df["stage"] == "model_verify_step")).any():
            raise SimtreeError(f"{named} holds no model_verify_step rows of {model} at {deployment}")
        return path
    found = []
    for path in sorted(Path(folder).glob("*.csv")):
        df = load_profile(path, allow_empty=True)
        if ((df["model"] == model) & (df["deployment"] == deployment.name) & (df["stage"] == "model_verify_step")).any():
            found.append(path)
    if len(found) > 1:
        raise SimtreeError(f"{model} at {deployment} has rows in {found[0].name} and {found[1].name}: name one in "
                           "its deployments.yaml entry (profile: ...) or keep one table per deployment")
    return found[0] if found else None


def main(argv=None) -> int:
    """``python -m simtree.deploy.shipped [--machine h200] [--profiles DIR]``: one line per
    default deployment, ``FIT model deployment tag table`` or ``WAIT model deployment`` (what
    scripts/ship_defaults.sh reads); ``--default-for MODEL``: that model's default deployment
    alone (what scripts/full_gpu.sh reads)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m simtree.deploy.shipped", description=main.__doc__)
    ap.add_argument("--machine", default=DEFAULT_MACHINE)
    ap.add_argument("--profiles", type=Path, default=None, help="default: simtree/data/profiles/<machine>")
    ap.add_argument("--default-for", default=None, metavar="MODEL", help="print MODEL's default deployment")
    ap.add_argument("--machines", action="store_true", help="print the machines with shipped defaults, one a line")
    ap.add_argument("--stamp", type=Path, default=None, metavar="BUNDLE",
                    help="write the --machine entry's caveat into BUNDLE's meta (ship_defaults.sh)")
    args = ap.parse_args(argv)
    if args.stamp is not None:
        text = stamp_caveat(args.stamp, args.machine)
        print(f"{args.stamp}: caveat {text!r}" if text else f"{args.stamp}: no caveat")
        return 0
    if args.machines:
        print("\n".join(shipped_machines()))
        return 0
    if args.default_for:
        print(default_deployment(args.default_for, args.machine).name)
        return 0
    folder = args.profiles or data_path("profiles", args.machine)
    for model, dep in shipped_deployments(args.machine):
        table = profile_for(model, dep, folder, args.machine)
        print(f"FIT {model} {dep.name} {dep.tag} {os.path.relpath(table)}" if table else f"WAIT {model} {dep.name}")
    return 0


if __name__ == "__main__":
    import sys

    try:
        sys.exit(main())
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
