"""One bounded GPU session of the full runtime for one model (``scripts/full_gpu.sh`` runs it after
the profile sweep of the runtime's layers).

    python -m simtree.runtime.full.gpu_run --model qwen3.6-27b --out DIR [--max-seconds 300]
    python -m simtree.runtime.full.gpu_run --model deepseek-v4-flash --deployment ep=8 --out DIR

``--deployment`` (default the model's shipped one, simtree/data/deployments.yaml) names the rank:
the runtime builds Qwen whole (tp=1) and one DeepSeek-V4 expert-parallel rank (ep=8); its whole
steps are tagged with it, and the session's predictions come from that deployment's shipped
bundle where one exists (``--costs`` replaces it; without either the measured runs carry no
prediction and the home side predicts them from the session's own profile).

Phases, each recorded in DIR/log.txt with timestamps; a phase that fails is logged and the
next one runs; every phase checks the time left (``--max-seconds``) and stops early:

1. ``build``    the model (random bf16 weights made on the GPU; refused if they do not fit),
                and the tree-attention kernel checked against its torch form on the GPU (on a
                failure or mismatch the rest of the session uses the torch form, logged).
2. ``lossless`` ``make_predictable`` (the MTP layer agrees with the target often, so rounds
                accept and reject; shapes unchanged, the later timings are unaffected), then 2
                prompts x {linear D=4, EAGLE s3 k2 D6, EAGLE s4 k4 D16, best-first D8 p3, and with
                a bundle cost_aware max 16 p3} at batch 2, live,
                against plain greedy -> lossless.csv (a mismatch with its top-2 logit gap).
3. ``measure``  ``full_run``: per batch size plain, linear D=4, the plan's choice (``--policy``;
                default for a one-GPU deployment the shipped plan under reports/<machine>/plan/ of
                the model and deployment, for the V4 ep=8 rank the rank planned alone from the
                session's bundle over its batch sizes - b sequences on the rank, no all-to-all, as
                it runs: :mod:`.rank_plan` -> DIR/plan/policy.json, candidates.csv; a policy of the
                ep=8 deployment's batch is refused before the build), one shape of every other runnable mode (``--modes``: best-first,
                cost_aware, batch_alloc, whose budgets come from the bundle) and the EAGLE shapes a
                plan may choose (``--eagle``), replay (--acceptance, default gsm8k, or --replay) ->
                summary.json (every round's measurements, for ``measure.repredict`` at home)
                and summary.csv / .md / .png predicted from the shipped bundle.
4. ``steps``    the runtime's whole steps (:mod:`.steps`): verify + commit at a few (b, n, l)
                and draft + catch-up over the (b, s, k) grid of the measured policies ->
                steps_profile.csv in the profile-table schema (variant ``full_runtime``).

``--dtype fp32`` and ``--layers N`` (the first N layers of the pattern, every kind kept:
``ModelShape.stack``) build another model than the one the profile and the bundles describe:
only ``--phases build,lossless`` runs on it (the lossless check without bf16 rounding; the V4
rank whole is 171 GB in fp32, more than one H200).

The fit, the plan and the predictions from the session's own profile run at home
(``python -m simtree.runtime.full.session_report``, scripts/full_report.sh).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from simtree.errors import SimtreeError
from simtree.fileio import write_csv_atomic
from simtree.models import get_model
from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.build import dtype_name
from simtree.runtime.full.measure import MIN_DRAWS
from simtree.runtime.full.rank_plan import plan_rank, plans_rank_alone

__all__ = ["main", "time_step", "EAGLE_SHAPES", "MODE_SHAPES", "VERIFY_GRID", "DRAFT_GRID", "shipped_plan"]

PHASES = ("build", "lossless", "measure", "steps")
# the EAGLE shapes (num_steps, topk, budget) measured at every batch size: the plan made at home
# from the session's own profile chooses among them
EAGLE_SHAPES = ((2, 2, 4), (3, 2, 6), (4, 2, 8), (5, 3, 12), (6, 4, 16))
# one shape of every runnable mode besides plain, linear and EAGLE, measured at every batch size
# before the EAGLE shapes (the shipped plans choose cost_aware at depth 2 and 3)
MODE_SHAPES = "best_first:budget=8,draft_depth=3;cost_aware:max_budget=16,draft_depth=3;" \
              "cost_aware:max_budget=16,draft_depth=2;batch_alloc:max_budget_per_seq=16,draft_depth=3"
# whole steps for the composed-vs-measured check: (b, n, l), the measured runs' contexts first
VERIFY_GRID = ([(b, n, 256) for n in (1, 8, 4, 16) for b in (1, 4, 16, 64)]
               + [(b, n, 2048) for n in (1, 8) for b in (1, 16)])
# the draft + catch-up steps of the measured policies: (b, num_steps, topk)
DRAFT_GRID = [(b, s, k) for s, k in ((3, 1), (3, 2), (2, 2), (4, 2), (5, 3), (6, 4), (1, 1), (7, 1))
              for b in (1, 4, 16, 64)]


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


def _check_attention(s: Session, device, dtype=torch.bfloat16) -> None:
    """The tree attention kernel against its torch form at the two models' shapes (Qwen's GQA
    24/4 x 256, V4's MTP latent 64/1 x 512 with window and sink), in the model's dtype."""
    from simtree.kernels.layers._attention_kernel import tree_attention_triton
    from simtree.kernels.layers.attention import chain_bits, tree_attention_ref
    from simtree.kernels.layers.forms import set_forms
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)  # noqa: E731
    name = dtype_name(dtype)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
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
            if not err < tol:
                raise SimtreeError(f"tree attention kernel differs from its torch form by {err:.3g} "
                                   f"(Hq {Hq}, Hkv {Hkv}, D {D})")
        s.log(f"tree attention kernel: matches its torch form ({name}, both models' shapes)")
    except Exception as exc:   # noqa: BLE001 - the session goes on with the torch form
        set_forms(tree_attention="torch")
        s.log(f"tree attention kernel FAILED ({type(exc).__name__}: {exc}); using the torch form")


def _lossless(s: Session, model, layers: str, costs_path: str | None = None) -> None:
    from .lossless import check_lossless, make_predictable
    make_predictable(model, 0.3)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.vocab, 24).tolist(), rng.integers(0, model.vocab, 17).tolist()]
    specs = [PolicySpec.from_dict("linear", {"budget": 4}), PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
             PolicySpec.from_dict("eagle", {"num_steps": 4, "topk": 4, "budget": 16}),
             PolicySpec.from_dict("best_first", {"budget": 8, "draft_depth": 3})]
    costs = None
    if costs_path is not None:   # the adaptive modes decide with the deployment's bundle
        from simtree.costs.model import load_costs
        costs = load_costs(costs_path)
        specs.append(PolicySpec.from_dict("cost_aware", {"max_budget": 16, "draft_depth": 3}))
    dtype = dtype_name(model.dtype)
    rows = [{"model": model.shape.name, "dtype": dtype, "layers": layers, **r}
            for r in check_lossless(model, prompts, specs, 32, costs=costs)]
    write_csv_atomic(s.out / "lossless.csv", rows)
    for r in rows:
        s.log(f"lossless {r['policy']} batch 2 {dtype} {layers} layers: {'MATCH' if r['match'] else 'DIFFERS'} (accepted/round "
              f"{r['accepted_tokens_per_round']:.2f}" + (f", first diff {r['first_diff']}, plain top-2 gap "
                                                         f"{r['margin']:.4g}, verify-vs-decode logit deviation "
                                                         f"{r['deviation']:.4g}, verify picks {r['verify_token']} "
                                                         f"(plain {r['plain_token']}, speculative {r['spec_token']})"
                                                         if not r['match'] else "") + ")")


def _steps(s: Session, model, tree_model, context_len: int, deployment: str, reserve_s: float = 10.0) -> None:
    """Whole verify and draft steps (module docstring) into steps_profile.csv, one row each,
    alternating between the two grids so a session cut short keeps some of both."""
    from simtree.costs.profile_table import append_rows
    from simtree.machine.metadata import device_label
    from .steps import draft_step, verify_step
    dev = device_label(str(model.device))
    dtype = dtype_name(model.dtype)
    path = s.out / "steps_profile.csv"
    verify = [("verify", p) for p in VERIFY_GRID]
    draft = [("draft", p) for p in DRAFT_GRID]
    points = [p for pair in zip(verify, draft) for p in pair] + verify[len(draft):] + draft[len(verify):]
    done = 0
    for kind, p in points:
        if s.left() < reserve_s:
            s.log(f"steps: time is up after {done} of {len(points)} points")
            break
        try:
            step = (verify_step(model, p[0], p[1], p[2], tree_model=tree_model) if kind == "verify" else
                    draft_step(model, p[0], p[1], p[2], context_len, tree_model=tree_model))
            med, p10, p90 = time_step(step)
            d = step.describe()
            step.close()
            row = {"stage": d["stage"], "model": model.shape.name, "deployment": deployment, "device": dev, "dtype": dtype,
                   "variant": "full_runtime", "batch_size": p[0], "context_len": d["context_len"],
                   "latency_us_median": med, "latency_us_p10": p10, "latency_us_p90": p90, "repeats": 10}
            if kind == "verify":
                row.update(nodes_per_seq=p[1], tree_shape="eagle")
            else:
                row.update(nodes_per_seq=p[2], tree_shape="eagle", num_steps=p[1], topk=p[2])
            append_rows(path, [row])
            done += 1
            s.log(f"steps {kind} {p}: {med:.0f} us")
        except Exception as exc:   # noqa: BLE001
            s.log(f"steps {kind} {p} FAILED: {type(exc).__name__}: {exc}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def runtime_deployment(model: str, deployment: str | None) -> str:
    """The canonical deployment of the rank gpu_run builds for ``model`` (default: the model's
    shipped one, else the rank the runtime builds); a one-line error for a rank the full runtime
    does not build."""
    from simtree.parallel import parse_deployment
    from simtree.deploy.shipped import default_deployment
    from simtree.kernels.layers.v4 import default_ep_ranks

    shape = get_model(model)
    own = parse_deployment(f"ep={default_ep_ranks(shape)}" if shape.family == "v4" else "tp=1")
    dep = parse_deployment(deployment) if deployment else default_deployment(model, fallback=own)
    if dep != own:
        raise SimtreeError(f"--deployment {dep}: the full runtime builds {model} only as {own} (the layer sweep "
                           f"alone times other ranks: DEPLOYMENT={dep} bash scripts/full_gpu.sh {model})")
    return dep.name


def this_machine() -> str:
    """The machine whose shipped defaults a session on this process's GPU uses (h100 on an H100;
    the default machine on a GPU no shipped section names, or without one)."""
    from simtree.deploy.shipped import shipped_machine_for

    return shipped_machine_for(torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def default_costs(model: str, deployment: str, machine: str | None = None) -> str | None:
    """The shipped bundle of (model, deployment) on ``machine`` (default: this GPU's,
    :func:`this_machine`), or None where none ships yet."""
    from simtree.parallel import parse_deployment
    from simtree.deploy.shipped import shipped_bundle

    path = shipped_bundle(model, parse_deployment(deployment), machine or this_machine())
    return str(path) if path.is_file() else None


def shipped_plan(model: str, deployment: str, root: Path | None = None) -> str | None:
    """The policy file of the shipped plan for (model, deployment) under ``root`` (default
    reports/<this GPU's machine>/plan), or None where none is."""
    import json
    root = Path(root) if root is not None else Path("reports") / this_machine() / "plan"
    for path in sorted(root.glob("*/policy.json")):
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if d.get("model") == model and str(d.get("deployment", "tp=1")) == deployment:
            return str(path)
    return None


def _rank_plan(s: Session, costs_path: str | None, workload, sizes: list[int]) -> str | None:
    """The rank planned alone from the session's bundle (:mod:`.rank_plan`) -> DIR/plan/; None,
    logged, without a bundle or where planning fails (the runs go on without the plan's choice)."""
    try:
        return None if costs_path is None else str(plan_rank(costs_path, workload, sizes, s.out / "plan", s.log)[0])
    except Exception as exc:   # noqa: BLE001 - the measured runs go on without a plan
        s.log(f"plan of the rank FAILED: {type(exc).__name__}: {exc}")
        return None


def _modes(text: str) -> list[tuple[str, PolicySpec]]:
    """"mode:key=v,key=v;mode:..." -> [(mode, PolicySpec), ...] (a one-line error for a mode the
    runtime does not build)."""
    from .drafting import round_shape
    out = []
    for part in filter(None, text.split(";")):
        mode, _, params = part.partition(":")
        spec = PolicySpec.from_dict(mode.strip(), {k.strip(): int(v) for k, v in
                                                   (kv.split("=") for kv in filter(None, params.split(",")))})
        round_shape(spec)
        out.append((spec.mode, spec))
    return out


def _eagle(text: str) -> list[tuple[str, PolicySpec]]:
    """"s,k,D;s,k,D" -> [("eagle", PolicySpec), ...]."""
    out = []
    for part in filter(None, text.split(";")):
        steps, topk, budget = (int(x) for x in part.split(","))
        out.append(("eagle", PolicySpec.from_dict("eagle", {"num_steps": steps, "topk": topk, "budget": budget})))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--deployment", default=None, help="the rank built and tagged: qwen tp=1, deepseek-v4-flash "
                                                      "ep=8 (default: the model's shipped deployment)")
    ap.add_argument("--costs", default=None, help="cost bundle for the session's own predictions (default: the "
                                                 "deployment's shipped bundle of this GPU's machine, simtree/data/"
                                                 "costs/<machine>_<model>_<tag>.json; none ships: no predictions)")
    ap.add_argument("--policy", default=None, help="a policy file whose choice is measured too (default: the "
                                                  "shipped plan of the model and deployment, reports/<machine>/plan/; "
                                                  "a rank of several GPUs: the rank planned alone in the session)")
    ap.add_argument("--modes", default=MODE_SHAPES, help="shapes of the other runnable modes measured at every "
                                                        "batch size: 'mode:key=v,key=v;...'")
    ap.add_argument("--eagle", default=";".join(",".join(map(str, e)) for e in EAGLE_SHAPES[1::3]),
                    help="EAGLE shapes measured at every batch size: 's,k,D;s,k,D' (default two of EAGLE_SHAPES; "
                         "all: the shapes an EAGLE-only plan chooses among)")
    ap.add_argument("--acceptance", default="gsm8k")
    ap.add_argument("--replay", default=None)
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--min-draws", type=int, default=MIN_DRAWS,
                    help="a batch of B runs at least ceil(min_draws / B) rounds (replay draws per run)")
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--measure-share", type=float, default=0.6,
                    help="share of the session after which no new measured run starts (the steps follow)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                    help="the weights' dtype (fp32: lossless check only)")
    ap.add_argument("--layers", type=int, default=None,
                    help="build the first N layers of the pattern, every kind kept (lossless check only)")
    args = ap.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    altered = [o for o, on in ((f"--dtype {args.dtype}", args.dtype != "bf16"),
                               (f"--layers {args.layers}", args.layers is not None)) if on]
    if altered and set(phases) - {"build", "lossless"}:
        print(f"error: {' and '.join(altered)} build{'s' if len(altered) == 1 else ''} another model than the "
              "profile's: only --phases build,lossless runs on it", file=sys.stderr)
        return 2
    if args.layers is not None:
        try:
            kinds = get_model(args.model).kinds()
        except SimtreeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.layers < len(kinds):
            print(f"error: --layers {args.layers}: {args.model} has {len(kinds)} layer kinds ({', '.join(kinds)}), "
                  f"a cut keeps each: at least {len(kinds)}", file=sys.stderr)
            return 2
    if args.policy is not None and "measure" in phases:
        from simtree.planning.policy_file import Policy
        try:   # the rank runs b sequences: a plan of a deployment's batch b is not its plan
            Policy.load(args.policy).check_rank_run(f"--policy {args.policy}")
        except SimtreeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    s = Session(args.out, args.max_seconds)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    failed = []
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    s.log(f"session: {args.model} on {args.device} ({gpu}), torch {torch.__version__}, phases {phases}, "
          f"{args.max_seconds:.0f} s")
    from simtree.acceptance.model import get_workload
    from .build import DTYPES, build_model, weight_bytes
    workload = get_workload(args.replay or args.acceptance)
    try:
        deployment = runtime_deployment(args.model, args.deployment)
        costs_path = args.costs or default_costs(args.model, deployment)
        s.log(f"deployment {deployment}; predictions from {costs_path or 'no bundle (none ships for it)'}")
        policy = args.policy
        if policy is None and "measure" in phases:
            policy = (_rank_plan(s, costs_path, workload, sizes) if plans_rank_alone(deployment)
                      else shipped_plan(args.model, deployment))
        s.log(f"the plan's choice from {policy or 'no plan (none ships for it)'}")
        extra = _modes(args.modes) + _eagle(args.eagle)
        whole = get_model(args.model)
        shape = whole if args.layers is None else dataclasses.replace(whole, layer_kinds=whole.stack(args.layers))
        layers = f"{shape.num_layers}/{whole.num_layers}"
        model = build_model(shape, args.device, dtype=DTYPES[args.dtype], seed=0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        s.log(f"build: {model.shape.name} ({model.deployment}; {layers} layers, {args.dtype}), {weight_bytes(model.shape, model.dtype) / 1e9:.1f} GB "
              f"of weights" + (f", {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated" if torch.cuda.is_available()
                               else ""))
        if args.device.startswith("cuda"):
            _check_attention(s, model.device, model.dtype)
    except Exception as exc:   # noqa: BLE001 - without a model nothing else can run
        s.log(f"build FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 1
    for phase in phases[1:] if phases and phases[0] == "build" else phases:
        if s.left() < 20:
            s.log(f"{phase}: skipped, {s.left():.0f} s left")
            failed.append(phase)
            continue
        s.log(f"=== {phase}")
        try:
            if phase == "lossless":
                _lossless(s, model, layers, costs_path)
            elif phase == "measure":
                from .measure import full_run
                res = full_run(model, device=args.device, costs=costs_path, policy=policy, batch_sizes=sizes,
                               replay=args.replay, acceptance=None if args.replay else args.acceptance,
                               out=s.out, rounds=args.rounds, min_draws=args.min_draws, warmup_rounds=3, progress=s.log,
                               deadline=s.t0 + args.measure_share * s.limit, extra=extra)
                for n in res["notes"] + res["prediction_notes"]:
                    s.log(f"note: {n}")
            elif phase == "steps":
                _steps(s, model, workload.acceptance, max(1, int(round(workload.mean_prompt_len))), deployment)
            else:
                raise SimtreeError(f"unknown phase {phase!r} (known: {', '.join(PHASES)})")
        except Exception as exc:   # noqa: BLE001 - a failed phase is logged; the next one runs
            failed.append(phase)
            s.log(f"{phase} FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    s.log(f"done; failed phases: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
