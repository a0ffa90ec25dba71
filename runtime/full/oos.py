"""Throughput predicted out of sample: a frozen bundle, a later GPU run, points off the profile.

Freeze (home side, before the GPU call; commit the result):

    python -m simtree.runtime.full.oos freeze --model qwen3.6-27b --costs SHIPPED.json \\
        --drafter-profile reports/h100/drafters_profile.csv --out FROZEN.json

writes the shipped bundle with the block drafters' C_d fitted from the drafter profile
(``modes_gpu.drafter_bundle``: the shipped bundles hold no drafter fits) as one bundle; its
``meta.frozen`` names what it was built from (paths and sha256s) and the fit's notes.

GPU side (``scripts/oos_gpu.sh``), one model per call:

    python -m simtree.runtime.full.oos run --model qwen3.6-27b --costs FROZEN.json --out DIR [--modes all]

builds the model once and measures every runnable policy (:func:`policies`: plain decoding,
linear D=4, the ``POLICIES`` below and one shape of every mode the runtime builds,
``modes_report.MODE_SHAPES``) at every (context, batch size) point (replayed acceptance,
``full_run``), predicted from ``FROZEN.json``.  A bundle without a block drafter's C_d runs the
other modes and logs the block ones as not run.  The points run one after another, each whole
(``DIR/ctx_<l>_b<bbb>/``): a point starts only if the time left holds its runs (at the seconds a
run took at that batch so far), so a deadline loses whole points (their runs listed as skipped),
never a policy at every point - the plan's-choice check needs >= 6 policies at a point.  Each run
is first checked by the deployment memory check on this GPU (``simtree.deploy.memory.check_rank_fits``:
the rank holding all b sequences, at the cache rows the run allocates, ``measure.run_max_len`` of
the batch's rounds, with the verify buffers of the bucket it verifies - the RoundShape full_run
builds for it, ``measure.memory_use`` - and its drafter - a block drafter's weights, caches and
round buffers, ``simtree.deploy.drafter_memory``; as ``memory_runs`` checks the logged runs): a
run the check refuses is skipped alone, its row saying the check's line, and the point's other
runs go on; where plain decoding does not fit, nothing at the
point does, and it is skipped whole before anything is built for it (the first every-mode runs
spent GPU time on Qwen3.6-27B at batch 64, context 4096, and ran out of memory).  Such a point is
not complete: a run asked for was not measured, so the report lists it and its plan's-choice
check does not count the point.

What is out of sample: the cost bundle (fitted on an earlier session's profile; its sha256 is
in every row) and the points (contexts, batch sizes and budgets the profile did not time are
marked ``on_profile_grid`` False).  What is not: the acceptance is replayed from the same preset
the prediction uses (``accept_rel_err`` is small by construction), so the error is the cost
model's.  The rank runs the batch the bundle prices (a V4 ``ep=8`` rank at batch b is priced at
rank batch b, without the all-to-all it does not run): a row of a rank run alone says so in its
deployment ("ep=8 rank", the label policy files use; the summary says the all-to-all was not run):
batch_size is the rank's b sequences, not the ep=8 deployment's batch, of which a rank would hold
ceil(b / 8)).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from simtree.errors import SimtreeError
from simtree.fileio import file_sha256, write_text_atomic
from simtree.planning.modes import BLOCK_DRAFTER_MODES, PolicySpec

from .modes_report import MODE_SHAPES
from .oos_report import COLUMNS, report

__all__ = ["POLICIES", "CONTEXTS", "BATCH_SIZES", "COLUMNS", "policies", "freeze", "run", "report", "main"]

# the points both models measure in one call: batch sizes off the MTP draft profile's grid (1, 4, 16, 64
# timed); each row's on_profile_grid says where it lies on its bundle's profiles
CONTEXTS = (1024, 4096)
BATCH_SIZES = (2, 8, 32)
# besides plain and linear D=4 (full_run measures those): budgets on and off the draft grid
# (the shipped profiles time draft steps s <= 7 and nodes 1-4, 6, 8, 12, 16)
POLICIES = (("linear_d10", "linear", {"budget": 10}),
            ("eagle", "eagle", {"num_steps": 2, "topk": 2, "budget": 4}),
            ("eagle", "eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
            ("eagle", "eagle", {"num_steps": 5, "topk": 3, "budget": 12}),
            ("eagle", "eagle", {"num_steps": 6, "topk": 4, "budget": 16}),
            ("eagle", "eagle", {"num_steps": 8, "topk": 2, "budget": 10}))
# seconds a run takes before any point has run (H100 logs: 1.3-3 s at batch <= 16, up to 4.6 s at 64)
FIRST_RUN_S = 3.0
WARMUP_ROUNDS = 3      # rounds each run takes before its measured ones


def policies(modes=None) -> list[tuple[str, PolicySpec]]:
    """(label, spec) of every policy a point measures besides plain and linear D=4: ``POLICIES``,
    then each ``MODE_SHAPES`` entry not among them (labelled by its mode); ``modes``: the modes
    kept (None: all; a mode none of them has is a one-line error)."""
    out: list = []
    for label, spec in [(label, PolicySpec.from_dict(mode, params)) for label, mode, params in POLICIES] + \
            [(mode, PolicySpec.from_dict(mode, params)) for mode, params in MODE_SHAPES]:
        if spec not in {s for _, s in out}:
            out.append((label, spec))
    if modes is None:
        return out
    known = list(dict.fromkeys(s.mode for _, s in out))
    unknown = [m for m in modes if m not in known]
    if unknown or not modes:
        raise SimtreeError(f"--modes {','.join(modes)}: {'unknown mode ' + unknown[0] if unknown else 'no mode'} "
                           f"(one or more of {', '.join(known)}, or all; plain and linear D=4 run at every point)")
    return [(label, s) for label, s in out if s.mode in modes]


def freeze(model: str, costs: str, drafter_profile: str, out: Path) -> list[str]:
    """Write ``costs`` (a shipped bundle of ``model``) with the block drafters' C_d fitted from
    ``drafter_profile``'s rows of ``model`` to ``out`` as one bundle; returns the fit's notes."""
    from simtree.costs.model import load_costs
    from simtree.costs.profile_table import load_profile

    from .modes_gpu import drafter_bundle
    shipped = load_costs(costs)
    if shipped.meta.get("model") != model:
        raise SimtreeError(f"{costs}: a bundle of {shipped.meta.get('model')!r}, not of {model!r}")
    rows = load_profile(drafter_profile)
    rows = rows[rows["model"] == model]
    if rows.empty:
        raise SimtreeError(f"{drafter_profile}: no drafter rows of {model} (nothing to freeze beside the bundle)")
    bundle, notes = drafter_bundle(str(costs), str(drafter_profile), model)
    if not bundle.drafters:
        raise SimtreeError(f"{drafter_profile}: no drafter of {model} could be fitted ({'; '.join(notes)})")
    devices = sorted({str(d) for d in rows["device"]})
    if devices != [str(shipped.meta.get("device"))]:
        notes.append(f"ASSUMPTION: the drafters were timed on {', '.join(devices)}, C_v and the MTP C_d fitted on "
                     f"{shipped.meta.get('device')}")
    frozen = {"costs": str(costs), "costs_sha256": file_sha256(costs), "drafter_profile": str(drafter_profile),
              "drafter_profile_sha256": file_sha256(drafter_profile), "drafters": sorted(bundle.drafters),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "notes": notes}
    dataclasses.replace(bundle, meta={**bundle.meta, "frozen": frozen}).save(out)
    return notes


def run(model: str, costs: str, out: Path, *, contexts=CONTEXTS, batch_sizes=BATCH_SIZES, device: str = "cuda",
        deployment: str | None = None, max_seconds: float = 420.0, acceptance: str = "gsm8k",
        rounds: int = 24, min_draws: int = 96, modes=None) -> int:
    """Measure every (context, batch, policy) of one model, point by point (module docstring);
    ``out/ctx_<l>_b<bbb>/summary.json`` per point (batch zero-padded: the folders sort by it)."""
    import torch

    from simtree.costs.model import load_costs
    from simtree.models import get_model
    from .build import build_model
    from .gpu_run import runtime_deployment

    t0 = time.time()
    bundle = load_costs(costs)                    # a missing or broken bundle: one line, before anything runs
    extra = policies(modes)
    dep = runtime_deployment(model, deployment)
    unpriced = [s.name for _, s in extra if s.mode in BLOCK_DRAFTER_MODES and s.mode not in bundle.drafters]
    extra = [(label, s) for label, s in extra if s.name not in unpriced]
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a", buffering=1)

    def say(line: str) -> None:
        msg = f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:6.1f}s] {line}"
        print(msg, flush=True)
        log.write(msg + "\n")

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {"model": model, "deployment": dep, "gpu": gpu, "torch": torch.__version__, "costs": str(costs),
            "bundle_sha256": file_sha256(costs), "contexts": list(contexts), "batch_sizes": list(batch_sizes),
            "policies": [[label, s.mode, s.to_dict()] for label, s in extra], "acceptance": acceptance,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if unpriced:
        meta.update(not_run=unpriced, not_run_why="the frozen bundle has no C_d of their drafter: freeze it with "
                                                  "--drafter-profile")
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    write_text_atomic(out / "meta.json", json.dumps(meta, indent=1))
    say(f"oos {model} ({dep}) on {gpu}; frozen bundle {costs} sha256 {meta['bundle_sha256'][:12]}")
    if unpriced:
        say(f"no C_d for {', '.join(unpriced)} in {costs}: not run")
    built = build_model(get_model(model), device, seed=0)   # V4: one ep=8 rank, as gpu_run builds it
    say(f"built {built.shape.name} ({built.deployment})")
    failed = _points(built, bundle, out, [(c, b) for c in contexts for b in batch_sizes], extra, say,
                     end=t0 + max_seconds, device=device, acceptance=acceptance, rounds=rounds, min_draws=min_draws,
                     deployment=dep)
    say(f"done; {failed} point(s) failed")
    return 1 if failed else 0


def _points(built, bundle, out: Path, points, extra, say, *, end: float, device, acceptance, rounds,
            min_draws, deployment: str | None = None) -> int:
    """Run each (context, batch) point whole, or skip it (its runs listed as skipped) where the time
    left cannot hold it at the seconds a run took at the last point of that batch (none yet: the
    most at any point, else FIRST_RUN_S); returns how many points failed."""
    from .measure import LINEAR_D4, PLAIN, AcceptanceSource, RunConfig, full_run
    seconds: dict = {}                   # batch size -> seconds a run took at each point run
    failed = 0
    source = AcceptanceSource(None, acceptance, device, 0)     # full_run's: each run's shape as it builds it
    for ctx, B in points:
        specs = [PLAIN, LINEAR_D4, *(s for _, s in extra)]
        cfg = RunConfig(ctx, rounds, WARMUP_ROUNDS, min_draws=min_draws).for_batch(B)
        checked: dict = {}

        def check(spec, rs, cfg=cfg, B=B, checked=checked):    # the run full_run builds: its bucket and rounds
            if (spec, rs) not in checked:
                checked[spec, rs] = _memory_refusal(built.shape, deployment, B, spec, rs, cfg, device)
            return checked[spec, rs]
        shapes = {s: source.shape_or_none(s, B, bundle, ctx) for s in specs} if deployment else {}
        why_not = {s.name: why for s, rs in shapes.items() if rs is not None and (why := check(s, rs))}
        refused = why_not.get(PLAIN.name)        # plain decoding does not fit: no run at the point does
        modes_refused = {} if refused else why_not
        runs = 2 + len(extra) - len(modes_refused)     # plain and linear D=4 beside the policies
        per_run = seconds[B][-1] if B in seconds else max((s for v in seconds.values() for s in v), default=FIRST_RUN_S)
        need, left = runs * per_run, end - time.time()
        whole = need <= left and not refused    # a point the memory check refuses: no GPU time spent on it
        say(f"=== context {ctx} batch {B}: " + (f"skipped whole, {refused}" if refused else
            f"{runs} runs, ~{need:.0f} s of {left:.0f} s left" + ("" if whole else ": skipped whole")))
        for name, why in modes_refused.items():
            say(f"context {ctx} batch {B} {name} skipped, {why}")
        started = time.time()
        try:
            full_run(built, device=device, costs=bundle, batch_sizes=[B], acceptance=acceptance, context_len=ctx,
                     out=out / f"ctx_{ctx}_b{B:03d}", rounds=rounds, warmup_rounds=WARMUP_ROUNDS, min_draws=min_draws,
                     progress=say,
                     deadline=end - 5 if whole else started - 1, extra=extra,
                     skip=refused if refused or not deployment else check)
        except Exception as exc:   # noqa: BLE001 - one point failing leaves the others
            failed += 1
            say(f"context {ctx} batch {B} FAILED: {type(exc).__name__}: {exc}")
            from .engine import release_memory
            release_memory()
            continue
        if whole:
            seconds.setdefault(B, []).append((time.time() - started) / runs)
    return failed


def _memory_refusal(shape, deployment: str, batch_size: int, spec, rs, cfg, device, machine=None) -> str | None:
    """Why the deployment memory check refuses ``spec``'s run at this point as full_run builds it
    (the rank's weights, every one of its ``batch_size`` sequences' caches at the rows the run
    allocates - ``measure.run_max_len`` of ``cfg``, the batch's RunConfig -, the verify round's
    buffers at its bucket ``rs.nodes``, the drafter, the CUDA context, against the usable memory of
    the GPU it runs on: :func:`simtree.deploy.memory.check_rank_fits` with ``measure.memory_use``, as
    ``memory_runs`` checks the logged runs), or None where it fits, ``device`` (the run's) is no CUDA
    GPU or no machine table describes it (``machine``: that GPU's, default ``device``'s)."""
    from simtree.deploy.memory import check_rank_fits
    from simtree.machine.machines import gpu_machine

    from .measure import memory_use
    if machine is None:
        machine = gpu_machine(device)
    if machine is None:
        return None
    try:
        check_rank_fits(shape, deployment, machine, batch_size, cfg.context_len, **memory_use(spec, rs, cfg))
    except SimtreeError as exc:
        return f"the deployment memory check refuses it: {exc}"
    return None


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SimtreeError(f"{flag} {text}: comma-separated whole numbers expected") from None
    if not values or min(values) < 1:
        raise SimtreeError(f"{flag} {text}: one or more numbers >= 1 expected")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("freeze", help="home: a shipped bundle with the block drafters' C_d, as one frozen bundle")
    f.add_argument("--model", required=True)
    f.add_argument("--costs", required=True, help="the shipped cost bundle of the model")
    f.add_argument("--drafter-profile", required=True,
                   help="the block drafters' profile, e.g. reports/h100/drafters_profile.csv")
    f.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run", help="GPU: measure one model against a frozen bundle")
    r.add_argument("--model", required=True)
    r.add_argument("--costs", required=True, help="the frozen cost bundle")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--deployment", default=None)
    r.add_argument("--device", default="cuda")
    r.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    r.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    r.add_argument("--modes", default="all", help="the modes measured besides plain and linear D=4, comma-separated "
                                                  "(linear, eagle, best_first, ..., dspark) or all")
    r.add_argument("--max-seconds", type=float, default=420.0)
    r.add_argument("--min-draws", type=int, default=96)
    p = sub.add_parser("report", help="home: the out-of-sample table from run folders")
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("reports/validation"))
    p.add_argument("--bundle", action="append", default=[], help="a frozen bundle the runs used (repeatable)")
    p.add_argument("--profile", action="append", default=[], type=Path,
                   help="a profile a bundle was fitted on, found by the sha256 the bundle records (repeatable; "
                        "a profile beside the bundle or shipped is found without it)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "freeze":
            notes = freeze(args.model, args.costs, args.drafter_profile, args.out)
            print(f"{args.out}: {args.costs} with the drafters' C_d of {args.drafter_profile} ({len(notes)} notes "
                  "in its meta.frozen)")
            return 0
        if args.cmd == "run":
            modes = None if args.modes == "all" else [m.strip() for m in args.modes.split(",") if m.strip()]
            return run(args.model, args.costs, args.out, contexts=_ints(args.contexts, "--contexts"),
                       batch_sizes=_ints(args.batch_sizes, "--batch-sizes"), device=args.device,
                       deployment=args.deployment, max_seconds=args.max_seconds, min_draws=args.min_draws,
                       modes=modes)
        for path in (*args.bundle, *args.profile):
            if not Path(path).is_file():
                raise SimtreeError(f"{path}: no such file")
        stats = report(args.dirs, args.out, {file_sha256(b): b for b in args.bundle}, args.profile)
        print(f"{stats['runs']} runs: median {100 * stats['median']:.1f}%, worst {100 * stats['worst']:.1f}%; "
              f"plan's choice best or within 2% at {stats['plan_ok']} of {stats['points']} points -> {args.out}")
        return 0
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
