"""End-to-end check of tree verify + commit against float64 sequential decoding.

Used by the tests (CPU) and by profiler/bench_v4.py (GPU, reduced size).  For B sequences
with random histories (decoded by the reference from empty), random trees and weights:

  * every node's output == the reference output of the last token of its root path;
  * verify never writes the cache (checksum before == after);
  * after committing one accepted root path per sequence, the cache == the reference state
    after sequentially decoding that path (window, entries, partial buffers, lengths).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from simtree.trees.tree import DraftTree, TreeBatch

from .cache import V4Cache
from .commit import apply_commit, commit
from .config import V4AttnConfig
from .device_plan import plan_commit_device, plan_verify_device, tree_tensors
from .reference import V4Inputs, decode_tokens, empty_state, random_inputs, random_layer_weights
from ._launched import tree_verify_fused
from .verify import plan_verify, random_tree, tree_verify

__all__ = ["check_against_reference", "check_flashmla_path"]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    a, b = a.double().cpu(), b.double().cpu()
    if torch.isnan(a).any() or torch.isnan(b).any():  # max(err, nan) would silently drop it
        return float("inf")
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    return float(torch.where(both_inf, 0.0, (a - b).abs()).max())


def check_against_reference(cfg: V4AttnConfig, kind: str, history: Sequence[int],
                            trees: Sequence[DraftTree] | None = None, nodes: int = 8,
                            accepted: Sequence[Sequence[int]] | None = None, seed: int = 0,
                            device="cpu", dtype=torch.float64, attention: str = "torch",
                            planner: str = "host", fusions: tuple = ()) -> dict:
    """Returns {"verify_err", "commit_err", "verify_wrote_cache", "rejected_identical"}.

    history[b]: tokens already decoded in sequence b; trees default to random ones of
    ``nodes`` nodes; accepted[b] defaults to the deepest root path of tree b.  planner "host":
    plan_verify + commit; "device": plan_verify_device (three padding node rows of random
    inputs, a max_nodes bound one above the largest tree) + plan_commit_device + apply_commit.
    """
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    w64 = random_layer_weights(cfg, kind, seed)
    states = []
    for L in history:
        st = empty_state(cfg, w64)
        decode_tokens(cfg, w64, st, random_inputs(cfg, L, gen))
        states.append(st)
    trees = list(trees) if trees is not None else [random_tree(nodes, rng) for _ in history]
    tb = TreeBatch(tuple(trees))
    inp64 = random_inputs(cfg, tb.total_nodes, gen)
    max_len = max(history) + max(t.num_nodes for t in trees) + 4
    w = w64.to(device, torch.float64 if dtype == torch.float64 else torch.float32)
    cache = V4Cache.from_states(cfg, w, [s.clone() for s in states], max_len, dtype=dtype,
                                state_dtype=w.sink.dtype, device=device, seed=seed)
    inp = inp64.to(device, dtype if attention == "torch" else (torch.float32 if dtype == torch.float64 else dtype))
    if planner == "device":
        max_nodes = tb.max_nodes + 1
        parents, cu = tree_tensors(tb, min(tb.batch_size * max_nodes, tb.total_nodes + 3), device)
        pad = random_inputs(cfg, parents.numel() - tb.total_nodes, gen).to(device, inp.q.dtype)
        rows = V4Inputs(*(torch.cat([getattr(inp, k), getattr(pad, k)]) for k in ("q", "kv", "x", "iq", "iw")))
        plan = plan_verify_device(cache, w, parents, cu, torch.as_tensor(cache.lens, device=device), max_nodes,
                                  validate=True)
    else:
        plan, rows = plan_verify(cache, tb, w, device=device), inp
    before = cache.checksum()
    out, scratch = tree_verify_fused(cache, w, rows, plan, fusions, attention=attention)
    wrote = cache.checksum() != before
    verify_err = 0.0
    for b, (tree, start) in enumerate(zip(trees, tb.cu_nodes[:-1])):
        for j in range(tree.num_nodes):
            path = torch.as_tensor(tree.path_to(j) + start)
            ref = decode_tokens(cfg, w64, states[b].clone(), inp64.select(path))[-1]
            verify_err = max(verify_err, _max_diff(ref, out[start + j]))
    if accepted is None:
        accepted = [t.path_to(int(t.leaves[np.argmax(t.depth[t.leaves])])).tolist() for t in trees]
    rejected = [b for b, a in enumerate(accepted) if len(a) == 0]
    kept = {b: cache.sequence_state(b).clone() for b in rejected}
    if planner == "device":
        last = torch.tensor([a[-1] if len(a) else -1 for a in accepted], dtype=torch.int64, device=device)
        cp = plan_commit_device(cache, w, plan, last, validate=True)
        apply_commit(cache, scratch, cp)
        cache.lens[:] = cp.new_lens.cpu().numpy()
    else:
        commit(cache, w, plan, scratch, accepted)
    commit_err = 0.0
    for b, acc in enumerate(accepted):
        st = states[b].clone()
        if len(acc):
            decode_tokens(cfg, w64, st, inp64.select(torch.as_tensor(np.asarray(acc) + tb.cu_nodes[b])))
        got = cache.sequence_state(b)
        if got.length != st.length:
            commit_err = float("inf")
        commit_err = max(commit_err, _max_diff(got.kv, st.kv[st.kv.shape[0] - got.kv.shape[0]:]))
        for name in ("comp", "idx", "comp_kv", "comp_score", "idx_kv", "idx_score"):
            if getattr(got, name) is not None:
                commit_err = max(commit_err, _max_diff(getattr(got, name), getattr(st, name)))
    identical = all(torch.equal(getattr(kept[b], n), getattr(cache.sequence_state(b), n))
                    for b in rejected for n in ("kv", "comp", "idx", "comp_kv", "comp_score", "idx_kv", "idx_score")
                    if getattr(kept[b], n) is not None)
    return {"verify_err": verify_err, "commit_err": commit_err, "verify_wrote_cache": wrote,
            "rejected_identical": identical}


def check_flashmla_path(device) -> dict:
    """GPU only: tree_verify(attention="flashmla") vs the Triton path at V4-Flash head shapes
    (FP8 core: relative error < 6%), before and after a commit (the FP8 mirrors must follow the
    pools).  Returns {"check", "ok", "rel_err"} or the error."""
    import traceback

    from .flashmla import flashmla_available
    from .steps import make_tree
    if device != "cuda" or not flashmla_available()[0]:
        return {"check": "tree_verify_flashmla", "ok": None, "skipped": "no CUDA or no flash_mla"}
    out = {"check": "tree_verify_flashmla"}
    try:
        cfg = V4AttnConfig.flash(window=128, topk=64, page_size=64)
        errs = []
        for kind in ("csa", "hca", "swa"):
            w = random_layer_weights(cfg, kind, 2, torch.float32, device)
            cache = V4Cache.random(cfg, w, 3, 700, 760, device=device, seed=2)
            cache.lens[:] = [300, 517, 700]
            rng = np.random.default_rng(2)
            tb = TreeBatch(tuple(make_tree(7, "random", rng) for _ in range(3)))
            inp = random_inputs(cfg, tb.total_nodes, torch.Generator(device=device).manual_seed(2), torch.float32, device)
            inp.q, inp.kv = inp.q.to(torch.bfloat16), inp.kv.to(torch.bfloat16)
            for rnd in range(2):
                plan = plan_verify(cache, tb, w, device=device)
                got, sc = tree_verify(cache, w, inp, plan, attention="flashmla")
                ref, _ = tree_verify(cache, w, inp, plan, attention="triton")
                errs.append(float((got.float() - ref.float()).norm() / ref.float().norm()))
                commit(cache, w, plan, sc, [t.path_to(int(t.leaves[0])).tolist() for t in tb.trees])
        out["rel_err"] = max(errs)
        out["ok"] = out["rel_err"] < 0.06
    except Exception as exc:  # noqa: BLE001
        out.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
        traceback.print_exc()
    return out
