"""FP8 expert GEMMs on a Hopper GPU (scripts/fp8_gpu.sh runs it): correctness at DeepSeek-V4-Flash's
expert shapes, FP8 against bf16 timings under CUDA graphs, and the V4-Flash ep=8 rank built at FP8.

    python3 scripts/fp8_gpu.py --out OUT [--phases check,time,rank] [--max-seconds 400]

check  fp8_check.csv: each FP8 GEMM path (Triton grouped kernel, cuBLAS block-scaled
       torch._scaled_mm, the Triton kernel as a dense linear) against the FP8 GEMM's math in
       float32 (kernels/layers/fp8.py linear_emulated) at the rank's shapes (32 experts, hidden
       4096, expert intermediate 2048, the shared expert), tokens 1-512, 6 experts per token;
       also the activations' FP8 rounding against the bf16 dequantised linear (information)
time   fp8_times.csv: median / p10 / p90 us per call, CUDA-graph replays, FP8 vs bf16: the routed
       experts' grouped GEMMs (gate_up, down), the whole routed_experts call, the shared expert's
       two linears (weights rotated past L2), tokens 1-512
rank   fp8_rank.csv: the V4-Flash ep=8 rank built with FP8 experts (bytes allocated against
       ModelShape.weight_bytes) and one plain decoding step timed under a CUDA graph at batch
       1, 8, 32; then the same with bf16 experts where it fits the GPU
Every phase is bounded and logged; a failing phase is written to fp8_meta.json and the next runs.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from simtree.kernels.layers import fp8, moe
from simtree.kernels.layers.forms import forms, set_forms
from simtree.machine.metadata import collect_metadata
from simtree.profiler.timing import time_workload

E, TOPK, H, I = 32, 6, 4096, 2048          # one ep=8 rank of DeepSeek-V4-Flash
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CHECK_TOKENS = (1, 8, 64, 512)
START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - START:.0f}s] {msg}", flush=True)


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


def experts(dev, out_f: int, in_f: int, seed: int = 0, dense: bool = False) -> fp8.Fp8Weight:
    """E expert weights [E, out, in] (one [out, in] when ``dense``), quantised to block-scaled FP8."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    shape = (out_f, in_f) if dense else (E, out_f, in_f)
    w = torch.randn(*shape, device=dev, generator=gen) / in_f ** 0.5
    return fp8.quantize_weight(w)


def routing(dev, T: int, seed: int = 0):
    """T tokens, each to TOPK distinct experts of E at random: (ids [T, k], offs [E] int32, order)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.rand(T, E, device=dev, generator=gen).topk(TOPK, -1).indices
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_ids, torch.arange(E, device=dev), right=True).to(torch.int32)
    return ids, offs, order


def emulated_grouped(x, w: fp8.Fp8Weight, offs) -> torch.Tensor:
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out.append(fp8.linear_emulated(x[start:end], fp8.Fp8Weight(w.weight[e], w.scale_inv[e])))
        start = end
    return torch.cat(out)


def compare(y: torch.Tensor, ref: torch.Tensor) -> dict:
    y, ref = y.float(), ref.float()
    scale = ref.abs().max().item()
    err = (y - ref).abs()
    ok = bool((err <= 2.0 ** -7 * ref.abs() + 1e-3 * scale).all())
    return dict(max_abs_err=err.max().item(), ref_max=scale,
                rel_fro=((y - ref).norm() / ref.norm()).item(), ok=ok)


def phase_check(dev, out: Path) -> dict:
    rows = []
    gu, down = experts(dev, 2 * I, H, seed=1), experts(dev, H, I, seed=2)
    sgu, sdown = experts(dev, 2 * I, H, 3, dense=True), experts(dev, H, I, 4, dense=True)
    for T in CHECK_TOKENS:
        _, offs, _ = routing(dev, T, seed=T)
        for name, w, K in (("routed_gate_up", gu, H), ("routed_down", down, I)):
            x = torch.randn(T * TOPK, K, device=dev).to(torch.bfloat16)
            ref = emulated_grouped(x, w, offs)
            y = fp8.grouped_linear(x, w, offs)
            rows.append(dict(op=name, path="triton_grouped", tokens=T, M=x.shape[0], N=w.shape[-2], K=K, **compare(y, ref)))
            dq = torch._grouped_mm(x, fp8.dequantize_weight(w, torch.bfloat16).transpose(-2, -1), offs=offs)
            rows.append(dict(op=name, path="bf16_dequantised(info)", tokens=T, M=x.shape[0], N=w.shape[-2], K=K,
                             **compare(dq, ref)))
        for name, w, K in (("shared_gate_up", sgu, H), ("shared_down", sdown, I)):
            x = torch.randn(T, K, device=dev).to(torch.bfloat16)
            ref = fp8.linear_emulated(x, w)
            for path in ("scaled_mm", "triton"):
                try:
                    with forms(fp8_gemm=path):
                        res = compare(fp8.linear(x, w), ref)
                    ran = "scaled_mm->triton" if path == "scaled_mm" and not fp8._SCALED_MM["ok"] else path
                    rows.append(dict(op=name, path=ran, tokens=T, M=T, N=w.shape[0], K=K, **res))
                except Exception as exc:  # noqa: BLE001 - recorded, the next path runs
                    rows.append(dict(op=name, path=path, tokens=T, M=T, N=w.shape[0], K=K, max_abs_err="", ref_max="",
                                     rel_fro="", ok=f"error: {type(exc).__name__}: {str(exc)[:120]}"))
        log(f"check T={T}: " + ", ".join(f"{r['op']}/{r['path']} ok={r['ok']}" for r in rows if r["tokens"] == T))
    write_csv(out / "fp8_check.csv", rows)
    bad = [r for r in rows if "info" not in r["path"] and r["ok"] is not True]
    return dict(rows=len(rows), failed=len(bad), scaled_mm_fell_back=not fp8._SCALED_MM["ok"])


def _timed(fns) -> dict:
    st = time_workload(fns, "cuda", target_s=0.05, spin_ms=30)
    return dict(median_us=round(st.median_us, 2), p10_us=round(st.p10_us, 2), p90_us=round(st.p90_us, 2),
                repeats=st.repeats, mode=st.mode)


def phase_time(dev, out: Path, deadline: float) -> dict:
    rows = []
    gu, down = experts(dev, 2 * I, H, seed=1), experts(dev, H, I, seed=2)
    gu16, down16 = fp8.dequantize_weight(gu, torch.bfloat16), fp8.dequantize_weight(down, torch.bfloat16)
    copies = 8       # the shared expert's weights (16 / 32 MB) rotated past the 50 MB L2
    sgu = [experts(dev, 2 * I, H, 10 + c, dense=True) for c in range(copies)]
    sdown = [experts(dev, H, I, 20 + c, dense=True) for c in range(copies)]
    sgu16 = [fp8.dequantize_weight(w, torch.bfloat16) for w in sgu]
    sdown16 = [fp8.dequantize_weight(w, torch.bfloat16) for w in sdown]
    for T in TOKENS:
        if time.monotonic() > deadline:
            log(f"time: budget spent before T={T}")
            break
        ids, offs, _ = routing(dev, T, seed=T)
        wts = torch.full((T, TOPK), 1.0 / TOPK, device=dev)
        xr = {K: torch.randn(T * TOPK, K, device=dev).to(torch.bfloat16) for K in (H, I)}
        xt = {K: torch.randn(T, K, device=dev).to(torch.bfloat16) for K in (H, I)}
        cases = [
            ("routed_gate_up", "fp8_triton", [lambda: fp8.grouped_linear(xr[H], gu, offs)]),
            ("routed_gate_up", "bf16_grouped_mm", [lambda: torch._grouped_mm(xr[H], gu16.transpose(-2, -1), offs=offs)]),
            ("routed_down", "fp8_triton", [lambda: fp8.grouped_linear(xr[I], down, offs)]),
            ("routed_down", "bf16_grouped_mm", [lambda: torch._grouped_mm(xr[I], down16.transpose(-2, -1), offs=offs)]),
            ("routed_experts", "fp8", [lambda: moe.routed_experts(xt[H], ids, wts, gu, down)]),
            ("routed_experts", "bf16", [lambda: moe.routed_experts(xt[H], ids, wts, gu16, down16)]),
            ("shared_gate_up", "bf16", [lambda w=w: torch.nn.functional.linear(xt[H], w) for w in sgu16]),
            ("shared_down", "bf16", [lambda w=w: torch.nn.functional.linear(xt[I], w) for w in sdown16]),
        ]
        for path in ("scaled_mm", "triton"):
            cases += [("shared_gate_up", f"fp8_{path}", [lambda w=w, p=path: _dense(xt[H], w, p) for w in sgu]),
                      ("shared_down", f"fp8_{path}", [lambda w=w, p=path: _dense(xt[I], w, p) for w in sdown])]
        for op, path, fns in cases:
            try:
                res = _timed(fns)
            except Exception as exc:  # noqa: BLE001 - recorded, the next case runs
                res = dict(median_us="", p10_us="", p90_us="", repeats=0, mode=f"error: {type(exc).__name__}: "
                                                                              f"{str(exc)[:120]}")
            rows.append(dict(op=op, path=path, tokens=T, rows=T * TOPK if op.startswith("routed") else T, **res))
        write_csv(out / "fp8_times.csv", rows)
        log(f"time T={T}: " + ", ".join(f"{r['op']}/{r['path']} {r['median_us']}" for r in rows if r["tokens"] == T))
    return dict(rows=len(rows))


def _dense(x, w, path):
    with forms(fp8_gemm=path):      # read at each call, so also during capture
        return fp8.linear(x, w)


def phase_rank(dev, out: Path, deadline: float) -> dict:
    from simtree.models import get_model
    from simtree.runtime.full.build import build_model, weight_bytes

    rows = []
    whole = get_model("deepseek-v4-flash")
    for xdt in ("fp8", "bf16"):
        if time.monotonic() > deadline:
            break
        shape = dataclasses.replace(whole, mlp={**whole.mlp, "expert_dtype": xdt})
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        try:
            model = build_model(shape, device=dev, dtype=torch.bfloat16)
        except Exception as exc:  # noqa: BLE001 - bf16 experts do not fit an 80 GB GPU
            rows.append(dict(experts=xdt, batch="", weight_bytes=weight_bytes(shape, torch.bfloat16), allocated="",
                             median_us="", p10_us="", p90_us="", mode=f"not built: {str(exc)[:160]}"))
            log(f"rank {xdt}: not built ({exc})")
            continue
        alloc = torch.cuda.memory_allocated(dev) - base
        log(f"rank {xdt}: built, {alloc / 1e9:.1f} GB allocated, weight_bytes {weight_bytes(shape) / 1e9:.1f} GB")
        for B in (1, 8, 32):
            if time.monotonic() > deadline:
                break
            try:
                st = model.new_state(B, 2048 + 2048)     # each replay decodes one more token
                model.fill_random(st, None, 2048)
                tokens = torch.randint(0, model.vocab, (B,), device=dev)
                res = _timed([lambda: model.decode(st, tokens)])
            except Exception as exc:  # noqa: BLE001 - recorded, the next batch runs
                res = dict(median_us="", p10_us="", p90_us="", mode=f"error: {type(exc).__name__}: {str(exc)[:120]}")
            rows.append(dict(experts=xdt, batch=B, weight_bytes=weight_bytes(shape), allocated=alloc, **res))
            log(f"rank {xdt} B={B}: {res}")
            write_csv(out / "fp8_rank.csv", rows)
            st = None
        del model
    write_csv(out / "fp8_rank.csv", rows)
    return dict(rows=len(rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="check,time,rank")
    ap.add_argument("--max-seconds", type=float, default=400.0)
    ap.add_argument("--fp8-gemm", default="auto", choices=("auto", "scaled_mm", "triton", "ref"),
                    help="the FP8 GEMM's form outside the per-path comparisons (the rank phase)")
    args = ap.parse_args(argv)
    set_forms(fp8_gemm=args.fp8_gemm)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    meta = {**collect_metadata("cuda"), "capability": list(torch.cuda.get_device_capability(dev)),
            "shapes": dict(experts=E, experts_per_token=TOPK, hidden=H, expert_intermediate=I, block=128),
            "tokens": list(TOKENS), "phases": {}}
    deadline = START + args.max_seconds
    budgets = {"check": 0.25, "time": 0.45, "rank": 0.30}      # shares of what is left when a phase starts
    phases = [p for p in args.phases.split(",") if p]
    for i, name in enumerate(phases):
        left = deadline - time.monotonic()
        share = budgets.get(name, 0.3) / sum(budgets.get(p, 0.3) for p in phases[i:])
        phase_deadline = time.monotonic() + left * share
        log(f"phase {name}: {left * share:.0f} s")
        t0 = time.monotonic()
        try:
            fn = {"check": lambda: phase_check(dev, out), "time": lambda: phase_time(dev, out, phase_deadline),
                  "rank": lambda: phase_rank(dev, out, phase_deadline)}[name]
            meta["phases"][name] = {"status": "ok", **fn()}
        except Exception as exc:  # noqa: BLE001 - a failing phase does not stop the next
            meta["phases"][name] = {"status": f"failed: {type(exc).__name__}: {exc}"[:400]}
            traceback.print_exc()
        meta["phases"][name]["seconds"] = round(time.monotonic() - t0, 1)
        log(f"phase {name}: {meta['phases'][name]}")
        torch.cuda.empty_cache()
        (out / "fp8_meta.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
