"""Live acceptance of every drafter of the shipped trained target: MTP chain and trees, and the
trained block drafters (``block``, ``tfm``, ``dspark``), on held-out ShareGPT prompts.

    python -m simtree.runtime.drafter_acceptance --out out/drafter_acceptance --docs docs/drafters.md

Each policy of :data:`POLICIES` decodes the same prompts live on the full runtime (CPU, float32,
one batch; :func:`simtree.runtime.full.decode.decode_prompts`, what ``simtree run --model M
--prompt-ids ...`` runs), beside plain greedy decoding: its mean accepted tokens per round (the
bonus token included), the tokens it verified per round, and whether its output is plain
decoding's token for token.  ``--out`` keeps every run's ``run.json`` (and a block drafter's
``traces.jsonl``) under ``OUT/<policy>/`` and the table as ``OUT/acceptance.csv``; ``--docs``
rewrites the table between the markers in that file.

Prompts: :func:`simtree.runtime.data.prompts` ``sharegpt`` from index ``--start`` (default 900; a
prompt repeating an earlier one's text skipped): odd-indexed ShareGPT conversations, never read
by ``simtree train`` or ``simtree train-drafter`` (both train on the even-indexed ones), and
a range no other table of the project decodes.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from simtree.acceptance.traces import read_traces
from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic
from simtree.planning.simulate import PolicySpec
from simtree.reporting.summary import replace_block

from .bpe import BpeTokenizer
from .acceptance_oos_prompts import distinct_chat_prompts
from .full.build import build_model
from .full.decode import decode_prompts

__all__ = ["POLICIES", "measure", "table_markdown", "main"]

MODEL = "simtree/data/models/qwen3.5-tiny-sharegpt"
START, COUNT, NEW_TOKENS = 900, 32, 64
BEGIN, END = "<!-- live-acceptance:begin -->", "<!-- live-acceptance:end -->"
# (drafter, shape label, mode, params)
POLICIES = [
    ("MTP chain", "linear, 4 nodes", "linear", {"budget": 4}),
    ("MTP chain", "linear, 8 nodes", "linear", {"budget": 8}),
    ("MTP tree", "eagle 4 steps x top-2, 8 nodes", "eagle", {"num_steps": 4, "topk": 2, "budget": 8}),
    ("MTP tree", "eagle 6 steps x top-3, 16 nodes", "eagle", {"num_steps": 6, "topk": 3, "budget": 16}),
    ("MTP tree", "best-first, 8 nodes, depth 5", "best_first", {"budget": 8, "width": 1, "draft_depth": 5}),
    ("MTP tree", "best-first, 16 nodes, depth 7", "best_first", {"budget": 16, "width": 1, "draft_depth": 7}),
    ("block", "best-first from marginals, 4 nodes", "block", {"budget": 4}),
    ("block", "best-first from marginals, 8 nodes", "block", {"budget": 8}),
    ("block", "best-first from marginals, 16 nodes", "block", {"budget": 16}),
    ("tfm", "adapter best-first, 8 nodes, 1 a step", "tfm", {"budget": 8, "width": 1}),
    ("tfm", "adapter best-first, 16 nodes, 4 a step", "tfm", {"budget": 16, "width": 4}),
    ("dspark", "chain of 3 (block 3), all verified", "dspark", {"block_len": 3, "threshold": 0.0}),
    ("dspark", "chain of 7, all verified", "dspark", {"threshold": 0.0}),
    ("dspark", "chain of 7, survival >= 0.3 verified", "dspark", {"threshold": 0.3}),
    ("dspark", "chain of 7, survival >= 0.6 verified", "dspark", {"threshold": 0.6}),
]


def _verified(run_dir: Path, report: dict) -> float:
    """Mean draft nodes verified per round: DSpark's verified prefix from its traces, else the
    round's tree size less its root (static shapes)."""
    trace = run_dir / "traces.jsonl"
    if report["mode"] == "dspark" and trace.is_file():
        return float(np.mean([r.verified_len for r in read_traces(trace)]))
    p = report["params"]
    return float(p.get("budget", p.get("block_len", 7) + 1) - 1)


def measure(model_dir: str, out: Path, start: int = START, count: int = COUNT, new_tokens: int = NEW_TOKENS,
            say=print) -> list[dict]:
    torch.set_num_threads(1)
    model = build_model(model_dir, device="cpu", dtype=torch.float32)
    tok = BpeTokenizer.from_file(model_dir)
    ids = [tok.encode(p) for p in distinct_chat_prompts(start, count)[0]]
    plain = decode_prompts(model, ids, PolicySpec.from_dict("none", {}), new_tokens, out=out / "plain")["outputs"]
    rows = []
    for drafter, shape, mode, params in POLICIES:
        t0 = time.perf_counter()
        run_dir = out / f"{mode}_{'_'.join(f'{k}{v}' for k, v in params.items())}"
        rep = decode_prompts(model, ids, PolicySpec.from_dict(mode, params), new_tokens, out=run_dir)
        if rep["notes"]:
            raise SimtreeError(f"{drafter} {shape}: {rep['notes'][0]}")
        rows.append({"drafter": drafter, "shape": shape, "mode": mode, "params": json.dumps(params, sort_keys=True),
                     "accepted_per_round": round(rep["accepted_tokens_per_round"], 3),
                     "verified_drafts_per_round": round(_verified(run_dir, rep), 2), "rounds": rep["rounds"],
                     "lossless": rep["outputs"] == plain})
        say(f"{drafter:9s} {shape:40s} {rows[-1]['accepted_per_round']:.2f} tokens/round "
            f"({rows[-1]['verified_drafts_per_round']:.1f} drafts verified), lossless {rows[-1]['lossless']}, "
            f"{time.perf_counter() - t0:.0f}s")
    return rows


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "runtime", "simtree", "kernels"],
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def table_markdown(rows: list[dict], start: int, count: int, new_tokens: int, commit: str) -> str:
    lines = [f"Measured live by `python -m simtree.runtime.drafter_acceptance --docs docs/drafters.md` at commit "
             f"{commit}: {MODEL} on the CPU (float32, one batch), {count} held-out ShareGPT prompts "
             f"(`data.prompts` indices from {start}, repeats skipped; never trained on), {new_tokens} new tokens "
             "each.  Accepted tokens per round include the bonus token; drafts verified: the tree's nodes less "
             "its root (DSpark: the mean verified prefix).", "",
             "| drafter | shape | accepted tokens / round | drafts verified / round | lossless |", "|---|---|---|---|---|"]
    lines += [f"| {r['drafter']} | {r['shape']} | {r['accepted_per_round']:.2f} | {r['verified_drafts_per_round']:.1f} | "
              f"{'yes' if r['lossless'] else 'NO'} |" for r in rows]
    return "\n".join(lines) + "\n"


def write_docs(path: Path, block: str) -> None:
    """The table between ``path``'s BEGIN and END markers (one of each, in order; else one line)."""
    write_text_atomic(path, replace_block(path.read_text(), block, str(path), BEGIN, END))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--out", required=True, help="folder for every run's run.json / traces.jsonl and acceptance.csv")
    ap.add_argument("--docs", default=None, help="rewrite the table between the markers of this file")
    ap.add_argument("--start", type=int, default=START)
    ap.add_argument("--count", type=int, default=COUNT)
    ap.add_argument("--max-new-tokens", type=int, default=NEW_TOKENS)
    args = ap.parse_args(argv)
    try:
        out = Path(args.out)
        rows = measure(args.model, out, args.start, args.count, args.max_new_tokens)
        cols = list(rows[0])
        write_text_atomic(out / "acceptance.csv", "\n".join([",".join(cols), *[",".join(
            json.dumps(r[c]) if c == "params" else str(r[c]) for c in cols) for r in rows]]) + "\n")
        if args.docs:
            write_docs(Path(args.docs), table_markdown(rows, args.start, args.count, args.max_new_tokens, _commit()))
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
