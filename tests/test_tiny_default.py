"""The embedded tiny default is a Qwen3.5 checkpoint (qwen3_5_text, its MTP layer included) that
loads through simtree.checkpoints as a user's does; its committed command writes the same bytes;
test_runtime_engine.py decodes it with every policy the engine builds."""
import hashlib
import json

import pytest
import torch

from simtree.checkpoints import open_checkpoint
from simtree.data import data_path
from simtree.models import get_model
from simtree.runtime.full.build import build_model
from simtree.runtime.tokenizer import VOCAB_SIZE

torch.set_num_threads(1)
FOLDER = data_path("models") / "runtime-tiny"


def test_the_default_is_a_qwen3_5_text_checkpoint_with_its_mtp_layer():
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["vocab_size"] == VOCAB_SIZE      # the byte tokenizer's vocabulary
    shape = get_model("runtime-tiny")
    assert shape.family == "gdn_hybrid" and shape.layer_kinds == ("gdn", "gdn", "gdn", "attn")
    ckpt = open_checkpoint(FOLDER)
    assert ckpt is not None
    model = build_model("runtime-tiny", device="cpu")
    assert model.random_weights == [] and model.load_notes == []      # every weight from the file, MTP too
    assert model.dtype == torch.float32 and (FOLDER / "model.safetensors").stat().st_size < 3_000_000


def test_the_committed_command_writes_the_same_bytes(tmp_path):
    pytest.importorskip("transformers")
    from simtree.runtime.full.tiny import write_tiny_checkpoint
    write_tiny_checkpoint(tmp_path)
    for name in ("config.json", "model.safetensors"):
        digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / name, FOLDER / name)]
        assert digest[0] == digest[1], name


def test_the_byte_tokenizer_round_trips_text():
    from simtree.errors import SimtreeError
    from simtree.runtime.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and max(ids[1:]) < 256
    assert tok.decode(ids) == text
    with pytest.raises(SimtreeError):
        tok.decode([999])
