"""Where the Qwen3.6-27B runs at batch 32 with 10 nodes miss: the numbers of docs/validation.md
(section 3, "GEMM M-tiles between node counts"), read from the committed archives.

  .venv/bin/python scripts/tile_diagnosis.py [COSTS]    (COSTS: another bundle's C_v beside the frozen one's)

Prints (1) the layer pieces of the H100 session's profile at b = 32 and 64 across n (the matrix
products step with 128-row tiles of n b rows), (2) the out-of-sample runs at b = 32: measured
verify + commit and draft per round against the frozen bundle's C_v and the rest of its
predicted round (and COSTS' C_v), (3) the session's own runs
at b = 64 (320 rows at n = 5 against 384 at n = 6).
"""
import io
import sys
import tarfile
import warnings
from pathlib import Path

import pandas as pd

from simtree.costs.model import load_costs

ROOT = Path(__file__).resolve().parents[1]
SESSIONS = ROOT / "reports/h100/live/sessions.tgz"
OOS = ROOT / "reports/validation/oos_runs.tgz"
MODEL = "qwen3.6-27b"
PIECES = ("mlp_step", "gdn_proj_step", "attn_proj_step", "lm_head_step", "attn_tree_verify", "model_verify_step")


def _member(tar: tarfile.TarFile, name: str) -> bytes:
    """A member's bytes, named with or without a leading "./"."""
    names = set(tar.getnames())
    return tar.extractfile(name if name in names else f"./{name}").read()


FROZEN = ROOT / "reports/validation/frozen_h100_qwen3.6-27b_tp1.json"


def main(costs_path: str | None) -> None:
    warnings.simplefilter("ignore")
    frozen = load_costs(FROZEN)
    other = load_costs(costs_path) if costs_path else None
    with tarfile.open(SESSIONS) as outer:
        inner = tarfile.open(fileobj=io.BytesIO(_member(outer, f"full_{MODEL}.tgz")))
        profile = pd.read_csv(io.BytesIO(_member(inner, "profile/profile.csv")))
        session = pd.read_csv(io.BytesIO(_member(inner, "summary.csv")))
    print(f"(1) session profile pieces, us (context 1024 for attention and the composed step; rows = n b)")
    for stage in PIECES:
        rows = profile[(profile.stage == stage) & profile.batch_size.isin([32, 64])
                       & profile.context_len.isin([0, 1024])]
        table = rows.pivot_table(index="batch_size", columns="nodes_per_seq", values="latency_us_median")
        print(f"  {stage}\n" + table.round(1).to_string().replace("\n", "\n    ").join(["    ", ""]))
    print("\n(2) out-of-sample runs at b = 32, ms per round: measured verify + commit, draft; bundle C_v, round - C_v")
    with tarfile.open(OOS) as tar:
        for ctx in (1024, 4096):
            runs = pd.read_csv(io.BytesIO(_member(tar, f"{MODEL}/ctx_{ctx}/summary.csv")))
            runs = runs[(runs.batch_size == 32) & runs.measured_round_ms.notna()].sort_values("nodes")
            for _, r in runs.iterrows():
                n = float(r.nodes)
                cv = frozen.verify.predict(n, float(ctx), 32.0) / 1e3
                vc = r.verify_ms + r.commit_ms
                line = (f"  l={ctx:5d} n={n:4g} {r.policy:24s} verify+commit {vc:6.2f}  C_v {cv:6.2f} "
                        f"({cv / vc - 1:+.1%})  draft {r.draft_ms:6.2f}  predicted round - C_v {r.predicted_round_ms - cv:6.2f}")
                if other is not None:
                    cn = other.verify.predict(n, float(ctx), 32.0) / 1e3
                    line += f"  COSTS C_v {cn:6.2f} ({cn / vc - 1:+.1%})"
                print(line)
    print("\n(3) the session's own runs at b = 64, verify ms (rows = 64 n)")
    rows = session[session.batch_size == 64].sort_values("nodes")
    for _, r in rows.iterrows():
        print(f"  n={r.nodes:3g} rows={64 * r.nodes:5g} {r.policy:34s} verify {r.verify_ms:6.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
