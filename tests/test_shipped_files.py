"""Files the repository ships twice, or keeps from earlier versions, stay what their readers take.

Every shipped cost bundle ``simtree/data/costs/<machine>_<name>.json`` is the fit
``reports/<machine>/fit/<name>.json`` that ``scripts/ship_defaults.sh`` copies it from, and
every committed plan's policies (``policy.json`` entries, ``candidates.csv`` rows) still load
as the policies they name.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from simtree.planning.modes import ADAPTIVE_MODES, PolicySpec
from simtree.planning.policy_file import Policy

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "simtree/data/costs").glob("*.json"))
PLANS = sorted(ROOT.glob("reports/**/plan/**/policy.json"))
CANDIDATES = sorted(ROOT.glob("reports/**/plan/**/candidates.csv"))


def fit_of(bundle: Path) -> Path:
    """reports/<machine>/fit/<name>.json of simtree/data/costs/<machine>_<name>.json."""
    machine, name = bundle.stem.split("_", 1)
    return ROOT / "reports" / machine / "fit" / f"{name}.json"


def test_every_machine_ships_bundles():
    assert SHIPPED and {p.stem.split("_", 1)[0] for p in SHIPPED} >= {"h100", "h200"}


@pytest.mark.parametrize("bundle", SHIPPED, ids=lambda p: p.stem)
def test_a_shipped_bundle_is_its_report_fit(bundle):
    fit = fit_of(bundle)
    assert fit.is_file(), f"{bundle.relative_to(ROOT)} has no fit {fit.relative_to(ROOT)} (scripts/ship_defaults.sh)"
    assert json.loads(bundle.read_text()) == json.loads(fit.read_text()), \
        f"{bundle.relative_to(ROOT)} differs from {fit.relative_to(ROOT)}: refit both with scripts/ship_defaults.sh"


@pytest.mark.parametrize("path", PLANS, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_a_committed_policy_file_loads_as_written(path):
    written = json.loads(path.read_text())["entries"]
    loaded = Policy.load(path).entries
    assert [e.params.to_dict() for e in loaded] == [e["params"] for e in written]
    assert [e.mode for e in loaded] == [e["mode"] for e in written]


def test_committed_candidates_load_as_the_policies_they_name():
    adaptive = 0
    for path in CANDIDATES:
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                params = json.loads(row["params"])
                spec = PolicySpec.from_dict(row["mode"], params)
                assert (spec.name, spec.to_dict()) == (row["policy"], params), (path, row["policy"])
                adaptive += row["mode"] in ADAPTIVE_MODES
    assert adaptive > 0   # the cost_aware and batch_alloc rows are among them
