"""The shipped presets against the published DeepSeek-V4-Flash MTP numbers: the calibration
table is recomputed with the project's own builders and Phi, checked against the targets and
against the committed reports/acceptance/preset_calibration.csv."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simtree.acceptance.calibrate import (TARGETS, calibration_table, check_targets, main, params_to_vector,
                                          vector_to_params)
from simtree.acceptance.model import get_workload
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.presets import (PRESETS, PUBLISHED_BUDGETS, PUBLISHED_TREE_GAIN_PCT, PUBLISHED_V4_FLASH_MTP,
                                        PresetParams, preset_levels, preset_model, preset_params)
from simtree.errors import SimtreeError

COMMITTED = Path(__file__).resolve().parents[1] / "reports" / "acceptance" / "preset_calibration.csv"


@pytest.fixture(scope="module")
def table():
    return calibration_table()


def test_calibration_meets_every_target(table):
    assert check_targets(table) == []
    lin = table[table["shape"].str.endswith("accepted tokens")]
    gains = table[table["shape"].str.endswith("gain over linear %")]
    assert len(lin) == len(gains) == len(PRESETS) * len(PUBLISHED_BUDGETS)
    assert (lin["preset"] - lin["published"]).abs().max() <= TARGETS["linear_tokens"]
    assert (gains["preset"] - gains["published"]).abs().max() <= TARGETS["gain_points"]


def test_committed_table_is_what_the_presets_give(table):
    committed = pd.read_csv(COMMITTED)
    assert list(committed.columns) == ["workload", "budget", "shape", "published", "preset"]
    assert committed["shape"].tolist() == table["shape"].tolist()
    assert np.allclose(committed["preset"], table["preset"], atol=1e-3)
    assert np.allclose(committed["published"], table["published"])


def test_check_targets_names_a_miss():
    bad = calibration_table({"gsm8k": preset_levels(PresetParams(0.8, 0.95, 0.4, 0.0, 6.0, 0.3), "gsm8k")})
    misses = check_targets(bad)
    assert any("linear" in m for m in misses) and any("tree gain" in m for m in misses)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_structure(name):
    acc = get_workload(name).acceptance
    assert acc.num_levels == 8 and acc.weights.sum() == pytest.approx(1.0)
    assert np.array_equal(acc.draft_probs, acc.tables)            # a calibrated drafter
    chain = acc.weights @ acc.tables[:, :, 0]
    assert chain[0] > 0.6 and chain[5:].max() < 0.05              # the horizon: deep drafts rarely right
    assert "qwen3.6-27b" in acc.meta["models"] and "assumed" in acc.meta["models"]["qwen3.6-27b"]
    # linear is flat in D: a deeper chain buys nothing, a top-2 tree gains
    lin = [accepted_per_round(acc, "linear", {"budget": d}) for d in PUBLISHED_BUDGETS]
    assert max(lin) - min(lin) < 0.02 and lin[0] == pytest.approx(PUBLISHED_V4_FLASH_MTP[name], abs=0.05)
    tree = accepted_per_round(acc, "eagle", {"num_steps": 3, "topk": 2, "budget": 8})
    assert 100 * (tree / lin[-1] - 1) == pytest.approx(PUBLISHED_TREE_GAIN_PCT[8], abs=1.5)


def test_parameter_vector_round_trips():
    p = preset_params("mbpp")
    back = vector_to_params(params_to_vector(p))
    assert np.allclose([getattr(back, k) for k in p.__dataclass_fields__],
                       [getattr(p, k) for k in p.__dataclass_fields__], rtol=1e-6)


def test_bad_parameters_are_refused():
    with pytest.raises(SimtreeError, match="out of range"):
        preset_levels(PresetParams(0.8, 0.5, 0.9, 0.5, 3.0, 0.2))   # unsure above sure
    with pytest.raises(SimtreeError, match="unknown preset"):
        preset_model("humaneval")


def test_calibrate_command_writes_the_table(tmp_path):
    assert main(["--out", str(tmp_path)]) == 0
    written = pd.read_csv(tmp_path / "preset_calibration.csv")
    assert len(written) == len(PRESETS) * (3 * len(PUBLISHED_BUDGETS) + 1)


@pytest.mark.parametrize("mode, params", [("linear", {"budget": 6}), ("eagle", {"num_steps": 3, "topk": 2, "budget": 8}),
                                          ("best_first", {"budget": 8, "width": 1, "draft_depth": 4})])
def test_simulator_reads_the_presets_as_the_model_predicts(mode, params):
    from simtree.planning.simulate import PolicySpec, static_round
    acc = preset_model("mbpp")
    shape = static_round(acc, PolicySpec.from_dict(mode, params))
    assert 1.0 + acc.weights @ shape.accepted == pytest.approx(accepted_per_round(acc, mode, params), abs=1e-9)


def test_published_holdout_table_is_its_fits_evaluated():
    """reports/acceptance/published_holdout.csv: the fitted parameters in its JSON, evaluated again,
    give the table; train rows are the linear column (and D = 5, 6 gains for the split)."""
    import json
    from pathlib import Path

    import pandas as pd

    from simtree.acceptance.holdout import SPLIT_TRAIN_BUDGETS, holdout_table, summarize
    from simtree.acceptance.presets import PresetParams

    folder = Path(__file__).resolve().parents[1] / "reports" / "acceptance"
    data = json.loads((folder / "published_holdout.json").read_text())
    fields = PresetParams.__dataclass_fields__
    fits = {}
    for name, by in data["fits"].items():
        lin = PresetParams(**{k: by["linear_only"][k] for k in fields})
        assert abs(lin.sibling_share - data["rank_prior"]["sibling_share"]) < 1e-3
        fits[name] = {"linear_only": lin, "linear_only_ceiling": PresetParams(**{**{k: by["linear_only"][k] for k in fields},
                                                                                "sibling_share": 1.0}),
                      "split": PresetParams(**{k: by["split"][k] for k in fields})}
    table = holdout_table(fits)
    shipped = pd.read_csv(folder / "published_holdout.csv")
    assert list(shipped.columns) == list(table.columns) and len(shipped) == len(table)
    assert (shipped["predicted"] - table["predicted"]).abs().max() < 2e-3
    tests = table[table["fitted_on"] == "test"]
    assert set(tests["quantity"].str.contains("gain over linear")) == {True}
    assert set(tests[tests["split"] == "split"]["budget"]) == {7, 8} and SPLIT_TRAIN_BUDGETS == (5, 6)
    got = summarize(table)
    assert got.keys() == data["summary"].keys()
    for split, s in got.items():
        assert s["tests"] == data["summary"][split]["tests"]
        assert s["median_points"] == pytest.approx(data["summary"][split]["median_points"], abs=2e-3)


def test_rank_catch_rate_counts_rank_two_where_rank_one_missed():
    from types import SimpleNamespace

    import numpy as np

    from simtree.acceptance.holdout import rank_catch_rate
    rec = SimpleNamespace(num_accepted=1, topk_tokens=np.array([[5, 6], [7, 8], [1, 2]]),
                          target_tokens=np.array([5, 8]))
    assert rank_catch_rate([rec]) == (1.0, 1)
    rec2 = SimpleNamespace(num_accepted=0, topk_tokens=np.array([[5, 6]]), target_tokens=np.array([9]))
    assert rank_catch_rate([rec, rec2]) == (0.5, 2)
    with pytest.raises(SimtreeError):
        rank_catch_rate([SimpleNamespace(num_accepted=0, topk_tokens=None, target_tokens=None)])
