"""The GDN floor benchmark's book-keeping (the GPU run itself: scripts/gdn_floor_gpu.sh)."""
import pandas as pd

from simtree.profiler.bench.gdn_floor import COLUMNS, QWEN36, floor_bytes, summary, write_csv

D = {k: QWEN36[k] for k in ("H", "HV", "K", "V")}


def test_the_pair_floor_is_two_state_passes_plus_the_token_rows():
    S = 16 * 48 * 128 * 128 * 4                           # batch 16, fp32 state
    rows = 16 * 128 * ((2 * 16 * 128 + 2 * 48 * 128) * 2 + 2 * 48 * 4)
    assert floor_bytes("gdn_verify+commit", 16, 128, 0, D) == 2 * S + rows
    assert floor_bytes("gdn_verify_fold+defer", 16, 128, 0, D) == 2 * S + rows
    assert floor_bytes("gdn_verify", 16, 128, 0, D) == S + rows
    assert floor_bytes("gdn_commit", 16, 128, 0, D) == 2 * S
    # token rows only: 100 path rows (about 6 per sequence) move a thirteenth of the state
    assert 0 < floor_bytes("gdn_defer_commit", 16, 128, 100, D) < S / 10


def row(kernel, b, n, us, ratio):
    return dict(kernel=kernel, layer_kind="gdn", batch=b, nodes=n, context=0, measured_us=us,
                floor_us=us / ratio, ratio=ratio)


def test_the_csv_keeps_other_layer_kinds_and_replaces_gdn_rows(tmp_path):
    path = tmp_path / "floor.csv"
    v4 = dict(kernel="v4_verify", layer_kind="csa", batch=1, nodes=4, context=4096, measured_us=9.0,
              floor_us=3.0, ratio=3.0)
    pd.DataFrame([v4, row("gdn_verify", 1, 1, 5.0, 2.0)], columns=COLUMNS).to_csv(path, index=False)
    write_csv(path, [row("gdn_verify", 1, 2, 6.0, 2.0)])
    got = pd.read_csv(path)
    assert list(got.columns) == COLUMNS
    assert got["layer_kind"].tolist() == ["csa", "gdn"] and got["nodes"].tolist() == [4, 2]


def test_the_summary_reads_the_targets():
    rows = [row("gdn_verify_fold+defer", 16, 128, 140.0, 1.3), row("gdn_verify_fold+defer", 1, 16, 5.5, 2.0),
            row("gdn_verify+commit", 16, 128, 200.0, 1.9), row("gdn_verify+commit", 1, 16, 9.0, 4.0)]
    s = summary(rows)
    assert s["gdn_verify_fold+defer"]["meets"] and not s["gdn_verify+commit"]["meets"]
    assert s["gdn_verify+commit"]["max_ratio_batch_ge16"] == 1.9
