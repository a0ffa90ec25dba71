"""Live decoding of text prompts on a Hugging Face checkpoint with the full runtime, traced.

    python -m simtree.runtime.target_trace --model DIR --workload humaneval --prompts 32 --out DIR

writes DIR/<workload>_drafts_p15.jsonl (the drafter's confidences, no outcome) and, with
``--calibrate``, DIR/<workload>_linear_d16.jsonl (the linear run whose outcomes calibrate the
drafter): ``simtree plan --workload DIR/humaneval_drafts_p15.jsonl@DIR/sharegpt_linear_d16.jsonl``.

    runs = trace_policies("simtree/data/models/qwen3.5-tiny-sharegpt", ["Hello", ...], policies,
                          max_new_tokens=64, workload="sharegpt", out="traces/")
    runs["linear_d16"]["records"], runs["linear_d16"]["outputs"]

Each policy runs the prompts as one static batch through :class:`simtree.runtime.full.FullEngine`
(live acceptance: greedy, lossless) and leaves one acceptance trace (``simtree.trace/2``,
docs/acceptance.md) per round per sequence: the drafted tree (tokens, parents, draft log-probs,
sibling ranks), the accepted path and the target's greedy tokens along it; linear runs also
carry the MTP layer's top-``TOPK`` at every drafted position of the chain (``topk_tokens`` /
``topk_probs``: the depth x rank x confidence fields the confidence fit reads).  Only the
rounds that begin while their sequence is short of ``max_new_tokens`` are kept (the static batch
decodes on until the slowest sequence is done; the kept rounds decode the same text under every
policy).

The engine is observed, not changed: the acceptance source is :class:`Live` wrapped to copy each
round's tree and target tokens, and the model is wrapped to copy the MTP layer's
probabilities (``draft_logits``) and the context length at each verify.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from simtree.acceptance.traces import read_traces
from simtree.acceptance.transfer import DRAFTS_SCHEMA, context_match
from simtree.fileio import write_text_atomic
from simtree.planning.simulate import PolicySpec

from .full.acceptance import Live
from .full.drafting import round_shape
from .full.engine import FullEngine

__all__ = ["trace_policies", "draft_confidences", "policy_name", "TOPK", "TRACE_SCHEMA"]

TRACE_SCHEMA = "simtree.trace/2"
TOPK = 8    # drafter candidates logged per drafted chain position


def policy_name(mode: str, params: dict) -> str:
    p = params
    if mode == "eagle":
        return f"eagle_s{p['num_steps']}_k{p['topk']}_d{p['budget']}"
    if mode == "best_first":
        return f"best_first_d{p['budget']}_p{p['draft_depth']}"
    if mode == "linear":
        return f"linear_d{p['budget']}"
    if mode == "cost_aware":
        return f"cost_aware_max{p['max_budget']}_p{p['draft_depth']}"
    if mode == "batch_alloc":
        return f"batch_alloc_max{p['max_budget_per_seq']}_p{p['draft_depth']}"
    return mode


def _np(t: torch.Tensor) -> np.ndarray:
    """A copy on the host (the engine reuses its buffers every round; a CPU tensor's numpy() is a view)."""
    return t.detach().cpu().numpy().copy()


class _Observed:
    """The model, with its ``draft_logits`` and ``verify`` calls observed (everything else passes)."""

    def __init__(self, model, topk: int):
        self._model, self._k = model, topk
        self.first = None       # top-K of the latest one-row-per-sequence draft call (a round's first position)
        self.steps = []         # top-K of this round's chain steps
        self.context = None

    def __getattr__(self, name):
        return getattr(self._model, name)

    def draft_logits(self, hidden):
        logits = self._model.draft_logits(hidden)
        probs = torch.softmax(logits.float(), -1)
        p, i = probs.topk(min(self._k, probs.shape[-1]), -1)
        if hidden.dim() == 2:
            self.first = (_np(i), _np(p))
        else:   # [B, frontier, K]: the chain's (frontier 1) next position
            self.steps.append((_np(i[:, 0]), _np(p[:, 0])))
        return logits

    def verify(self, st, tokens, parents):
        self.context = _np(st.lengths)
        return self._model.verify(st, tokens, parents)


class _Recorder(Live):
    """Live acceptance that keeps each round's trees, target tokens and accepted nodes."""

    def __init__(self, probe: _Observed, chain_topk: bool):
        self.probe, self.chain_topk, self.rounds = probe, chain_topk, []

    def accept(self, tree, target_next, rs):
        acc = super().accept(tree, target_next, rs)
        topk = None
        if self.chain_topk and self.probe.first is not None:
            pos = [self.probe.first, *self.probe.steps]
            topk = (np.stack([t for t, _ in pos], 1), np.stack([p for _, p in pos], 1))   # [B, P, K]
        self.probe.steps = []
        self.rounds.append({"tokens": _np(tree.tokens), "parents": _np(tree.parents), "score": _np(tree.score.float()),
                            "rank": _np(tree.rank), "valid": _np(tree.valid), "target": _np(target_next),
                            "accepted": _np(acc), "context": self.probe.context, "topk": topk})
        return acc


def _add_context_match(recs: list[dict], prompt_ids: list[list[int]], outputs: list[list[int]]) -> None:
    """Each record with the drafter's chain top-K gets ``context_match``: the rank of the context
    lookup's token at each chain position (:func:`simtree.acceptance.transfer.context_match`),
    the context being the prompt and the tokens generated before the round."""
    made = {}
    for rec in recs:   # a sequence's records in round order
        b = rec["seq"]
        start = made.get(b, 1)     # the prefill made the first token
        if "topk_tokens" in rec:
            rec["context_match"] = context_match([*prompt_ids[b], *outputs[b][:start]],
                                                 np.asarray(rec["topk_tokens"])).tolist()
        made[b] = start + rec["num_accepted"] + 1


class _DraftsOnly(Live):
    """Accepts no draft: every round gains exactly the target's greedy token, so the drafter
    drafts its chain from every position of the greedy text in turn.  Keeps the drafter's top-K
    probabilities of each chain and nothing of the target's verdict on them."""

    def __init__(self, probe: _Observed):
        self.probe, self.rounds = probe, []

    def accept(self, tree, target_next, rs):
        pos = [self.probe.first, *self.probe.steps]
        self.probe.steps = []
        self.rounds.append({"probs": np.stack([p for _, p in pos], 1), "ids": np.stack([t for t, _ in pos], 1),
                            "context": self.probe.context})   # [B, P, K]
        return torch.zeros(tree.tokens.shape[0], dtype=torch.int64, device=tree.tokens.device)


def _records(rounds: list[dict], mode: str, workload: str, batch_size: int, max_new_tokens: int) -> list[dict]:
    """Trace records (format v2) of the kept rounds (module docstring)."""
    made = np.ones(batch_size, np.int64)    # the prefill made each sequence's first token
    out = []
    for r, rd in enumerate(rounds):
        for b in range(batch_size):
            keep = np.flatnonzero(rd["valid"][b])       # valid nodes: closed under parents, root first
            local = {int(j): i for i, j in enumerate(keep)}
            par = [-1] + [local[int(rd["parents"][b, j])] for j in keep[1:]]
            score = rd["score"][b, keep]
            lp = [0.0] + [round(float(score[i] - (score[par[i]] if par[i] > 0 else 0.0)), 6) for i in range(1, len(keep))]
            acc = local[int(rd["accepted"][b])]
            path = [acc]
            while par[path[-1]] >= 0:
                path.append(par[path[-1]])
            path = path[::-1]
            rec = {"schema": TRACE_SCHEMA, "workload": workload, "batch_size": batch_size, "round": r, "seq": b,
                   "mode": mode, "context_len": int(rd["context"][b]), "parents": par,
                   "tokens": rd["tokens"][b, keep].tolist(), "log_probs": lp,
                   "ranks": rd["rank"][b, keep].tolist(), "accepted_path": path, "accepted_node": acc,
                   "num_accepted": len(path) - 1, "target_tokens": rd["target"][b, keep[path]].tolist(),
                   "drafter": "mtp"}
            if rd["topk"] is not None:
                rec["topk_tokens"] = rd["topk"][0][b].tolist()
                rec["topk_probs"] = [[round(float(x), 6) for x in row] for row in rd["topk"][1][b]]
            if made[b] < max_new_tokens:
                out.append(rec)
            made[b] += len(path)
    return out


@torch.no_grad()
def trace_policies(model, prompt_ids: list[list[int]], policies: list[tuple[str, dict]], max_new_tokens: int,
                   workload: str, out=None, say=None, costs=None) -> dict:
    """{policy name: {"records": [TraceRecord], "outputs": [[int]], "path": trace file or None,
    "context_len": mean context over the kept rounds}} for each (mode, params); ``model``: a
    built full-runtime model (``build_model``); ``costs``: the bundle cost_aware and batch_alloc
    decide their budgets with."""
    runs = {}
    for mode, params in policies:
        spec = PolicySpec.from_dict(mode, dict(params))
        rs = round_shape(spec)
        probe = _Observed(model, TOPK)
        source = _Recorder(probe, chain_topk=(mode == "linear"))
        # the static batch decodes until its slowest sequence has max_new_tokens: a faster one
        # gains up to path_rows tokens in each of those (at most max_new_tokens) rounds
        max_len = max(map(len, prompt_ids)) + max_new_tokens * max(rs.path_rows, 1) + rs.budget + 2
        engine = FullEngine(probe, rs, len(prompt_ids), max_len, source=source, graphs=False, costs=costs)
        engine.prefill(prompt_ids)
        engine.run(max_new_tokens=max_new_tokens)
        name = policy_name(mode, params)
        recs = _records(source.rounds, mode, workload, len(prompt_ids), max_new_tokens)
        _add_context_match(recs, prompt_ids, engine.outputs())
        text = "".join(json.dumps(r) + "\n" for r in recs)
        path = None
        if out is not None:
            path = write_text_atomic(Path(out) / f"{workload}_{name}.jsonl", text)
        else:
            import tempfile
            with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as fh:
                fh.write(text)
            path = Path(fh.name)
        # the reader's checks: every record is a valid trace (plain decoding drafts nothing: none)
        records = read_traces(path, workload) if recs else []
        if out is None:
            path.unlink()
            path = None
        runs[name] = {"mode": mode, "params": dict(params), "records": records, "path": path,
                      "context_len": float(np.mean([r.context_len for r in records])) if records else 0.0,
                      "outputs": [o[:max_new_tokens] for o in engine.outputs()]}
        if say is not None:
            acc = np.mean([r.num_accepted + 1 for r in records]) if records else float("nan")
            say(f"{workload} {name}: {len(records)} rounds x sequences, {acc:.3f} tokens per round")
    return runs


@torch.no_grad()
def draft_confidences(model, prompt_ids: list[list[int]], depth: int, max_new_tokens: int, workload: str,
                      out=None) -> dict:
    """The drafter's confidences on a workload, without any acceptance outcome:
    {"records": [dict] (``simtree.drafts/1``, :mod:`simtree.acceptance.transfer`), "outputs",
    "path"}.  The prompts decode as plain greedy (one token per round: no draft is ever
    accepted), and at each generated position the MTP layer drafts a greedy chain of ``depth``
    positions; a record keeps that chain's top-``TOPK`` probabilities per position, the
    sequence, the position and the context length: only what the drafter computed.  Positions
    up to ``max_new_tokens`` - 1 (those a traced round can begin at)."""
    spec = PolicySpec.from_dict("linear", {"budget": depth + 1})
    rs = round_shape(spec)
    probe = _Observed(model, TOPK)
    source = _DraftsOnly(probe)
    max_len = max(map(len, prompt_ids)) + max_new_tokens + rs.budget + 2
    engine = FullEngine(probe, rs, len(prompt_ids), max_len, source=source, graphs=False)
    engine.prefill(prompt_ids)
    engine.run(max_new_tokens=max_new_tokens)
    recs, outputs = [], engine.outputs()
    for r, rd in enumerate(source.rounds[:max_new_tokens - 1]):
        for b in range(len(prompt_ids)):
            recs.append({"schema": DRAFTS_SCHEMA, "workload": workload, "seq": b, "position": r,
                         "context_len": int(rd["context"][b]), "drafter": "mtp",
                         "topk_probs": (np.floor(rd["probs"][b].astype(np.float64) * 1e6) / 1e6).tolist(),
                         "context_match": context_match([*prompt_ids[b], *outputs[b][:r + 1]], rd["ids"][b]).tolist()})
    path = None
    if out is not None:
        path = write_text_atomic(Path(out) / f"{workload}_drafts_p{depth}.jsonl",
                                 "".join(json.dumps(r) + "\n" for r in recs))
    return {"records": recs, "outputs": [o[:max_new_tokens] for o in engine.outputs()], "path": path}


def main(argv=None) -> int:
    import argparse
    import sys

    from simtree.errors import SimtreeError
    ap = argparse.ArgumentParser(description="The drafter's confidences on a workload's prompts (simtree.drafts/1), "
                                             "and the linear run that calibrates them")
    ap.add_argument("--model", required=True, help="qwen3_5_text folder with its tokenizer.json (its MTP layer drafts)")
    ap.add_argument("--workload", default="sharegpt", choices=("sharegpt", "humaneval"))
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts of the workload")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=15, help="chain positions drafted from each position")
    ap.add_argument("--calibrate", action="store_true", help="also trace the linear run of budget depth + 1")
    ap.add_argument("--out", required=True, help="folder for the files")
    args = ap.parse_args(argv)
    try:
        from .bpe import BpeTokenizer
        from .data import prompts
        from .full.build import build_model
        if not 1 <= args.prompts <= 4096 or not 2 <= args.max_new_tokens <= 4096 or not 1 <= args.depth <= 64:
            raise SimtreeError("--prompts in 1..4096, --max-new-tokens in 2..4096 and --depth in 1..64")
        torch.set_num_threads(1)
        model = build_model(args.model, device="cpu", dtype=torch.float32)
        tok = BpeTokenizer.from_file(Path(args.model))
        ids = [tok.encode(p) for p in prompts(args.workload, args.prompts)]
        done = draft_confidences(model, ids, args.depth, args.max_new_tokens, args.workload, out=args.out)
        print(f"wrote {done['path']}: {len(done['records'])} positions")
        if args.calibrate:
            runs = trace_policies(model, ids, [("linear", {"budget": args.depth + 1})], args.max_new_tokens,
                                  args.workload, out=args.out)
            print(f"wrote {next(iter(runs.values()))['path']}")
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
