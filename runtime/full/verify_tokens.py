"""Does the V4 target's verify time depend on the drafted tokens?  The replay behind
``scripts/v4_verify_tokens_gpu.py`` (its docstring says why and what to expect):

    row = verify_tokens_row(model, costs, "block", {"budget": 8, "block_len": 7}, batch_size=8)

Per run shape, the engine runs ``rounds`` rounds (CUDA graphs where it can); each round's verify is
replayed alone (one CUDA graph of ``model.verify``, or eagerly, called with the engine's own verify
arguments, such as a block drafter's layer taps) on token sets of that round's tree shape
(:data:`TOKEN_SETS`), over the state that round's verify read: the target's state is kept before the
round and put back for the replays (after the round's commit the lengths have moved on and the
window ring holds the accepted rows, so a replay over it would verify other positions than the run
did).  Each replay's inputs are checked on the host first (tokens in the vocabulary, a tree per
sequence, positions inside the state's capacity): a bad one is one line, not a device-side assert.
Checks per replay: the argmax is of the tree's shape and the hidden states finite; ``drafted`` gives the
engine's own verify output node for node (``drafted_mismatch``: the nodes where it does not) and its
verify stage time within 3%.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from simtree.errors import SimtreeError
from simtree.planning.modes import PolicySpec

from .block_engine import make_engine
from .engine import release_memory
from .measure import AcceptanceSource

__all__ = ["SHAPES", "TOKEN_SETS", "COLUMNS", "token_sets", "check_replay", "verify_tokens_row"]

SHAPES = [("linear", {"budget": 4}), ("best_first", {"budget": 8, "draft_depth": 3, "width": 1}),
          ("block", {"budget": 8, "block_len": 7}), ("dspark", {"block_len": 7})]
TOKEN_SETS = ("drafted", "uniform", "per_sequence", "one_token")
COLUMNS = ["batch", "run", "nodes", "distinct_tokens_per_round", "tokens_per_round", "engine_verify_ms",
           *[f"{k}_ms" for k in TOKEN_SETS], "drafted_mismatch", "note"]
STAGE_TOLERANCE = 0.03      # the drafted replay's time off the engine's verify stage: said in the note


def _time_ms(fn, cuda: bool, reps: int) -> float:
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(out))


def _state_tensors(st) -> list[torch.Tensor]:
    """Every tensor the target's verify reads from a V4 state: the lengths and each layer's
    persistent cache (window, compressed pools, compressor buffers)."""
    return [st.lengths] + [t for cache in st.caches.values() for t in cache.persistent_tensors().values()]


def _snapshot(st) -> list[torch.Tensor]:
    return [t.clone() for t in _state_tensors(st)]


def _restore(st, saved: list[torch.Tensor]) -> None:
    """In place: a captured graph keeps reading the same tensors."""
    for t, s in zip(_state_tensors(st), saved):
        t.copy_(s)


def check_replay(tokens: torch.Tensor, parents: torch.Tensor, lengths: torch.Tensor, vocab: int,
                 max_len: int) -> None:
    """One line unless tokens [B, n] lie in [0, vocab), parents [B, n] make one tree per
    sequence (root -1 at node 0, every other node's parent an earlier node) and every node's
    position (its sequence's length + depth) is below ``max_len``: what the target's verify
    indexes with (embedding, hash-routing table, device plan, RoPE rows)."""
    tok, par, L = (t.detach().cpu().numpy() for t in (tokens, parents, lengths))
    if tok.shape != par.shape or tok.ndim != 2 or L.shape != (tok.shape[0],):
        raise SimtreeError(f"replay inputs of shapes tokens {list(tok.shape)}, parents {list(par.shape)}, "
                           f"lengths {list(L.shape)}: need [B, n], [B, n] and [B]")
    bad = np.flatnonzero((tok < 0) | (tok >= vocab))
    if bad.size:
        b, j = divmod(int(bad[0]), tok.shape[1])
        raise SimtreeError(f"replay token {int(tok[b, j])} at sequence {b} node {j} is outside the vocabulary "
                           f"[0, {vocab})")
    local = np.arange(tok.shape[1])[None, :]
    wrong = np.where(local == 0, par != -1, (par < 0) | (par >= local))
    if wrong.any():
        b, j = map(int, np.argwhere(wrong)[0])
        raise SimtreeError(f"replay tree of sequence {b}: node {j} has parent {int(par[b, j])} (the root needs -1, "
                           "others an earlier node)")
    depth = np.zeros(par.shape, np.int64)
    for j in range(1, par.shape[1]):        # parents come first: one pass in node order
        depth[:, j] = depth[np.arange(par.shape[0]), par[:, j]] + 1
    last = L + depth.max(1)
    if np.any(last >= max_len):
        b = int(np.argmax(last))
        raise SimtreeError(f"replay of sequence {b} reaches position {int(last[b])}, past the state's capacity of "
                           f"{max_len} tokens")


def _verify_replayer(model, st, tokens: torch.Tensor, parents: torch.Tensor, cuda: bool, verify_kw: dict):
    """(tokens buffer, replay(), out): the target's verify over a fixed tree, called as the
    engine calls it (``verify_kw``: the engine's), its argmax in ``out["next"]`` [B * n]; one
    CUDA graph where ``cuda`` (else eager: launches overlap the device's work, so a step of tens
    of ms times about as its graph does)."""
    buf = tokens.clone()
    par = parents.clone()
    out = {}

    def verify():
        hidden, _ = model.verify(st, buf, par, **verify_kw)
        out["next"] = model.greedy(hidden)
        out["hidden"] = hidden          # checked after the timed replays, outside them

    if not cuda:
        return buf, verify, out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        verify()                    # warm-up (Triton compiles, cached tables) before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify()
    return buf, graph.replay, out


def token_sets(tokens: torch.Tensor, vocab: int, gen: torch.Generator) -> dict:
    """{name: [B, n]} of :data:`TOKEN_SETS` for a round's tokens [B, n]."""
    B, n = tokens.shape
    return {"drafted": tokens,
            "uniform": torch.randint(0, vocab, (B, n), generator=gen, device=tokens.device),
            "per_sequence": tokens[:, :1].expand(B, n).contiguous(),
            "one_token": torch.full_like(tokens, int(tokens[0, 0]))}


def _replay_round(model, st, verify_kw: dict, tokens, parents, engine_next, gen, graphs: bool, reps: int,
                  times: dict, notes: list) -> int:
    """Every token set through the round's verify (state as the round read it, the engine's
    ``verify_kw``): times appended to ``times``, bad outputs to ``notes``; -> the nodes where
    ``drafted`` differs from the engine."""
    cuda = model.device.type == "cuda"
    sets = token_sets(tokens, model.vocab, gen)
    # the tree and positions are every set's; the other sets' tokens are the drafted ones or drawn in range
    check_replay(tokens, parents, st.lengths, model.vocab, st.max_len)
    buf, replay, out = _verify_replayer(model, st, tokens, parents, cuda and graphs, verify_kw)
    mismatch = 0
    for name, toks in sets.items():
        buf.copy_(toks)
        times[name].append(_time_ms(replay, cuda, reps))
        nxt = out["next"]
        if nxt.numel() != tokens.numel() or not bool(torch.isfinite(out["hidden"]).all()):
            notes.append(f"{name}: bad verify output (not finite, or not the tree's shape)")
        elif name == "drafted":
            mismatch = int((nxt.view_as(engine_next) != engine_next).sum())
    return mismatch


def verify_tokens_row(model, costs, mode: str, params: dict, batch_size: int, rounds: int = 6, context: int = 256,
                      seed: int = 0, graphs: bool = True, reps: int = 10) -> dict:
    """One row of the table (``COLUMNS``) for run shape (``mode``, ``params``) at ``batch_size``
    sequences (module docstring); ``graphs``: the replayed verify as one CUDA graph (else eager;
    the engine keeps its graphs); ``reps``: replays per token set and round (their median)."""
    cuda = model.device.type == "cuda"
    spec = PolicySpec.from_dict(mode, params)
    source = AcceptanceSource(None, "gsm8k", str(model.device), seed, "stratified")
    rs = source.round_shape(spec, batch_size, costs, context)
    src = source.make(rs, batch_size, rounds + 2, costs, context)
    max_len = context + (rounds + 6) * rs.path_rows + 8
    engine = make_engine(model, rs, batch_size, max_len, src, costs=costs)
    engine.capture()
    engine.fill_context(context, seed)
    engine.run(rounds=2)
    engine.rewind_source()      # the capture's and warm-up's rounds drew rows: the timed rounds start at row 0
    engine.begin()
    gen = torch.Generator(device=model.device).manual_seed(seed + 7)
    times = {k: [] for k in TOKEN_SETS}
    distinct, notes, mismatch = [], [], 0
    for _ in range(rounds):
        before = _snapshot(engine.st)
        engine.step()
        tokens, parents = engine.tree.tokens.clone(), engine.tree.parents.clone()
        engine_next = engine.last_target_next().clone()
        after = _snapshot(engine.st)
        _restore(engine.st, before)         # the state this round's verify read
        distinct.append(int(torch.unique(tokens).numel()))
        mismatch += _replay_round(model, engine.st, engine.verify_kw, tokens, parents, engine_next, gen, graphs, reps,
                                  times, notes)
        _restore(engine.st, after)
        del before, after
    stats = engine.stats(1.0)
    stage = float(np.mean(stats.verify_ms))
    row = {"batch": batch_size, "run": spec.name, "nodes": rs.nodes,
           "distinct_tokens_per_round": float(np.mean(distinct)), "tokens_per_round": batch_size * rs.nodes, "engine_verify_ms": stage,
           **{f"{k}_ms": float(np.mean(v)) for k, v in times.items()}, "drafted_mismatch": mismatch}
    if mismatch:
        notes.append(f"drafted replay's argmax differs from the engine's verify at {mismatch} of "
                     f"{rounds * batch_size * rs.nodes} nodes (replay is not the run's verify)")
    gap = row["drafted_ms"] / stage - 1
    if abs(gap) > STAGE_TOLERANCE:
        notes.append(f"drafted replay {100 * gap:+.1f}% off the engine's verify stage")
    row["note"] = "; ".join(dict.fromkeys(notes))
    del engine
    release_memory()
    return row
