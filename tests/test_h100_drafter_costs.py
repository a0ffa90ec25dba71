"""The committed H100 drafter sweep prices C_d as the runtime's round runs it: every family of both
targets fitted from ``round`` rows (the runtime's own draft code), one surface per context timed,
the held-out errors those of reports/h100/drafters_fit.csv, and the note that names the profile
names the sweep (variant, contexts, days)."""
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from simtree.costs.drafter_fit import FIT_COLUMNS, fitted_rows, sweep_label
from simtree.costs.model import DRAFTER_STAGE
from simtree.drafters import LOOP_BUILDER_VARIANT, ROUND_VARIANT
from simtree.runtime.full.modes_gpu import DRAFTER_PROFILE, drafter_bundle

ROOT = Path(__file__).resolve().parents[1]
BUNDLES = {"qwen3.6-27b": "simtree/data/costs/h100_qwen3.6-27b_tp1.json",
           "deepseek-v4-flash": "simtree/data/costs/h100_deepseek-v4-flash_ep8.json"}


@pytest.mark.parametrize("model", sorted(BUNDLES))
def test_the_h100_c_d_is_fitted_from_the_runtimes_round_per_context(model):
    profile = pd.read_csv(ROOT / DRAFTER_PROFILE)
    fit = pd.read_csv(ROOT / "reports/h100/drafters_fit.csv")
    assert list(fit.columns) == list(FIT_COLUMNS)
    bundle, notes = drafter_bundle(str(ROOT / BUNDLES[model]), str(ROOT / DRAFTER_PROFILE), model)
    assert set(bundle.drafters) == {"block", "tfm", "dspark"}
    for fam, m in bundle.drafters.items():
        rows = profile[(profile["model"] == model) & (profile["stage"] == DRAFTER_STAGE[fam])]
        timed = sorted({int(c) for c in rows.loc[rows["variant"] == ROUND_VARIANT, "context_len"]})
        assert m.info["source"]["variant"] == ROUND_VARIANT
        assert len(timed) >= 2 and m.contexts == timed, f"{fam}: one surface per context timed"
        for ctx, mc in m.by_context:      # the shipped fit table is this fit, up to its float format
            want = fit[(fit["model"] == model) & (fit["drafter"] == fam) & (fit["context_len"] == ctx)]
            assert len(want) == 1 and mc.info["source"]["variant"] == ROUND_VARIANT
            assert mc.info["form"] == want["form"].iloc[0] and mc.info["num_points"] == want["points"].iloc[0]
            got = mc.info["fit_error"]["heldout"][mc.info["form"]]
            assert float(f"{got['median']:.6g}") == want["heldout_median"].iloc[0]
            assert float(f"{got['p90']:.6g}") == want["heldout_p90"].iloc[0]
        # priced per context: the round at the largest context is dearer than at the smallest
        # here (the drafter attends to b x l), and a context between them lies between
        x, y = (4, 7) if fam == "dspark" else (8, 7)
        lo, hi = (float(m.predict(x, y, 32, c)) for c in (timed[0], timed[-1]))
        mid = float(m.predict(x, y, 32, (timed[0] + timed[-1]) / 2))
        assert lo < hi and mid == pytest.approx((lo + hi) / 2, rel=1e-9)
    named = [n for n in notes if n.startswith("drafters' C_d from")]
    assert len(named) == 1 and f"variant {ROUND_VARIANT}, contexts 256 and 1024, timed 20" in named[0]


def test_the_sweep_label_and_the_rows_a_fit_took():
    rows = pd.DataFrame({"stage": ["draft_block"] * 5 + ["draft_tfm"],
                         "variant": [LOOP_BUILDER_VARIANT, ROUND_VARIANT, ROUND_VARIANT, ROUND_VARIANT,
                                     ROUND_VARIANT, ROUND_VARIANT],
                         "context_len": [1024, 256, 1024, 4096, 256, 512],
                         "timestamp": ["2026-12-06T06:00:00+00:00", "2026-12-07T01:22:00+00:00",
                                       "2026-12-08T01:23:00+00:00", "2026-12-09T01:00:00+00:00",
                                       "2026-12-09T02:00:00+00:00", "2026-12-07T02:00:00+00:00"],
                         "model": ["m"] * 6, "device": ["gpu"] * 4 + ["other"] + ["gpu"],
                         "dtype": ["bf16"] * 6, "deployment": ["tp=1"] * 6})
    # the fit kept the round rows at 256 and 1024 (not 4096: not fitted there) of one device
    fitted = {"block": SimpleNamespace(info={"source": {"variant": ROUND_VARIANT, "context_len": 1024}},
                                       contexts=[256, 1024])}
    took = fitted_rows(rows, fitted, model="m", device="gpu", dtype="bf16", deployment="tp=1")
    assert list(took.index) == [1, 2]   # not the layers row, the unfitted context, the other device, nor tfm's
    assert sweep_label(took) == "variant round, contexts 256 and 1024, timed 2026-12-07 to 2026-12-08"
    assert sweep_label(rows.iloc[:1]) == "variant layers, context 1024, timed 2026-12-06"
    assert sweep_label(rows.iloc[[0, 1, 2, 5]]) == ("variants layers, round, contexts 256, 512 and 1024, "
                                                    "timed 2026-12-06 to 2026-12-08")
    assert sweep_label(rows.iloc[:0]) == "no rows"
