"""The V4 layer verify's memory floor (profiler/bench/v4_floor_model.py): its bytes by hand."""
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.layers.v4 import V4Dims, layer_specs
from simtree.profiler.bench.v4_floor_model import MOE_WEIGHTS, verify_floor
from simtree.models import get_model


@pytest.fixture(scope="module")
def flash():
    return V4Dims.of(get_model("deepseek-v4-flash"))


def test_csa_cache_bytes_by_hand(flash):
    d = flash
    f = verify_floor(d, "csa", batch=3, nodes=4, context=4096)
    E = 4096 // 4
    assert f.cache["window"] == 3 * 127 * 512 * 2
    assert f.cache["compressed"] == 3 * 512 * 512 * 2           # top-k rows, not all E
    assert f.cache["indexer_keys"] == 3 * E * 128 * 2            # every key scored
    assert f.cache["compressor_state"] == 3 * (2 * 8 * 1024 + 2 * 8 * 256) * 4
    assert f.activations == 2 * 12 * d.hc * d.h * 2


def test_hca_reads_every_entry_and_swa_only_the_window(flash):
    h = verify_floor(flash, "hca", 2, 4, 16384)
    assert h.cache["compressed"] == 2 * (16384 // 128) * 512 * 2 and "indexer_keys" not in h.cache
    s = verify_floor(flash, "swa", 2, 4, 16384)
    assert set(s.cache) == {"window"}
    assert verify_floor(flash, "swa", 1, 1, 10).cache["window"] == 10 * 512 * 2   # short context


def test_weights_at_their_stored_dtypes(flash):
    """The attention's linears FP8 with their block scales (V4-Flash's config; bf16 when asked),
    the compressors fp32 (their projections bf16 under the form v4_comp "model", as the
    checkpoint ships them); the experts FP8 with their block scales."""
    from simtree.kernels.layers.forms import forms
    with forms(v4_comp="fp32"):
        f = verify_floor(flash, "csa", 1, 4, 4096)
        bf = verify_floor(flash, "csa", 1, 4, 4096, fp8_projections=False)
    assert flash.proj == "fp8" and f.weights["wq_b"] == 64 * 512 * 1024 and f.weights["wq_b_scale_inv"] == 256 * 8 * 4
    assert f.weights["wo_a"] == 8 * 1024 * 8 * 512 and f.weights["wo_a_scale_inv"] == 8 * 8 * 32 * 4
    assert f.weights["wqkv_a"] == 1536 * 4096 and f.weights["wi_head"] == 64 * 4096 * 2
    assert bf.weights["wq_b"] == 64 * 512 * 1024 * 2 and "wq_b_scale_inv" not in bf.weights
    assert bf.weights["wqkv_a"] == 1600 * 4096 * 2 and "wi_head" not in bf.weights
    assert f.weight_bytes < 0.6 * bf.weight_bytes
    assert f.weights["comp.wkv"] == 1024 * 4096 * 4 and f.weights["comp.ape"] == 4 * 1024 * 4
    with forms(v4_comp="model"):
        g = verify_floor(flash, "csa", 1, 4, 4096)
    assert g.weights["comp.wkv"] == 1024 * 4096 * 2 and g.weights["comp.ape"] == 4 * 1024 * 4
    assert not any(name.startswith(("experts", "shared", "router")) for name in f.weights)
    m = verify_floor(flash, "csa", 64, 16, 4096, scope="moe")      # 1024 tokens touch every expert
    assert flash.experts == "fp8"
    assert m.weights["experts_gu"] == pytest.approx(32 * 2 * 2048 * 4096, rel=1e-6)
    assert m.weights["experts_gu_scale_inv"] == pytest.approx(32 * 32 * 32 * 4, rel=1e-6)


def test_tree_nodes_share_the_cache(flash):
    """More nodes per sequence add activations (and touched experts), never cache rows."""
    a, b = verify_floor(flash, "csa", 2, 1, 16384), verify_floor(flash, "csa", 2, 16, 16384)
    assert a.cache == b.cache and a.weights == b.weights and b.activations == 16 * a.activations
    assert verify_floor(flash, "csa", 1, 16, 4096, "moe").weight_bytes > verify_floor(flash, "csa", 1, 1, 4096,
                                                                                        "moe").weight_bytes


def test_layer_is_attention_plus_moe(flash):
    for kind in ("swa", "csa", "hca"):
        a, m, lay = (verify_floor(flash, kind, 4, 4, 4096, s) for s in ("attention", "moe", "layer"))
        assert lay.total_bytes == a.total_bytes + m.total_bytes
        names = {s.name for s in layer_specs("", kind, flash, 1.0, torch.float32)} - {"tid2eid"}
        assert set(lay.weights) == names and not set(a.weights) & set(m.weights)
        assert all(n.replace("_scale_inv", "") in MOE_WEIGHTS for n in m.weights)


def test_floor_us_and_growth(flash):
    f = verify_floor(flash, "csa", 1, 4, 4096)
    assert f.us(1000.0) == pytest.approx(f.total_bytes / 1e6)
    longer = verify_floor(flash, "csa", 1, 4, 16384)
    assert longer.total_bytes > f.total_bytes


@pytest.mark.parametrize("args", [("mla", 1, 1, 1, "attention"), ("csa", 0, 1, 1, "attention"),
                                  ("csa", 1, 1, 1, "everything")])
def test_bad_input_is_one_line(flash, args):
    kind, b, n, l, scope = args
    with pytest.raises(SimtreeError):
        verify_floor(flash, kind, b, n, l, scope)


def test_core_reads_the_compressors_and_the_cache(flash):
    c, a = verify_floor(flash, "csa", 2, 4, 4096, "core"), verify_floor(flash, "csa", 2, 4, 4096)
    assert set(c.weights) == {n for n in a.weights if n.startswith(("comp.", "idx.", "sink"))}
    assert c.cache == a.cache and c.total_bytes < a.total_bytes
    assert c.activations == 8 * (2 * 64 * 512 + 512 + 4096 + 64 * 128 + 2 * 64) * 2


def test_compute_floor_by_hand(flash):
    d = flash
    c = verify_floor(d, "csa", 2, 4, 4096, "core")
    comp = 2 * (1024 + 1024 + 256 + 256) * 4096                     # the compressors' four GEMMs
    want = 8 * (comp + 4 * 64 * 512 * (128 + 512) + 2 * 64 * 128 * 1024)
    assert c.flops == pytest.approx(want)
    m = verify_floor(d, "swa", 1, 1, 4096, "moe")
    routed = 2 * 6 * (2 * 2048 * 4096 + 4096 * 2048)                 # 6 of the rank's 32 experts
    assert m.flops > routed and c.compute_us(1.0) == pytest.approx(c.flops / 1e6)
    big = verify_floor(d, "csa", 16, 16, 16384)
    assert big.compute_us() > big.us()                              # 256 tokens: compute-bound


def test_fp8_projections_halve_the_attention_linears(flash):
    a, f = verify_floor(flash, "csa", 1, 4, 4096, fp8_projections=False), verify_floor(flash, "csa", 1, 4, 4096)
    assert f.weights["wq_b"] == 64 * 512 * 1024 and f.weights["wq_b_scale_inv"] == 256 * 8 * 4
    assert f.weights["wo_a_scale_inv"] == 8 * 8 * 32 * 4                    # [8 groups, 1024, 4096]
    assert f.weights["comp.wkv"] == a.weights["comp.wkv"]                    # the compressors as the form keeps them
    assert 0.5 < f.weight_bytes / a.weight_bytes < 0.65
