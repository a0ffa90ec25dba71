"""The committed full-scale H200 results (reports/h200/live/) are what the committed home-side
command makes of the committed session archives (reports/h200/live/sessions/), and the shipped
rank profiles are its profile tables."""
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
LIVE = ROOT / "reports" / "h200" / "live"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    out = tmp_path_factory.mktemp("live")
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "scripts/full_report.sh"), str(LIVE / "sessions"), str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    return out


@pytest.mark.parametrize("name", ["summary.csv", "alternatives.csv", "composed_vs_measured.csv", "lossless.csv"])
def test_committed_tables_are_regenerated_from_the_sessions(regenerated, name):
    got, committed = pd.read_csv(regenerated / name), pd.read_csv(LIVE / name)
    pd.testing.assert_frame_equal(got, committed, check_exact=False, rtol=1e-6)


@pytest.mark.parametrize("name", ["profile_deepseek-v4-flash_ep8.csv", "profile_qwen3.6-27b_tp1.csv",
                                  "profile_qwen3.6-27b_tp2.csv"])
def test_shipped_rank_profiles_are_the_sessions_profiles(regenerated, name):
    shipped = ROOT / "simtree" / "data" / "profiles" / "h200" / name
    assert (regenerated / name).read_bytes() == shipped.read_bytes()   # the folder keeps no copy of its own
    assert not (LIVE / name).exists()
