"""scripts/verify_shape_gpu.py --summary over a CSV whose older rows predate the device-name and
torch columns (device 'cuda', torch empty) and whose newer rows time fewer shapes."""
import importlib.util
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("verify_shape_gpu", ROOT / "scripts" / "verify_shape_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_old_and_new_rows_in_one_summary(tmp_path):
    rows = []
    for b, n, shapes, us, device, torch in [
            (8, 12, ("chain", "best_first_p3"), 24000.0, "cuda", None),
            (8, 16, ("chain", "best_first_p3"), 25000.0, "cuda", None),
            (64, 5, ("chain", "eagle_top2"), 49000.0, "Test GPU", "2.0"),
            (64, 6, ("chain", "eagle_top2"), 47000.0, "Test GPU", "2.0")]:
        for i, s in enumerate(shapes):
            rows.append({"batch_size": b, "nodes_per_seq": n, "shape": s, "context_len": 256,
                         "verify_us_median": us + 100 * i, "verify_us_p10": us, "verify_us_p90": us,
                         "depth_max": 1, "leaves": 1, "valid_nodes": n, "graphs": True, "device": device,
                         "torch": torch})
    csv = tmp_path / "verify_shape.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    text = _script().summary(csv, gpu="Test GPU")
    assert "| 64 | 5 | 320 | - | 49.00 | 49.10 | 0.2% |" in text           # best_first_p3 not timed there
    assert "| 8 | 12 | 96 | 24.10 | 24.00 | - | 0.4% |" in text
    assert "The rows at batch 8 predate the script's device-name and torch columns (their `device` reads " \
           "`cuda`, their `torch` is empty)" in text
    assert "the rows at batch 64 record Test GPU and torch 2.0." in text
    assert "batch 64, 5 nodes +4.3% over 6 nodes (chain, eagle_top2)." in text
