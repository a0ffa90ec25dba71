"""GPU benchmark of V4 compressed-attention tree verify (one layer per kind), one invocation.

    python -m simtree.profiler.bench_v4 --out $OUT --max-seconds 240

1. correctness at reduced size on the device: Triton tree verify + commit vs float64
   sequential decoding (every kind), and the Triton kernel at V4-Flash shapes (bf16) vs torch;
2. copy bandwidth (for the memory floor);
3. the FlashMLA probe (sgl-flash-mla, V4 format) — errors are printed, never fatal;
4. the sweep: kinds x contexts x batches x n, tree (random trees) vs linear (a chain of the
   same n tokens), verify and commit, CUDA-graph replay (median, p10, p90).  Points are
   taken in priority order (n <= 8 first) until --max-seconds is spent.

Writes into --out: bench_v4.csv (every measured row), profile_v4.csv (+ .meta.json) in the
profile-table schema, summary_v4.json (GPU, versions, shapes, correctness, ratios).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from simtree.kernels.v4 import V4AttnConfig, sparse_attention, sparse_attention_torch
from simtree.kernels.v4.cache import V4Cache
from simtree.kernels.v4.check import check_against_reference
from simtree.kernels.v4.reference import random_layer_weights
from simtree.kernels.v4.steps import make_verify_step, verify_bytes

MODEL = "deepseek-v4-flash"


def log(msg: str) -> None:
    print(f"[bench_v4 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def env_info() -> dict:
    import triton
    info = {"torch_version": torch.__version__, "triton_version": triton.__version__,
            "python": sys.version.split()[0], "gpu": "cpu", "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}")
        try:
            import subprocess
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                                             "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception as exc:  # noqa: BLE001
            info["driver"] = f"unknown ({exc})"
    return info


def time_us(fn, use_graph: bool = True, unroll: int = 0, replays: int = 0) -> tuple[float, float, float, int, str]:
    """(median, p10, p90 in us per call, repeats, method): fn captured ``unroll`` times in one
    CUDA graph, each replay timed with events (host launch cost excluded).  unroll/replays 0:
    chosen from one eager call so that slow points cost ~1 s, fast ones ~40 x 10 calls."""
    if not torch.cuda.is_available():  # --smoke on a CPU: wall clock, a few calls
        t = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e6)
        return float(np.median(t)), min(t), max(t), 3, "cpu"
    if use_graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            est_us = (time.perf_counter() - t0) * 1e6  # upper bound (includes launches)
            unroll = unroll or int(min(10, max(4, 2000 // max(est_us, 1))))
            replays = replays or (40 if est_us < 2000 else 15)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(unroll):
                    fn()
            times = []
            for i in range(replays + 3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                if i >= 3:
                    times.append(a.elapsed_time(b) * 1e3 / unroll)
            del g
            t = np.asarray(times)
            return float(np.median(t)), float(np.percentile(t, 10)), float(np.percentile(t, 90)), replays * unroll, "cudagraph"
        except Exception as exc:  # noqa: BLE001
            log(f"cuda graph failed ({type(exc).__name__}: {str(exc)[:200]}); timing eagerly (includes launch cost)")
            torch.cuda.synchronize()
    import triton.testing as tt
    res = tt.do_bench(fn, warmup=10, rep=40, quantiles=[0.5, 0.1, 0.9])
    return res[0] * 1e3, res[1] * 1e3, res[2] * 1e3, 0, "eager"


def copy_bandwidth_gbs(device) -> float:
    n = 1 << 28  # 512 MiB of bf16 per buffer, far beyond L2
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    med, *_ = time_us(lambda: b.copy_(a), use_graph=False)
    return 2 * a.numel() * a.element_size() / (med * 1e-6) / 1e9


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
        a = sparse_attention(q, idx, srcs, sink, flash.scale).float()
        b = sparse_attention_torch(q.float(), idx, [s.float() for s in srcs], sink, flash.scale)
        err = float((a - b).abs().max())
        results.append({"check": "sparse_attention_flash_bf16", "ok": err < 3e-2, "max_err": err})
    except Exception as exc:  # noqa: BLE001
        results.append({"check": "sparse_attention_flash_bf16", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        traceback.print_exc()
    return results


def core_timings(step, use_graph: bool, flashmla_ok: bool) -> dict:
    """Attention core alone on the step's own index lists: Triton, and FlashMLA when it works."""
    from simtree.kernels.v4.tree_verify import attention_lists
    cfg, cache = step.cfg, step.cache
    idx, sources, _ = attention_lists(cache, step.weights, step.inputs, step.plan)
    q, sink = step.inputs.q, step.weights.sink
    out = {"triton": time_us(lambda: sparse_attention(q, idx, sources, sink, cfg.scale), use_graph)}
    if not flashmla_ok:
        return out
    try:
        from simtree.kernels.v4.flashmla import flashmla_sparse_attention, pack_v4_rows
        B = cache.batch
        n = q.shape[0] // B
        W = cfg.window
        kc = pack_v4_rows(torch.cat([sources[0], sources[1]]))
        win = idx[:, :W].reshape(B, n, W)
        extra = extra_idx = None
        if len(sources) > 2:
            base = sources[0].shape[0] + sources[1].shape[0]
            ext = torch.where(idx[:, W:] >= 0, idx[:, W:] - base, -1)
            pad = -ext.shape[1] % 64
            if pad or ext.shape[1] == 0:
                ext = torch.cat([ext, ext.new_full((ext.shape[0], pad or 64), -1)], 1)
            extra_idx = ext.reshape(B, n, -1)
            extra = pack_v4_rows(torch.cat([sources[2], sources[3]]))
        qb = q.reshape(B, n, cfg.num_heads, cfg.head_dim).to(torch.bfloat16)
        _, sched = flashmla_sparse_attention(qb, win, kc, sink, cfg.scale, extra_idx, extra)
        out["flashmla"] = time_us(lambda: flashmla_sparse_attention(qb, win, kc, sink, cfg.scale, extra_idx, extra, sched), use_graph)
    except Exception as exc:  # noqa: BLE001
        out["flashmla_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


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
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--kinds", default="csa,hca,swa")
    ap.add_argument("--contexts", default="4096,16384,65536,131072")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--ns", default="4,5,6,7,8,12,16")
    ap.add_argument("--tree-shape", default="random", help="random | eagle")
    ap.add_argument("--no-flashmla", action="store_true")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness step")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run of the sweep code at a small config")
    ap.add_argument("--cores", type=int, default=1, help="also time the attention core alone (1/0)")
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
        log(f"correctness {r['check']}: {'OK' if r['ok'] else 'FAIL'} "
            + ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("check", "ok")))
    if device == "cpu" and not args.smoke:
        log("no CUDA device: correctness only")
        (out / "summary_v4.json").write_text(json.dumps(summary, indent=1, default=str))
        return 0
    try:
        summary["copy_bandwidth_gbs"] = bw = copy_bandwidth_gbs(device) if device == "cuda" else 50.0
    except Exception as exc:  # noqa: BLE001
        bw = 4250.0
        summary["copy_bandwidth_gbs"] = f"failed ({exc}); using 4250"
    log(f"copy bandwidth {bw:.0f} GB/s")
    if not args.no_flashmla and device == "cuda":
        try:
            from simtree.kernels.v4 import flashmla
            summary["flashmla"] = flashmla.probe_and_bench(device, log, time_us, budget_s=min(60.0, args.max_seconds / 4))
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
    flashmla_ok = "check_max_err" in summary.get("flashmla", {})  # the call ran (a mismatch is reported)
    flashmla_errors: list = []
    summary["flashmla_core_errors"] = flashmla_errors
    log(f"sweep: {len(pts)} points, budget {args.max_seconds:.0f} s total")
    for i, (kind, ctx, b, n) in enumerate(pts):
        if time.time() - t_start > args.max_seconds:
            log(f"time budget spent after {i} of {len(pts)} points")
            summary["points_skipped"] = len(pts) - i
            break
        key = (kind, ctx, b)
        try:
            if key not in caches:
                caches.clear()
                torch.cuda.empty_cache()
                caches[key] = V4Cache.random(cfg, weights[kind], b, ctx, ctx + 64, device=device, seed=1)
            cache = caches[key]
            res = {}
            for shape in (args.tree_shape, "linear"):
                t0 = time.time()
                step = make_verify_step(cfg, kind, b, n, ctx, shape, device=device, cache=cache, weights=weights[kind])
                plan_ms = (time.time() - t0) * 1e3
                v = time_us(step.verify, not args.no_graph)
                c = time_us(step.commit, not args.no_graph)
                floor_us = verify_bytes(step) / (bw * 1e9) * 1e6
                res[shape] = (v, c, floor_us)
                variant = "triton_linear" if shape == "linear" else "triton_tree"
                cores = core_timings(step, not args.no_graph, flashmla_ok) if args.cores else {}
                if "flashmla_error" in cores and not flashmla_errors:
                    flashmla_errors.append(cores["flashmla_error"])
                    log(f"flashmla core failed: {cores['flashmla_error']}")
                for impl in ("triton", "flashmla"):
                    if impl in cores:
                        t = cores[impl]
                        suffix = "linear" if shape == "linear" else "tree"
                        prof_rows.append({"stage": f"v4_{kind}_attn", "model": MODEL, "device": info["gpu"],
                                          "dtype": "bf16" if impl == "triton" else "fp8",
                                          "variant": f"{impl}_{suffix}", "batch_size": b, "nodes_per_seq": n,
                                          "total_tokens": b * n, "context_len": ctx, "tree_shape": shape,
                                          "num_steps": 0, "topk": 0, "latency_us_median": round(t[0], 3),
                                          "latency_us_p10": round(t[1], 3), "latency_us_p90": round(t[2], 3),
                                          "repeats": max(t[3], 1)})
                rows.append({"kind": kind, "context_len": ctx, "batch_size": b, "nodes_per_seq": n,
                             "tree_shape": shape, "variant": variant, "verify_us": round(v[0], 2),
                             "verify_p10_us": round(v[1], 2), "verify_p90_us": round(v[2], 2),
                             "commit_us": round(c[0], 2), "commit_frac": round(c[0] / v[0], 4),
                             "floor_us": round(floor_us, 2), "plan_host_ms": round(plan_ms, 1), "timing": v[4],
                             "attn_triton_us": round(cores["triton"][0], 2) if "triton" in cores else None,
                             "attn_flashmla_us": round(cores["flashmla"][0], 2) if "flashmla" in cores else None})
                for stage, t in ((f"v4_{kind}_verify", v), (f"v4_{kind}_commit", c)):
                    prof_rows.append({"stage": stage, "model": MODEL, "device": info["gpu"], "dtype": "bf16",
                                      "variant": variant, "batch_size": b, "nodes_per_seq": n,
                                      "total_tokens": b * n, "context_len": ctx, "tree_shape": shape,
                                      "num_steps": 0, "topk": 0, "latency_us_median": round(t[0], 3),
                                      "latency_us_p10": round(t[1], 3), "latency_us_p90": round(t[2], 3),
                                      "repeats": max(t[3], 1)})
                del step
            ratio = res[args.tree_shape][0][0] / res["linear"][0][0]
            rows[-2]["tree_over_linear"] = rows[-1]["tree_over_linear"] = round(ratio, 3)
            log(f"{kind} ctx={ctx} b={b} n={n}: tree {res[args.tree_shape][0][0]:.1f} us, linear "
                f"{res['linear'][0][0]:.1f} us (x{ratio:.2f}), commit {res[args.tree_shape][1][0]:.1f} us, "
                f"floor {res[args.tree_shape][2]:.1f} us")
        except Exception as exc:  # noqa: BLE001
            log(f"{kind} ctx={ctx} b={b} n={n}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            rows.append({"kind": kind, "context_len": ctx, "batch_size": b, "nodes_per_seq": n,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            if "out of memory" in str(exc).lower():
                caches.clear()
                torch.cuda.empty_cache()
    write_outputs(out, rows, prof_rows, summary, info)
    print_table(rows)
    log(f"done in {time.time() - t_start:.0f} s; files in {out}")
    return 0


def write_outputs(out: Path, rows, prof_rows, summary, info) -> None:
    cols = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("kind", "context_len", "batch_size", "nodes_per_seq"), k))
    with open(out / "bench_v4.csv", "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=cols)
        wr.writeheader()
        wr.writerows(rows)
    ok = [r for r in rows if "tree_over_linear" in r and r["tree_shape"] != "linear"]
    summary["tree_over_linear_max_n_le_8"] = max((r["tree_over_linear"] for r in ok if r["nodes_per_seq"] <= 8), default=None)
    summary["commit_frac_max"] = max((r["commit_frac"] for r in ok), default=None)
    summary["points"] = len(ok)
    summary["errors"] = [r for r in rows if "error" in r]
    summary["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    (out / "summary_v4.json").write_text(json.dumps(summary, indent=1, default=str))
    if not prof_rows:
        return
    try:
        from simtree.profile_table import append_rows, write_meta
        path = out / "profile_v4.csv"
        if path.exists():
            path.unlink()
        append_rows(path, prof_rows)
        write_meta(path, {"gpu": info.get("gpu"), "driver": info.get("driver"), "torch": info["torch_version"],
                          "triton": info["triton_version"], "sweep": "bench_v4", "model": MODEL})
    except Exception as exc:  # noqa: BLE001
        log(f"profile table via simtree.profile_table failed ({exc}); writing plain CSV")
        with open(out / "profile_v4.csv", "w", newline="") as fh:
            wr = csv.DictWriter(fh, fieldnames=list(prof_rows[0]))
            wr.writeheader()
            wr.writerows(prof_rows)


def print_table(rows) -> None:
    print(f"{'kind':4} {'ctx':>6} {'b':>3} {'n':>3} {'tree_us':>9} {'lin_us':>9} {'ratio':>6} {'commit%':>8} {'floor_us':>9}")
    by = {}
    for r in rows:
        if "error" in r:
            continue
        by.setdefault((r["kind"], r["context_len"], r["batch_size"], r["nodes_per_seq"]), {})[r["tree_shape"]] = r
    for (k, ctx, b, n), d in by.items():
        t = next((v for s, v in d.items() if s != "linear"), None)
        lin = d.get("linear")
        if t and lin:
            print(f"{k:4} {ctx:>6} {b:>3} {n:>3} {t['verify_us']:>9.1f} {lin['verify_us']:>9.1f} "
                  f"{t['verify_us'] / lin['verify_us']:>6.2f} {100 * t['commit_frac']:>7.1f}% {t['floor_us']:>9.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
