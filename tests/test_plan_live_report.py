"""The committed plan-live runs (reports/h200/plan_live/): each folder's summary.csv is what its
summary.json's rounds predict from the shipped bundle its run named, and its plan rows are the
choices of its policy file."""
from pathlib import Path

import pandas as pd
import pytest

from simtree.planning.policy_file import Policy
from simtree.runtime.full.measure import repredict

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = sorted(p for p in (ROOT / "reports" / "h200" / "plan_live").iterdir() if p.is_dir())


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_plan_live_tables_are_their_rounds_predicted_by_the_shipped_bundle(folder, tmp_path):
    res = repredict(folder / "summary.json", ROOT / "simtree" / "data" / "costs" / f"h200_{folder.name}.json",
                    out=tmp_path)
    got, committed = pd.read_csv(tmp_path / "summary.csv"), pd.read_csv(folder / "summary.csv")
    pd.testing.assert_frame_equal(got, committed, check_exact=False, rtol=1e-6)
    policy = Policy.load(folder / "policy.json")
    plans = [r for r in res["rows"] if r["policy"].startswith("plan:")]
    assert sorted(r["batch_size"] for r in plans) == [1, 4, 16, 64]
    for r in plans:
        entry, _ = policy.resolve("gsm8k", r["batch_size"])
        assert r["policy"] == f"plan:{entry.params.name}"
