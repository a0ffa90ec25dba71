"""A V4 layer's tree verify with the fused launch (the CSA top-k and list in one) against float64
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


def test_unknown_fusion_is_one_line():
    with pytest.raises(SimtreeError, match="fusion"):
        tree_verify_fused(None, None, None, None, ("comp_proj",))


def test_forms_pick_the_fusions():
    from simtree.kernels.layers.forms import V4_AUTO, forms, v4_fusions
    with forms(v4_topk="fused"):
        assert v4_fusions() == ("topk",)
    with forms(v4_topk="sort"):
        assert v4_fusions() == ()
    with forms(v4_topk="auto"):
        assert v4_fusions() == (("topk",) if V4_AUTO["v4_topk"] == "fused" else ())
    for bad in (dict(v4_topk="radix"), dict(v4_comp_proj="fused")):
        with pytest.raises((SimtreeError, TypeError)):
            with forms(**bad):
                pass
