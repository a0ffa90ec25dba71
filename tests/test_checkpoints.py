"""simtree.checkpoints refuses every bad folder with one line naming the problem, before any
weight is read: tiny Qwen3.5 folders written here with safetensors (no transformers needed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from simtree.checkpoints import open_checkpoint
from simtree.checkpoints.qwen3_5 import shape_fields, tensor_plan
from simtree.errors import SimtreeError
from simtree.models import ModelShape, get_model

CONFIG = {"model_type": "qwen3_5_text", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 12,
          "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 4, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
          "linear_key_head_dim": 4, "linear_value_head_dim": 2, "linear_conv_kernel_dim": 4,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
          "dtype": "float32"}


def tensors(config=CONFIG, mtp: bool = False) -> dict[str, torch.Tensor]:
    shape = ModelShape(**shape_fields(config, "t"))
    plan = tensor_plan(config, shape)
    keys = dict(plan.required, **(plan.optional["MTP layer"] if mtp else {}))
    return {k: torch.randn(s) for k, s in keys.items()}


def write(folder: Path, config=CONFIG, weights=None, shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    weights = tensors(config) if weights is None else weights
    if shards == 1:
        save_file(weights, str(folder / "model.safetensors"))
        return folder
    keys = sorted(weights)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in keys[i::shards]}
        save_file(part, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def refused(folder, match: str):
    with pytest.raises(SimtreeError, match=match) as info:
        shape = get_model(str(folder))
        open_checkpoint(folder).load(shape, torch.float32)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_good_folder_loads_single_and_sharded(tmp_path):
    w = tensors()
    for shards in (1, 3):
        folder = write(tmp_path / f"s{shards}", weights=w, shards=shards)
        weights, absent = open_checkpoint(folder).load(get_model(str(folder)), torch.float32)
        assert absent == ["MTP layer"]
        assert torch.equal(weights["layers.1.o"], w["model.layers.1.self_attn.o_proj.weight"])
        assert torch.allclose(weights["norm"], 1 + w["model.norm.weight"])   # zero-centred: 1 + w


def test_a_folder_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "has no config.json")


def test_a_missing_folder(tmp_path):
    with pytest.raises(SimtreeError, match="unknown model"):
        get_model(str(tmp_path / "nope"))
    with pytest.raises(SimtreeError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")


def test_an_unknown_model_type(tmp_path):
    refused(write(tmp_path / "x", dict(CONFIG, model_type="llama"), weights={}), "unknown model_type 'llama'")


def test_the_moe_variant_is_refused_in_one_line(tmp_path):
    refused(write(tmp_path / "x", dict(CONFIG, model_type="qwen3_5_moe"), weights={}), "dense MLP")


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "linear_num_value_heads", "vocab_size"])
def test_a_config_missing_a_needed_field(tmp_path, field):
    config = {k: v for k, v in CONFIG.items() if k != field}
    refused(write(tmp_path / "x", config, weights={}), f"lacks '{field}'")


def test_a_missing_tensor_is_named(tmp_path):
    w = tensors()
    del w["model.layers.0.linear_attn.A_log"]
    refused(write(tmp_path / "x", weights=w), "'model.layers.0.linear_attn.A_log' missing")


def test_an_extra_tensor_is_named(tmp_path):
    w = dict(tensors(), **{"model.layers.0.mlp.bias": torch.zeros(3)})
    refused(write(tmp_path / "x", weights=w), "unexpected tensor 'model.layers.0.mlp.bias'")


def test_a_wrong_shape_names_both_shapes(tmp_path):
    w = tensors()
    w["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(5, 8)
    msg = refused(write(tmp_path / "x", weights=w), "k_proj.weight' has shape")
    assert "[5, 8]" in msg and "[4, 8]" in msg


def test_a_wrong_dtype_is_named(tmp_path):
    w = tensors()
    w["model.norm.weight"] = torch.zeros(8, dtype=torch.int32)
    refused(write(tmp_path / "x", weights=w), "'model.norm.weight' has dtype I32")


def test_a_truncated_file_is_refused(tmp_path):
    folder = write(tmp_path / "x")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    refused(folder, "model.safetensors is truncated")


def test_an_index_naming_a_missing_shard(tmp_path):
    folder = write(tmp_path / "x", shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    refused(folder, "names shard model-00002-of-00002.safetensors, which is missing")


def test_a_folder_without_weights(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps(CONFIG))
    assert get_model(str(tmp_path / "x")).layer_kinds == ("gdn", "attn")   # the shape needs no weights
    refused(tmp_path / "x", "has no weights")


def test_a_partial_mtp_layer_is_refused(tmp_path):
    w = tensors(mtp=True)
    del w["mtp.fc.weight"]
    refused(write(tmp_path / "x", weights=w), "'mtp.fc.weight' of the MTP layer missing")


def test_the_vl_wrapper_reads_text_config_and_leaves_the_vision_tower(tmp_path):
    w = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors(mtp=True).items()}
    w["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    config = {"model_type": "qwen3_5", "text_config": dict(CONFIG, model_type="qwen3_5_text"),
              "vision_config": {"depth": 1}}
    folder = write(tmp_path / "vl", config, weights=w)
    weights, absent = open_checkpoint(folder).load(get_model(str(folder)), torch.float32)
    assert absent == [] and "mtp.fc" in weights and not any("visual" in k for k in weights)


def test_a_rank_shard_that_does_not_fit_says_how_much_is_missing(tmp_path):
    from simtree.runtime.full.build import check_fits
    shape = get_model(str(write(tmp_path / "x")))
    with pytest.raises(SimtreeError, match=r"GB short"):
        check_fits(shape, "cpu", torch.float32, available_bytes=1000)


def test_a_checkpoint_folder_stands_in_for_the_sweeps_models_of_its_family(tmp_path):
    """simtree profile --model PATH: the sweep's grid at the checkpoint's shape."""
    from simtree.profiler.sweep import default_sweep_path, expand_points, load_sweep
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    points = expand_points(load_sweep(default_sweep_path("cpu")), "cpu", None, [str(folder)])
    assert points and {p.model for _, p in points} == {str(folder)}
    assert {"gdn_tree_verify", "attn_tree_verify"} <= {p.stage for _, p in points}


def test_the_shipped_qwen_config_gives_the_published_shape():
    """qwen3.6-27b is a shipped Hugging Face config; its shape is the public numbers, so its
    sizes (and every shipped result built on them) are what they were as a YAML shape."""
    from simtree.models import list_models
    shape = get_model("qwen3.6-27b")
    assert "qwen3.6-27b" in list_models() and shape.source.endswith("qwen3.6-27b/config.json")
    assert shape.layer_kinds == ("gdn", "gdn", "gdn", "attn") * 16 and (shape.hidden, shape.vocab) == (5120, 248320)
    assert shape.attn == dict(q_heads=24, kv_heads=4, head_dim=256, output_gate=True, rope_dim=64, rope_theta=1e7)
    assert shape.gdn == dict(key_heads=16, value_heads=48, key_dim=128, value_dim=128, conv_kernel=4)
    assert shape.mlp == dict(kind="dense", intermediate=17408) and shape.dtype == "bf16"
    assert shape.draft == dict(attention="attn", mlp="model", fuse_proj=True)


def test_a_known_model_type_without_its_reader_is_one_line(tmp_path, monkeypatch):
    import simtree.checkpoints as ck
    monkeypatch.setitem(ck.FAMILIES, "future_model", "no_such_family_module")
    refused(write(tmp_path / "x", dict(CONFIG, model_type="future_model"), weights={}),
            "no checkpoint reader for it yet")
