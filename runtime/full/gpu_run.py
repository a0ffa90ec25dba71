"""One bounded GPU session of the full runtime for one model (``scripts/full_run_gpu.sh`` runs it).

    python -m simtree.runtime.full.gpu_run --model qwen3.6-27b --out DIR [--max-seconds 520]

Phases, each recorded in DIR/log.txt with timestamps; a phase that fails is logged and the
next one runs; every phase checks the time left (``--max-seconds``) and stops early:

1. ``build``    the model (random bf16 weights made on the GPU; refused if they do not fit),
                and the tree-attention kernel checked against its torch form on the GPU (on a
                failure or mismatch the rest of the session uses the torch form, logged).
2. ``lossless`` ``make_predictable`` (the MTP layer agrees with the target often, so rounds
                accept and reject; shapes unchanged, the later timings are unaffected), then 2
                prompts x {linear D=4, EAGLE s3 k2 D6, EAGLE s4 k4 D16} at batch 2, live,
                against plain greedy -> lossless.csv.
3. ``plan``     ``simtree plan``'s search over the policies the runtime builds on the device
                (none, linear, eagle) with the cost bundle -> policy.json (unless --policy).
4. ``measure``  ``full_run``: per batch size plain, linear D=4 and the plan's choice, replay
                (--acceptance, default gsm8k, or --replay) -> summary.csv, summary.md,
                predicted_vs_measured.png.
5. ``profile``  the runtime's own steps (:mod:`.steps`) on a small grid -> steps_profile.csv in
                the profile-table schema (variant ``full_runtime``): ``simtree fit`` reads it.
6. ``refit``    cost models fitted to that profile -> costs_runtime.json, and the measured runs
                predicted again from them (``measure.repredict``) -> runtime_costs/summary.*
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
from pathlib import Path

import numpy as np
import torch

import simtree
from simtree.errors import SimtreeError
from simtree.planning.simulate import PolicySpec

__all__ = ["main", "time_step"]

PHASES = ("build", "lossless", "plan", "measure", "profile", "refit")
VERIFY_GRID = [(b, n, l) for l in (512, 2048) for b in (1, 4, 16, 64) for n in ((1, 2, 4, 8, 16) if l == 512 else (1, 8))]
DRAFT_GRID = [(b, s, k) for b in (1, 4, 16, 64) for s, k in ((1, 1), (3, 1), (3, 2), (7, 2), (8, 3))]


class Session:
    def __init__(self, out: Path, max_seconds: float):
        self.out, self.t0, self.limit = out, time.time(), max_seconds
        out.mkdir(parents=True, exist_ok=True)
        self.log_fh = open(out / "log.txt", "a", buffering=1)

    def left(self) -> float:
        return self.limit - (time.time() - self.t0)

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.log_fh.write(line + "\n")


def time_step(step, reps: int = 10, warmup: int = 3) -> tuple[float, float, float]:
    """(median, p10, p90) microseconds of ``step.run()`` (CUDA events; perf counters on CPU)."""
    cuda = step.engine.device.type == "cuda"
    for _ in range(warmup):
        step.run()
    times = []
    if cuda:
        torch.cuda.synchronize()
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in evs:
            a.record()
            step.run()
            b.record()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) * 1e3 for a, b in evs]
    else:
        for _ in range(reps):
            t = time.perf_counter()
            step.run()
            times.append((time.perf_counter() - t) * 1e6)
    return tuple(float(np.percentile(times, q)) for q in (50, 10, 90))


def _check_attention(s: Session, device) -> None:
    """The tree attention kernel against its torch form at the two models' shapes (Qwen's GQA
    24/4 x 256, V4's MTP latent 64/1 x 512 with window and sink), bf16."""
    from simtree.kernels.layers.attention_kernel import tree_attention_triton
    from simtree.kernels.layers.attention import chain_bits, tree_attention_ref
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)  # noqa: E731
    B, Q, S, T = 4, 8, 700, 8
    lens = torch.tensor([1, 64, 300, 700], device=device)
    pos = lens[:, None] + torch.arange(Q, device=device)
    try:
        for Hq, Hkv, D, window, sink in ((24, 4, 256, 0, None), (64, 1, 512, 128, torch.randn(64, device=device))):
            kc, kt = r(B, S, Hkv, D), r(B, T, Hkv, D)
            args = (r(B, Q, Hq, D), kc, kc if Hkv == 1 else r(B, S, Hkv, D), lens, pos, kt,
                    kt if Hkv == 1 else r(B, T, Hkv, D), chain_bits(B, Q, device))
            got = tree_attention_triton(*args, scale=D ** -0.5, window=window, sink=sink).float()
            want = tree_attention_ref(*args, scale=D ** -0.5, window=window, sink=sink).float()
            err = float((got - want).abs().max())
            if not err < 3e-2:
                raise SimtreeError(f"tree attention kernel differs from its torch form by {err:.3g} "
                                   f"(Hq {Hq}, Hkv {Hkv}, D {D})")
        s.log("tree attention kernel: matches its torch form (bf16, both models' shapes)")
    except Exception as exc:   # noqa: BLE001 - the session goes on with the torch form
        os.environ["SIMTREE_TREE_ATTENTION"] = "torch"
        s.log(f"tree attention kernel FAILED ({type(exc).__name__}: {exc}); using the torch form")


def _lossless(s: Session, model) -> None:
    from .lossless import check_lossless, make_predictable
    make_predictable(model, 0.3)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.vocab, 24).tolist(), rng.integers(0, model.vocab, 17).tolist()]
    specs = [PolicySpec.from_dict("linear", {"budget": 4}), PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
             PolicySpec.from_dict("eagle", {"num_steps": 4, "topk": 4, "budget": 16})]
    rows = check_lossless(model, prompts, specs, 32)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    (s.out / "lossless.csv").write_text(buf.getvalue())
    for r in rows:
        s.log(f"lossless {r['policy']} batch 2: {'MATCH' if r['match'] else 'DIFFERS'} (accepted/round "
              f"{r['accepted_tokens_per_round']:.2f}" + (f", first diff {r['first_diff']}, plain top-2 gap "
                                                         f"{r['margin']:.4g}" if not r['match'] else "") + ")")


def _plan(s: Session, costs, batch_sizes, workload: str) -> Path:
    """``workload``: a preset or a trace file (``get_workload``), as the measured runs replay it."""
    from simtree.acceptance.model import get_workload
    from simtree.planning.planner import SearchSpace, plan
    res = plan(costs, [get_workload(workload)], batch_sizes, SearchSpace(draft_depths=(), adaptive=False))
    path = s.out / "policy.json"
    res.to_policy().save(path)
    for r in res.chosen.itertuples():
        s.log(f"plan: batch {r.batch_size} {r.policy} predicted {r.tok_s:.0f} tok/s")
    return path


def _profile(s: Session, model, tree_model, reserve_s: float = 15.0) -> None:
    from simtree.costs.profile_table import append_rows
    from simtree.machine.metadata import device_label
    from .steps import draft_step, verify_step
    dev = device_label(str(model.device))
    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}[model.dtype]
    path = s.out / "steps_profile.csv"
    points = [("verify", p) for p in VERIFY_GRID] + [("draft", p) for p in DRAFT_GRID]
    order = sorted(range(len(points)), key=lambda i: (i % 3, i))   # a spread of the grid first
    done = 0
    for i in order:
        if s.left() < reserve_s:
            s.log(f"profile: time is up after {done} of {len(points)} points")
            break
        kind, p = points[i]
        try:
            step = (verify_step(model, p[0], p[1], p[2], tree_model=tree_model) if kind == "verify" else
                    draft_step(model, p[0], p[1], p[2], 512, tree_model=tree_model))
            med, p10, p90 = time_step(step)
            d = step.describe()
            step.close()
            row = {"stage": d["stage"], "model": model.shape.name, "device": dev, "dtype": dtype,
                   "variant": "full_runtime", "batch_size": p[0], "context_len": d["context_len"],
                   "latency_us_median": med, "latency_us_p10": p10, "latency_us_p90": p90, "repeats": 10}
            if kind == "verify":
                row.update(nodes_per_seq=p[1], tree_shape="eagle" if p[1] > 1 else "linear")
            else:
                row.update(nodes_per_seq=p[2], tree_shape="eagle", num_steps=p[1], topk=p[2])
            append_rows(path, [row])
            done += 1
            s.log(f"profile {kind} {p}: {med:.0f} us")
        except Exception as exc:   # noqa: BLE001
            s.log(f"profile {kind} {p} FAILED: {type(exc).__name__}: {exc}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _refit(s: Session) -> None:
    """Cost models fitted to the runtime's own steps (steps_profile.csv) -> costs_runtime.json,
    and the measured runs predicted again from them -> runtime_costs/summary.*"""
    from simtree.costs.fit import fit_profile
    from .measure import repredict
    report = fit_profile(s.out / "steps_profile.csv", stage="model_verify_step", variant="full_runtime",
                         draft_variant="full_runtime")
    report.bundle.save(s.out / "costs_runtime.json")
    for note in report.notes:
        s.log(f"refit note: {note}")
    res = repredict(s.out / "summary.json", report.bundle, s.out / "runtime_costs")
    from .report import error_stats
    for key in ("rel_err", "cost_rel_err"):
        st = error_stats(res["rows"], key)
        s.log(f"refit: |{key}| median {st['median']:.1%}, worst {st['worst']:.1%} over {st['n']} runs")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--costs", default=None, help="cost bundle (default: simtree/data/costs/h200_<model>.json)")
    ap.add_argument("--policy", default=None, help="policy file (default: planned here)")
    ap.add_argument("--acceptance", default="gsm8k")
    ap.add_argument("--replay", default=None)
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--max-seconds", type=float, default=520.0)
    ap.add_argument("--phases", default=",".join(PHASES))
    args = ap.parse_args(argv)
    s = Session(args.out, args.max_seconds)
    phases = [p for p in args.phases.split(",") if p]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    failed = []
    s.log(f"session: {args.model} on {args.device} ({torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}), "
          f"torch {torch.__version__}, phases {phases}, {args.max_seconds:.0f} s")
    from simtree.costs.model import load_costs
    from .build import build_model, weight_bytes
    costs_path = args.costs or str(Path(simtree.__file__).resolve().parent / "data" / "costs" / f"h200_{args.model}.json")
    try:
        model = build_model(args.model, args.device, seed=0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        s.log(f"build: {model.shape.name} ({model.deployment}), {weight_bytes(model.shape, model.dtype) / 1e9:.1f} GB "
              f"of weights" + (f", {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated" if torch.cuda.is_available()
                               else ""))
        if args.device.startswith("cuda"):
            _check_attention(s, model.device)
    except Exception as exc:   # noqa: BLE001 - without a model nothing else can run
        s.log(f"build FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 1
    policy = args.policy
    for phase in phases[1:] if phases and phases[0] == "build" else phases:
        if s.left() < 20:
            s.log(f"{phase}: skipped, {s.left():.0f} s left")
            failed.append(phase)
            continue
        s.log(f"=== {phase}")
        try:
            if phase == "lossless":
                _lossless(s, model)
            elif phase == "plan" and policy is None:
                policy = _plan(s, load_costs(costs_path), sizes, args.replay or args.acceptance)
            elif phase == "measure":
                from .measure import full_run, runs_json
                # the measured runs may take 70% of the session; the step profile and the refit follow
                res = full_run(model, device=args.device, costs=costs_path, policy=policy, batch_sizes=sizes,
                               replay=args.replay, acceptance=None if args.replay else args.acceptance,
                               out=s.out, rounds=args.rounds, warmup_rounds=3, progress=s.log,
                               deadline=s.t0 + 0.7 * s.limit)
                for n in res["notes"]:
                    s.log(f"note: {n}")
                res["runs"] = runs_json(res["runs"])
                (s.out / "summary.json").write_text(json.dumps(res, default=str, indent=1))
            elif phase == "profile":
                from simtree.acceptance.model import get_workload
                _profile(s, model, get_workload(args.replay or args.acceptance).acceptance, reserve_s=75)
            elif phase == "refit":
                _refit(s)
        except Exception as exc:   # noqa: BLE001 - a failed phase is logged; the next one runs
            failed.append(phase)
            s.log(f"{phase} FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    s.log(f"done; failed phases: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
