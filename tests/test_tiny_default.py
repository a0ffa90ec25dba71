"""The embedded tiny default is a Qwen3.5 checkpoint (qwen3_5_text, its MTP layer included) that
loads through simtree.checkpoints as a user's does; its committed command writes the same bytes;
the engine decodes it losslessly (every policy the runtime builds, batch 1 and 3)."""
import hashlib
import json

import pytest
import torch

from simtree.checkpoints import open_checkpoint
from simtree.data import data_path
from simtree.models import get_model
from simtree.planning.modes import PolicySpec
from simtree.runtime.full.build import build_model
from simtree.runtime.full.lossless import check_lossless
from simtree.runtime.tokenizer import VOCAB_SIZE

torch.set_num_threads(1)
FOLDER = data_path("models") / "runtime-tiny"
POLICIES = [PolicySpec.from_dict("linear", {"budget": 4}),
            PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
            PolicySpec.from_dict("best_first", {"budget": 8, "draft_depth": 3}),
            PolicySpec.from_dict("cost_aware", {"max_budget": 10, "draft_depth": 3}),
            PolicySpec.from_dict("batch_alloc", {"max_budget_per_seq": 6, "draft_depth": 4})]
PROMPTS = [list(b"The quick brown fox jumps"), list(b"def f(x):\n    return"), list(b"Hello")]


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


@pytest.mark.parametrize("batch", [1, 3])
def test_every_policy_decodes_the_default_as_plain_greedy_does(batch):
    model = build_model("runtime-tiny", device="cpu", dtype=torch.float64)
    from simtree.costs.synthetic import synthetic_costs
    rows = check_lossless(model, PROMPTS[:batch], POLICIES, 20, costs=synthetic_costs())
    for r in rows:
        assert r["match"], r
    # the MTP layer's drafts are accepted and rejected: both paths of a round ran
    assert all(1.1 < r["accepted_tokens_per_round"] < 4.5 for r in rows), rows
