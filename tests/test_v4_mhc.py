"""DeepSeek-V4 pieces on their own: the hyper-connection weights and the clamped SwiGLU as Triton
kernels (through the interpreter) against their torch forms; YaRN frequencies against
transformers'; the rope-row permutation that turns the kernels' half-split rotation into V4's
interleaved one."""
from __future__ import annotations

import math

import pytest
import torch

from simtree.kernels.layers import fused, reference as ref
from simtree.kernels.layers.rope import inv_freq


@pytest.mark.parametrize("hc", [3, 4])
def test_hc_weights_kernel_equals_torch(hc):
    g = torch.Generator().manual_seed(hc)
    n = (2 + hc) * hc
    m, base = torch.randn(7, n, generator=g), torch.randn(n, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    want = ref.hc_weights(m, base, scale, 20, 1e-6)
    got = fused.hc_weights(m, base, scale, 20, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    comb = want[2]   # doubly stochastic after Sinkhorn
    torch.testing.assert_close(comb.sum(-2), torch.ones(7, hc), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(comb.sum(-1), torch.ones(7, hc), rtol=1e-3, atol=1e-3)


def test_clamped_swiglu_kernel_equals_torch():
    gu = torch.randn(6, 2 * 37, generator=torch.Generator().manual_seed(0)) * 4
    torch.testing.assert_close(fused.silu_mul(gu, 2.0), ref.swiglu(gu, 2.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.silu_mul(gu), ref.silu_mul(gu), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ref.swiglu(gu, 2.0), ref.silu_mul(gu))        # the clamp bites here


def test_yarn_frequencies_are_transformers():
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32,
            "beta_slow": 1}
    cfg = DeepseekV4Config(num_hidden_layers=2, rope_parameters=dict(yarn), max_position_embeddings=1 << 20)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu", layer_type="compress")
    assert factor == 1.0
    got = inv_freq(64, 160000.0, yarn)
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32), want, rtol=0, atol=0)
    assert not torch.allclose(torch.as_tensor(inv_freq(64, 160000.0), dtype=torch.float32), want)


def test_the_rope_permutation_makes_half_split_rotation_interleaved():
    from simtree.checkpoints.deepseek_v4 import rope_perm
    from simtree.kernels.v4.compressor import apply_rope
    D, R, pos = 12, 8, torch.tensor([5])
    x = torch.randn(1, D, dtype=torch.float64)
    inv = inv_freq(R, 10000.0)
    # V4: pairs (2i, 2i + 1) of the trailing R channels rotated by angle pos * inv[i]
    y = x.clone()
    for i in range(R // 2):
        a, b = D - R + 2 * i, D - R + 2 * i + 1
        c, s = math.cos(5 * inv[i]), math.sin(5 * inv[i])
        y[0, a], y[0, b] = x[0, a] * c - x[0, b] * s, x[0, a] * s + x[0, b] * c
    perm = rope_perm(D, R)
    got = apply_rope(x[:, perm], pos, R, 10000.0, inv)
    torch.testing.assert_close(got, y[:, perm])
