"""HF-style checkpoints (config.json + safetensors): round trip and one-line errors."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime_helpers import random_prompts, tiny_model
from simtree.errors import SimtreeError
from simtree.runtime.loading import load_config, load_model, save_model
from simtree.runtime.model import HybridLM, ModelConfig
from simtree.runtime.tokenizer import ByteTokenizer


@pytest.fixture()
def checkpoint(tmp_path):
    model = tiny_model(20)
    save_model(model, tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def test_round_trip_gives_identical_logits(checkpoint):
    model, path = checkpoint
    loaded = load_model(path, torch.float64)
    ids = torch.tensor(random_prompts(np.random.default_rng(0), [10]))
    torch.testing.assert_close(loaded(ids), model(ids), atol=1e-6, rtol=0)  # weights stored as fp32


def test_tied_head_is_not_stored_twice(tmp_path):
    model = HybridLM(ModelConfig(hidden_size=32, intermediate_size=32, layer_types=["full_attention"]))
    save_model(model, tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.embed_tokens.weight.data_ptr()


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, fragment", [
    ({"model_type": "llama"}, "model_type"),
    ({"num_experts": 8}, "unknown config key 'num_experts'"),
    ({"layer_types": ["linear_attention", "mamba"]}, "layer_types\\[1\\]"),
    ({"num_hidden_layers": 7}, "num_hidden_layers"),
    ({"linear_num_key_heads": 3}, "multiple"),
    ({"hidden_size": -4}, "hidden_size"),
    ({"rope_theta": float("nan")}, "rope_theta"),
])
def test_bad_config_gives_one_line_error(checkpoint, changes, fragment):
    _, path = checkpoint
    _edit_config(path, **changes)
    with pytest.raises(SimtreeError, match=fragment) as err:
        load_model(path)
    assert "\n" not in str(err.value)


def test_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SimtreeError, match="not valid JSON"):
        load_config(tmp_path)


def _narrow_embedding(state):
    state["embed_tokens.weight"] = state["embed_tokens.weight"][:, :8].contiguous()


def _nan_norm(state):
    state["norm.weight"][0] = float("nan")


def _drop_norm(state):
    del state["norm.weight"]


@pytest.mark.parametrize("corrupt, message", [(_narrow_embedding, "embed_tokens.weight.*shape"),
                                              (_nan_norm, "NaN"),
                                              (_drop_norm, "missing tensor 'norm.weight'")],
                         ids=["shape_mismatch", "nan", "missing_tensor"])
def test_bad_weights_are_refused(checkpoint, corrupt, message):
    _, path = checkpoint
    state = load_file(str(path / "model.safetensors"))
    corrupt(state)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(SimtreeError, match=message):
        load_model(path)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and max(ids[1:]) < 256
    assert tok.decode(ids) == text
    with pytest.raises(SimtreeError):
        tok.decode([999])


def test_a_save_interrupted_between_its_two_files_is_refused(tmp_path):
    """save_model writes the weights, then config.json: a crash in between leaves new weights
    beside the old config, which load_model must not pair."""
    save_model(tiny_model(1), tmp_path)
    old_config = (tmp_path / "config.json").read_text()
    save_model(tiny_model(2), tmp_path)
    (tmp_path / "config.json").write_text(old_config)          # as if the second save died here
    with pytest.raises(SimtreeError, match="different saves") as err:
        load_model(tmp_path)
    assert "\n" not in str(err.value)
    save_model(tiny_model(2), tmp_path)                         # a whole save loads again
    load_model(tmp_path)
