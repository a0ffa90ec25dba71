"""The text state of every decoded position of an out-of-sample half, from its context alone
(:mod:`simtree.acceptance.text_state`): the calibration's text feature on the calibrating runs'
rounds and the drafting pass's positions.

The context of a position is the prompt and the tokens generated before it: every policy
decodes the same text (greedy decoding is lossless), which a linear run's records spell out -
the first round's root (the prefill's token) and then every round's target tokens - so a
half's kept traces give it back without decoding.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from simtree.acceptance.text_state import WINDOW, context_nonword_share, word_tokens
from simtree.errors import SimtreeError

__all__ = ["generated_tokens", "half_contexts", "text_features", "tokenizer_words"]


def tokenizer_words(tok) -> np.ndarray:
    """bool [vocab]: the word tokens of a :class:`~simtree.runtime.bpe.BpeTokenizer`."""
    return word_tokens(tok.decode, tok.vocab_size)


def generated_tokens(records) -> dict[int, list[int]]:
    """{seq: the generated tokens} of one linear run's records: the first round's root token,
    then each round's target tokens (the accepted drafts and the bonus)."""
    out: dict[int, list[int]] = {}
    for r in sorted(records, key=lambda r: (r.seq, r.round_index)):
        if r.seq not in out:
            out[r.seq] = [int(r.tree.tokens[0])]
        out[r.seq].extend(int(t) for t in r.target_tokens)
    return out


def half_contexts(prompt_ids: list[list[int]], records) -> dict[int, np.ndarray]:
    """{seq: prompt + generated tokens} of a half (``records``: one of its linear runs)."""
    gen = generated_tokens(records)
    if len(gen) != len(prompt_ids):
        raise SimtreeError(f"{len(prompt_ids)} prompts but a run of {len(gen)} sequences: not the half's prompts")
    return {s: np.array([*prompt_ids[s], *gen[s]], np.int64) for s in gen}


def text_features(half: dict, prompt_ids: list[list[int]], is_word: np.ndarray, linear_name: str, window: int = WINDOW):
    """(record -> feature, drafts with ``text``): the half's text feature at every calibrating
    round (by its seq and context length) and at every drafting-pass position: over the tokens
    in the cache and the round's root (the newest output, which the drafter drafts from).  The
    contexts are the linear run's tokens, which are the drafting pass's when both equal plain
    decoding (the half's ``lossless`` check; else one line)."""
    lossless = half.get("lossless", {})
    if not (lossless.get(linear_name) and lossless.get("drafting_pass")):
        raise SimtreeError(f"the text state reads {linear_name}'s tokens for the drafting pass's: both must equal "
                           f"plain decoding, the half's lossless check says {linear_name} {lossless.get(linear_name)}, "
                           f"drafting pass {lossless.get('drafting_pass')} (kept traces without lossless.json: "
                           "decode them again, or --earlier-model, which reads no text state)")
    ctx = half_contexts(prompt_ids, half["runs"][linear_name]["records"])
    share = {s: context_nonword_share(c, is_word, np.arange(c.size + 1), window) for s, c in ctx.items()}

    def at(seq: int, length: int) -> float:   # the cache's context_len tokens and the round's root
        v = share[int(seq)]
        return float(v[min(int(length) + 1, v.size - 1)])
    drafts = half["drafts"]
    text = np.array([at(s, c) for s, c in zip(drafts.seq, drafts.context_len)])
    return (lambda rec: at(rec.seq, rec.context_len)), replace(drafts, text=text)
