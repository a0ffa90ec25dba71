"""A/B of the runtime's per-round GDN metadata: A = the device builder issued eagerly (the
runtime before ``verify_round_meta_host``), B = the host builder (now); the same live runs
(shipped tiny models, ShareGPT prompts), interleaved, ``--reps`` times, the first with the
lossless check; writes one JSON line per run to OUT/ab.jsonl (and prints it), the device
and software to OUT/gpu.txt, each run's run.json under OUT/<case>_<variant>_<rep>/.

    python3 scripts/round_meta_ab.py --device cuda --out DIR [--prompts 8] [--new-tokens 48]
    python3 scripts/round_meta_ab.py --report DIR    # DIR/ab.jsonl + gpu.txt -> DIR/README.md
"""
import argparse
import json
import os

from simtree.kernels.gdn import ops as g
from simtree.kernels import gdn as kg
from simtree.machine.metadata import collect_metadata
from simtree.runtime.live import live_run
from simtree.planning.modes import params_from_flags

new = g.round_meta


def old(meta, batch, hv, v):
    meta["gdn"] = kg.tree_meta(meta["parents"], meta["cu_nodes"], max_nodes=batch.max_nodes,
                               validate=False, depth_first=batch.known_depth_first)
    return meta


ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--out", default="/tmp/round_meta_ab")
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--new-tokens", type=int, default=48)
ap.add_argument("--reps", type=int, default=2)
ap.add_argument("--report", metavar="DIR", help="write DIR/README.md from DIR/ab.jsonl and exit")
args = ap.parse_args()
if args.report:
    import pandas as pd

    from simtree.fileio import write_text_atomic
    from simtree.profiler.bench.report_util import markdown_table
    df = pd.DataFrame([json.loads(line) for line in open(f"{args.report}/ab.jsonl")])
    gpu = open(f"{args.report}/gpu.txt").read().split("\n")
    wide = df.pivot_table(index=["case", "rep"], columns="variant", values=["round_us", "verify_us"])
    diff = pd.DataFrame({f"{v} A - B (ms)": (wide[v]["A_device_eager"] - wide[v]["B_host"]) / 1e3
                         for v in ("round_us", "verify_us")}).round(2).reset_index()
    checked = df[df.lossless_checked]
    write_text_atomic(f"{args.report}/README.md", f"""# Round metadata A/B in the live runtime

`python3 scripts/round_meta_ab.py --device cuda` on {gpu[0]} ({gpu[1]} host cores, torch {gpu[2]}):
the shipped tiny GDN-hybrid target and draft, ShareGPT prompts; A = the GDN round metadata built
by device ops issued eagerly (the runtime before `verify_round_meta_host`), B = built on the
host in numpy and copied once (now). Runs interleaved A, B per case; the first repetition with
the lossless check (greedy speculative output vs plain greedy decoding): {len(checked)} runs
checked, {int(checked.mismatches.sum())} mismatching outputs. Generated from `ab.jsonl` by
`--report`.

{markdown_table(df)}

Per case and repetition, A minus B (positive: the host build is faster):

{markdown_table(diff)}

The tiny models' rounds are host-bound and vary from run to run: compare the repetitions
before reading a difference.
""")
    raise SystemExit(0)
out = args.out
os.makedirs(out, exist_ok=True)
with open(f"{out}/gpu.txt", "w") as fh:   # the lines --report reads: device, host cores, torch
    m = collect_metadata(args.device)
    name = m["device"] + (f", {m['driver']}" if m.get("driver") else "")
    fh.write(f"{name}\n{m['cpu_count']}\n{m['torch_version']}\n")
log = open(f"{out}/ab.jsonl", "w")
cases = [("b1_best_first", "best_first", params_from_flags("best_first", 3, 2, 16, 1, None), 1),
         ("b4_eagle", "eagle", params_from_flags("eagle", 4, 2, 12, 1, None), 4)]
for rep in range(args.reps):
    for name, mode, params, bs in cases:
        for tag, fn in (("A_device_eager", old), ("B_host", new)):
            g.round_meta = fn
            d = f"{out}/{name}_{tag}_{rep}"
            r = live_run(spec=params, workload="sharegpt", batch_size=bs,
                         prompts=args.prompts, max_new_tokens=args.new_tokens, out=d,
                         check_lossless=rep == 0, device=args.device)
            m = r["measured"]
            line = json.dumps(dict(case=name, variant=tag, rep=rep, tok_s=round(m["tokens_per_s"], 1),
                                   round_us=round(m["round_us_median"]), verify_us=round(m["verify_us_median"]),
                                   lossless_checked=r["lossless_checked"],
                                   mismatches=r["lossless_mismatches"]))
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
