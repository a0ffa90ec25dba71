"""GPU benchmark of the GDN tree verify (issue 5): correctness first, then CUDA-graph timing.

    python -m simtree.profiler.bench.bench_gdn --out $OUT [--max-seconds 170] [--ns 4,8,16,32,64,128] [--bs 1,4,16,64]

Qwen3.6-27B GDN shapes (H=16, HV=48, K=V=128), bf16 q/k/v, fp32 g/beta/state, random
EAGLE-like trees, stored depth-first, larger subtree first (``--tree-order dfs``, the order
``TreeBatch.depth_first()`` gives them, as the runtime hands them to the kernel; the same trees
as built, breadth-first, are timed as ``triton_tree_bfs``).  Variants per (batch b, nodes n):
triton_tree, recurrent_baseline
(per-branch: parent state reloaded from HBM, every node's state stored), fla_chunk and
fla_recurrent (flash-linear-attention on a CHAIN of n tokens per sequence), the memory floor
(bytes read + written / the larger of copy and read-only bandwidth, both counted as bytes read
+ written) and gdn_tree_commit; tuning variants triton_tree_<cfg> (--tree-configs) and
triton_commit_<cfg> (--commit-configs).  fla_recurrent runs last, in a child process, so an
illegal memory access there (seen at b=64, T=128) cannot poison this one.
Every variant is guarded: a failure is recorded and the run goes on.  Writes into --out:
bench_gdn.csv (variant x shape), profile_gdn.csv (contract-1 rows), bench_gdn.json (env,
correctness, ratios vs the issue's targets), rewritten after every shape; ``--resume`` on the
same --out keeps the shapes a cut run finished and times only the rest.  CPU smoke run (tiny
shapes, interpreter):
TRITON_INTERPRET=1 python -m simtree.profiler.bench.bench_gdn --device cpu --tiny --out /tmp/x
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import torch

from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic
from simtree.profiler.timing import measured_bandwidth
from simtree.trees.tree import DraftTree
from simtree.kernels.gdn import (gdn_accepted_paths_ref, gdn_tree_commit, gdn_tree_verify_dense_ref,
                                 gdn_tree_verify_recurrent, gdn_tree_verify_ref, tree_meta,
                                 verify_round_meta)
from simtree.kernels.gdn._launch import (CommitLaunch, LaunchNotApplicable, VerifyLaunch,
                                         commit_dot16, commit_launch_config, verify_launch_config)
from simtree.kernels.gdn._launched import launched_commit, launched_recurrent, launched_verify
from simtree.profiler.bench.gdn_util import (QWEN36, TREE_ORDERS, env_info, fla_closure,
                                             fla_recurrent_worker, graph_time_us,
                                             memory_floor_bytes, random_gdn_inputs, shape_inputs,
                                             shape_trees)

TINY = dict(H=2, HV=4, K=16, V=32)
TRITON = VerifyLaunch(backend="triton")   # the rule's launch, on the Triton kernels
_CFG_KEYS = dict(block_v="v", block_t="t", num_warps="w", num_stages="s", max_registers="r",
                 g_prologue="g", u_bf16="u", prefetch="p", heavy_first="o", prenorm="q",
                 g_pass="j", kside="k", kside_heads="h", solve_bf16="b",
                 u_cache_bf16="c", pdl="l", early="e",
                 kside_registers="m", transposed="x", cuda_walk="y", walk_kside="z",
                 kside_cuda="a", l2_prefetch="f")


_COMMIT_KEYS = dict(path="p", block_t="t", block_v="v", num_warps="w")
# (sequences, nodes) whose default launch runs the K-side kernel: 16 x 128 with its register
# cap, 64 x 72 (heavy-first walk on breadth-first trees; the transposed walk on its tiles,
# either tree order); the correctness checks of
# bench_gdn and tune_gdn include them, so every K-side variant timed is checked
KSIDE_CASES = ((16, 128), (64, 72))


def parse_configs(text: str, keys: dict = _CFG_KEYS, what: str = "tree") -> list[dict]:
    """"v64,t32w8" -> the switches of a ``VerifyLaunch`` (letters: _CFG_KEYS), or of a
    ``CommitLaunch`` with keys=_COMMIT_KEYS and what="commit" ("p1t16,p0t64"), as dicts in
    the order given; a value the launch type refuses is a one-line exit."""
    names = {v: k for k, v in keys.items()}
    letters = "".join(keys.values())
    launch_type = CommitLaunch if what == "commit" else VerifyLaunch
    out = []
    for c in filter(None, text.split(",")):
        if not re.fullmatch(rf"([{letters}]\d+)+", c):
            raise SystemExit(f"bad {what} config {c!r}: letters {letters}, each with a number")
        cfg = {names[k]: int(v) for k, v in re.findall(rf"([{letters}])(\d+)", c)}
        try:
            launch_type(**cfg)
        except SimtreeError as exc:
            raise SystemExit(f"bad {what} config {c!r}: {exc}") from None
        out.append(cfg)
    return out


def config_name(cfg: dict, keys: dict = _CFG_KEYS) -> str:
    return "".join(f"{keys[k]}{v}" for k, v in cfg.items())


def commit_name(cfg: dict) -> str:
    return "triton_commit_" + config_name(cfg, _COMMIT_KEYS)


def parse_shapes(text: str) -> set:
    """"16:128,64:128" -> {(16, 128), (64, 128)}: (sequences, nodes) shapes; "" -> none."""
    try:
        return {(int(b), int(n)) for b, n in (x.split(":") for x in filter(None, text.split(",")))}
    except ValueError:
        raise SystemExit(f"shapes are B:N pairs separated by commas, got {text!r}") from None


def launch_columns(cfg: dict, fn) -> dict:
    """The cfg_ columns of a tree-verify row: the launch asked for (``cfg``), with the switches
    the launch took in their place where they differ (``fn()``'s ``GDNTreeCache.launch``: e.g.
    the Triton walk where the CUDA kernels cannot run, the L2 bits a launch cannot take)."""
    return {"cfg_" + k: v for k, v in {**cfg, **fn()[1].launch}.items()}


def checked(fn, tol: float, **keys) -> dict:
    """One correctness record: ``fn()``'s relative error against ``tol`` (ok True / False), or
    ok None where the launch cannot take a switch at this case (``LaunchNotApplicable``), or
    ok False with the error of any other failure (recorded; the run goes on)."""
    rec = dict(keys, rel_err=float("nan"), tol=tol)
    try:
        rec["rel_err"] = err = fn()
        rec["ok"] = bool(err <= tol)
    except LaunchNotApplicable as exc:   # a switch this case's launch cannot take
        rec.update(ok=None, error=f"not applicable: {exc}"[:300])
    except Exception as exc:  # noqa: BLE001
        rec.update(ok=False, error=repr(exc)[:300])
    return rec


def rel_err(a, b) -> float:
    """max |a - b| / max |b|, in float64."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def correctness(args, dims, log) -> list[dict]:
    """Triton tree / recurrent baseline / commit vs fp64 references on a few random trees."""
    recs = []
    # (b, n, dtypes): the bf16 builds are the ones the timing reuses (same BV / words);
    # b16 n64 and KSIDE_CASES: launches with the K-side kernel (verify_launch_config), and
    # every launch variant timed at those batch sizes
    cases = ([(1, 8, "fb"), (1, 128, "b"), (4, 128, "fb"), (16, 64, "b")]
             + [(b, n, "b") for b, n in KSIDE_CASES] if not args.tiny
             else [(1, 8, "fb"), (2, 70, "fb")])
    for b, n, dts in cases:
        trees, _, _ = shape_trees(b, n, args.seed + 1, args.tree_order)
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            if str(dtype)[6] not in dts:
                continue
            name = f"b{b}_n{n}_{str(dtype).split('.')[-1]}"

            def check(variant, fn, tol=tol, name=name):   # each check guarded on its own
                recs.append(checked(fn, tol, case=name, variant=variant))

            inp = random_gdn_inputs(trees, **dims, dtype=dtype, device=args.device, seed=b + n)
            x = {key: inp[key].double() for key in ("q", "k", "v", "g", "beta", "state")}
            tree = (inp["parents"], inp["cu_nodes"])
            ref = gdn_tree_verify_dense_ref(*x.values(), *tree)
            cache = {}

            def tree_check():
                out, cache["c"] = launched_verify(*(inp[key] for key in x), *tree, launch=TRITON)
                return rel_err(out, ref)

            def commit_check(launch=None):
                rng = np.random.default_rng(b * 31 + n)
                acc = torch.tensor([int(rng.integers(0, t.num_nodes)) for t in trees], device=args.device)
                S = inp["state"].clone()
                launched_commit(S, inp["k"], cache["c"], *tree, acc, launch=launch)
                # ground truth: the accepted paths decoded in fp64
                return rel_err(S, gdn_accepted_paths_ref(*x.values(), trees, inp["cu_nodes"], acc))

            check("triton_tree", tree_check)
            if args.tree_order != "stored":   # the same trees as built (timed as triton_tree_bfs)
                check("triton_tree_bfs", lambda: _bfs_check(args, dims, b, n, dtype))
            for cfg in args.tree_configs:   # every launch variant timed below is checked too
                check("triton_tree_" + config_name(cfg), lambda cfg=cfg: rel_err(launched_verify(
                    *(inp[key] for key in x), *tree, launch=VerifyLaunch(backend="triton", **cfg))[0],
                    ref))
            check("triton_commit", commit_check)
            for cfg in args.commit_configs:
                check(commit_name(cfg), lambda cfg=cfg: commit_check(CommitLaunch(**cfg)))
            check("recurrent_baseline", lambda: rel_err(gdn_tree_verify_recurrent(*(inp[key] for key in x), *tree)[0], ref))
            if n <= 64 and b * n <= 256:   # reference (a): recurrence along every path (python loop)
                check("path_ref_vs_dense", lambda: rel_err(gdn_tree_verify_ref(*x.values(), *tree), ref), tol=1e-9)
            log(f"correctness {name}: " + ", ".join(f"{r['variant']}={r['rel_err']:.2e}"
                                                    for r in recs if r["case"] == name))
    if args.device == "cuda":   # cross-check against fla on a chain (bf16)
        try:
            b, n = 4, 64
            inp = random_gdn_inputs([DraftTree.chain(n)] * b, **dims, seed=5)
            out, _ = launched_verify(*(inp[key] for key in ("q", "k", "v", "g", "beta", "state")),
                                     inp["parents"], inp["cu_nodes"], launch=TRITON)
            fo = fla_closure("fla_chunk", inp, n)()[0].reshape(out.shape)
            recs.append(dict(case="chain_b4_n64_bf16", variant="tree_vs_fla_chunk", rel_err=rel_err(out, fo), tol=2e-2))
        except Exception as exc:  # noqa: BLE001
            recs.append(dict(case="chain_b4_n64_bf16", variant="tree_vs_fla_chunk", rel_err=float("nan"),
                             tol=2e-2, error=repr(exc)[:300]))
        recs[-1]["ok"] = bool(recs[-1]["rel_err"] <= recs[-1]["tol"])
    return recs


def _bfs_check(args, dims, b, n, dtype) -> float:
    """The correctness case's trees in their stored (breadth-first) order: the kernel's
    depth-first walk through a node-order table."""
    trees, _, _ = shape_trees(b, n, args.seed + 1, "stored")
    inp = random_gdn_inputs(trees, **dims, dtype=dtype, device=args.device, seed=b + n + 1)
    x = [inp[key] for key in ("q", "k", "v", "g", "beta", "state")]
    ref = gdn_tree_verify_dense_ref(*(t.double() for t in x), inp["parents"], inp["cu_nodes"])
    return rel_err(launched_verify(*x, inp["parents"], inp["cu_nodes"], launch=TRITON)[0], ref)


def time_shape(args, dims, b, n, bw, log) -> list[dict]:
    """All in-process variants for one (b, n); each failure becomes a row with its error."""
    rows = []
    trees, steps, topk = shape_trees(b, n, args.seed, args.tree_order)
    copies = shape_inputs(b, n, args.seed, dims, device=args.device, max_copies=args.max_copies,
                          trees=trees)
    tb = copies[0]["tb"]
    meta = tree_meta(copies[0]["parents"], copies[0]["cu_nodes"], depth_first=tb.is_depth_first)
    keys = ("q", "k", "v", "g", "beta", "state", "parents", "cu_nodes")
    base = dict(batch_size=b, nodes_per_seq=n, total_tokens=b * n, num_steps=steps, topk=topk,
                copies=len(copies))

    def run(variant, fns, shape="eagle", cfg=None, **extra):
        """Time ``fns``; ``cfg``: the tree launch asked for, recorded as cfg_ columns with the
        switches the launch took in their place (``GDNTreeCache.launch``, one call first)."""
        if time.time() > args.timing_deadline:
            rows.append(dict(base, variant=variant, tree_shape=shape, status="skipped: --max-seconds"))
            return
        try:
            if cfg is not None:
                extra.update(launch_columns(cfg, fns[0]))
            r = graph_time_us(fns, replays=args.replays)
            rows.append(dict(base, variant=variant, tree_shape=shape, status="ok",
                             latency_us_median=r["median"], latency_us_p10=r["p10"],
                             latency_us_p90=r["p90"], repeats=r["repeats"], timer=r["timer"], **extra))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(base, variant=variant, tree_shape=shape, status=f"error: {exc!r}"[:300]))
        log(f"b={b:3d} n={n:4d} {variant:20s} {rows[-1].get('latency_us_median', rows[-1]['status'])}")

    default = verify_launch_config(b, dims["HV"], dims["V"], args.device, max_nodes=n,
                                   depth_first=meta.depth_first, H=dims["H"]).switches()
    run("triton_tree", [lambda c=c: launched_verify(*(c[key] for key in keys), launch=TRITON,
                                                    meta=meta, check=False) for c in copies],
        cfg=default)
    for cfg in args.tree_configs:   # launch-config variants of the same kernel (tuning data)
        if {**default, **cfg} == default:
            continue   # the default launch at this shape
        launch = VerifyLaunch(backend="triton", **cfg)
        run("triton_tree_" + config_name(cfg), [
            lambda c=c, launch=launch: launched_verify(*(c[key] for key in keys), launch=launch,
                                                       meta=meta, check=False) for c in copies],
            cfg={**default, **cfg})
    if args.tree_order != "stored":   # the same trees as built (breadth-first), own default
        bfs = shape_inputs(b, n, args.seed, dims, device=args.device, max_copies=args.max_copies)
        bmeta = tree_meta(bfs[0]["parents"], bfs[0]["cu_nodes"], depth_first=False)
        run("triton_tree_bfs", [lambda c=c: launched_verify(*(c[key] for key in keys),
                                                            launch=TRITON, meta=bmeta,
                                                            check=False) for c in bfs],
            cfg=verify_launch_config(b, dims["HV"], dims["V"], args.device, max_nodes=n,
                                     H=dims["H"]).switches())
        del bfs
    # per round, shared by every layer: ancestor bits and the launch's sub-chunk pairs (and the
    # kernel's node order where it walks breadth-first trees depth-first)
    run("round_meta", [lambda c=c: verify_round_meta(c["parents"], c["cu_nodes"], n, dims["HV"],
                                                     dims["V"], meta.depth_first) for c in copies])
    caches = [launched_verify(*(c[key] for key in keys), launch=TRITON, meta=meta, check=False)[1]
              for c in copies]
    acc = torch.as_tensor(tb.deepest_nodes, device=args.device)
    commit_default = commit_launch_config(b, dims["HV"], dims["V"], n,
                                          commit_dot16(caches[0])).switches()
    run("triton_commit", [lambda c=c, ca=ca: gdn_tree_commit(c["state"], c["k"], ca, c["parents"],
                                                             c["cu_nodes"], acc, check=False)
                          for c, ca in zip(copies, caches)])
    for cfg in args.commit_configs:   # commit launch variants (tuning data)
        if {**commit_default, **cfg} == commit_default:
            continue   # the default launch at this shape
        launch = CommitLaunch(**cfg)
        run(commit_name(cfg), [lambda c=c, ca=ca, launch=launch: launched_commit(
            c["state"], c["k"], ca, c["parents"], c["cu_nodes"], acc, check=False, launch=launch)
            for c, ca in zip(copies, caches)])
    del caches
    try:
        node_states = torch.empty((b * n, dims["HV"], dims["K"], dims["V"]), dtype=torch.float32,
                                  device=args.device)
        run("recurrent_baseline", [lambda c=c, ns=node_states: launched_recurrent(
            *(c[key] for key in keys), node_states=ns, check=False) for c in copies])
        del node_states
    except Exception as exc:  # noqa: BLE001 - e.g. OOM for the node-state buffer
        rows.append(dict(base, variant="recurrent_baseline", tree_shape="eagle", status=f"error: {exc!r}"[:300]))
    if args.device == "cuda":
        note = ""
        try:
            fla_closure("fla_chunk", copies[0], n)()
        except Exception:  # noqa: BLE001 - fla build without grouped value heads
            for c in copies:
                c["fla_repeat_heads"] = True
            note = "q/k repeated to HV heads"
        run("fla_chunk", [fla_closure("fla_chunk", c, n) for c in copies], shape="chain", note=note)
    floor_us = memory_floor_bytes(b, b * n, **dims) / bw["floor_Bps"] * 1e6
    rows.append(dict(base, variant="memory_floor", tree_shape="eagle", status="ok",
                     latency_us_median=floor_us, latency_us_p10=floor_us, latency_us_p90=floor_us,
                     repeats=1, timer="bytes/bandwidth"))
    del copies
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def fla_recurrent_all(args, shapes, log) -> list[dict]:
    """fla_recurrent in child processes; a crash costs only the shape it happened on.
    ``args.resume``: the shapes a previous run finished are kept, not timed again."""
    rows, todo, results = [], list(shapes), {}
    path = os.path.join(args.out, "fla_recurrent.jsonl")
    if os.path.exists(path):
        kept = [x for x in open(path) if args.resume and json.loads(x)["status"] != "started"]
        write_text_atomic(path, "".join(kept))   # a started-only line was the old run's cut
        results = {(d["b"], d["n"]): d for d in map(json.loads, kept)}
        todo = [s for s in todo if s not in results]
    while todo and time.time() < args.deadline - 5:
        timed_out = False
        spec = json.dumps(dict(shapes=todo, seed=args.seed, out=path, dims=args.dims,
                               max_copies=args.max_copies))
        try:
            subprocess.run([sys.executable, os.path.abspath(__file__), "--fla-recurrent-worker", spec],
                           timeout=max(5, args.deadline - time.time()), check=False)
        except subprocess.TimeoutExpired:
            log("fla_recurrent worker hit --max-seconds")
            timed_out = True
        done = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
        results.update({(d["b"], d["n"]): d for d in done if d["status"] != "started"})
        started = [(d["b"], d["n"]) for d in done if d["status"] == "started"]
        crashed = [s for s in started if s not in results and not timed_out]
        for s in crashed:   # started, never finished: the child died on it
            results[s] = dict(b=s[0], n=s[1], status="error: child process died (e.g. illegal memory access)")
            with open(path, "a") as f:
                f.write(json.dumps(results[s]) + "\n")
        todo = [s for s in todo if s not in results]
        if not crashed:
            break
    for (b, n), d in sorted(results.items()):
        row = dict(batch_size=b, nodes_per_seq=n, total_tokens=b * n, num_steps=0, topk=0,
                   variant="fla_recurrent", tree_shape="chain", status=d["status"], note=d.get("note", ""))
        if "median" in d:
            row.update(latency_us_median=d["median"], latency_us_p10=d["p10"], latency_us_p90=d["p90"],
                       repeats=d["repeats"], timer=d.get("timer"), copies=d.get("copies"))
        rows.append(row)
        log(f"b={b:3d} n={n:4d} fla_recurrent        {row.get('latency_us_median', row['status'])}")
    return rows


def ratios(df: pd.DataFrame) -> dict:
    if "latency_us_median" not in df.columns:   # nothing was timed (budget spent on compiles)
        return {}
    ok = df[df.status == "ok"].set_index(["variant", "batch_size", "nodes_per_seq"])["latency_us_median"]
    get = lambda v, b, n: float(ok.get((v, b, n), np.nan))   # noqa: E731
    shapes = sorted({(b, n) for _, b, n in ok.index})
    out = {"targets": {"baseline_over_tree_at_n128": ">= 10", "tree_over_best_fla": "<= 2 (aim 1)",
                       "tree_over_floor_b>=16": "<= 3"},
           "baseline_over_tree_at_n128": {}, "tree_over_best_fla": {}, "tree_over_floor_b>=16": {},
           "best_tree_config_us": {}}
    for b, n in shapes:
        tree = get("triton_tree", b, n)
        tuned = [get(v, b, n) for v, bb, nn in ok.index if v.startswith("triton_tree_") and (bb, nn) == (b, n)]
        out["best_tree_config_us"][f"b{b}_n{n}"] = float(np.nanmin([tree] + tuned))
        if n == 128:
            out["baseline_over_tree_at_n128"][f"b{b}"] = get("recurrent_baseline", b, n) / tree
        fla = np.nanmin([get("fla_chunk", b, n), get("fla_recurrent", b, n)] + [np.inf])
        if np.isfinite(fla):
            out["tree_over_best_fla"][f"b{b}_n{n}"] = tree / fla
        if b >= 16:
            out["tree_over_floor_b>=16"][f"b{b}_n{n}"] = tree / get("memory_floor", b, n)
    return out


# bench variant -> (profile stage, profile variant) of its contract-1 rows; tuning variants
# (triton_tree_<cfg>, triton_commit_<cfg>) and the floor stay out
PROFILE_STAGES = {"triton_tree": ("gdn_tree_verify", "triton_tree"),
                  "recurrent_baseline": ("gdn_tree_verify", "recurrent_baseline"),
                  "fla_chunk": ("gdn_tree_verify", "fla_chunk"),
                  "fla_recurrent": ("gdn_tree_verify", "fla_recurrent"),
                  "triton_commit": ("gdn_tree_commit", "triton_tree"),
                  "round_meta": ("gdn_round_meta", "torch_graph")}   # timed from CUDA graphs


def write_profile_rows(out: str, rows, env: dict, tiny: bool = False) -> str:
    """profile_gdn.csv: the benchmark's rows as profile-table rows (``PROFILE_STAGES``)."""
    prof = [dict(stage=PROFILE_STAGES[r["variant"]][0], model="qwen3.6-27b" if not tiny else "tiny",
                 device=env["gpu"], dtype="bf16", variant=PROFILE_STAGES[r["variant"]][1],
                 batch_size=r["batch_size"], nodes_per_seq=r["nodes_per_seq"], total_tokens=r["total_tokens"],
                 context_len=0, tree_shape=r["tree_shape"], num_steps=r["num_steps"], topk=r["topk"],
                 latency_us_median=r["latency_us_median"], latency_us_p10=r["latency_us_p10"],
                 latency_us_p90=r["latency_us_p90"], repeats=int(r["repeats"]),
                 torch_version=env["torch"], triton_version=env["triton"], timestamp=env["timestamp"])
            for r in rows if r.get("status") == "ok" and r["variant"] in PROFILE_STAGES]
    path = os.path.join(out, "profile_gdn.csv")
    try:
        from simtree.costs.profile_table import append_rows
        if os.path.exists(path):
            os.remove(path)
        append_rows(path, prof)
    except Exception as exc:  # noqa: BLE001 - keep the rows even if the table module rejects them
        print(f"profile_table.append_rows failed ({exc!r}); writing plain CSV")
        pd.DataFrame(prof).to_csv(path, index=False)
    return path


def write_outputs(args, env, bw, corr, rows) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    for key in ("gpu", "torch", "triton", "fla"):
        df[key] = env.get(key)
    for key, val in args.dims.items():
        df[key] = val
    df["dtype"] = "bf16"
    write_text_atomic(os.path.join(args.out, "bench_gdn.csv"), df.to_csv(index=False))
    summary = dict(env=env, bandwidth=bw, correctness=corr, ratios=ratios(df),
                   args={k: v for k, v in vars(args).items() if "deadline" not in k})
    write_text_atomic(os.path.join(args.out, "bench_gdn.json"), json.dumps(summary, indent=1, default=str))
    write_profile_rows(args.out, rows, env, args.tiny)
    return df


_ENV_KEYS = ("gpu", "torch", "triton", "fla")


def previous_run(out: str, env: dict, dims: dict) -> tuple[list[dict], set, dict, list]:
    """--resume: the rows of the shapes a previous run in ``out`` finished (every in-process
    variant timed, none cut by --max-seconds), its bandwidth and correctness records.  Refuses
    a run from another GPU, software stack or head shape (one line)."""
    csv_path, json_path = os.path.join(out, "bench_gdn.csv"), os.path.join(out, "bench_gdn.json")
    if not (os.path.exists(csv_path) and os.path.exists(json_path)):
        raise SystemExit(f"--resume: no bench_gdn.csv / bench_gdn.json in {out} to resume from")
    prev = json.loads(open(json_path).read())
    theirs = {k: prev.get("env", {}).get(k) for k in _ENV_KEYS}
    ours = {k: env.get(k) for k in _ENV_KEYS}
    if theirs != ours:
        raise SystemExit(f"--resume: {out} was measured with {theirs}, this run has {ours}")
    df = pd.read_csv(csv_path)
    if any(int(df[k].iloc[0]) != v for k, v in dims.items() if k in df and len(df)):
        raise SystemExit(f"--resume: {out} holds other head shapes than {dims}")
    inproc = df[df.variant != "fla_recurrent"]
    done = set()
    for (b, n), g in inproc.groupby(["batch_size", "nodes_per_seq"]):
        if (g.variant != "all").all() and not g.status.str.startswith("skipped").any():
            done.add((int(b), int(n)))
    keep = inproc[[(int(b), int(n)) in done for b, n in zip(inproc.batch_size, inproc.nodes_per_seq)]]
    keep = keep.drop(columns=[c for c in (*_ENV_KEYS, *dims, "dtype") if c in keep])
    rows = [{k: v for k, v in r.items() if not (isinstance(v, float) and np.isnan(v))}
            for r in keep.to_dict("records")]
    return rows, done, prev["bandwidth"], prev.get("correctness", [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_gdn_out"))
    ap.add_argument("--max-seconds", type=float, default=170)
    ap.add_argument("--ns", default="4,8,16,32,64,128")
    ap.add_argument("--bs", default="1,4,16,64")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny head shapes (CPU smoke run)")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--resume", action="store_true",
                    help="keep the shapes a previous run in --out finished (same GPU, versions "
                         "and head shapes; its measured bandwidth) and time only the rest")
    ap.add_argument("--retime", default="", metavar="B:N,...",
                    help="with --resume: time these finished shapes again (their in-process rows "
                         "dropped; fla_recurrent's kept), e.g. after a launch-rule change there")
    ap.add_argument("--max-copies", type=int, default=32, help="input copies rotated against L2")
    ap.add_argument("--tree-order", default="dfs", choices=TREE_ORDERS,
                    help="node order of the timed trees: dfs (depth-first, larger subtree first, "
                         "as the runtime stores them; the breadth-first order is timed beside it "
                         "as triton_tree_bfs) or stored (as built, breadth-first)")
    ap.add_argument("--tree-configs",
                    default="q0,q1",
                    help="extra tree-kernel launch configs to time (skipped where equal to the "
                         "default): v<BV> t<BT> w<warps> s<stages> r<max registers, 0 = unbounded> "
                         "g<G prologue 0/1> u<bf16 u operands 0/1> p<prefetch 0/1> o<heavy-first order 0/1> "
                         "q<q/k pre-normalised 0/1> j<G written by the pre-pass 0/1> k<warps of the "
                         "K-side kernel, 0 = none> h<its value heads per program, 0 = all of a "
                         "key head's> b<bf16 diagonal tiles 0/1> c<bf16 u buffer 0/1> l<PDL 0/1> "
                         "e<diagonal tiles early 0/1> m<K-side register cap, 0 = none> "
                         "x<transposed walk 0/1>; the default "
                         "times the other q/k path at every shape")
    ap.add_argument("--profile-from", metavar="DIR",
                    help="rewrite DIR/profile_gdn.csv from DIR/bench_gdn.csv and bench_gdn.json "
                         "(no GPU) and exit")
    ap.add_argument("--commit-configs", default="p0,p1",
                    help="extra commit launch configs to time: p<gather the accepted path 0/1> "
                         "t<node step 16/32/64> v<BV> w<warps>")
    args = ap.parse_args()
    if args.profile_from:
        env = json.loads(open(os.path.join(args.profile_from, "bench_gdn.json")).read())["env"]
        bench = pd.read_csv(os.path.join(args.profile_from, "bench_gdn.csv"))
        tiny = "H" in bench and int(bench["H"].iloc[0]) == TINY["H"]
        print(write_profile_rows(args.profile_from, bench.to_dict("records"), env, tiny))
        return
    t0 = time.time()
    args.deadline = t0 + args.max_seconds
    args.timing_deadline = t0 + 0.8 * args.max_seconds   # the rest is for fla_recurrent (child)
    args.dims = TINY if args.tiny else QWEN36
    args.tree_configs = parse_configs(args.tree_configs)
    args.commit_configs = parse_configs(args.commit_configs, _COMMIT_KEYS, "commit")
    os.makedirs(args.out, exist_ok=True)
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)   # noqa: E731
    env = env_info(args.dims)
    rows, done, corr = [], set(), []
    retime = parse_shapes(args.retime)
    if retime and not args.resume:
        raise SystemExit("--retime times shapes of a previous run again: it needs --resume")
    if args.resume:   # the floor rows kept and the new ones share the old run's bandwidth
        rows, done, bw, corr = previous_run(args.out, env, args.dims)
        rows = [r for r in rows if (r["batch_size"], r["nodes_per_seq"]) not in retime]
        done -= retime
        log(f"resuming {args.out}: {len(done)} shapes kept"
            + (f", {len(retime)} timed again" if retime else ""))
    else:
        bw = measured_bandwidth(args.device, numel=(1 << 28) if args.device == "cuda" else (1 << 20))
    log(f"{env['gpu']} torch {env['torch']} triton {env['triton']} fla {env['fla']}; copy "
        f"{bw['copy_GBps']:.0f} GB/s, read {bw['read_GBps']:.0f} GB/s (bytes read + written)")
    if not args.skip_correctness:
        corr = correctness(args, args.dims, log)
    shapes = [(b, n) for b in map(int, args.bs.split(",")) for n in map(int, args.ns.split(","))]
    shapes.sort(key=lambda s: (-s[1], s[0]))   # large trees first: they carry the targets
    for b, n in shapes:
        if (b, n) in done:
            continue
        if time.time() > args.timing_deadline:
            rows.append(dict(batch_size=b, nodes_per_seq=n, total_tokens=b * n, variant="all",
                             tree_shape="eagle", num_steps=0, topk=0, status="skipped: --max-seconds"))
            continue
        try:
            rows += time_shape(args, args.dims, b, n, bw, log)
        except Exception as exc:  # noqa: BLE001 - e.g. OOM building the inputs
            rows.append(dict(batch_size=b, nodes_per_seq=n, total_tokens=b * n, variant="all",
                             tree_shape="eagle", num_steps=0, topk=0, status=f"error: {exc!r}"[:300]))
        write_outputs(args, env, bw, corr, rows)   # partial results survive a kill
    if args.device == "cuda":
        order = sorted(shapes, key=lambda s: s == (64, 128))   # the known-bad shape last
        rows += fla_recurrent_all(args, order, log)
    df = write_outputs(args, env, bw, corr, rows)
    ok = df[df.status == "ok"]
    table = ok.pivot_table(index=["batch_size", "nodes_per_seq"], columns="variant",
                           values="latency_us_median")
    print("\nmedian latency (us), one GDN layer:")
    print(table.round(1).to_string())
    print("\ncorrectness:", "all ok" if all(r.get("ok") is not False for r in corr) else
          [f"{r['case']}/{r['variant']}: {r['rel_err']:.2e}" for r in corr if r.get("ok") is False])
    print("ratios:", json.dumps(ratios(df), indent=1))
    bad = df[df.status != "ok"]
    if len(bad):
        print(f"{len(bad)} rows not ok:", bad[["variant", "batch_size", "nodes_per_seq", "status"]].to_string())
    log(f"done; wrote {args.out}/bench_gdn.csv, profile_gdn.csv, bench_gdn.json")


if __name__ == "__main__":
    if "--fla-recurrent-worker" in sys.argv:
        _spec = json.loads(sys.argv[sys.argv.index("--fla-recurrent-worker") + 1])
        fla_recurrent_worker([tuple(s) for s in _spec["shapes"]], _spec["seed"], _spec["out"], _spec["dims"],
                             _spec["max_copies"])
    else:
        main()
