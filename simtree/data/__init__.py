"""Data shipped inside the package, read through :func:`data_path` only.

    models/<name>.yaml           model shapes (:mod:`simtree.models`)
    models/{target,draft}/       the runtime's tiny checkpoints (config.json + model.safetensors)
    costs/*.json                 fitted cost bundles the planner uses by default
    sweeps/*.yaml                profile sweeps (``simtree profile --sweep <name>.yaml``)
    profiles/                    the measured profiles: one rank profile per default deployment
                                 (what the shipped bundles are fitted from, deployments.yaml) and
                                 the kernel-level profile of every stage (profile.csv)

Every folder holds an ``__init__.py`` so that ``pip install .`` installs its files
(``[tool.setuptools.package-data]`` in pyproject.toml); nothing here is imported.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from simtree.errors import SimtreeError

__all__ = ["data_path"]


def data_path(*parts: str) -> Path:
    """The file system path of ``simtree/data/<parts...>`` in this installation (a source
    checkout, an editable or a regular install); it need not exist."""
    root = resources.files(__name__)
    if not isinstance(root, Path):   # a zip or other non-file importer: no paths to hand out
        raise SimtreeError(f"simtree's package data is not on the file system ({root}): install simtree "
                           "from a wheel or a source folder")
    return root.joinpath(*parts)
