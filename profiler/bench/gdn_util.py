"""Helpers shared by the GDN benchmarks (bench_gdn, tune_gdn, scripts/gdn_*.py).

eagle_like_tree (random EAGLE-like trees), random_gdn_inputs (random verify inputs),
graph_time_us (CUDA-graph timer over rotated input copies), memory_floor_bytes,
env_info, fla_closure (flash-linear-attention on a chain).
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch

from simtree.models import get_model
from simtree.trees.tree import DraftTree, TreeBatch


def model_dims(name: str) -> dict:
    """The GDN layer shapes of a model (a shipped name or a model YAML) as the benchmarks take
    them: dict(H, HV, K, V) (``ModelShape.gdn_dims``)."""
    return get_model(name).gdn_dims()


QWEN36 = model_dims("qwen3.6-27b")   # the benchmarks' default: H=16, HV=48, K=V=128


def eagle_like_tree(n: int, rng: np.random.Generator, topk: int = 4,
                    num_steps: int | None = None) -> tuple[DraftTree, int, int]:
    """EAGLE-like tree of n nodes: s steps of top-k expansion, pruned to the n best by score.

    Returns (tree, num_steps, topk).  Each step expands the top-k frontier nodes by cumulative
    draft log-prob; children's log-probs are sorted Dirichlet samples (peaked, like a drafter).
    """
    if n == 1:
        return DraftTree([-1]), 0, 0
    steps = num_steps or max(1, min(n - 1, round(2 * math.log2(n))))
    parents, score, frontier = [-1], [0.0], [0]
    for _ in range(steps):
        new = []
        for p in sorted(frontier, key=lambda i: -score[i])[:topk]:
            probs = np.sort(rng.dirichlet(np.full(topk + 1, 0.3)))[::-1][:topk]
            for pr in probs:
                parents.append(p)
                score.append(score[p] + float(np.log(max(pr, 1e-9))))
                new.append(len(parents) - 1)
        frontier = new
    while len(parents) < n:               # too few candidates: extend the best node by a chain
        parents.append(len(parents) - 1)
        score.append(score[-1] - 1.0)
    # the n best by score are ancestor-closed (a child scores below its parent); ties by index
    keep = sorted(sorted(range(1, len(parents)), key=lambda i: (-score[i], i))[:n - 1])
    remap = {0: 0, **{old: new + 1 for new, old in enumerate(keep)}}
    par = [-1] + [remap[parents[i]] for i in keep]
    return DraftTree(par, log_probs=[0.0] + [score[i] - score[parents[i]] for i in keep]), steps, topk


def random_gdn_inputs(trees, H=16, HV=48, K=128, V=128, dtype=torch.bfloat16, device="cuda",
                      seed=0) -> dict:
    """Random GDN verify inputs for a list of DraftTrees (never zeros), generated on ``device``.

    Returns dict q, k [N, H, K]; v [N, HV, V] (dtype); g (log-decay, mostly in [-0.3, 0]) and
    beta [N, HV] fp32; state [B, HV, K, V] fp32; parents, cu_nodes int64; tb (TreeBatch).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    tb = TreeBatch(trees)
    md = tb.to_torch(device)
    N, B = tb.total_nodes, tb.batch_size

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    return dict(q=rnd(N, H, K).to(dtype), k=rnd(N, H, K).to(dtype), v=rnd(N, HV, V).to(dtype),
                g=torch.nn.functional.logsigmoid(rnd(N, HV) + 3.0).float(),
                beta=torch.sigmoid(rnd(N, HV)).float(), state=rnd(B, HV, K, V, scale=0.05).float(),
                parents=md["parents"], cu_nodes=md["cu_nodes"], tb=tb)


TREE_ORDERS = ("stored", "dfs")


def shape_trees(b: int, n: int, seed: int, order: str = "stored") -> tuple[list[DraftTree], int, int]:
    """The b EAGLE-like trees of n nodes used for shape (b, n): same seed, same trees.
    order "stored": as built (breadth-first, as EAGLE expands them); "dfs": the same trees
    renumbered depth-first, larger subtree first (``DraftTree.depth_first``)."""
    if order not in TREE_ORDERS:
        raise ValueError(f"unknown tree order {order!r} (one of {', '.join(TREE_ORDERS)})")
    rng = np.random.default_rng(seed + 7919 * b + n)
    made = [eagle_like_tree(n, rng) for _ in range(b)]
    trees = [t for t, _, _ in made]
    if order == "dfs":
        trees = [t.depth_first() for t in trees]
    return trees, made[0][1], made[0][2]


def probe_inputs(b: int, n: int, shapes: dict = QWEN36, device="cuda") -> dict:
    """One bf16 input set on the benchmark's depth-first trees of shape (b, n), seed fixed:
    what the single-call probes (``scripts/gdn_kernel_times.py``, ``scripts/ncu_gdn_verify.py``)
    run the verify on."""
    trees, _, _ = shape_trees(b, n, 1, "dfs")
    return random_gdn_inputs(trees, **shapes, dtype=torch.bfloat16, device=device, seed=b * n)


def shape_inputs(b: int, n: int, seed: int, shapes: dict, dtype=torch.bfloat16, device="cuda",
                 l2_bytes: int = 256 << 20, max_copies: int = 32,
                 order: str = "stored", trees=None, min_copies: int = 1) -> list[dict]:
    """Input copies for shape (b, n), enough that one graph replay streams > l2_bytes, and at
    least ``min_copies`` (a two-round check needs two however large one copy is);
    ``trees``: the shape's trees when the caller built them already (``shape_trees``)."""
    if trees is None:
        trees, _, _ = shape_trees(b, n, seed, order)
    per_copy = memory_floor_bytes(b, b * n, **shapes)
    copies = max(1, min_copies, min(max_copies, -(-l2_bytes // per_copy)))
    return [random_gdn_inputs(trees, **shapes, dtype=dtype, device=device,
                              seed=seed + 1000 * b + n + 100003 * c) for c in range(copies)]


def graph_time_us(fns, warmup: int = 3, replays: int = 20, spin_ms: float = 30.0) -> dict:
    """Median/p10/p90 microseconds per call of a list of closures (one per rotated input
    copy): the profiler's CUDA-graph timer (CPU wall clock without CUDA), as a dict; on a
    GPU the step is replayed for ``spin_ms`` first (clocks back up after compiling: a resumed
    benchmark's first shape came out 7% slow without it, reports/h200/gdn/tuning/run72)."""
    from simtree.profiler.timing import time_workload

    device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = {"spin_ms": spin_ms} if device == "cuda" else {}
    stats = time_workload(list(fns), device, warmup=warmup, min_reps=replays, max_reps=replays,
                          **extra)
    return dict(median=stats.median_us, p10=stats.p10_us, p90=stats.p90_us, repeats=stats.repeats,
                timer={"cuda_graph": "cuda_graph", "cuda_events": "eager", "cpu": "cpu_wall"}[stats.mode])


def memory_floor_bytes(B: int, N: int, H=16, HV=48, K=128, V=128, elem=2) -> int:
    """Bytes a tree verify must move: fp32 state read once + q, k, v read and o written once
    + g, beta read (read and written bytes both counted, like ``profiler.timing.measured_bandwidth``)."""
    return B * HV * K * V * 4 + N * (2 * H * K + 2 * HV * V) * elem + N * HV * 2 * 4


def env_info(shapes: dict = QWEN36) -> dict:
    """GPU, versions and shapes for a GDN benchmark's JSON (from the profiler's one collector)."""
    from simtree.machine.metadata import collect_metadata
    m = collect_metadata("cuda" if torch.cuda.is_available() else "cpu")
    return dict(gpu=m["device"], torch=m["torch_version"], triton=m["triton_version"],
                cuda=m["torch_cuda"] or None, fla=m["fla_version"] or "unavailable",
                driver=m.get("driver", ""), shapes=shapes, timestamp=m["collected"])


# ------------------------------------------------------------------------------ fla wrappers
def fla_closure(kind: str, inp: dict, n: int):
    """A closure running fla on a chain of n tokens per sequence (same tensors as the tree)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    B = inp["cu_nodes"].numel() - 1
    q, k, v = (inp[x].view(B, n, *inp[x].shape[1:]) for x in ("q", "k", "v"))
    g, beta = inp["g"].view(B, n, -1), inp["beta"].view(B, n, -1)
    if inp.get("fla_repeat_heads"):   # fla build without grouped value heads
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    op = chunk_gated_delta_rule if kind == "fla_chunk" else fused_recurrent_gated_delta_rule
    return lambda: op(q, k, v, g=g, beta=beta, initial_state=inp["state"], output_final_state=False,
                      use_qk_l2norm_in_kernel=True)


def fla_recurrent_worker(shapes: list, seed: int, out_path: str, shape_dims: dict,
                         max_copies: int = 32) -> None:
    """Child process: time fla_recurrent per shape, one JSON line each (crash-safe)."""
    for b, n in shapes:
        with open(out_path, "a") as f:
            f.write(json.dumps(dict(b=b, n=n, status="started")) + "\n")
        copies = shape_inputs(b, n, seed, shape_dims, max_copies=max_copies)
        note = ""
        try:
            r = graph_time_us([fla_closure("fla_recurrent", c, n) for c in copies])
        except Exception:  # noqa: BLE001 - retry with q/k repeated to the value heads
            for c in copies:
                c["fla_repeat_heads"] = True
            note = "q/k repeated to HV heads"
            try:
                r = graph_time_us([fla_closure("fla_recurrent", c, n) for c in copies])
            except Exception as exc:  # noqa: BLE001
                r = dict(error=repr(exc)[:300])
        rec = dict(b=b, n=n, status="ok" if "median" in r else "error", note=note,
                   copies=len(copies), **r)
        with open(out_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        del copies
        torch.cuda.empty_cache()
