"""The GDN verify + commit against its two-pass memory floor, on the GPU (issue 45): the commit
as today (the verify reads the state, the commit reads and writes it) beside the commit deferred
into the next verify (``simtree.kernels.gdn.deferred``: the verify folds the round before's
accepted path into the state it reads and writes it once), both deferred forms (the path rows
copied by a deferred-commit launch; or no commit launch, the round before folded from its own
buffers) and the launch variants of ``gdn_floor_variants.py``, every one checked first.

    python -m simtree.profiler.bench.gdn_floor --out $OUT/floor.csv [--max-seconds 300]
        [--variants default,round,...]
    OUT=/tmp/out bash scripts/gdn_floor_gpu.sh         # the same after the editable install

Qwen3.6-27B GDN shapes (H=16, HV=48, K=V=128, from simtree/data/models/qwen3.6-27b), bf16 q/k/v,
fp32 g/beta/state, the benchmark's EAGLE-like trees stored depth-first (``gdn_util``), each
tree's deepest node accepted; batch 1/16/64/4 x nodes 1-128.  Every timing is the median of
CUDA-graph replays (warm-up first) over copies of fresh random inputs rotated past L2
(``gdn_util.graph_time_us``); each round's graph holds both calls, so the deferred pair folds a
real path every replay.  Rows (``kernel``, with ``variant`` and ``gpu``):

    gdn_verify+commit        today: verify, then the standalone commit        floor: 2 S + rows
    gdn_verify_fold+defer    deferred: verify with the fold, deferred commit   floor: 2 S + rows
    gdn_verify_fold+arm      no commit launch: verify folding the round
                             before from its buffers, the flags' memset       floor: 2 S + rows
    gdn_verify               the verify alone                                  floor: S + rows
    gdn_commit               the standalone commit alone                       floor: 2 S
    gdn_defer_commit         the deferred commit alone (token rows only)       floor: path rows
    gdn_fold_pending         the standalone fold (sequence leaving, last round;
                             its graph also resets the waiting flags)          floor: 2 S
    gdn_fold_round           the same for a waiting round                      floor: 2 S
    gdn_arm                  the round form's commit stage alone (the flags'
                             memset; a runtime can fold it into its acceptance
                             step's own kernel)                                floor: flags

S = the fp32 state's bytes, rows = the round's token rows (q, k, v read, o written, g, beta).
floor_us = bytes / the copy bandwidth measured in the same run (bytes read + written, 1 GiB
buffers; ``profiler.timing.measured_bandwidth``); the JSON sidecar also holds the read-only
figure.  GDN has no context axis (the state is the whole history): context = 0.  Before any
timing every variant is checked on the GPU at the CHECKS shapes it is timed at, each way it is
timed, against today's pair and float64 sequential decoding of the accepted paths
(``floor.json``: errors, pass / fail).  The CSV keeps rows of other layer kinds already in
``--out`` and replaces the GDN ones; it is rewritten after every shape, so a run cut by
``--max-seconds`` leaves the shapes it finished.  The GPU's name is recorded, nothing branches
on it.  CPU smoke run (interpreter, tiny heads): TRITON_INTERPRET=1 python -m
simtree.profiler.bench.gdn_floor --tiny --out /tmp/floor.csv
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch

from simtree.fileio import write_text_atomic
from simtree.kernels.gdn import gdn_accepted_paths_ref, new_pending, tree_meta
from simtree.kernels.gdn import _launch as rule
from simtree.kernels.gdn._launch import CommitLaunch, FoldLaunch, VerifyLaunch
from simtree.kernels.gdn._launched import launched_commit, launched_verify
from simtree.kernels.gdn._launched_deferred import (launched_defer_commit, launched_fold_pending,
                                                    launched_fold_round)
from simtree.kernels.gdn.pending import new_pending_round
from simtree.profiler.bench.gdn_util import (QWEN36, env_info, graph_time_us, shape_inputs,
                                             shape_trees)
from simtree.profiler.bench.gdn_floor_variants import PAIRS, Variant, variants

COLUMNS = ["kernel", "layer_kind", "batch", "nodes", "context", "measured_us", "floor_us", "ratio",
           "variant", "gpu"]
KEYS = ("q", "k", "v", "g", "beta")
TINY = dict(H=2, HV=4, K=16, V=32)
# the targets' batches first: a run cut by --max-seconds loses batch 4 first
BATCHES, NODES = (1, 16, 64, 4), (1, 2, 4, 8, 16, 32, 64, 128)
PATH_ROWS = 16          # the runtime's QwenModel.defer_path_rows
FIRST_PASS = ("default", "round")
CHECKS = ((1, 1), (1, 16), (1, 128), (4, 32), (16, 16), (16, 128), (64, 128))


def state_bytes(b: int, d: dict) -> int:
    return b * d["HV"] * d["K"] * d["V"] * 4


def row_bytes(N: int, d: dict, elem: int = 2) -> int:
    """The round's token rows: q, k, v read and o written (``elem`` bytes), g and beta (fp32)."""
    return N * ((2 * d["H"] * d["K"] + 2 * d["HV"] * d["V"]) * elem + 2 * d["HV"] * 4)


def path_bytes(path_rows: int, d: dict, elem: int = 2) -> int:
    """A deferred commit's traffic: each accepted path row's k, u, G read and k, w, u written."""
    return path_rows * (d["H"] * d["K"] * (elem + 4) + d["HV"] * d["V"] * 2 * elem + d["HV"] * 8)


def floor_bytes(kernel: str, b: int, n: int, path_rows: int, d: dict) -> int:
    S, rows = state_bytes(b, d), row_bytes(b * n, d)
    return {"gdn_verify+commit": 2 * S + rows, "gdn_verify_fold+defer": 2 * S + rows,
            "gdn_verify_fold+arm": 2 * S + rows, "gdn_verify": S + rows, "gdn_commit": 2 * S,
            "gdn_fold_pending": 2 * S, "gdn_fold_round": 2 * S, "gdn_arm": b * d["HV"] * d["V"],
            "gdn_defer_commit": path_bytes(path_rows, d)}[kernel]


class Round:
    """One shape's inputs: rotated copies, the trees' meta, the accepted nodes, per-copy states,
    pending paths and pending rounds; the closures of every timed row of a variant."""

    def __init__(self, b: int, n: int, d: dict, device: str, seed: int = 0, max_copies: int = 8,
                 min_copies: int = 1):
        trees, _, _ = shape_trees(b, n, seed, "dfs")
        self.trees = trees
        self.copies = shape_inputs(b, n, seed, d, order="dfs", trees=trees, max_copies=max_copies,
                                   device=device, min_copies=min_copies)
        c0 = self.copies[0]
        self.meta = tree_meta(c0["parents"], c0["cu_nodes"], depth_first=True)
        self.acc = torch.as_tensor(c0["tb"].deepest_nodes, device=device)
        self.path_rows = int(sum(t.depth[a] + 1 for t, a in zip(trees, self.acc.tolist())))
        self.d, self.device = d, device
        self.pend = [new_pending(b, d["H"], d["HV"], d["K"], d["V"], PATH_ROWS, device,
                                 torch.bfloat16 if device == "cuda" else torch.float32)
                     for _ in self.copies]
        self.rounds = [new_pending_round(b, d["HV"], d["V"], device) for _ in self.copies]

    def verify(self, c, state, pending=None, launch: dict | None = None, pending_round=None):
        la = VerifyLaunch(**(launch or {})) if self.device == "cuda" else \
            VerifyLaunch("triton", **(launch or {}))
        return launched_verify(*(c[k] for k in KEYS), state, c["parents"], c["cu_nodes"],
                               meta=self.meta, check=False, pending=pending,
                               pending_round=pending_round, launch=la)

    def commit(self, c, state, cache, launch: dict | None = None):
        la = CommitLaunch(**(launch or {})) if self.device == "cuda" else \
            CommitLaunch("triton", **(launch or {}))
        launched_commit(state, c["k"], cache, c["parents"], c["cu_nodes"], self.acc, check=False,
                        launch=la)

    def defer(self, c, state, p, cache, knobs: dict | None = None):
        launched_defer_commit(state, p, c["k"], cache, c["parents"], c["cu_nodes"], self.acc,
                              check=False, launch=self.fold_launch(knobs))

    def fold(self, state, p, knobs: dict | None = None):
        launched_fold_pending(state, p, launch=self.fold_launch(knobs))

    def fold_round(self, state, pr, knobs: dict | None = None):
        launched_fold_round(state, pr, launch=self.fold_launch(knobs))

    def arm(self, pr, c, cache):
        pr.arm(c["k"], cache, c["cu_nodes"], self.acc)

    def fold_launch(self, knobs: dict | None) -> FoldLaunch:
        """A variant's fold / defer knobs as a ``FoldLaunch`` (Triton through the interpreter
        on a CPU)."""
        return FoldLaunch("auto" if self.device == "cuda" else "triton", **(knobs or {}))

    def closures(self, v: Variant, kernels: tuple) -> dict:
        """The closures (one per input copy) of ``kernels``, at variant ``v``'s launches."""
        cs, ps, rs = self.copies, self.pend, self.rounds
        L, CL, FK, DK = v.verify, v.commit, v.fold, v.defer
        # fixed caches: the commits timed alone and the rounds armed read these
        caches = [self.verify(c, c["state"], launch=L)[1] for c in cs]
        for c, p, ca, pr in zip(cs, ps, caches, rs):          # a path / round waits everywhere
            self.defer(c, c["state"], p, ca, DK)
            self.arm(pr, c, ca)
        fns = {
            "gdn_verify+commit": lambda c, p, ca, pr: self.commit(
                c, c["state"], self.verify(c, c["state"], launch=L)[1], CL),
            "gdn_verify_fold+defer": lambda c, p, ca, pr: self.defer(
                c, c["state"], p, self.verify(c, c["state"], p, L)[1], DK),
            "gdn_verify_fold+arm": lambda c, p, ca, pr: (
                self.verify(c, c["state"], launch=L, pending_round=pr), pr.on.fill_(1)),
            "gdn_verify": lambda c, p, ca, pr: self.verify(c, c["state"], launch=L),
            "gdn_commit": lambda c, p, ca, pr: self.commit(c, c["state"], ca, CL),
            "gdn_defer_commit": lambda c, p, ca, pr: self.defer(c, c["state"], p, ca, DK),
            "gdn_fold_pending": lambda c, p, ca, pr: (p.on.fill_(1), self.fold(c["state"], p, FK)),
            "gdn_fold_round": lambda c, p, ca, pr: (pr.on.fill_(1),
                                                    self.fold_round(c["state"], pr, FK)),
            "gdn_arm": lambda c, p, ca, pr: pr.on.fill_(1),
        }
        return {k: [lambda f=fns[k], a=a: f(*a) for a in zip(cs, ps, caches, rs)]
                for k in kernels}


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def check_base(b: int, n: int, d: dict, device: str) -> dict:
    """A check shape's inputs (two rounds from one state), the float64 sequential state after
    round 1 and today's pair at the rule's launches (state after round 1, round 2's outputs,
    state after round 2): built once per shape, shared by every variant's check."""
    r = Round(b, n, d, device, seed=11, max_copies=2, min_copies=2)   # two rounds: two copies however large
    c1 = r.copies[0]
    S0 = c1["state"].clone()
    truth = gdn_accepted_paths_ref(*(c1[k].double() for k in KEYS), S0.double(), r.trees,
                                   c1["cu_nodes"], r.acc)
    base = dict(r=r, S0=S0, truth=truth)
    base["today"] = _pair_rounds(base)
    return base


def _pair_rounds(base: dict, L=None, CL=None) -> tuple:
    """Two rounds of today's pair (verify, commit) at launches L / CL: (state after round 1,
    round 2's outputs, state after round 2)."""
    r, (c1, c2), s = base["r"], base["r"].copies, base["S0"].clone()
    r.commit(c1, s, r.verify(c1, s, launch=L)[1], CL)
    s1 = s.clone()
    o2, cache2 = r.verify(c2, s, launch=L)
    r.commit(c2, s, cache2, CL)
    return s1, o2, s


def check_shape(base: dict, v: Variant, kernels: tuple) -> dict:
    """Two rounds from one state, each way ``v`` times (``kernels``), against today's pair at
    the rule's launches and the float64 sequential decoding of the accepted path: the state
    after round 1 (folded by round 2's verify where deferred), round 2's outputs, the state
    after round 2 (its standalone fold where deferred)."""
    r, S0, truth, ref = base["r"], base["S0"], base["truth"], base["today"]
    c1, c2 = r.copies
    b, n = len(r.trees), r.meta.max_nodes
    d, device = r.d, r.device

    def path(L, DK, FK):
        s, p = S0.clone(), r.pend[0]
        p.clear()
        r.defer(c1, s, p, r.verify(c1, s, p, L)[1], DK)
        o2, cache2 = r.verify(c2, s, p, L)
        s1 = s.clone()
        r.defer(c2, s, p, cache2, DK)
        r.fold(s, p, FK)
        return s1, o2, s

    def rounds(L, FK):
        s, pr = S0.clone(), new_pending_round(b, d["HV"], d["V"], device)
        r.arm(pr, c1, r.verify(c1, s, launch=L, pending_round=pr)[1])
        o2, cache2 = r.verify(c2, s, launch=L, pending_round=pr)
        s1 = s.clone()
        r.arm(pr, c2, cache2)
        r.fold_round(s, pr, FK)
        return s1, o2, s

    out = dict(variant=v.name, batch=b, nodes=n,
               today_state_vs_float64=rel_err(ref[0], truth))
    flows = {}
    if {"gdn_verify+commit", "gdn_verify", "gdn_commit"} & set(kernels):
        flows["pair"] = _pair_rounds(base, v.verify, v.commit)
    if {"gdn_verify_fold+defer", "gdn_defer_commit", "gdn_fold_pending"} & set(kernels):
        flows["deferred"] = path(v.verify, v.defer, v.fold)
    if {"gdn_verify_fold+arm", "gdn_fold_round"} & set(kernels):
        flows["round"] = rounds(v.verify, v.fold)
    ok = True
    for tag, (s1, o2, s2) in flows.items():
        e = dict(state_vs_float64=rel_err(s1, truth), state_vs_today=rel_err(s1, ref[0]),
                 out2_vs_today=rel_err(o2, ref[1]), last_round_vs_today=rel_err(s2, ref[2]))
        out.update({f"{tag}_{k}": x for k, x in e.items()})
        # bf16 inputs and u: each way as close to float64 as today's, up to bf16 rounding
        ok &= (e["state_vs_float64"] <= max(2 * out["today_state_vs_float64"], 1e-3)
               and e["state_vs_today"] < 2e-2 and e["out2_vs_today"] < 3e-2
               and e["last_round_vs_today"] < 3e-2)
    out["ok"] = bool(ok)
    return out


def cuda_walk_at(b: int, n: int, d: dict, device: str) -> bool:
    """Whether the rule takes the CUDA walk at shape (b, n) (depth-first trees, bf16)."""
    return rule.verify_launch_config(b, d["HV"], d["V"], device, n, True, d["H"]).cuda_walk > 0


def todo_at(chosen: tuple, b: int, n: int, d: dict, device: str) -> list:
    """(variant, the rows it times) at shape (b, n), for the variants that time any there."""
    cw = cuda_walk_at(b, n, d, device)
    return [(v, k) for v, k in ((v, v.kernels_at(b, n, cw)) for v in chosen) if k]


def time_shape(b: int, n: int, d: dict, device: str, bw_Bps: float, replays: int,
               errors: list, todo: list, gpu: str) -> list[dict]:
    r = Round(b, n, d, device)
    rows = []
    for v, kernels in todo:
        for kernel, fns in r.closures(v, kernels).items():
            floor_us = floor_bytes(kernel, b, n, r.path_rows, d) / bw_Bps * 1e6
            try:
                us = graph_time_us(fns, replays=replays)["median"]
            except Exception as exc:   # noqa: BLE001 - one variant failing leaves the others' rows
                errors.append(f"b{b} n{n} {kernel} {v.name}: "
                              f"{' '.join(f'{type(exc).__name__}: {exc}'.split())[:300]}")
                print(errors[-1], flush=True)
                us = float("nan")
            rows.append(dict(kernel=kernel, layer_kind="gdn", batch=b, nodes=n, context=0,
                             measured_us=round(us, 3), floor_us=round(floor_us, 3),
                             ratio=round(us / floor_us, 3), variant=v.name, gpu=gpu))
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    """The GDN rows into ``path``, other layer kinds' rows kept."""
    new = pd.DataFrame(rows, columns=COLUMNS)
    if path.exists():
        old = pd.read_csv(path)
        new = pd.concat([old[old["layer_kind"] != "gdn"], new], ignore_index=True)
    write_text_atomic(path, new[COLUMNS].to_csv(index=False))


def summary(rows: list[dict]) -> dict:
    """The issue's targets on these rows: the pair <= 1.4x its floor at batch >= 16 (n <= 128),
    the pair <= 6 us at batch 1, n <= 16 - for each pair and variant timed (key "kernel
    variant"), and for the best pair of each shape (key "best")."""
    df = pd.DataFrame(rows, columns=COLUMNS)
    df = df[df["kernel"].isin(PAIRS)].dropna(subset=["measured_us"])   # NaN: a failed timing
    out = {}

    def verdict(k):
        big, small = k[k["batch"] >= 16], k[(k["batch"] == 1) & (k["nodes"] <= 16)]
        r = dict(max_ratio_batch_ge16=float(big["ratio"].max()) if len(big) else None,
                 max_us_batch1_n_le16=float(small["measured_us"].max()) if len(small) else None)
        r["meets"] = bool(len(big) and len(small) and big["ratio"].max() <= 1.4
                          and small["measured_us"].max() <= 6.0)
        return r

    for (kernel, variant), k in df.groupby(["kernel", "variant"], sort=False):
        out[f"{kernel} {variant}"] = verdict(k)
    if len(df):
        best = df.loc[df.groupby(["batch", "nodes"])["measured_us"].idxmin()]
        out["best"] = dict(verdict(best), ways=sorted(set(best["kernel"] + " " + best["variant"])))
    return out


def run_checks(d: dict, device: str, chosen: tuple, shapes) -> list[dict]:
    """Every chosen variant checked at the CHECKS shapes it is timed at."""
    done = []
    for b, n in shapes:
        base = None
        for v, kernels in todo_at(chosen, b, n, d, device):
            try:
                base = base or check_base(b, n, d, device)
                done.append(check_shape(base, v, kernels))
            except Exception as exc:   # noqa: BLE001 - a failed check is a result, not the end
                done.append(dict(variant=v.name, batch=b, nodes=n, ok=False, error=" ".join(
                    f"{type(exc).__name__}: {exc}".split())[:300]))
            print(json.dumps(done[-1]), flush=True)
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="floor.csv to write (its .json sidecar beside it)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--nodes", default=",".join(map(str, NODES)))
    ap.add_argument("--variants", default="all", help="comma-separated (gdn_floor_variants.py)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--max-seconds", type=float, default=300.0,
                    help="no new shape starts after this (the CSV keeps the finished ones)")
    ap.add_argument("--tiny", action="store_true", help="tiny heads on the CPU (a smoke run)")
    args = ap.parse_args(argv)
    t0 = time.time()
    chosen = variants(args.variants)
    device = "cpu" if args.tiny else "cuda"
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("error: gdn_floor times the GDN kernels on a CUDA GPU; none is visible "
                         "(--tiny: a CPU smoke run)")
    d = dict(TINY) if args.tiny else {k: QWEN36[k] for k in ("H", "HV", "K", "V")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        bw = dict(copy_GBps=1.0, read_GBps=1.0, counting="nominal 1 GB/s (CPU smoke run)")
    else:
        from simtree.profiler.timing import measured_bandwidth
        bw = measured_bandwidth("cuda")
    env = env_info(d)
    info = dict(env=env, shapes=d, bandwidth=bw, floor_bandwidth="copy_GBps (measured)",
                path_rows=PATH_ROWS, accepted="each tree's deepest node",
                variants={v.name: dict(verify=v.verify, commit=v.commit, fold=v.fold,
                                       defer=v.defer) for v in chosen},
                checks=[], skipped=[], errors=[])
    side = out.with_suffix(".json")
    info["checks"] = run_checks(d, device, chosen, [(1, 4)] if args.tiny else CHECKS)
    rows: list[dict] = []
    # passes over the shapes: the rule's launches and the launch-free round first, then each
    # other variant in VARIANTS' order (most promising first), so a run cut by --max-seconds
    # loses the least promising variants' rows first
    first = tuple(v for v in chosen if v.name in FIRST_PASS)
    passes = [p for p in [first] + [(v,) for v in chosen if v not in first] if p]
    for part, b, n in ((p, b, n) for p in passes for b in map(int, args.batches.split(","))
                       for n in map(int, args.nodes.split(","))):
        todo = todo_at(part, b, n, d, device)
        if todo and time.time() - t0 > args.max_seconds:
            info["skipped"].append([b, n, [v.name for v, _ in todo]])
        elif todo:
            new = time_shape(b, n, d, device, bw["copy_GBps"] * 1e9, args.replays,
                             info["errors"], todo, env["gpu"])
            rows += new
            write_csv(out, rows)
            print(f"b{b} n{n}", " ".join(f"{r['kernel']}[{r['variant']}]={r['measured_us']:.1f}us/"
                                         f"{r['ratio']:.2f}x" for r in new), flush=True)
            info["summary"] = summary(rows)
            write_text_atomic(side, json.dumps(info, indent=1, default=str))
    info["summary"] = summary(rows)
    info["seconds"] = round(time.time() - t0, 1)
    write_text_atomic(side, json.dumps(info, indent=1, default=str))
    print(json.dumps(info["summary"]), flush=True)
    return 0 if all(c["ok"] for c in info["checks"]) and not info["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
