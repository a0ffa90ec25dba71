"""A byte-level BPE tokenizer trained on the packaged training text (``tokenizers``).

    python -m simtree.runtime.bpe --out DIR [--vocab-size 2048] [--conversations 1500]

writes ``DIR/tokenizer.json`` (Hugging Face's format: ``tokenizers.Tokenizer.from_file`` and
``transformers.PreTrainedTokenizerFast(tokenizer_file=...)`` read it).  Training text: the
training split of :func:`simtree.runtime.data.training_docs` (even-indexed ShareGPT
conversations and HumanEval problems 0..131), the documents in their fixed order; the trainer is deterministic (the same
text and vocabulary size give byte-identical files: ``tests/test_target_model.py``).  Byte-level
pre-tokenisation with every byte in the initial alphabet: any text encodes, nothing is unknown.
Token 0 is ``<|endoftext|>``, the document separator and each prompt's first token (BOS).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable

from simtree.errors import SimtreeError, check_int
from simtree.fileio import write_text_atomic

__all__ = ["train_tokenizer", "BpeTokenizer", "ENDOFTEXT", "TOKENIZER_FILE"]

ENDOFTEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
VOCAB_RANGE = (260, 1 << 17)   # the 256 bytes, the special token and a few merges .. 131072


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens over ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    vocab_size = check_int(vocab_size, "--vocab-size", *VOCAB_RANGE)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[ENDOFTEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


class BpeTokenizer:
    """``encode(text) -> list[int]`` (BOS first) and ``decode(ids) -> str`` of a tokenizer.json."""

    def __init__(self, tokenizer):
        self.tokenizer = self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.bos_id = self.eos_id = tokenizer.token_to_id(ENDOFTEXT)
        if self.bos_id is None:
            raise SimtreeError(f"the tokenizer has no {ENDOFTEXT} token")

    @classmethod
    def from_file(cls, path) -> "BpeTokenizer":
        from tokenizers import Tokenizer
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:   # noqa: BLE001 - tokenizers raises its own exception types
            raise SimtreeError(f"{path}: not a readable tokenizer.json ({' '.join(str(exc).split())[:120]})") from None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise SimtreeError(f"tokenizer input must be text, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def to_json(self) -> str:
        return self._tok.to_str(pretty=True)


def write_tokenizer(tok, folder) -> Path:
    """``folder/tokenizer.json`` (atomic) and a ``tokenizer_config.json`` naming its specials."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / TOKENIZER_FILE
    write_text_atomic(path, tok.to_str(pretty=True) + "\n")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT,
           "unk_token": None, "add_prefix_space": False, "model_max_length": 4096}
    write_text_atomic(folder / "tokenizer_config.json", json.dumps(cfg, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    from simtree.runtime.data import training_docs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--conversations", type=int, default=2000, help="ShareGPT records x 2 read (even ones train)")
    args = ap.parse_args(argv)
    try:
        tok = train_tokenizer(training_docs(args.conversations)[0], args.vocab_size)
        path = write_tokenizer(tok, args.out)
    except SimtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}: {tok.get_vocab_size()} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
