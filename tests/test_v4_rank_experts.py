"""One expert-parallel rank of DeepSeek-V4-Flash holds 32 routed experts per layer, 6 of them per
token (issue 32), wherever its shape comes from: the runtime's rank, the profiler's layer
pieces and ``ModelShape.shard("ep=8")`` agree, and nothing divides the experts by 8 twice."""
import pytest
import torch

from simtree.costs.steps import Point
from simtree.errors import SimtreeError
from simtree.kernels.layers import v4 as L
from simtree.models import get_model
from simtree.profiler.layer_pieces import layers_workload
from simtree.profiler.pieces import Ctx
from simtree.runtime.full import v4_rank
from simtree.runtime.full.v4_rank import V4Rank


def _expert_rows(specs) -> dict[str, int]:
    """Experts (the grouped weight's leading dimension) of every layer's routed-expert weights, by layer prefix."""
    return {s.name.rsplit(".", 1)[0]: s.shape[0] for s in specs if s.name.endswith("experts_gu")}


def test_v4_flash_rank_has_32_experts_6_per_token_from_every_source():
    whole = get_model("deepseek-v4-flash")
    rank = whole.shard("ep=8")
    assert rank.mlp["n_experts"] == 32 and rank.mlp["experts_per_token"] == 6 and rank.deployment == "ep=8"
    assert whole.mlp["n_experts"] == 256 and whole.deployment == "tp=1"
    # the runtime's rank: from the whole model (its default split) or from the shard, and the
    # pieces the profiler times (V4Dims of the sweep's shard shape, layer_specs)
    assert L.rank_experts(whole) == L.rank_experts(rank) == (32, 8)
    for shape in (whole, rank):
        rows = _expert_rows(v4_rank.param_specs(shape, dtype=torch.bfloat16))
        assert len(rows) == whole.num_layers + 1 and set(rows.values()) == {32}
    d = L.V4Dims.of(rank)
    assert (d.E, d.topk_e) == (32, 6)
    piece = [s for s in L.layer_specs("", "csa", d, 1.0, torch.float32) if s.name == "experts_gu"]
    assert piece[0].shape[:2] == (32, 2 * d.I)
    # the registry's bytes of the shard are what the runtime's rank allocates
    from simtree.kernels.layers.weights import spec_bytes
    assert rank.weight_bytes() == spec_bytes(v4_rank.param_specs(whole, dtype=torch.bfloat16), torch.bfloat16)


def test_a_rank_shape_is_not_split_again():
    rank = get_model("deepseek-v4-flash").shard("ep=8")
    assert L.rank_experts(rank, 8) == (32, 8)
    with pytest.raises(SimtreeError, match="already one rank of ep=8"):
        L.rank_experts(rank, 4)
    tp_rank = get_model("deepseek-v4-flash").shard("tp=2")   # attention split, every expert kept
    assert L.rank_experts(tp_rank) == (256, 1)


@pytest.mark.parametrize("source", ["whole", "shard"])
def test_tiny_rank_runtime_and_profiler_piece_build_the_same_experts(source):
    whole = get_model("tiny-v4")
    shape = whole if source == "whole" else whole.shard("ep=2")
    model = V4Rank(shape, "cpu", torch.float32)
    ctx = Ctx(shape, torch.device("cpu"), torch.float32, seed=0)
    layers_workload(ctx, Point("mlp_step", "layers", whole.name, 1, 2, 0, "eagle")).make()
    piece = ctx.notes["layers"].moe["experts_gu"]
    assert model.w["layers.0.experts_gu"].shape == piece.shape
    assert model.d.E == ctx.notes["layers"].d.E == whole.mlp["n_experts"] // 2
    assert model.deployment.startswith("ep=2 ")
