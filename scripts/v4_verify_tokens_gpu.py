"""Does the MoE target's verify time depend on the drafted tokens?  The modes runs
(reports/h100/modes) found a block drafter's verify on DeepSeek-V4-Flash off the MTP-drafted
verify of as many nodes (DSpark's 4-node chain 35.5 ms against linear_d4's 37.3 at batch 8;
block_d8 68.7 against best_first_d8's 63.1 at batch 32) and varying round to round, while on the
dense Qwen target the two agree (docs/validation.md section 3).  The inference: the experts a
token routes to (V4's hash layers by token id, the router by the hidden state) make the MoE's
cost, C_v is profiled with uniform random tokens, and the random-weight block drafters draft few
distinct tokens.  This script tests it on the GPU:

    OUT=/tmp/out python scripts/v4_verify_tokens_gpu.py [--model deepseek-v4-flash] [--rounds 6]

Per batch size (8, 32) and run shape (linear_d4, best_first_d8_w1_p3, block_d8_p7,
dspark_p7_sched, as the modes runs build them: gsm8k replay, context 256): the engine runs
``--rounds`` rounds (CUDA graphs), and after each its tree's tokens are kept.  Then the target's
verify alone (one CUDA graph of ``model.verify`` over the engine's state and the round's tree)
is replayed on token sets of that tree shape: ``drafted`` (the round's own tokens), ``uniform``
(random over the vocabulary: the profile's), ``per_sequence`` (each sequence's root repeated at
every node) and ``one_token`` (one token everywhere).  Checks: every replayed verify's argmax is
finite and of the tree's shape; ``drafted`` reproduces the engine's own verify stage within 3%
(else the replay is not the run's verify: said in the output).  Writes $OUT/verify_tokens.csv
and prints it: batch, run, nodes, distinct tokens per round (mean, and of b x n), the engine's
verify stage ms and the replayed verify ms per token set (median of 10 replays a round, mean
over rounds).  Expected if the inference holds: ``uniform`` about the same for every run of a
node count (C_v), ``drafted`` near it for the MTP runs and off it for block and DSpark.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from simtree.fileio import write_text_atomic
from simtree.planning.modes import PolicySpec
from simtree.runtime.full.block_engine import make_engine
from simtree.runtime.full.build import build_model
from simtree.runtime.full.gpu_run import default_costs, runtime_deployment
from simtree.runtime.full.measure import _Source
from simtree.runtime.full.modes_gpu import DRAFTER_PROFILE, drafter_bundle

SHAPES = [("linear", {"budget": 4}), ("best_first", {"budget": 8, "draft_depth": 3, "width": 1}),
          ("block", {"budget": 8, "block_len": 7}), ("dspark", {"block_len": 7})]
TOKEN_SETS = ("drafted", "uniform", "per_sequence", "one_token")


def _time_ms(fn, cuda: bool, reps: int = 10) -> float:
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(out))


def _verify_replayer(model, st, tokens: torch.Tensor, parents: torch.Tensor, cuda: bool):
    """(tokens buffer, replay(), argmax of the last replay): the target's verify over a fixed tree,
    one CUDA graph where ``cuda`` (else eager: launches overlap the device's work, so a step of
    tens of ms times about as its graph does)."""
    buf = tokens.clone()
    par = parents.clone()
    out = {}

    def verify():
        hidden, _ = model.verify(st, buf, par)
        out["next"] = model.greedy(hidden)

    if not cuda:
        return buf, verify, out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        verify()                    # warm-up (Triton compiles, cached tables) before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify()
    return buf, graph.replay, out


def token_sets(tokens: torch.Tensor, vocab: int, gen: torch.Generator) -> dict:
    B, n = tokens.shape
    return {"drafted": tokens,
            "uniform": torch.randint(0, vocab, (B, n), generator=gen, device=tokens.device),
            "per_sequence": tokens[:, :1].expand(B, n).contiguous(),
            "one_token": torch.full_like(tokens, int(tokens[0, 0]))}


def one_shape(model, costs, mode: str, params: dict, B: int, rounds: int, ctx: int, seed: int,
              graphs: bool = True) -> dict:
    cuda = model.device.type == "cuda"
    spec = PolicySpec.from_dict(mode, params)
    source = _Source(None, "gsm8k", str(model.device), seed, "stratified")
    rs = source.round_shape(spec, B, costs, ctx)
    src = source.make(rs, B, rounds + 2, costs, ctx)
    max_len = ctx + (rounds + 6) * rs.path_rows + 8
    engine = make_engine(model, rs, B, max_len, src, costs=costs)
    engine.capture()
    engine.fill_context(ctx, seed)
    engine.run(rounds=2)
    engine.rewind_source()      # the capture's and warm-up's rounds drew rows: the timed rounds start at row 0
    engine.begin()
    trees = []
    for _ in range(rounds):
        engine.step()
        trees.append((engine.tree.tokens.clone(), engine.tree.parents.clone()))
    stats = engine.stats(1.0)
    gen = torch.Generator(device=model.device).manual_seed(seed + 7)
    times = {k: [] for k in TOKEN_SETS}
    distinct, notes = [], []
    for tokens, parents in trees:
        distinct.append(int(torch.unique(tokens).numel()))
        buf, replay, out = _verify_replayer(model, engine.st, tokens, parents, cuda and graphs)
        for name, toks in token_sets(tokens, model.vocab, gen).items():
            buf.copy_(toks)
            times[name].append(_time_ms(replay, cuda))
            nxt = out["next"]
            if nxt.numel() != tokens.numel() or not bool(((nxt >= 0) & (nxt < model.vocab)).all()):
                notes.append(f"{name}: bad argmax")
        del replay
    stage = float(np.mean(stats.verify_ms))
    row = {"batch": B, "run": spec.name, "nodes": rs.nodes, "distinct_tokens_per_round": float(np.mean(distinct)),
           "tokens_per_round": B * rs.nodes, "engine_verify_ms": stage,
           **{f"{k}_ms": float(np.mean(v)) for k, v in times.items()}}
    gap = row["drafted_ms"] / stage - 1
    if abs(gap) > 0.03:
        notes.append(f"drafted replay {100 * gap:+.1f}% off the engine's verify stage (replay is not the run's verify)")
    row["note"] = "; ".join(dict.fromkeys(notes))
    del engine
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v4-flash")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--shapes", default=",".join(m for m, _ in SHAPES), help="which run shapes (modes)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--drafter-profile", default=DRAFTER_PROFILE)
    ap.add_argument("--no-graphs", action="store_true", help="time the replayed verify eagerly (the engine keeps its graphs)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    deployment = runtime_deployment(args.model, None)
    costs, _ = drafter_bundle(default_costs(args.model, deployment), args.drafter_profile, args.model)
    model = build_model(args.model, args.device)
    rows = []
    for B in (int(b) for b in args.batch_sizes.split(",")):
        for mode, params in (x for x in SHAPES if x[0] in args.shapes.split(",")):
            try:
                rows.append(one_shape(model, costs, mode, params, B, args.rounds, args.context, 0,
                                      graphs=not args.no_graphs))
            except Exception as exc:   # noqa: BLE001 - one failed shape is a row; the next goes on
                traceback.print_exc()
                rows.append({"batch": B, "run": mode, "note": f"FAILED: {type(exc).__name__}: {exc}"[:300]})
            print(rows[-1], flush=True)
    cols = ["batch", "run", "nodes", "distinct_tokens_per_round", "tokens_per_round", "engine_verify_ms",
            *[f"{k}_ms" for k in TOKEN_SETS], "note"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(args.out) / "verify_tokens.csv", buf.getvalue())
    print(buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
