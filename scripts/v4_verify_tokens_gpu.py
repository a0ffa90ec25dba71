"""Does the MoE target's verify time depend on the drafted tokens?  The modes runs
(reports/h100/modes) found a block drafter's verify on DeepSeek-V4-Flash off the MTP-drafted
verify of as many nodes (DSpark's 4-node chain 35.5 ms against linear_d4's 37.3 at batch 8;
block_d8 68.7 against best_first_d8's 63.1 at batch 32) and varying round to round, while on the
dense Qwen target the two agree (docs/validation.md section 3).  The inference: the experts a
token routes to (V4's hash layers by token id, the router by the hidden state) make the MoE's
cost, C_v is profiled with uniform random tokens, and the random-weight block drafters draft few
distinct tokens.  This script tests it on the GPU:

    OUT=/tmp/out python scripts/v4_verify_tokens_gpu.py [--model deepseek-v4-flash] [--rounds 6]
    python scripts/v4_verify_tokens_gpu.py --model tiny-v4 --costs-model deepseek-v4-flash --device cpu \
        --batch-sizes 2 --rounds 2 --context 32 --no-graphs --out /tmp/vt      # the same replay on a CPU

Per batch size (8, 32) and run shape (linear_d4, best_first_d8_w1_p3, block_d8_p7, dspark_p7_sched,
as the modes runs build them: gsm8k replay, context 256): the engine runs ``--rounds`` rounds (CUDA
graphs); after each, the target's verify alone (one CUDA graph of ``model.verify``, called with the
engine's verify arguments, over the state that round's verify read - kept before the round, put back
for the replays - and the round's tree) is replayed on token sets of that tree shape: ``drafted``
(the round's own tokens), ``uniform`` (random over the vocabulary: the profile's), ``per_sequence``
(each sequence's root repeated at every node) and ``one_token`` (one token everywhere).  Checks:
each replay's inputs on the host (tokens in the vocabulary, one tree per sequence, positions inside
the state: one line, not a device-side assert); every replayed verify's argmax is finite and of the
tree's shape; ``drafted`` gives the engine's own verify output node for node (``drafted_mismatch``)
and its verify stage time within 3% (else said in the note).  The replay is
:mod:`simtree.runtime.full.verify_tokens`.
``--costs-model``: the model whose shipped cost bundle and drafter profile rows size the rounds
(default ``--model``; a tiny config has none).  Writes $OUT/verify_tokens.csv and prints it: batch,
run, nodes, distinct tokens per round (mean, and of b x n), the engine's verify stage ms and the
replayed verify ms per token set (median of 10 replays a round, mean over rounds).  Expected if the
inference holds: ``uniform`` about the same for every run of a node count (C_v), ``drafted`` near
it for the MTP runs and off it for block and DSpark.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch

from simtree.errors import SimtreeError
from simtree.fileio import write_csv_atomic
from simtree.runtime.full.build import build_model
from simtree.runtime.full.gpu_run import default_costs, runtime_deployment
from simtree.runtime.full.modes_gpu import DRAFTER_PROFILE, drafter_bundle
from simtree.runtime.full.verify_tokens import COLUMNS, SHAPES, verify_tokens_row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v4-flash")
    ap.add_argument("--costs-model", default=None, help="whose shipped costs size the rounds (default --model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--shapes", default=",".join(m for m, _ in SHAPES), help="which run shapes (modes)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--drafter-profile", default=DRAFTER_PROFILE)
    ap.add_argument("--no-graphs", action="store_true", help="time the replayed verify eagerly (the engine keeps its graphs)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    try:
        costs_model = args.costs_model or args.model
        path = default_costs(costs_model, runtime_deployment(costs_model, None))
        if path is None:
            raise SimtreeError(f"no shipped cost bundle of {costs_model} on this machine: name a model with one "
                               "(--costs-model deepseek-v4-flash)")
        costs, _ = drafter_bundle(path, args.drafter_profile, costs_model)
        model = build_model(args.model, args.device)
    except (SimtreeError, OSError) as exc:     # OSError: no drafter profile there (a path from the checkout)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = []
    for B in (int(b) for b in args.batch_sizes.split(",")):
        for mode, params in (x for x in SHAPES if x[0] in args.shapes.split(",")):
            try:
                rows.append(verify_tokens_row(model, costs, mode, params, B, args.rounds, args.context, 0,
                                              graphs=not args.no_graphs))
            except Exception as exc:   # noqa: BLE001 - one failed shape is a row; the next goes on
                traceback.print_exc()
                rows.append({"batch": B, "run": mode, "note": f"FAILED: {type(exc).__name__}: {exc}"[:300]})
            print(rows[-1], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    stamp = {"model": args.model, "context": args.context, "rounds": args.rounds, "gpu": gpu, "torch": torch.__version__}
    table = write_csv_atomic(Path(args.out) / "verify_tokens.csv", [{**r, **stamp} for r in rows],
                             [*COLUMNS, *stamp])   # LF, as pandas writes
    print(table.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
