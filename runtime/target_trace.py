"""Live decoding of text prompts on a Hugging Face checkpoint with the full runtime, traced.

    python -m simtree.runtime.target_trace --model DIR --workload humaneval --prompts 32 --out DIR

writes DIR/<workload>_drafts_p15.jsonl (the drafter's confidences, no outcome) and, with
``--calibrate``, DIR/<workload>_linear_d16.jsonl (the linear run whose outcomes calibrate the
drafter): ``simtree plan --workload DIR/humaneval_drafts_p15.jsonl@DIR/sharegpt_linear_d16.jsonl``.

    runs = trace_policies("simtree/data/models/qwen3.5-tiny-sharegpt", ["Hello", ...], policies,
                          max_new_tokens=64, workload="sharegpt", out="traces/")
    runs["linear_d16"]["records"], runs["linear_d16"]["outputs"]

Each policy runs the prompts as one static batch through the full runtime's traced decoding
(:func:`simtree.runtime.full.generate.generate` with a trace: live acceptance, greedy, lossless;
:mod:`simtree.runtime.full.round_trace` makes the records) and leaves one acceptance trace (``simtree.trace/2``,
docs/acceptance.md) per round per sequence: the drafted tree (tokens, parents, draft log-probs,
sibling ranks), the accepted path and the target's greedy tokens along it; linear runs also
carry the MTP layer's top-``TOPK`` at every drafted position of the chain (``topk_tokens`` /
``topk_probs``: the depth x rank x confidence fields the confidence fit reads).  Only the
rounds that begin while their sequence is short of ``max_new_tokens`` are kept (the static batch
decodes on until the slowest sequence is done; the kept rounds decode the same text under every
policy).

The drafting pass (:func:`draft_confidences`) runs linear rounds that accept no draft, on an
engine that keeps the chain's top-K (``trace_topk``), and reads them once a round
(``FullEngine.last_round``).
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
from .full.generate import TRACE_TOPK, generate, state_rows
from .full.round_trace import RecordList
from .trace import TRACE_SCHEMA

__all__ = ["trace_policies", "draft_confidences", "policy_name", "TOPK", "TRACE_SCHEMA"]

TOPK = TRACE_TOPK    # drafter candidates logged per drafted chain position


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


class _NoneAccepted(Live):
    """Accepts no draft: every round gains exactly the target's greedy token, so the drafter
    drafts its chain from every position of the greedy text in turn."""

    def accept(self, tree, target_next, rs):
        return torch.zeros(tree.tokens.shape[0], dtype=torch.int64, device=tree.tokens.device)


def _kept(records: list[dict], mode: str, batch_size: int, max_new_tokens: int) -> list[dict]:
    """The records (round order) of the rounds that begin while their sequence is short of
    ``max_new_tokens`` (module docstring); the drafter's top-K kept in linear runs' alone."""
    made = np.ones(batch_size, np.int64)    # the prefill made each sequence's first token
    out = []
    for rec in records:
        b = rec["seq"]
        if made[b] < max_new_tokens:
            if mode != "linear":
                rec.pop("topk_tokens", None)
                rec.pop("topk_probs", None)
            out.append(rec)
        made[b] += rec["num_accepted"] + 1
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
        traced = RecordList() if spec.mode != "none" else None     # plain decoding drafts nothing: no records
        res = generate(model, prompt_ids, max_new_tokens, spec, costs=costs, workload=workload, trace=traced)
        name = policy_name(mode, params)
        recs = _kept(traced or [], mode, len(prompt_ids), max_new_tokens)
        _add_context_match(recs, prompt_ids, res.outputs)
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
                      "outputs": res.outputs}
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
    rs = round_shape(PolicySpec.from_dict("linear", {"budget": depth + 1}))
    engine = FullEngine(model, rs, len(prompt_ids), state_rows(prompt_ids, rs, max_new_tokens),
                        source=_NoneAccepted(), graphs=False, trace_topk=min(TOPK, model.vocab))
    engine.prefill(prompt_ids)
    engine.begin()
    rounds, prompt_lens = [], np.array([len(p) for p in prompt_ids], np.int64)
    for r in range(max_new_tokens - 1):    # one token a round: the rounds that begin short of max_new_tokens
        engine.step()
        lp, ids = engine.last_round()["marginals"]      # [B, P, K]
        # the round's context: the prompt and every output but the newest (r + 1 outputs: no draft is accepted)
        rounds.append((prompt_lens + r, np.exp(lp.astype(np.float64)), ids))
    recs, outputs = [], engine.outputs()
    for r, (context, probs, ids) in enumerate(rounds):
        for b in range(len(prompt_ids)):
            recs.append({"schema": DRAFTS_SCHEMA, "workload": workload, "seq": b, "position": r,
                         "context_len": int(context[b]), "drafter": "mtp",
                         "topk_probs": (np.floor(probs[b] * 1e6) / 1e6).tolist(),
                         "context_match": context_match([*prompt_ids[b], *outputs[b][:r + 1]], ids[b]).tolist()})
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
