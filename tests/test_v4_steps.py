"""Benchmark helpers (random state at a context length, trees, verify/commit steps) and the
FlashMLA V4 cache packing, on CPU."""
import numpy as np
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.v4 import V4AttnConfig
from simtree.kernels.v4.flashmla import ROW_BYTES, pack_v4_rows, unpack_v4_rows
from simtree.kernels.v4.steps import make_tree, make_verify_step, verify_bytes

CFG = V4AttnConfig.tiny(num_heads=16, head_dim=32, hidden=16, topk=4)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_verify_step_runs_and_commit_advances_nothing_on_host(kind):
    step = make_verify_step(CFG, kind, batch_size=2, nodes_per_seq=5, context_len=37,
                            tree_shape="random", device="cpu", dtype=torch.float32, attention="torch")
    out = step.verify()
    assert out.shape == (10, CFG.num_heads, CFG.head_dim) and torch.isfinite(out).all()
    lens = step.cache.lens.copy()
    step.commit()  # device part only: host lengths unchanged, so it can be replayed for timing
    assert np.array_equal(step.cache.lens, lens)
    assert verify_bytes(step) > 0


def test_tree_shapes():
    rng = np.random.default_rng(0)
    assert make_tree(6, "linear", rng).max_depth == 5
    assert make_tree(7, "eagle", rng).max_depth == 2
    assert make_tree(9, "random", rng).num_nodes == 9
    with pytest.raises(SimtreeError):
        make_tree(4, "bushy", rng)


def test_config_rejects_bad_values():
    with pytest.raises(SimtreeError):
        V4AttnConfig.tiny(rope_dim=7)
    with pytest.raises(SimtreeError):
        V4AttnConfig.tiny().ratio("mla")


def test_v4_cache_pack_roundtrip():
    """584-byte rows: fp8 NoPE with power-of-two scales per 64 values, bf16 RoPE."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(70, 512, generator=g)
    packed = pack_v4_rows(rows, page_block_size=64)
    assert packed.shape == (2, 64, 1, ROW_BYTES)
    back = unpack_v4_rows(packed)[:70]
    torch.testing.assert_close(back[:, 448:], rows[:, 448:].bfloat16().float())
    rel = (back[:, :448] - rows[:, :448]).abs() / rows[:, :448].abs().reshape(70, 7, 64).amax(-1).repeat_interleave(64, 1)
    assert rel.max() < 2 ** -3  # e4m3: 3 mantissa bits relative to the tile maximum
