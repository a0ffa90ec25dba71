"""GPU benchmark of V4 compressed-attention tree verify (one layer per kind), one invocation.

    python -m simtree.profiler.bench.bench_v4 --out $OUT --max-seconds 200

1. correctness at reduced size on the device: Triton tree verify + commit vs float64
   sequential decoding (every kind), and the Triton kernel at V4-Flash shapes (bf16) vs torch;
2. copy bandwidth (for the memory floor);
3. the FlashMLA probe (sgl-flash-mla, V4 format) — errors are printed, never fatal;
4. the sweep: kinds x contexts x batches x n, tree (random trees) vs linear (a chain of the
   same n tokens), each with the Triton attention core (variants triton_tree/triton_linear)
   and, where FlashMLA works, its FP8 V4 sparse decode as the core (flashmla_tree/
   flashmla_linear); verify and commit, CUDA-graph replay (median, p10, p90); the Triton
   core alone on the tree's lists.  Points in priority order (n <= 8 first) until
   --max-seconds is spent.

Writes into --out: bench_v4.csv (every measured row), profile_v4.csv (+ .meta.json) in the
profile-table schema, summary_v4.json (GPU, versions, shapes, correctness, ratios).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from simtree.fileio import write_text_atomic
from simtree.kernels.v4 import V4AttnConfig, sparse_attention, sparse_attention_torch
from simtree.profiler.timing import measured_bandwidth
from simtree.kernels.v4.cache import V4Cache
from simtree.kernels.v4.check import check_against_reference, check_flashmla_path
from simtree.kernels.v4.reference import random_layer_weights
from simtree.kernels.v4.steps import deepest_paths, make_tree, make_verify_step, verify_bytes

MODEL = "deepseek-v4-flash"


def log(msg: str) -> None:
    print(f"[bench_v4 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def env_info() -> dict:
    """GPU and versions for summary_v4.json (from the profiler's one collector)."""
    from simtree.machine.metadata import collect_metadata
    m = collect_metadata("cuda" if torch.cuda.is_available() else "cpu")
    info = {"torch_version": m["torch_version"], "triton_version": m["triton_version"],
            "python": m["python"], "gpu": m["device"], "cuda": m["torch_cuda"] or None}
    if m["device_type"] == "cuda":
        info.update(sm_count=m["gpu_sm_count"], memory_gib=round(m["gpu_memory_bytes"] / 2**30, 1),
                    capability=m["gpu_capability"],
                    driver=", ".join(m.get(k, "?") for k in ("smi_driver_version", "smi_clocks_max_sm",
                                                                "smi_clocks_max_mem")))
    return info


def time_us(fn, use_graph: bool = True, unroll: int = 0, replays: int = 0) -> tuple[float, float, float, int, str]:
    """(median, p10, p90 in us per call, repeats, method) through profiler.timing: ``fn``
    captured ``unroll`` times in one CUDA graph (host launch cost excluded), each replay timed
    with events; unroll/replays 0: the timer sizes the repetitions to its time budget."""
    from simtree.profiler.timing import time_workload

    device = "cuda" if torch.cuda.is_available() else "cpu"   # --smoke on a CPU: wall clock
    if not unroll and device == "cuda" and use_graph:
        # a graph replay costs a few us of its own: unroll small ops (up to 16x) so that it
        # is spread over >= ~2 ms of work (4x unrolling added ~1 us to the 2 us SWA commit)
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est_us = (time.perf_counter() - t0) * 1e6      # upper bound: includes launches
        unroll = int(min(16, max(4, 2000 // max(est_us, 1.0))))
    fns = [fn] * max(1, unroll or 1)
    kw = dict(use_graph=use_graph) if device == "cuda" else {}
    if replays:
        kw.update(min_reps=replays, max_reps=replays)
    st = time_workload(fns, device, **kw)
    return st.median_us, st.p10_us, st.p90_us, st.repeats * len(fns), st.mode


def run_correctness(device) -> list[dict]:
    results = []
    cfg = V4AttnConfig.tiny(num_heads=16, head_dim=64, rope_dim=16, indexer_dim=32, indexer_heads=8,
                            hidden=48, window=16, hca_ratio=16, topk=6, page_size=8)
    for kind in ("swa", "csa", "hca"):
        try:
            r = check_against_reference(cfg, kind, [37, 52, 9], nodes=12, seed=1, device=device,
                                        dtype=torch.float32, attention="triton")
            ok = (r["verify_err"] < 2e-3 and r["commit_err"] < 2e-4 and not r["verify_wrote_cache"])
            results.append({"check": f"tree_verify_{kind}", "ok": bool(ok), **r})
        except Exception as exc:  # noqa: BLE001
            results.append({"check": f"tree_verify_{kind}", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            traceback.print_exc()
    try:  # the kernel at V4-Flash shapes, bf16 sources
        flash = V4AttnConfig.flash()
        g = torch.Generator(device=device).manual_seed(0)
        N, D = 24, flash.head_dim
        srcs = [torch.randn(n, D, generator=g, device=device).to(torch.bfloat16) for n in (300, 24, 2000, 8)]
        idx = torch.randint(-1, 2332, (N, 640), generator=g, device=device)
        q = torch.randn(N, flash.num_heads, D, generator=g, device=device).to(torch.bfloat16)
        sink = torch.randn(flash.num_heads, generator=g, device=device)
        b = sparse_attention_torch(q.float(), idx, [s.float() for s in srcs], sink, flash.scale)
        for splits in (None, 1):  # auto (split index lists at this small N) and unsplit
            a = sparse_attention(q, idx, srcs, sink, flash.scale, num_splits=splits).float()
            err = float((a - b).abs().max())
            results.append({"check": f"sparse_attention_flash_bf16_splits_{splits or 'auto'}", "ok": err < 3e-2,
                            "max_err": err})
    except Exception as exc:  # noqa: BLE001
        results.append({"check": "sparse_attention_flash_bf16", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        traceback.print_exc()
    results.append(check_flashmla_path(device))
    return results


def core_timings(step, use_graph: bool) -> dict:
    """The Triton attention core alone on the step's own index lists."""
    from simtree.kernels.v4.verify import attention_lists
    idx, sources, _ = attention_lists(step.cache, step.weights, step.inputs, step.plan)
    q, sink = step.inputs.q, step.weights.sink
    return {"triton": time_us(lambda: sparse_attention(q, idx, sources, sink, step.cfg.scale), use_graph)}


def stage_timings(step, use_graph: bool) -> dict:
    """Pieces of a compressed layer's verify before the attention core (us): compressor GEMMs,
    pooling, and for CSA the indexer scan, torch.topk and the list kernel."""
    import importlib
    tv = importlib.import_module("simtree.kernels.v4.verify")  # the module, not the function
    from simtree.kernels.v4._indexer_kernels import indexer_scores, selection_to_list
    cache, w, inp, plan = step.cache, step.weights, step.inputs, step.plan
    if not cache.ratio:
        return {}
    out = {}
    x = tv.layer_input(w, inp)
    comps = [(w.comp, cache.comp_kv, cache.comp_score, cache.comp.pool.dtype)]
    if w.indexer is not None:
        comps.append((w.indexer, cache.idx_kv, cache.idx_score, cache.idx.pool.dtype))
    projs = [tv.project_stacked(p, x, plan.pos_mod) for p, *_ in comps]
    out["proj_us"] = time_us(lambda: [tv.project_stacked(p, x, plan.pos_mod) for p, *_ in comps], use_graph)[0]
    out["pool_us"] = time_us(lambda: [tv._scratch_entries(p, kv, sc, (pr[0], pr[1]), plan, True, dt)
                                      for (p, kv, sc, dt), pr in zip(comps, projs)], use_graph)[0]
    if w.indexer is None:
        return out
    keys = tv._scratch_entries(w.indexer, cache.idx_kv, cache.idx_score, (projs[1][0], projs[1][1]), plan, True,
                               cache.idx.pool.dtype)
    N, emax, vis = inp.iq.shape[0], plan.persist_idx_rows.shape[1], plan.scratch_vis
    scores = torch.empty(N, emax + vis.shape[1], dtype=torch.float32, device=inp.iq.device)
    out["indexer_scan_us"] = time_us(lambda: indexer_scores(inp.iq, inp.iw, cache.idx.pool, plan.persist_idx_rows,
                                                            plan.pad_nodes, scores, keys, vis), use_graph)[0]
    k = min(step.cfg.topk, scores.shape[1])
    out["topk_us"] = time_us(lambda: torch.topk(scores, k, dim=1), use_graph)[0]
    val, sel = torch.topk(scores, k, dim=1)
    base = cache.window.num_rows + N
    out["list_us"] = time_us(lambda: selection_to_list(sel, val, plan.win_idx, plan.persist_comp_rows, vis,
                                                       plan.node_seq, cache.comp.num_rows, base), use_graph)[0]
    return out


def _prof_row(stage, variant, info, b, n, ctx, shape, t, dtype="bf16") -> dict:
    return {"stage": stage, "model": MODEL, "device": info["gpu"], "dtype": dtype, "variant": variant,
            "batch_size": b, "nodes_per_seq": n, "total_tokens": b * n, "context_len": ctx,
            "tree_shape": shape, "num_steps": 0, "topk": 0, "latency_us_median": round(t[0], 3),
            "latency_us_p10": round(t[1], 3), "latency_us_p90": round(t[2], 3), "repeats": max(t[3], 1)}


def measure(cfg, kind, b, n, ctx, shape, attn, cache, w, bw, info, use_graph, cores,
            device="cuda") -> tuple[dict, list]:
    """One (point, tree shape, attention core): verify + commit timings, floor, optional core."""
    t0 = time.time()
    step = make_verify_step(cfg, kind, b, n, ctx, shape, device=device, cache=cache, weights=w, attention=attn)
    setup_ms = (time.time() - t0) * 1e3
    v = time_us(step.verify, use_graph)
    c = time_us(step.commit, use_graph)
    floor_us = verify_bytes(step) / (bw * 1e9) * 1e6
    variant = f"{attn}_{'linear' if shape == 'linear' else 'tree'}"
    dtype = "fp8" if attn == "flashmla" else "bf16"
    prof = [_prof_row(f"v4_{kind}_verify", variant, info, b, n, ctx, shape, v, dtype),
            _prof_row(f"v4_{kind}_commit", variant, info, b, n, ctx, shape, c, dtype)]
    row = {"kind": kind, "context_len": ctx, "batch_size": b, "nodes_per_seq": n, "tree_shape": shape,
           "variant": variant, "attention": attn, "verify_us": round(v[0], 2), "verify_p10_us": round(v[1], 2),
           "verify_p90_us": round(v[2], 2), "commit_us": round(c[0], 2), "commit_frac": round(c[0] / v[0], 4),
           "floor_us": round(floor_us, 2), "floor_ratio": round(v[0] / max(floor_us, 1e-9), 2),
           "plan_host_ms": round(step.plan_ms, 1), "setup_ms": round(setup_ms, 1), "timing": v[4]}
    if cores and attn == "triton":
        ct = core_timings(step, use_graph)["triton"]
        row["attn_triton_us"] = round(ct[0], 2)
        try:  # where the non-attention time goes (compressed kinds)
            row.update({k: round(v, 2) for k, v in stage_timings(step, use_graph).items()})
        except Exception as exc:  # noqa: BLE001
            row["stage_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        prof.append(_prof_row(f"v4_{kind}_attn", "triton_tree", info, b, n, ctx, shape, ct))
    del step
    return row, prof


def measure_pair(cfg, kind, b, n, ctx, attn, cache, w, bw, info, args, ns, device, rows, prof_rows) -> None:
    """Tree and linear of one point with one attention core; appends rows, logs one line."""
    if attn == "flashmla":  # spare rows for the largest n once (no rebuild per n)
        cache.flashmla_mirror(b * max(ns), b * max(ns))
    got, prof = {}, []
    for shape in (args.tree_shape, "linear"):
        r, p = measure(cfg, kind, b, n, ctx, shape, attn, cache, w, bw, info, not args.no_graph,
                       cores=bool(args.cores) and shape != "linear", device=device)
        got[shape] = r
        prof += p
    ratio = got[args.tree_shape]["verify_us"] / got["linear"]["verify_us"]
    for shape in got:
        got[shape]["tree_over_linear"] = round(ratio, 3)
        rows.append(got[shape])
    prof_rows.extend(prof)
    t = got[args.tree_shape]
    log(f"{kind} ctx={ctx} b={b} n={n} {attn}: tree {t['verify_us']:.1f} us, linear "
        f"{got['linear']['verify_us']:.1f} us (x{ratio:.2f}), commit {t['commit_us']:.1f} us "
        f"({100 * t['commit_frac']:.1f}%), floor {t['floor_us']:.1f} us"
        + (f", triton core {t['attn_triton_us']:.1f} us" if t.get("attn_triton_us") else ""))


def sweep_points(kinds, contexts, batches, ns) -> list[tuple]:
    """(kind, ctx, batch, n) in priority order: n <= 8 first, small n before large."""
    first = [n for n in ns if n <= 8]
    rest = [n for n in ns if n > 8]
    pts = []
    for group in ([n for n in first if n in (4, 8)], [n for n in first if n not in (4, 8)], rest):
        for kind in kinds:
            for ctx in contexts:
                for b in batches:
                    pts += [(kind, ctx, b, n) for n in group]
    return pts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out_bench_v4"))
    ap.add_argument("--max-seconds", type=float, default=200.0)
    ap.add_argument("--kinds", default="csa,hca,swa")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--ns", default="4,8,16")
    ap.add_argument("--tree-shape", default="random", help="random | eagle")
    ap.add_argument("--no-flashmla", action="store_true")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness step")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run of the sweep code at a small config")
    ap.add_argument("--cores", type=int, default=1, help="also time the attention core alone (1/0)")
    ap.add_argument("--plan-switches", type=float, default=0.0, metavar="SECONDS",
                    help="after the sweep, time host planning with the CSA persistent rows built on the "
                         "host / device and PACK_UPLOADS off / on, for this many seconds (plan_switches.csv)")
    args = ap.parse_args(argv)
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = env_info()
    log(f"device {info['gpu']}, torch {info['torch_version']}, triton {info['triton_version']}")
    summary = {"env": info, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "config": V4AttnConfig.flash().__dict__, "args": vars(args)}

    summary["correctness"] = [] if args.no_check else run_correctness(device)
    for r in summary["correctness"]:
        log(f"correctness {r['check']}: {'SKIP' if r['ok'] is None else ('OK' if r['ok'] else 'FAIL')} "
            + ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("check", "ok")))
    if device == "cpu" and not args.smoke:
        log("no CUDA device: correctness only")
        write_text_atomic(out / "summary_v4.json", json.dumps(summary, indent=1, default=str))
        return 0
    try:
        summary["copy_bandwidth_gbs"] = bw = (measured_bandwidth(device)["copy_GBps"]
                                              if device == "cuda" else 50.0)
    except Exception as exc:  # noqa: BLE001
        bw = 4250.0
        summary["copy_bandwidth_gbs"] = f"failed ({exc}); using 4250"
    log(f"copy bandwidth {bw:.0f} GB/s")
    if not args.no_flashmla and device == "cuda":
        try:
            from simtree.kernels.v4 import flashmla
            summary["flashmla"] = flashmla.probe_and_bench(device, log, time_us, budget_s=min(15.0, args.max_seconds / 8))
        except Exception as exc:  # noqa: BLE001
            summary["flashmla"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"flashmla: {type(exc).__name__}: {exc}")
            traceback.print_exc()

    cfg = V4AttnConfig.flash()
    if args.smoke:
        cfg = V4AttnConfig.tiny(num_heads=16, head_dim=64, rope_dim=16, indexer_dim=32, hidden=48,
                                window=16, hca_ratio=16, topk=8, page_size=16)
    kinds = args.kinds.split(",")
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    ns = [int(x) for x in args.ns.split(",")]
    rows, prof_rows = [], []
    caches: dict = {}
    weights = {k: random_layer_weights(cfg, k, 0, torch.float32, device) for k in kinds}
    pts = sweep_points(kinds, contexts, batches, ns)
    fm_check = next((r for r in summary["correctness"] if r["check"] == "tree_verify_flashmla"), {})
    attns = ["triton"] + (["flashmla"] if fm_check.get("ok") and not args.no_flashmla else [])
    summary["attention_variants"] = attns
    log(f"sweep: {len(pts)} points x {len(attns)} attention cores, budget {args.max_seconds:.0f} s total")
    fm_fail = 0
    for i, (kind, ctx, b, n) in enumerate(pts):
        if time.time() - t_start > args.max_seconds:
            log(f"time budget spent after {i} of {len(pts)} points")
            summary["points_skipped"] = len(pts) - i
            break
        key = (kind, ctx, b)
        try:
            if key not in caches:
                caches.clear()
                if device == "cuda":
                    torch.cuda.empty_cache()
                caches[key] = V4Cache.random(cfg, weights[kind], b, ctx, ctx + 64, device=device, seed=1)
            cache = caches[key]
            for attn in list(attns):
                try:
                    measure_pair(cfg, kind, b, n, ctx, attn, cache, weights[kind], bw, info, args, ns, device,
                                 rows, prof_rows)
                except Exception as exc:  # noqa: BLE001 — one core failing must not stop the other
                    if attn == "triton":
                        raise
                    fm_fail += 1
                    log(f"{kind} ctx={ctx} b={b} n={n} {attn}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    rows.append({"kind": kind, "context_len": ctx, "batch_size": b, "nodes_per_seq": n,
                                 "attention": attn, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                    if fm_fail >= 3:
                        log(f"dropping the {attn} variant after {fm_fail} failures")
                        attns.remove(attn)
        except Exception as exc:  # noqa: BLE001
            log(f"{kind} ctx={ctx} b={b} n={n}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            rows.append({"kind": kind, "context_len": ctx, "batch_size": b, "nodes_per_seq": n,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            if "out of memory" in str(exc).lower():
                caches.clear()
                torch.cuda.empty_cache()
        if i % 8 == 7:  # partial results survive a kill by an outer timeout
            write_outputs(out, rows, prof_rows, summary, info)
    write_outputs(out, rows, prof_rows, summary, info)
    print_table(rows)
    if args.plan_switches > 0:
        prow = plan_switch_timings(cfg, weights, device, contexts, batches, 8, budget_s=args.plan_switches)
        if prow:
            _write_csv(out / "plan_switches.csv", prow, list(prow[0]))
    log(f"done in {time.time() - t_start:.0f} s; files in {out}")
    return 0


PLAN_SWITCHES = ((False, False), (True, False), (False, True), (True, True))


def plan_switch_timings(cfg, weights, device, contexts, batches, n, repeats=7, budget_s=60.0) -> list[dict]:
    """Host planning of one round (plan_verify + deepest accepted paths + plan_commit, until
    the uploads are done) with the CSA persistent rows built on the host or on the device
    (kernels.v4.verify.DEVICE_PERSIST_MIN_ENTRIES forced to never / always) and
    PACK_UPLOADS off / on; every setting's plan tensors must equal the plain setting's."""
    import importlib

    from simtree.kernels.v4.commit import plan_commit
    tv = importlib.import_module("simtree.kernels.v4.verify")   # the module, not the function
    from simtree.trees.tree import TreeBatch
    saved, rows, t0 = (tv.DEVICE_PERSIST_MIN_ENTRIES, tv.PACK_UPLOADS), [], time.time()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def tensors(plan, cplan):
        return {f"{tag}.{k}": v.cpu() for tag, obj in (("v", plan), ("c", cplan))
                for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}
    try:
        for kind in [k for k in ("csa", "hca") if k in weights]:
            for ctx in contexts:
                for b in batches:
                    if time.time() - t0 > budget_s:
                        return rows
                    w = weights[kind]
                    cache = V4Cache.random(cfg, w, b, ctx, ctx + 2 * n + 8, device=device, seed=1)
                    rng = np.random.default_rng(b * 7 + ctx)
                    trees = TreeBatch(tuple(make_tree(n, "random", rng) for _ in range(b)))
                    plain = None
                    for persist, pack in PLAN_SWITCHES:
                        tv.DEVICE_PERSIST_MIN_ENTRIES = 0 if persist else sys.maxsize
                        tv.PACK_UPLOADS = pack
                        times = []
                        for _ in range(repeats + 1):          # the first call warms up
                            sync()
                            t = time.perf_counter()
                            plan = tv.plan_verify(cache, trees, w, device=device)
                            cplan = plan_commit(cache, w, plan, deepest_paths(plan), device=device)
                            sync()
                            times.append((time.perf_counter() - t) * 1e3)
                        got = tensors(plan, cplan)
                        plain = plain or got
                        same = got.keys() == plain.keys() and all(torch.equal(got[k], plain[k]) for k in got)
                        ms = np.array(times[1:])
                        rows.append(dict(kind=kind, context_len=ctx, batch_size=b, nodes_per_seq=n,
                                         device_persist_rows=persist, pack_uploads=pack,
                                         plan_ms_median=round(float(np.median(ms)), 3),
                                         plan_ms_p10=round(float(np.percentile(ms, 10)), 3),
                                         plan_ms_p90=round(float(np.percentile(ms, 90)), 3),
                                         repeats=repeats, same_as_plain=bool(same)))
                        log(f"plan {kind} ctx={ctx} b={b} n={n} persist={int(persist)} pack={int(pack)}: "
                            f"{rows[-1]['plan_ms_median']:.2f} ms, same={same}")
                    del cache
                    if device == "cuda":
                        torch.cuda.empty_cache()
    finally:
        tv.DEVICE_PERSIST_MIN_ENTRIES, tv.PACK_UPLOADS = saved
    return rows


def _write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    """Rows as CSV, replaced atomically (a killed run keeps the previous complete file)."""
    buf = io.StringIO()
    wr = csv.DictWriter(buf, fieldnames=fields)
    wr.writeheader()
    wr.writerows(rows)
    write_text_atomic(path, buf.getvalue())


def write_outputs(out: Path, rows, prof_rows, summary, info) -> None:
    cols = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("kind", "context_len", "batch_size", "nodes_per_seq"), k))
    _write_csv(out / "bench_v4.csv", rows, cols)
    ok = [r for r in rows if "tree_over_linear" in r and r["tree_shape"] != "linear"]
    summary["tree_over_linear_max_n_le_8"] = max((r["tree_over_linear"] for r in ok if r["nodes_per_seq"] <= 8), default=None)
    summary["commit_frac_max"] = max((r["commit_frac"] for r in ok), default=None)
    summary["by_attention"] = {}
    for attn in sorted({r.get("attention", "triton") for r in ok}):
        sub = [r for r in ok if r.get("attention", "triton") == attn]
        summary["by_attention"][attn] = {
            "points": len(sub),
            "tree_over_linear_max_n_le_8": max((r["tree_over_linear"] for r in sub if r["nodes_per_seq"] <= 8), default=None),
            "commit_frac_max": max(r["commit_frac"] for r in sub),
            "commit_frac_median": float(np.median([r["commit_frac"] for r in sub])),
            "floor_ratio_median": float(np.median([r["floor_ratio"] for r in sub])),
            "commit_frac_max_by_kind": {k: max(r["commit_frac"] for r in sub if r["kind"] == k)
                                        for k in sorted({r["kind"] for r in sub})}}
    summary["points"] = len(ok)
    summary["errors"] = [r for r in rows if "error" in r]
    summary["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_text_atomic(out / "summary_v4.json", json.dumps(summary, indent=1, default=str))
    if not prof_rows:
        return
    try:
        from simtree.costs.profile_table import append_rows, write_meta
        path = out / "profile_v4.csv"
        if path.exists():
            path.unlink()
        append_rows(path, prof_rows)
        write_meta(path, {"gpu": info.get("gpu"), "driver": info.get("driver"), "torch": info["torch_version"],
                          "triton": info["triton_version"], "sweep": "bench_v4", "model": MODEL})
    except Exception as exc:  # noqa: BLE001
        log(f"profile table via simtree.costs.profile_table failed ({exc}); writing plain CSV")
        _write_csv(out / "profile_v4.csv", prof_rows, list(prof_rows[0]))


def print_table(rows) -> None:
    print(f"{'kind':4} {'ctx':>6} {'b':>3} {'n':>3} {'core':8} {'tree_us':>9} {'lin_us':>9} {'ratio':>6} {'commit%':>8} {'floor_us':>9}")
    by = {}
    for r in rows:
        if "error" in r:
            continue
        key = (r["kind"], r["context_len"], r["batch_size"], r["nodes_per_seq"], r.get("attention", "triton"))
        by.setdefault(key, {})[r["tree_shape"]] = r
    for (k, ctx, b, n, attn), d in by.items():
        t = next((v for s, v in d.items() if s != "linear"), None)
        lin = d.get("linear")
        if t and lin:
            print(f"{k:4} {ctx:>6} {b:>3} {n:>3} {attn:8} {t['verify_us']:>9.1f} {lin['verify_us']:>9.1f} "
                  f"{t['verify_us'] / lin['verify_us']:>6.2f} {100 * t['commit_frac']:>7.1f}% {t['floor_us']:>9.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
