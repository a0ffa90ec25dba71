"""The live run re-priced on a bundle refitted from its own profile (scripts/serve_live_reprice.py):
the committed CSV keeps the run's measurements and its own prediction, and the report shows both."""
import tarfile
from pathlib import Path

import pandas as pd

from simtree.serving.live_report import CATCH_UP_COLUMNS, COLUMNS, REPRICE_COLUMNS, live_section

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "reports" / "bench_serve"
MEASURED = ["phase", "batch_size", "new_tokens", "rounds", "switches", "tiers", "measured_tpot_ms", "tokens_per_round",
            "wall_s", "prefill_ms", "device", "prompts", "catch_ups", "measured_catchup_ms"]


def test_the_committed_csv_keeps_the_runs_measurements_and_its_own_prediction():
    with tarfile.open(BENCH / "live_run.tgz") as tar:
        member = next(m for m in tar.getmembers() if Path(m.name).name == "serve_live.csv")
        run = pd.read_csv(tar.extractfile(member))
    committed = pd.read_csv(BENCH / "serve_live.csv")
    pd.testing.assert_frame_equal(committed[MEASURED], run[MEASURED])
    assert list(committed.run_predicted_tpot_ms) == list(run.predicted_tpot_ms)
    assert set(committed.run_costs) == set(run.costs) and committed.costs.str.contains("refitted").all()


def test_the_report_of_a_repriced_run_gives_both_predictions(tmp_path):
    row = {c: 0 for c in COLUMNS} | {"phase": 0, "batch_size": 2, "new_tokens": 96, "rounds": 95, "tiers": "none:95",
                                     "measured_tpot_ms": 0.244, "predicted_tpot_ms": 0.233, "predicted_model_tpot_ms": 0.233,
                                     "device": "GPU", "costs": "live_run.tgz:profile.csv refitted", "prompts": "sharegpt",
                                     "catch_ups": 1, "measured_catchup_ms": 0.28, "predicted_catchup_ms": 0.39,
                                     "run_predicted_tpot_ms": 0.196, "run_costs": "live_costs.json"}
    csv = tmp_path / "live.csv"
    pd.DataFrame([row], columns=COLUMNS + CATCH_UP_COLUMNS + REPRICE_COLUMNS).to_csv(csv, index=False)
    section = live_section(csv, "cmd")
    assert "| 0.244 | 0.233 | -4.5% |" in section and "| 0.196 (-19.7%) |" in section
    assert "worst 19.7%, column run_predicted_tpot_ms" in section and "in sample" in section
    assert "scripts/serve_live_reprice.py" in section
    pd.DataFrame([row], columns=COLUMNS + CATCH_UP_COLUMNS).to_csv(csv, index=False)   # a run as measured
    assert "run's own prediction" not in live_section(csv, "cmd")


def test_the_later_run_was_predicted_by_the_refit_of_the_first_runs_profile(tmp_path):
    """The out-of-sample live run (serve_live_oos.csv) names a bundle that this checkout's fit of
    the first run's archived profile reproduces (without the pad map and the measured-cell
    corrections, which postdate it): its costs came from no measurement of its own."""
    import numpy as np

    from simtree.costs.model import load_costs
    from simtree.costs.profile_fit import fit_profile
    for name, into in (("live_run.tgz", "first"), ("live_oos_run.tgz", "later")):
        with tarfile.open(BENCH / name) as tar:
            tar.extractall(tmp_path / into, filter="data")
    used = load_costs(tmp_path / "later" / "refit_costs.json")
    # the archived bundle predates verify padding and cell corrections (simtree.costs.verify_pad,
    # verify_cells): fitted as measured, the surface alone
    refit = fit_profile(tmp_path / "first" / "profile.csv", verify_pad=False, verify_cells=False).bundle
    for b in (1, 2, 3, 4, 8):
        for n in (1, 4, 8):
            assert np.isclose(refit.verify.predict(n, 100, b), used.verify.predict(n, 100, b), rtol=1e-6)
        for steps, k in ((1, 1), (2, 2), (4, 2)):      # the eagle phases price drafting too
            assert np.isclose(refit.draft.predict(steps, k, b), used.draft.predict(steps, k, b), rtol=1e-6)
    later = pd.read_csv(BENCH / "serve_live_oos.csv")
    assert later.costs.str.endswith("refit_costs.json").all()      # the bundle the archive holds
    # the README's live section is what the report renders from the committed CSVs (not stale)
    section = live_section(BENCH / "serve_live.csv", "", BENCH / "serve_live_oos.csv", "live_oos_run.tgz:refit_costs.json")
    body = section.split("\n", 3)[3]          # past the heading and the line naming the report command
    assert body in (BENCH / "README.md").read_text()
