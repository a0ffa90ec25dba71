"""The V4 rank on the kernels' device plans: every stage of a round runs without reading the
device (so the rank captures into CUDA graphs like the Qwen model), and its experts are the
shape's."""
import dataclasses

import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.layers import moe
from simtree.kernels.layers.v4 import rank_experts
from simtree.models import get_model
from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.acceptance import TraceReplay
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.engine import FullEngine
from simtree.runtime.full.v4_rank import V4Rank

from host_reads import TorchCalls

torch.set_num_threads(1)


@pytest.mark.parametrize("policy", [("eagle", {"num_steps": 3, "topk": 2, "budget": 6}), ("none", {})])
def test_a_v4_round_never_reads_the_device(monkeypatch, policy):
    """With the grouped GEMM the CUDA path takes (torch._grouped_mm, here on the CPU), no stage
    of a round - the device plans, the layers, the commit, the drafting - reads a value back."""
    monkeypatch.setattr(moe, "grouped_mm_capturable", lambda *a: True)
    model = V4Rank(get_model("tiny-v4"), "cpu", torch.float32, 1)
    assert model.capturable
    rs = round_shape(PolicySpec.from_dict(*policy))
    engine = FullEngine(model, rs, 2, 64, TraceReplay.fixed(2, 2, "cpu"))
    engine.fill_context(20)
    for name, fn in engine._stages():
        with TorchCalls() as calls:
            fn()
        assert not calls.host_reads(), (name, calls.host_reads())
    # a context of 20 tokens, then one round: the root and 2 accepted drafts, or one plain token
    assert engine.st.lengths.tolist() == [20 + (1 if rs.plain else 3)] * 2


def test_rank_experts_from_the_shape():
    shape = get_model("deepseek-v4-flash")
    assert rank_experts(shape) == (32, 8)
    assert rank_experts(shape, 4) == (64, 4)
    rank = dataclasses.replace(shape, mlp={**shape.mlp, "n_experts": 16, "ep_ranks": 16})   # a rank's shape
    assert rank_experts(rank) == (16, 16)
    with pytest.raises(SimtreeError, match="fewer than the 6"):
        rank_experts(dataclasses.replace(shape, mlp={**shape.mlp, "n_experts": 4, "ep_ranks": 64}))
    assert V4Rank(get_model("tiny-v4"), "cpu", torch.float32).d.E == 4


def _fp8_tiny():
    """tiny-v4 with its attention's linears FP8 (block-scaled, as V4-Flash's checkpoint)."""
    shape = get_model("tiny-v4")
    return dataclasses.replace(shape, v4={**shape.v4, "attn_proj_dtype": "fp8"})


def test_fp8_attention_linears_are_the_ranks_and_its_bytes():
    from simtree.kernels.layers.weights import spec_bytes
    from simtree.runtime.full.v4_rank import param_specs
    shape = _fp8_tiny()
    model = V4Rank(shape, "cpu", torch.float32, 1)
    assert model.d.proj == "fp8"
    for name in ("layers.0.wqkv_a", "layers.1.wq_b", "layers.1.wq_idx", "layers.2.wo_a", "layers.2.wo_b", "mtp.wq_b"):
        assert model.w[name].dtype == torch.float8_e4m3fn and model.w[name + "_scale_inv"].dtype == torch.float32
    assert model.w["layers.1.wi_head"].dtype == torch.float32          # the indexer's head weights stay apart
    assert shape.shard("ep=2").weight_bytes() == spec_bytes(param_specs(shape, 2, torch.float32), torch.float32)
    assert shape.weight_bytes() < get_model("tiny-v4").weight_bytes()


@pytest.mark.parametrize("policy", [("eagle", {"num_steps": 3, "topk": 2, "budget": 6}), ("linear", {"budget": 4})])
def test_speculative_decoding_with_fp8_attention_linears_is_lossless(policy):
    from simtree.runtime.full.lossless import check_lossless
    model = V4Rank(_fp8_tiny(), "cpu", torch.float32, 1)
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 14)]
    rows = check_lossless(model, prompts, [PolicySpec.from_dict(*policy)], 10, 128)
    assert rows and all(r["match"] for r in rows), rows


def test_a_round_with_fp8_attention_linears_never_reads_the_device(monkeypatch):
    monkeypatch.setattr(moe, "grouped_mm_capturable", lambda *a: True)
    model = V4Rank(_fp8_tiny(), "cpu", torch.float32, 1)
    engine = FullEngine(model, round_shape(PolicySpec.from_dict("eagle", {"num_steps": 2, "topk": 2, "budget": 4})), 2,
                        64, TraceReplay.fixed(2, 2, "cpu"))
    engine.fill_context(20)
    for name, fn in engine._stages():
        with TorchCalls() as calls:
            fn()
        assert not calls.host_reads(), (name, calls.host_reads())
