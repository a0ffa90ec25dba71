"""Launch-config sweep of the GDN tree verify on the GPU: correctness of every config, then
CUDA-graph timing of each config at each shape.

    python -m simtree.profiler.bench.tune_gdn --out $OUT [--bs 1,4,16,64] [--ns 4,16,64,128]
        [--configs t16v64w4,t32v128w4,...] [--max-seconds 400] [--model qwen3-next-80b]

Config strings use bench_gdn's letters (t block_t, v block_v, w num_warps, s num_stages,
r max_registers, and the kernel switches g g_prologue, u u_bf16, p prefetch, o heavy_first,
q prenorm, j g_pass, k kside: the K-side kernel's warps, 0 off,
h kside_heads, b solve_bf16, c u_cache_bf16, l pdl, e early,
m kside_registers, x transposed, y cuda_walk: the CUDA walk's m-tiles per warp, 0 off,
z walk_kside: 1, the CUDA walk computes the K-side tiles itself, a kside_cuda: 1, the CUDA
K-side kernel writes them for the CUDA walk, f l2_prefetch: bits 1 the walk's L2 prefetch of
the next resident set's states, 2 the CUDA K-side kernel's of the first set's, 4 streaming
o / u stores, 8 the walk's v rows two sub-chunks ahead, 16 with 1 the walk's prefetch two
sub-chunks before each program's end; a kside_cuda 2: at 12 warps).
Writes tune_gdn.csv
(one row per config x shape x phase) and tune_gdn.json (env, correctness per config) into
--out; results are rewritten after every shape, so a killed run keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import pandas as pd
import torch

from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic
from simtree.kernels.gdn import gdn_tree_verify_dense_ref, tree_meta
from simtree.kernels.gdn._launch import VerifyLaunch
from simtree.kernels.gdn._launched import launched_verify
from simtree.profiler.bench.bench_gdn import (KSIDE_CASES, TINY, checked, config_name,
                                              parse_configs, rel_err)
from simtree.profiler.bench.gdn_util import (QWEN36, TREE_ORDERS, env_info, graph_time_us,
                                             model_dims, random_gdn_inputs, shape_inputs,
                                             shape_trees)

KEYS = ("q", "k", "v", "g", "beta", "state", "parents", "cu_nodes")


# (dtype, tolerance, case suffix) of the correctness checks: bf16 inputs everywhere, fp32 too
# at the K-side cases on a GPU (fp32 takes the rule's launch for exact fp32 dots there, eight
# warps and the untransposed walk, unless a config sets them)
BF16, FP32 = (torch.bfloat16, 2e-2, "bf16"), (torch.float32, 1e-4, "fp32")


def correctness_cases(gpu: bool) -> list[tuple]:
    """(sequences, nodes, (dtype, tolerance, suffix)) of ``correctness``."""
    return [(2, 128, BF16), (3, 23, BF16)] + [(b, n, dt) for b, n in KSIDE_CASES
                                              for dt in (BF16, FP32)] * gpu


def correctness(configs, dims, device, seed, order: str = "stored") -> list[dict]:
    """Each config vs the float64 dense reference on random trees: few sequences in bf16, and
    on a GPU ``KSIDE_CASES``, where the rule launches the K-side kernel, in bf16 and fp32 (a
    config that changes only that launch or the walk on its tiles is checked only there)."""
    recs = []
    for b, n, (dtype, tol, suffix) in correctness_cases(str(device).startswith("cuda")):
        trees, _, _ = shape_trees(b, n, seed + 11, order)
        inp = random_gdn_inputs(trees, **dims, dtype=dtype, device=device, seed=b * n)
        ref = gdn_tree_verify_dense_ref(*(inp[key].double() for key in KEYS[:6]),
                                        inp["parents"], inp["cu_nodes"])
        case = f"b{b}_n{n}_{suffix}"
        for cfg in configs:
            recs.append(checked(
                lambda cfg=cfg: rel_err(launched_verify(
                    *(inp[key] for key in KEYS), launch=VerifyLaunch(backend="triton", **cfg))[0],
                    ref),
                tol, config=config_name(cfg), case=case))
        del inp, ref
    return recs


def parse_seeds(text: str) -> list[int]:
    """"1,2,3" -> [1, 2, 3]: the tree-set seeds of a sweep (distinct integers)."""
    try:
        seeds = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise SystemExit(f"--seed takes integers separated by commas, got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seed {text}: a seed given twice")
    return seeds


def parse_heads(text: str) -> dict:
    """"16,32" -> dict(H=16, HV=32): key heads dividing value heads, both >= 1."""
    try:
        h, hv = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--heads takes H,HV (two integers), got {text!r}") from None
    if h < 1 or hv < h or hv % h:
        raise SystemExit(f"--heads {text}: the value heads must be a multiple of the key heads")
    return dict(H=h, HV=hv)


def checked_configs(configs, corr) -> list[dict]:
    """The configs to time: correct wherever they launched (``correctness``'s ok None: not
    applicable at that case) and checked at one case at least."""
    oks = {}
    for r in corr:
        oks.setdefault(r["config"], set()).add(r["ok"])
    return [cfg for cfg in configs
            if True in oks.get(config_name(cfg), ()) and False not in oks[config_name(cfg)]]


def compiled_kernel_stats() -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of the verify, pre-pass, K-side and commit kernels
    (from Triton's per-device kernel caches; empty where this Triton keeps them elsewhere)."""
    from simtree.kernels.gdn import _tree_kernels as tree_verify
    recs = []
    for name in tree_verify.VERIFY_KERNELS + ("_tree_commit_kernel",):
        fn = getattr(tree_verify, name)
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for kern in getattr(kernels, "values", lambda: [])():
                try:
                    kern._init_handles()
                    md = kern.metadata
                    consts = {k: v for k, v in getattr(kern.src, "constants", {}).items()
                              if isinstance(v, (int, str)) and not isinstance(v, bool)}
                    recs.append(dict(kernel=name, n_regs=kern.n_regs, n_spills=kern.n_spills,
                                     shared=getattr(md, "shared", None),
                                     num_warps=getattr(md, "num_warps", None),
                                     constants=str(consts)[:300]))
                except Exception as exc:  # noqa: BLE001 - diagnostics only
                    recs.append(dict(kernel=name, error=repr(exc)[:200]))
    return recs


def pair_counts(bs, ns, seed: int = 0, block_ts=(16, 32)) -> str:
    """Markdown: sub-chunk pairs that hold ancestors, per tree, in the stored (breadth-first)
    order and walked depth-first (``TreeMeta.heavy_first``), on the benchmark's own trees
    (``shape_trees``, same seed) - the pairs the kernel's loop visits.  CPU only."""
    from simtree.profiler.bench.report_util import markdown_table
    from simtree.trees.tree import TreeBatch
    rows = []
    for n in ns:
        for b in bs:
            md = TreeBatch(shape_trees(b, n, seed)[0]).to_torch()
            meta = tree_meta(md["parents"], md["cu_nodes"])
            walk = meta.heavy_first(md["cu_nodes"])[1]
            for bt in block_ts:
                c = -(-n // bt)
                stored, depth_first = (float(m.subchunk_pairs(md["cu_nodes"], bt)[1].sum(1).float().mean())
                                       for m in (meta, walk))
                rows.append(dict(nodes_per_seq=n, batch_size=b, block_t=bt, possible=c * (c - 1) // 2,
                                 stored=round(stored, 2), depth_first=round(depth_first, 2)))
    return markdown_table(pd.DataFrame(rows))


def renumber_cost(bs, ns, seed: int = 0, repeats: int = 7, bench_csv: str | None = None,
                  model: str = "qwen3.6-27b") -> pd.DataFrame:
    """Host time of ``TreeBatch.depth_first()`` (what the runtime pays per round where it stores
    trees depth-first) on the benchmark's trees, fresh DraftTree objects each repeat (nothing
    cached), median over ``repeats``; CPU only.  ``bench_csv`` (a bench_gdn.csv with
    ``triton_tree`` on depth-first trees and ``triton_tree_bfs``): also the kernel's saving per
    round, ``model``'s GDN layers x (breadth-first - depth-first), and whether it pays."""
    import platform
    import statistics

    from simtree.trees.tree import DraftTree, TreeBatch
    rows = []
    for n in ns:
        for b in bs:
            trees = shape_trees(b, n, seed)[0]
            times = []
            for _ in range(repeats):
                fresh = [DraftTree(t.parents, t.tokens, t.log_probs) for t in trees]
                t0 = time.perf_counter()
                TreeBatch(fresh).depth_first()
                times.append((time.perf_counter() - t0) * 1e6)
            rows.append(dict(nodes_per_seq=n, batch_size=b, renumber_us_median=round(statistics.median(times), 1),
                             repeats=repeats, cpu=platform.processor() or platform.machine(),
                             cpus=os.cpu_count(), python=platform.python_version()))
    out = pd.DataFrame(rows)
    if bench_csv:
        from simtree.models import get_model
        layers = get_model(model).layer_kinds.count("gdn")
        bench = pd.read_csv(bench_csv)
        us = bench[bench.status == "ok"].pivot_table(index=["batch_size", "nodes_per_seq"], columns="variant",
                                                     values="latency_us_median")
        saving = (layers * (us["triton_tree_bfs"] - us["triton_tree"])).rename("kernel_saving_us_per_round")
        out = out.merge(saving.round(1).reset_index(), on=["batch_size", "nodes_per_seq"], how="left")
        out["pays"] = out.kernel_saving_us_per_round > out.renumber_us_median
    return out


def summarize(*csv_paths: str) -> str:
    """Markdown: median us per config (rows) x (nodes, batch) (columns), and the fastest
    config per shape, read from one tune_gdn.csv or several calls' (a shape timed in more than
    one call is refused: their configs may have meant different launches).  A call over several
    tree sets (``--seed 1,2,...``): the median over them, then each config's range (min-max)."""
    from simtree.profiler.bench.report_util import markdown_table
    frames = [pd.read_csv(p) for p in csv_paths]
    shapes = [set(zip(f.batch_size, f.nodes_per_seq)) for f in frames]
    for i, a in enumerate(shapes):
        for j in range(i):
            if a & shapes[j]:
                raise SystemExit(f"{csv_paths[j]} and {csv_paths[i]} both time {sorted(a & shapes[j])[0]}")
    df = pd.concat(frames, ignore_index=True)
    ok = df[df.status == "ok"]
    index = ["config", "phase"] if "phase" in ok.columns else ["config"]   # older runs timed phases
    table = ok.pivot_table(index=index, columns=["nodes_per_seq", "batch_size"],
                           values="latency_us_median", aggfunc="median")
    table.columns = [f"n{n} b{b}" for n, b in table.columns]
    whole = table.xs("all", level="phase") if "phase" in index else table
    best = whole.idxmin().rename("fastest").to_frame().T
    gpu = ", ".join(sorted(set(df.get("gpu", pd.Series(["?"])).astype(str))))
    text = (f"GPU {gpu}; median us (CUDA graphs), rows = launch config\n\n"
            + markdown_table(table.round(1), with_index=True) + "\n\n"
            + markdown_table(best.reset_index(drop=True)) + "\n")
    sets = ok["seed"].nunique() if "seed" in ok.columns else 1
    if sets > 1:   # the spread over the tree sets
        grp = ok.groupby(["config", "nodes_per_seq", "batch_size"]).latency_us_median
        spread = (grp.min().round(1).astype(str) + "-" + grp.max().round(1).astype(str)).unstack(
            ["nodes_per_seq", "batch_size"])
        spread.columns = [f"n{n} b{b}" for n, b in spread.columns]
        text += (f"\nmin-max over {sets} tree sets (seeds "
                 f"{', '.join(map(str, sorted(ok.seed.unique())))}):\n\n"
                 + markdown_table(spread, with_index=True) + "\n")
    return text


def commit_summary(csv_path: str) -> str:
    """Markdown: median us of every commit variant (columns) per (batch, nodes), read from
    one bench_gdn.csv (``--commit-configs`` variants beside the default ``triton_commit``)."""
    from simtree.profiler.bench.report_util import markdown_table
    df = pd.read_csv(csv_path)
    ok = df[(df.status == "ok") & df.variant.str.startswith("triton_commit")]
    table = ok.pivot_table(index=["batch_size", "nodes_per_seq"], columns="variant",
                           values="latency_us_median", aggfunc="median")
    gpu = ", ".join(sorted(set(df.get("gpu", pd.Series(["?"])).astype(str))))
    return (f"GPU {gpu}; commit median us (CUDA graphs), each tree's deepest node accepted\n\n"
            + markdown_table(table.round(1), with_index=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "tune_gdn_out"))
    ap.add_argument("--bs", default="1,4,16,64")
    ap.add_argument("--ns", default="4,16,64,128")
    ap.add_argument("--configs", default="t16v64w4,t16v128w2,t16v128w4,t32v128w4,t32v64w8")
    ap.add_argument("--time-failing", action="store_true",
                    help="time configs that failed the check too (ablation studies)")
    ap.add_argument("--max-seconds", type=float, default=400)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--seed", default="0", metavar="S[,S...]",
                    help="tree-set seed; several (1,2,3) time every shape on each set (the CSV's "
                         "seed column; correctness on the first)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny head shapes (CPU smoke run)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                    help="input dtype of the timed shapes (the state is fp32 either way)")
    ap.add_argument("--model", metavar="NAME",
                    help="time the GDN layer of this model instead of qwen3.6-27b's (a shipped "
                         "model name, e.g. qwen3-next-80b, or a model YAML): its heads and dims")
    ap.add_argument("--heads", metavar="H,HV",
                    help="key and value heads, K = V = 128, for shapes no model file holds")
    ap.add_argument("--tree-order", default="stored", choices=TREE_ORDERS,
                    help="time the trees as built (breadth-first) or renumbered depth-first")
    ap.add_argument("--summarize", metavar="CSV", nargs="+",
                    help="print the markdown summary of a run (or of several calls' CSVs) and exit")
    ap.add_argument("--summarize-commit", metavar="CSV",
                    help="print the commit variants of a bench_gdn.csv as markdown and exit")
    ap.add_argument("--pairs", action="store_true",
                    help="print the sub-chunk pairs per tree (stored vs depth-first order) of the "
                         "benchmark's trees at --bs x --ns and exit (CPU)")
    ap.add_argument("--renumber-cost", metavar="CSV",
                    help="time TreeBatch.depth_first() on the host for the trees at --bs x --ns, "
                         "write CSV, print markdown and exit (CPU)")
    ap.add_argument("--saving-from", metavar="BENCH_CSV",
                    help="with --renumber-cost: the GDN kernel's saving per Qwen3.6-27B round from "
                         "a bench_gdn.csv (triton_tree_bfs - triton_tree), beside the host cost")
    args = ap.parse_args()
    seeds = parse_seeds(args.seed)
    if args.renumber_cost:
        from simtree.profiler.bench.report_util import markdown_table
        df = renumber_cost(list(map(int, args.bs.split(","))), list(map(int, args.ns.split(","))), seeds[0],
                           bench_csv=args.saving_from)
        write_text_atomic(args.renumber_cost, df.to_csv(index=False))
        print(markdown_table(df))
        return
    if args.summarize:
        print(summarize(*args.summarize))
        return
    if args.summarize_commit:
        print(commit_summary(args.summarize_commit))
        return
    if args.pairs:
        print(pair_counts(list(map(int, args.bs.split(","))), list(map(int, args.ns.split(","))), seeds[0]))
        return
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    configs = parse_configs(args.configs)
    dims = TINY if args.tiny else QWEN36
    if args.model and args.heads:
        raise SystemExit("--model and --heads both set the heads: give one")
    if args.model:
        try:
            dims = model_dims(args.model)
        except SimtreeError as exc:
            raise SystemExit(f"--model: {exc}") from None
    if args.heads:
        dims = dict(dims, **parse_heads(args.heads))
    env = env_info(dims)
    corr = correctness(configs, dims, args.device, seeds[0], args.tree_order)
    for r in corr:
        verdict = "n/a" if r["ok"] is None else "ok" if r["ok"] else "FAIL"
        print(f"correct {r['config']:28s} {r['case']:14s} {r['rel_err']:.2e} {verdict}")
    good = configs if args.time_failing else checked_configs(configs, corr)
    rows = []
    shapes = [(b, n) for n in map(int, args.ns.split(",")) for b in map(int, args.bs.split(","))]
    dtype = dict(bf16=torch.bfloat16, fp32=torch.float32)[args.dtype]

    def save():
        write_text_atomic(os.path.join(args.out, "tune_gdn.csv"),
                          pd.DataFrame(rows).assign(gpu=env["gpu"], torch=env["torch"],
                                                    triton=env["triton"], dtype=args.dtype).to_csv(index=False))
        write_text_atomic(os.path.join(args.out, "tune_gdn.json"),
                          json.dumps(dict(env=env, correctness=corr, shapes=dims,
                                          compiled=compiled_kernel_stats() if args.device == "cuda" else []),
                                     indent=1, default=str))

    for seed, (b, n) in ((s, shape) for s in seeds for shape in shapes):
        copies = shape_inputs(b, n, seed, dims, dtype=dtype, device=args.device, max_copies=8,
                              order=args.tree_order)
        meta = tree_meta(copies[0]["parents"], copies[0]["cu_nodes"],
                         depth_first=copies[0]["tb"].is_depth_first)   # as bench_gdn's launch
        for cfg in good:
            if time.time() - t0 > args.max_seconds:
                break
            name = config_name(cfg)
            launch = VerifyLaunch(backend="triton", **cfg)
            fns = [lambda c=c, launch=launch: launched_verify(*(c[key] for key in KEYS), launch=launch,
                                               meta=meta, check=False) for c in copies]
            try:
                r = graph_time_us(fns, replays=args.replays)
                rows.append(dict(config=name, batch_size=b, nodes_per_seq=n, status="ok",
                                 tree_order=args.tree_order, seed=seed,
                                 latency_us_median=r["median"], latency_us_p10=r["p10"],
                                 latency_us_p90=r["p90"], timer=r["timer"]))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(config=name, batch_size=b, nodes_per_seq=n,
                                 tree_order=args.tree_order, seed=seed,
                                 status=f"error: {exc!r}"[:300]))
            print(f"[{time.time() - t0:6.1f}s] b={b:3d} n={n:4d} {name:20s} "
                  f"{rows[-1].get('latency_us_median', rows[-1]['status'])}", flush=True)
        del copies
        torch.cuda.empty_cache()
        save()
    save()


if __name__ == "__main__":
    main()
