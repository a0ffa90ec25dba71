"""Byte-level tokenizer: UTF-8 bytes are tokens 0..255, then a few specials. No downloads.

Vocabulary (``VOCAB_SIZE`` = 260): 0..255 raw bytes, 256 BOS, 257 EOS, 258 PAD, 259 unused
(keeps the embedding a multiple of 4).  Decoding drops specials and replaces invalid UTF-8
(a greedy byte model can stop mid-character).
"""
from __future__ import annotations

from typing import Iterable

from simtree.errors import SimtreeError

__all__ = ["ByteTokenizer", "BOS", "EOS", "PAD", "VOCAB_SIZE"]

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 260


class ByteTokenizer:
    """``encode(text) -> list[int]`` and ``decode(ids) -> str`` over UTF-8 bytes."""

    vocab_size = VOCAB_SIZE
    bos_id, eos_id, pad_id = BOS, EOS, PAD

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise SimtreeError(f"tokenizer input must be text, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [BOS] + ids if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < VOCAB_SIZE:
                raise SimtreeError(f"token id {i} is outside the byte vocabulary [0, {VOCAB_SIZE})")
            if i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")
