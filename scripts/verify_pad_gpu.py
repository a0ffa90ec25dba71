"""Does padding a verify round to the cheaper bucket pay on the GPU?  (simtree.costs.verify_pad)

Fits the H100 bucket profile (simtree/data/profiles/h100/buckets_qwen3.6-27b_tp1.csv) twice: on
the lower envelope with its pad map (batch 32: 10 -> 11, 14 -> 16 nodes) and as measured (no
map); then decodes Qwen3.6-27B at full scale (random weights, acceptance replayed from the gsm8k
preset, CUDA graphs) at batch 32 with each bundle: plain, linear D=4, best-first trees of 10
and 14 nodes and cost_aware up to 16 nodes.  With the padded bundle the 10- and 14-node rounds
are captured at 11 and 16 nodes (summary.json: ``padded_from``; the rows' notes say so).
Writes $OUT/verify_pad.csv (bundle, policy, nodes verified, padded from, verify / round ms,
tok/s) and prints one line per padded policy: its verify ms padded against
not, PASS where padding is faster.  Needs one H100 (the bucket profile's GPU) and ~3 minutes.

    python scripts/verify_pad_gpu.py --out $OUT
    python scripts/verify_pad_gpu.py --out /tmp/pad --model tiny-gdn --device cpu --rounds 2   # dry run
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from simtree.costs.profile_fit import fit_profile
from simtree.data import data_path
from simtree.fileio import write_csv_atomic
from simtree.planning.modes import PolicySpec

TABLE = data_path("profiles") / "h100" / "buckets_qwen3.6-27b_tp1.csv"
SPECS = [("best_first10", PolicySpec.from_dict("best_first", {"budget": 10, "width": 1, "draft_depth": 3})),
         ("best_first14", PolicySpec.from_dict("best_first", {"budget": 14, "width": 1, "draft_depth": 3})),
         ("cost_aware16", PolicySpec.from_dict("cost_aware", {"max_budget": 16, "draft_depth": 3}))]
COLUMNS = ("bundle", "policy", "batch_size", "nodes", "padded_from", "verify_ms", "measured_round_ms",
           "measured_tok_s", "note")   # no prediction: the bucket table times context 0 only


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="qwen3.6-27b")
    ap.add_argument("--batch-sizes", default="32")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="cpu with --model tiny-gdn: a dry run of the script's logic")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bundles = {}
    for label, pad in (("padded", True), ("as_measured", False)):
        report = fit_profile(TABLE, model="qwen3.6-27b", deployment="tp=1", draft_from_verify=True, verify_pad=pad)
        bundles[label] = report.bundle.save(args.out / f"{label}.json")
        print(f"{label}: pad map {report.bundle.verify.info.get('verify_pad', {}).get('by_batch', {})}", flush=True)
    from simtree.runtime.full.build import build_model
    from simtree.runtime.full.measure import full_run

    t0 = time.time()
    model = build_model(args.model, args.device)
    print(f"built {args.model} in {time.time() - t0:.0f} s", flush=True)
    rows, verify = [], {}
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    for label, path in bundles.items():
        res = full_run(model, device=args.device, costs=str(path), batch_sizes=sizes, acceptance="gsm8k",
                       out=args.out / label, rounds=args.rounds, warmup_rounds=2, extra=SPECS,
                       progress=lambda line: print(line, flush=True))
        padded = {(r["label"], r["batch_size"]): r.get("padded_from", 0) for r in res["runs"]}
        for r in res["rows"]:
            name = r["policy"].split(":", 1)[0]
            row = {"bundle": label, "policy": r["policy"], "batch_size": r["batch_size"], "nodes": r["nodes"],
                   "padded_from": padded.get((name, r["batch_size"]), 0), "verify_ms": r["verify_ms"],
                   "measured_round_ms": r["measured_round_ms"], "measured_tok_s": r["measured_tok_s"],
                   "note": r["note"]}
            rows.append(row)
            verify[(label, r["policy"], r["batch_size"])] = row
    write_csv_atomic(args.out / "verify_pad.csv", rows, COLUMNS)
    for (label, policy, b), row in verify.items():
        if label != "padded" or not row["padded_from"]:
            continue
        other = verify.get(("as_measured", policy, b))
        if other is None:
            print(f"{policy} b{b}: no unpadded run to compare")
            continue
        ok = row["verify_ms"] < other["verify_ms"]
        print(f"{'PASS' if ok else 'FAIL'} {policy} b{b}: verify {row['verify_ms']:.2f} ms at {row['nodes']} nodes "
              f"(padded from {row['padded_from']}) vs {other['verify_ms']:.2f} ms at {other['nodes']}; round "
              f"{row['measured_round_ms']:.2f} vs {other['measured_round_ms']:.2f} ms")
    print(f"wrote {args.out / 'verify_pad.csv'}")


if __name__ == "__main__":
    main()
