"""A V4 layer's tree verify with the fused launches (the compressors' GEMMs in one, the CSA
top-k and list in one) against float64 sequential decoding of every node's root path, on
random trees, then the accepted path's commit (Triton's interpreter on the CPU)."""
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
    for name in ("project_compressors", "topk_to_list"):
        real = getattr(tv, name)
        monkeypatch.setattr(tv, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    cfg = V4AttnConfig.tiny()
    r = check_against_reference(cfg, kind, [14, 9], nodes=9, seed=7, dtype=torch.float32, attention="triton",
                                planner=planner, fusions=FUSIONS)
    assert r["verify_err"] < 2e-4 and r["commit_err"] < 2e-4
    assert not r["verify_wrote_cache"] and r["rejected_identical"]
    assert set(calls) == ({"project_compressors", "topk_to_list"} if kind == "csa" else {"project_compressors"})


def test_unknown_fusion_is_one_line():
    with pytest.raises(SimtreeError, match="fusion"):
        tree_verify_fused(None, None, None, None, ("everything",))


def test_forms_pick_the_fusions():
    from simtree.kernels.layers.forms import V4_AUTO, forms, v4_fusions
    with forms(v4_comp_proj="fused", v4_topk="sort"):
        assert v4_fusions() == ("comp_proj",)
    with forms(v4_comp_proj="auto", v4_topk="auto"):
        assert v4_fusions() == tuple(f for form, f in (("v4_comp_proj", "comp_proj"), ("v4_topk", "topk"))
                                     if V4_AUTO[form] == "fused")
    with pytest.raises(SimtreeError):
        with forms(v4_topk="radix"):
            pass
