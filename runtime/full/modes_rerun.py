"""The committed modes runs read again on CPU, as ``scripts/modes_repredict.py`` and
``scripts/block_round_costs.py`` read them: the run folders of folders or .tgz archives, each
folder's ``measure/summary.json``, and the cost bundle its run priced with."""
from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from simtree.data import data_path
from simtree.errors import SimtreeError

from .modes_gpu import BUNDLE_NOTE, DRAFTER_PROFILE, drafter_bundle
from .modes_report import run_dirs

__all__ = ["parser", "read_runs", "run_summary", "run_bundle", "run_bundles", "run_costs"]


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's arguments: the run folders or their .tgz, and the drafter profile to fit C_d from."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", type=Path, help="modes run folders or their .tgz")
    ap.add_argument("--drafter-profile", default=DRAFTER_PROFILE)
    return ap


def read_runs(inputs: list[Path], read: Callable[[Path], list]) -> list:
    """``read(folder)`` of every run folder of ``inputs``, in order, as one list (archives are
    unpacked into a scratch folder that lives until the last folder is read)."""
    with tempfile.TemporaryDirectory() as scratch:
        return [item for folder in run_dirs(inputs, Path(scratch)) for item in read(folder)]


def run_summary(folder: Path) -> dict:
    """The run folder's ``measure/summary.json`` (one line where it is missing or not JSON)."""
    path = folder / "measure" / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SimtreeError(f"{path}: not a readable summary ({exc})") from None


def run_bundle(folder: Path) -> Path:
    """The shipped bundle the run's log.txt names, in this checkout (the log gives its path on the GPU)."""
    log = (folder / "log.txt").read_text() if (folder / "log.txt").is_file() else ""
    named = next((line.rsplit(BUNDLE_NOTE, 1)[1].strip() for line in log.splitlines() if BUNDLE_NOTE in line), None)
    if named is None:
        raise SimtreeError(f"{folder / 'log.txt'} does not name the run's cost bundle")
    path = data_path("costs", Path(named).name)
    if not path.is_file():
        raise SimtreeError(f"the run's bundle {Path(named).name} is not in this checkout's simtree/data/costs")
    return path


REPORTS = Path(__file__).resolve().parents[2] / "reports"   # this checkout's committed results


def run_bundles(folder: Path) -> list[Path]:
    """The bundles the run may have priced with: the shipped one its log names, then the copies of
    it frozen in this checkout's reports/ (``frozen_<name>``, ``frozen_<stem>_*.json``) once the
    shipped file was refitted after the run; the caller keeps the one that prices it as recorded."""
    shipped = run_bundle(folder)
    frozen = sorted({*REPORTS.glob(f"**/frozen_{shipped.name}"), *REPORTS.glob(f"**/frozen_{shipped.stem}_*.json")})
    return [shipped, *frozen]


def run_costs(folder: Path, model: str, profile: str, builder_steps: str = "remove"):
    """The bundle the run priced with, with ``model``'s drafters' C_d fitted from ``profile`` as
    ``modes_gpu`` fits them (``builder_steps``: :func:`simtree.costs.drafter_fit.fit_drafters`')."""
    return drafter_bundle(str(run_bundle(folder)), profile, model, builder_steps)[0]
