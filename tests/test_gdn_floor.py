"""The GDN floor benchmark's book-keeping (the GPU run itself: scripts/gdn_floor_gpu.sh)."""
import pandas as pd
import torch
import pytest

from simtree.profiler.bench.gdn_floor import COLUMNS, QWEN36, floor_bytes, summary, write_csv
from simtree.profiler.bench.gdn_floor_variants import VARIANTS, variants

D = {k: QWEN36[k] for k in ("H", "HV", "K", "V")}


def test_the_pair_floor_is_two_state_passes_plus_the_token_rows():
    S = 16 * 48 * 128 * 128 * 4                           # batch 16, fp32 state
    rows = 16 * 128 * ((2 * 16 * 128 + 2 * 48 * 128) * 2 + 2 * 48 * 4)
    for pair in ("gdn_verify+commit", "gdn_verify_fold+defer", "gdn_verify_fold+arm"):
        assert floor_bytes(pair, 16, 128, 0, D) == 2 * S + rows
    assert floor_bytes("gdn_verify", 16, 128, 0, D) == S + rows
    assert floor_bytes("gdn_commit", 16, 128, 0, D) == 2 * S
    assert floor_bytes("gdn_fold_round", 16, 128, 0, D) == 2 * S
    assert floor_bytes("gdn_arm", 16, 128, 0, D) == 16 * 48 * 128     # one int8 flag a column
    # token rows only: 100 path rows (about 6 per sequence) move a thirteenth of the state
    assert 0 < floor_bytes("gdn_defer_commit", 16, 128, 100, D) < S / 10


def row(kernel, b, n, us, ratio, variant="default"):
    return dict(kernel=kernel, layer_kind="gdn", batch=b, nodes=n, context=0, measured_us=us,
                floor_us=us / ratio, ratio=ratio, variant=variant, gpu="GPU")


def test_the_csv_keeps_other_layer_kinds_and_replaces_gdn_rows(tmp_path):
    path = tmp_path / "floor.csv"
    v4 = dict(kernel="v4_verify", layer_kind="csa", batch=1, nodes=4, context=4096, measured_us=9.0,
              floor_us=3.0, ratio=3.0)
    pd.DataFrame([v4, row("gdn_verify", 1, 1, 5.0, 2.0)], columns=COLUMNS).to_csv(path, index=False)
    write_csv(path, [row("gdn_verify", 1, 2, 6.0, 2.0)])
    got = pd.read_csv(path)
    assert list(got.columns) == COLUMNS
    assert got["layer_kind"].tolist() == ["csa", "gdn"] and got["nodes"].tolist() == [4, 2]


def test_the_summary_reads_the_targets_per_variant_and_for_the_best_pair():
    rows = [row("gdn_verify_fold+defer", 16, 128, 140.0, 1.3),
            row("gdn_verify_fold+defer", 1, 16, 5.5, 2.0),
            row("gdn_verify+commit", 16, 128, 200.0, 1.9),
            row("gdn_verify+commit", 1, 16, 9.0, 4.0),
            row("gdn_verify_fold+arm", 1, 16, 4.0, 1.5, "bv32"), row("gdn_verify", 1, 16, 1.0, 1.0)]
    s = summary(rows)
    assert s["gdn_verify_fold+defer default"]["meets"]
    assert not s["gdn_verify+commit default"]["meets"]
    assert s["gdn_verify+commit default"]["max_ratio_batch_ge16"] == 1.9
    assert not s["gdn_verify_fold+arm bv32"]["meets"]        # no batch >= 16 row
    best = s["best"]     # the verify alone is no pair: the best b1 n16 pair is bv32's 4.0 us
    assert best["meets"] and best["max_us_batch1_n_le16"] == 4.0
    assert best["ways"] == ["gdn_verify_fold+arm bv32", "gdn_verify_fold+defer default"]


def test_variants_time_where_they_change_the_launch():
    by = {v.name: v for v in VARIANTS}
    assert by["default"].kernels_at(16, 128, True)[0] == "gdn_verify+commit"
    assert "gdn_fold_pending" not in by["default"].kernels_at(16, 2, False)
    assert by["bv32"].kernels_at(16, 4, False) == () and by["bv32"].kernels_at(1, 4, False)
    assert by["triton_walk"].kernels_at(16, 128, False) == ()
    assert by["triton_walk"].kernels_at(16, 128, True) == ("gdn_verify", "gdn_verify_fold+defer")
    assert [v.name for v in variants("round,default")] == ["default", "round"]
    with pytest.raises(SystemExit, match="unknown variant"):
        variants("nope")


def test_each_way_is_checked_against_today_and_float64():
    """The GPU run's checks, on tiny heads through the interpreter: the pair and the round at a
    split value dimension, the deferred pair and the launch-free round agree with today's pair
    and the float64 sequential state (bf16 inputs: as close as today's pair)."""
    from simtree.profiler.bench.gdn_floor import TINY, check_base, check_shape
    base = check_base(1, 6, TINY, "cpu")
    by = {v.name: v for v in VARIANTS}
    for name, ways in (("bv16", ("pair", "round")), ("default", ("deferred",)),
                       ("round", ("round",))):
        out = check_shape(base, by[name], by[name].kernels_at(1, 4, False))
        assert out["ok"], out
        for way in ways:
            assert out[f"{way}_state_vs_float64"] <= 1.01 * out["today_state_vs_float64"]
            assert out[f"{way}_state_vs_today"] < 1e-5 and out[f"{way}_out2_vs_today"] < 1e-5


def test_a_two_round_check_gets_two_input_copies_however_large_one_is():
    from simtree.profiler.bench.gdn_util import shape_inputs
    d = {"H": 2, "HV": 2, "K": 16, "V": 16}
    assert len(shape_inputs(2, 4, 0, d, dtype=torch.float32, device="cpu", l2_bytes=1)) == 1
    two = shape_inputs(2, 4, 0, d, dtype=torch.float32, device="cpu", l2_bytes=1, min_copies=2)
    assert len(two) == 2 and not torch.equal(two[0]["k"], two[1]["k"])   # two rounds, fresh inputs each
