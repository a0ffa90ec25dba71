"""A V4 layer's tree verify with the optional launches (the CSA top-k and list in one; the
compressors' pooling with padding rows skipped and split over (window, channels)) against float64
sequential decoding of every node's root path, on random trees, then the accepted path's commit
(Triton's interpreter on the CPU)."""
import importlib

import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.v4 import V4AttnConfig
from simtree.kernels.v4.check import check_against_reference
from simtree.kernels.v4._launched import FUSIONS, tree_verify_fused


@pytest.mark.parametrize("kind,planner", [("csa", "host"), ("hca", "device")])
def test_fused_verify_equals_sequential_decoding(kind, planner, monkeypatch):
    tv = importlib.import_module("simtree.kernels.v4.verify")     # the module, not the function
    calls = []
    real = tv.topk_to_list
    monkeypatch.setattr(tv, "topk_to_list", lambda *a, **k: calls.append("topk_to_list") or real(*a, **k))
    cfg = V4AttnConfig.tiny()
    r = check_against_reference(cfg, kind, [14, 9], nodes=9, seed=7, dtype=torch.float32, attention="triton",
                                planner=planner, fusions=FUSIONS)
    assert r["verify_err"] < 2e-4 and r["commit_err"] < 2e-4
    assert not r["verify_wrote_cache"] and r["rejected_identical"]
    assert set(calls) == ({"topk_to_list"} if kind == "csa" else set())


@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("fusion", ["pool_live", "pool_split"])
def test_pool_forms_equal_sequential_decoding(kind, fusion, monkeypatch):
    """The device plan's padded pool rows skipped, and (pool_split, at every ratio here: the tiny
    windows are short of POOL_SPLIT_RATIO) the two-launch pooling: still float64 sequential
    decoding; lengths put completing windows inside the trees beside the padding rows."""
    tv = importlib.import_module("simtree.kernels.v4.verify")
    monkeypatch.setattr(tv, "POOL_SPLIT_RATIO", 1)
    calls = []
    real = tv.pool_windows

    def spy(*a, **k):
        calls.append((int(a[4].shape[0]), int((a[4][:, -1] < 0).sum()), k.get("split"), k.get("skip_padding")))
        return real(*a, **k)
    monkeypatch.setattr(tv, "pool_windows", spy)
    cfg = V4AttnConfig.tiny()
    r = check_against_reference(cfg, kind, [14, 9, 30], nodes=9, seed=3, dtype=torch.float32, attention="triton",
                                planner="device", fusions=(fusion,))
    assert r["verify_err"] < 2e-4 and r["commit_err"] < 2e-4
    assert not r["verify_wrote_cache"] and r["rejected_identical"]
    assert calls and all(split == (fusion == "pool_split") and skip for _, _, split, skip in calls)
    rows, padding = calls[0][0], calls[0][1]
    assert 0 < padding < rows                      # live windows and padding rows both pooled


def test_unknown_fusion_is_one_line():
    with pytest.raises(SimtreeError, match="fusion"):
        tree_verify_fused(None, None, None, None, ("comp_proj",))


def test_forms_pick_the_fusions():
    from simtree.kernels.layers.forms import V4_AUTO, forms, v4_fusions
    with forms(v4_topk="fused", v4_pool="whole"):
        assert v4_fusions() == ("topk",)
    with forms(v4_topk="sort", v4_pool="whole"):
        assert v4_fusions() == ()
    with forms(v4_topk="auto", v4_pool="whole"):
        assert v4_fusions() == (("topk",) if V4_AUTO["v4_topk"] == "fused" else ())
    with forms(v4_topk="auto", v4_pool="auto"):        # the runtime's default: every fusion
        assert v4_fusions() == ("topk", "pool_split") == ((("topk",) if V4_AUTO["v4_topk"] == "fused" else ())
                                                          + ("pool_" + V4_AUTO["v4_pool"],))
    with forms(v4_topk="sort", v4_pool="live"):
        assert v4_fusions() == ("pool_live",)
    with forms(v4_topk="fused", v4_pool="split"):
        assert v4_fusions() == ("topk", "pool_split")
    with forms(v4_topk="sort", v4_pool="whole"):
        assert v4_fusions() == ()
    for bad in (dict(v4_topk="radix"), dict(v4_comp_proj="fused"), dict(v4_pool="fused")):
        with pytest.raises((SimtreeError, TypeError)):
            with forms(**bad):
                pass
