import filecmp
from pathlib import Path

import pytest

from simtree.errors import SimtreeError
from simtree.models import MODEL_DIR, get_model, list_models, load_model_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, counts, layers", [
    ("deepseek-v4-flash", {"swa": 2, "csa": 21, "hca": 20}, 43),   # compress_ratios [0,0]+[4,128]x20+[4]
    ("qwen3.6-27b", {"gdn": 48, "attn": 16}, 64),                   # 16 x [3 GDN + 1 attention]
    ("qwen3-next-80b", {"gdn": 36, "attn": 12}, 48),
])
def test_layer_counts_match_design(name, counts, layers):
    m = get_model(name)
    assert m.layer_counts() == counts
    assert m.num_layers == layers


def test_v4_flash_pattern_order():
    kinds = get_model("deepseek-v4-flash").layer_kinds
    assert kinds[:4] == ("swa", "swa", "csa", "hca") and kinds[-1] == "csa"


def test_stack_holds_every_layer_kind():
    for name in list_models():
        m = get_model(name)
        stack = m.stack(4)
        assert len(stack) == min(4, m.num_layers)
        assert set(stack) == set(m.kinds())


def test_unknown_model_lists_known_names():
    with pytest.raises(SimtreeError, match=r"unknown model 'nope'; known: .*qwen3.6-27b"):
        get_model("nope")


def test_scenario_links_match_packaged_shapes():
    for path in MODEL_DIR.glob("*.yaml"):
        twin = ROOT / "scenarios" / "models" / path.name
        assert twin.exists() and filecmp.cmp(path, twin, shallow=False), path.name


@pytest.mark.parametrize("text, message", [
    ("name: x\nfamily: f\nhidden: 8\nvocab: 8\nlayers: [{kinds: [gdn]}]\n", "missing key 'mlp'"),
    ("name: x\nfamily: f\nhidden: 8\nvocab: 8\nmlp: {kind: dense, intermediate: 4}\n"
     "layers: [{kinds: [mamba]}]\n", "unknown layer kind 'mamba'"),
    ("name: x\nfamily: f\nhidden: 8\nvocab: 8\nmlp: {kind: dense, intermediate: 4}\n"
     "layers: [{kinds: [gdn]}]\n", "needs a 'gdn' section"),
    ("name: [x\n", "not valid YAML"),
    # YAML true is a Python bool (an int subclass): not a count
    ("name: x\nfamily: f\nhidden: true\nvocab: 8\nmlp: {kind: dense, intermediate: 4}\n"
     "layers: [{kinds: [gdn]}]\ngdn: {}\n", "hidden must be an integer >= 1, got True"),
    ("name: x\nfamily: f\nhidden: 8\nvocab: 8\nmlp: {kind: dense, intermediate: 4}\n"
     "layers: [{kinds: [gdn], repeat: true}]\ngdn: {}\n", "layer repeat must be an integer >= 1, got True"),
])
def test_bad_model_file_is_one_line_error(tmp_path, text, message):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(SimtreeError, match=message) as info:
        load_model_file(path)
    assert "\n" not in str(info.value)
