"""Cost bundles are checked for physically possible values when loaded: one-line errors that
name the bundle file, the model (verify / draft) and the problem."""
import copy
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

from simtree.costs.forms import BasisSurface, GridSurface
from simtree.costs.model import CostBundle, DraftCostModel, VerifyCostModel, load_costs
from simtree.errors import SimtreeError

QWEN = "simtree/data/costs/h200_qwen3.6-27b_tp1.json"
DEEPSEEK = "tests/data/costs/v4_flash_one_gpu.json"   # a measured MoE fit, one GPU (tests/data/costs/README.md)


def _bundle(path=QWEN) -> dict:
    with open(path) as fh:
        return json.load(fh)


def _write(tmp_path, d, name="bad.json"):
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


def _load_error(tmp_path, d) -> str:
    p = _write(tmp_path, d)
    with pytest.raises(SimtreeError) as err:
        load_costs(p)
    msg = str(err.value)
    assert str(p) in msg and "\n" not in msg
    return msg


@pytest.mark.parametrize("path", [QWEN, DEEPSEEK])
def test_shipped_bundles_load_clean(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no flag raised on the shipped fits either
        b = load_costs(path)
    assert b.verify.predict(1, 4096, 1) > 0 and b.draft.predict(1, 1, 1) > 0


@pytest.mark.parametrize("model", ["verify", "draft"])
def test_negated_or_zero_latencies_are_refused(tmp_path, model):
    d = _bundle()
    values = np.asarray(d[model]["surface"]["values"])
    d[model]["surface"]["values"] = (-values).tolist()
    msg = _load_error(tmp_path, d)
    assert f"{model} model" in msg and "latencies must be" in msg
    d[model]["surface"]["values"] = np.zeros_like(values).tolist()
    if model == "verify":   # a verify step always takes time: 0 would divide every throughput
        assert "> 0 us" in _load_error(tmp_path, d)
    else:                   # a free drafter is meaningful (its work inside the verify step)
        b = load_costs(_write(tmp_path, d))
        assert b.draft.predict(3, 2, 8) == 0.0 and b.verify.predict(4, 4096, 8) > 0


@pytest.mark.parametrize("seed", range(6))
def test_a_decrease_along_any_axis_is_refused_and_located(tmp_path, seed):
    # scale the slab from a random index on a random axis down so that it starts below its
    # predecessor: a positive factor keeps every other axis monotone, so the error names this one
    rng = np.random.default_rng(seed)
    d = _bundle()
    model = ["verify", "draft"][seed % 2]
    surf = d[model]["surface"]
    V = np.asarray(surf["values"])
    axis = int(rng.integers(0, 3))                     # 0: z (batch), 1: y, 2: x
    i = int(rng.integers(1, V.shape[axis]))
    slab = [slice(None)] * 3
    slab[axis] = slice(i, None)
    first, prev = (np.take(V, i, axis=axis), np.take(V, i - 1, axis=axis))
    V[tuple(slab)] *= 0.9 * float(np.min(prev / first))
    surf["values"] = V.tolist()
    msg = _load_error(tmp_path, d)
    name = surf["axis_names"][2 - axis]
    assert f"{model} model: latency decreases along {name}:" in msg and "must be non-decreasing" in msg


def test_unsorted_or_repeated_axes_are_refused(tmp_path):
    d = _bundle()
    xs = d["verify"]["surface"]["xs"]
    xs[1], xs[2] = xs[2], xs[1]
    assert "strictly increasing" in _load_error(tmp_path, d)
    d = _bundle()
    d["draft"]["surface"]["ys"][1] = d["draft"]["surface"]["ys"][0]
    msg = _load_error(tmp_path, d)
    assert "draft model" in msg and "strictly increasing" in msg


def test_an_all_zero_basis_verify_model_is_refused(tmp_path):
    zero = BasisSurface("verify", [64.0], [0.0] * 6)
    draft = BasisSurface("draft", [64.0], [50.0, 2.0, 120.0, 0.1, 0.01, 0.5])
    path = CostBundle(VerifyCostModel(zero), DraftCostModel(draft), {"model": "toy"}).save(tmp_path / "z.json")
    with pytest.raises(SimtreeError, match=r"z\.json: verify model: latency 0 us at one node"):
        load_costs(path)


def test_bad_valid_range_and_non_boolean_flags_are_refused(tmp_path):
    d = _bundle()
    d["verify"]["surface"]["valid_range"]["context_len"] = [4096, 1024]
    assert "valid range of context_len" in _load_error(tmp_path, d)
    d = _bundle()
    d["verify"]["info"]["convex_in_n"] = "false"        # a string would read as True
    assert "info.convex_in_n must be true or false" in _load_error(tmp_path, d)
    d = _bundle()
    d["meta"]["synthetic"] = "no"
    assert "meta.synthetic must be true or false" in _load_error(tmp_path, d)


def test_a_grid_that_is_not_convex_in_n_is_flagged_not_refused(tmp_path):
    xs, ys, zs = [1.0, 2.0, 4.0, 8.0], [1024.0, 4096.0], [1.0, 4.0]
    base = np.array([100.0, 180.0, 200.0, 210.0])       # rises steeply, then flat: concave in n
    values = np.stack([np.stack([base + 10 * j + 40 * i for j in range(2)]) for i in range(2)])
    verify = VerifyCostModel(GridSurface(xs, ys, zs, values, ("nodes_per_seq", "context_len", "batch_size"),
                                         {"nodes_per_seq": [1, 8]}), {"convex_in_n": True})
    draft = DraftCostModel(BasisSurface("draft", [64.0], [50.0, 2.0, 120.0, 0.1, 0.01, 0.5]))
    path = CostBundle(verify, draft, {"model": "toy"}).save(tmp_path / "c.json")
    with pytest.warns(RuntimeWarning, match="not convex in nodes_per_seq"):
        b = load_costs(path)
    assert b.verify.convex_in_n is False          # budget rules then take the global argmax


def test_cli_reports_a_bad_bundle_in_one_line(tmp_path):
    d = copy.deepcopy(_bundle())
    d["verify"]["surface"]["values"] = (-np.asarray(d["verify"]["surface"]["values"])).tolist()
    p = _write(tmp_path, d)
    for args in (["simulate", "--costs", str(p)], ["plan", "--costs", str(p), "--out", str(tmp_path / "o")]):
        proc = subprocess.run([sys.executable, "-m", "simtree", *args], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: cost bundle {p}: verify model: latency -")
