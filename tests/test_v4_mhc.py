"""DeepSeek-V4 pieces on their own: the hyper-connection weights and the clamped SwiGLU as Triton
kernels (through the interpreter) against their torch forms; the hyper-connections' fused kernels
(mix partials, weights from partials, collapse, merge, head) against theirs and mhc's torch path
under the form v4_hc="fused"; YaRN frequencies against transformers'; the rope-row permutation
that turns the kernels' half-split rotation into V4's interleaved one."""
from __future__ import annotations

import math

import pytest
import torch

from simtree.kernels.layers import fused, fused_mhc as fm, mhc, reference as ref
from simtree.kernels.layers.forms import forms
from simtree.kernels.layers.rope import inv_freq


@pytest.mark.parametrize("hc", [3, 4])
def test_hc_weights_kernel_equals_torch(hc):
    g = torch.Generator().manual_seed(hc)
    n = (2 + hc) * hc
    m, base = torch.randn(7, n, generator=g), torch.randn(n, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    want = ref.hc_weights(m, base, scale, 20, 1e-6)
    got = fm.hc_weights(m, base, scale, 20, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    comb = want[2]   # doubly stochastic after Sinkhorn
    torch.testing.assert_close(comb.sum(-2), torch.ones(7, hc), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(comb.sum(-1), torch.ones(7, hc), rtol=1e-3, atol=1e-3)


def _streams(T: int, hc: int, h: int, dtype, seed: int):
    """Fresh random streams x [T, hc, h] and a mix's weights fn [(2 + hc) hc, hc h], base, scale."""
    g = torch.Generator().manual_seed(seed)
    n = (2 + hc) * hc
    x = (torch.randn(T, hc, h, generator=g) * (1 + torch.rand(T, hc, 1, generator=g))).to(dtype)
    fn = torch.randn(n, hc * h, generator=g) / (hc * h) ** 0.5
    return x, fn, torch.randn(n, generator=g), torch.rand(3, generator=g) + 0.5


def _tol(dtype) -> dict:
    """One rounding to the output's dtype apart (fp32 sums in another order)."""
    return dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)


HC_CASES = [(hc, T, dt) for hc in (3, 4) for T in (1, 5, 33) for dt in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("hc,T,dtype", HC_CASES)
def test_hc_mix_kernels_equal_torch(hc, T, dtype):
    x, fn, base, scale = _streams(T, hc, 37, dtype, seed=T * 10 + hc)
    p = fm.hc_mix_partials(x, fn)
    assert p.shape[1:] == (T, fn.shape[0] + 1) and p.dtype == torch.float32
    assert p.shape[0] == fm._mix_splits(T, hc * 37, fn.shape[0], x.element_size())[0]
    torch.testing.assert_close(p.sum(0), ref.hc_mix_partials(x, fn)[0], rtol=1e-5, atol=1e-5)
    m = fm.hc_mix(x, fn, 1e-6)
    torch.testing.assert_close(m, ref.hc_mix_reduce(ref.hc_mix_partials(x, fn), hc * 37, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m, mhc.mix(x, fn, 1e-6), rtol=1e-5, atol=1e-5)
    want = ref.hc_weights(ref.hc_mix_reduce(p, hc * 37, 1e-6), base, scale, 20, 1e-6)
    got = fm.hc_weights_partials(p, base, scale, 20, 1e-6, hc * 37, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,dtype,splits", [(1, torch.bfloat16, 69), (33, torch.float32, 18)])
def test_hc_mix_over_many_splits(T, dtype, splits):
    """K = 4400: at T = 1 69 splits, more than the weights' 64-split block, so their sum loops;
    at T = 33 (three row blocks) 18."""
    x, fn, base, scale = _streams(T, 4, 1100, dtype, seed=3)
    p = fm.hc_mix_partials(x, fn)
    assert p.shape[0] == splits
    torch.testing.assert_close(fm.hc_mix(x, fn, 1e-6), mhc.mix(x, fn, 1e-6), rtol=1e-5, atol=1e-5)
    m = ref.hc_mix_reduce(p, 4 * 1100, 1e-6)
    for a, b in zip(fm.hc_weights_partials(p, base, scale, 20, 1e-6, 4 * 1100, 1e-6),
                    ref.hc_weights(m, base, scale, 20, 1e-6)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,K", [(1, 16384), (5, 16384), (16, 16384), (33, 400), (4096, 16384), (8448, 16384), (1, 37)])
def test_mix_splits_cover_k_once(T, K):
    S, chunk = fm._mix_splits(T, K, 24, 2)
    assert chunk % fm._MIX_BK == 0 and (S - 1) * chunk < K <= S * chunk
    assert 8 * S * T * 25 * 8 <= 4 * 24 * K + 2 * T * K or S == 1       # partials' traffic <= 1/8 of the reads
    if T == 1 and K == 16384:
        assert S == min(fm._MIX_PROGRAMS, K // fm._MIX_BK) == 256   # V4-Flash at one token: 256 programs, a K step each
    if T == 8448:
        assert S == 1                                      # the row blocks alone reach the programs aimed at
    if T == 4096:
        assert S == fm._MIX_PROGRAMS // (T // fm._MIX_BT)  # 256 row blocks: 2 splits each


@pytest.mark.parametrize("hc,T,dtype", HC_CASES)
def test_hc_collapse_merge_head_kernels_equal_torch(hc, T, dtype):
    h = 37 if T != 5 else 600                              # 600: a full channel block of 512, then a partial one
    x, fn, base, scale = _streams(T, hc, h, dtype, seed=T * 10 + hc + 1)
    g = torch.Generator().manual_seed(T)
    pre = torch.rand(T, hc, generator=g) + 1e-6
    torch.testing.assert_close(fm.hc_collapse(x, pre), ref.hc_collapse(x, pre), **_tol(dtype))
    out = torch.randn(T, h, generator=g).to(dtype)
    _, post, comb = ref.hc_weights(mhc.mix(x, fn, 1e-6), base, scale, 20, 1e-6)
    got = fm.hc_merge(x, out, post, comb)
    torch.testing.assert_close(got, ref.hc_merge(x, out, post, comb), **_tol(dtype))
    # fp32 sums rounded once: within one rounding of the exact merge (2u: the interpreter's bf16
    # cast truncates, the GPU's rounds to nearest); the torch path rounds post, comb, both terms
    # and their sum to x's dtype: within a few roundings of the terms' magnitudes, which
    # cancellation can make large against the result
    exact = ref.hc_merge(x.double(), out.double(), post.double(), comb.double())
    u = 2.0 ** (-8 if dtype == torch.bfloat16 else -23)
    assert ((got.double() - exact).abs() <= 2 * u * exact.abs() + 1e-6).all()
    torch_err = (mhc.hc_post(x, out, post, comb).double() - exact).abs()
    terms = post.double().abs()[..., None] * out.double().abs()[:, None] \
        + comb.double().abs().transpose(1, 2) @ x.double().abs()
    assert (torch_err <= 4 * u * terms + 1e-6).all()
    fn_head, b_head, s_head = fn[:hc], base[:hc], scale[:1]
    got = fm.hc_head(x, fm.hc_mix_partials(x, fn_head), b_head, s_head, 1e-6, 1e-6)
    torch.testing.assert_close(got, mhc.hc_head(x, fn_head, b_head, s_head, 1e-6, 1e-6), **_tol(dtype))


def test_hc_kernels_read_strided_streams():
    """Streams as a row slice of a wider buffer (row stride > hc h), out a column slice."""
    buf = torch.randn(5, 4 * 37 + 11)
    x = buf[:, :4 * 37].view(5, 4, 37)
    assert not x.is_contiguous()
    _, fn, base, scale = _streams(5, 4, 37, torch.float32, seed=9)
    _, post, comb = ref.hc_weights(mhc.mix(x, fn, 1e-6), base, scale, 20, 1e-6)
    out = torch.randn(5, 50)[:, 3:40]
    torch.testing.assert_close(fm.hc_mix(x, fn, 1e-6), mhc.mix(x, fn, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fm.hc_collapse(x, post), ref.hc_collapse(x, post), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fm.hc_merge(x, out, post, comb), ref.hc_merge(x, out, post, comb),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_form_of_the_hyper_connections_equals_torch(dtype):
    """mhc.hc_pre / hc_post / hc_head under forms(v4_hc="fused") (the ops' CPU forms) against the
    torch path; float64 keeps the torch path, bit for bit."""
    x, fn, base, scale = _streams(5, 4, 37, dtype, seed=11)
    out = torch.randn(5, 37, generator=torch.Generator().manual_seed(12)).to(dtype)
    args = (fn, base, scale, 20, 1e-6, 1e-6)
    head = (fn[:4], base[:4], scale[:1], 1e-6, 1e-6)
    want = mhc.hc_pre(x, *args), mhc.hc_head(x, *head)
    with forms(v4_hc="fused"):
        got = mhc.hc_pre(x, *args), mhc.hc_head(x, *head)
        merged = mhc.hc_post(x, out, *want[0][1:])
    tol = dict(rtol=0, atol=0) if dtype == torch.float64 else _tol(dtype)
    for a, b in zip(got[0] + got[1:], want[0] + want[1:]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **(tol if a.dtype == dtype else dict(rtol=1e-5, atol=1e-6)))
    torch.testing.assert_close(merged, mhc.hc_post(x, out, *want[0][1:]), **tol)
    assert merged.shape == x.shape and merged.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_paths_kernels_compose_to_hc_pre_and_hc_post(dtype):
    """What the ops launch on CUDA under v4_hc="fused" (the kernels, through the interpreter):
    hc_pre = mix partials -> weights -> collapse, hc_post = merge, against mhc's torch path."""
    x, fn, base, scale = _streams(33, 4, 37, dtype, seed=21)
    a, post, comb = mhc.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    p = fm.hc_mix_partials(x, fn)
    pre, post_f, comb_f = fm.hc_weights_partials(p, base, scale, 20, 1e-6, 4 * 37, 1e-6)
    torch.testing.assert_close(post_f, post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb_f, comb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fm.hc_collapse(x, pre), a, **_tol(dtype))
    out = torch.randn(33, 37, generator=torch.Generator().manual_seed(22)).to(dtype)
    torch.testing.assert_close(fm.hc_merge(x, out, post_f, comb_f), mhc.hc_post(x, out, post, comb),
                               **_tol(dtype))


def _op_args(dtype):
    """Each hc op's arguments as mhc passes them (x [5, 4, 37] of ``dtype``)."""
    x, fn, base, scale = _streams(5, 4, 37, dtype, seed=31)
    p = ref.hc_mix_partials(x, fn)
    pre, post, comb = ref.hc_weights(ref.hc_mix_reduce(p, 4 * 37, 1e-6), base, scale, 20, 1e-6)
    out = torch.randn(5, 37, generator=torch.Generator().manual_seed(32)).to(dtype)
    ph = ref.hc_mix_partials(x, fn[:4])
    return {"hc_mix_partials": (x, fn), "hc_weights_partials": (p, base, scale, 20, 1e-6, 4 * 37, 1e-6),
            "hc_collapse": (x, pre), "hc_head": (x, ph, base[:4], scale[:1], 1e-6, 1e-6),
            "hc_merge": (x, out, post, comb)}


def test_the_ops_cuda_kernels_run_the_triton_form_for_16_32_bit_floats(monkeypatch):
    """What ops registers for CUDA, called with CPU tensors (the kernels through the interpreter):
    each op's arguments fit its fused_mhc function, the results its torch form's; float64 or
    forms(fused="torch") run the torch form without touching the kernels."""
    from simtree.kernels.layers import ops
    forms_of = {"hc_mix_partials": ref.hc_mix_partials, "hc_weights_partials": ops._weights_of_partials,
                "hc_collapse": ref.hc_collapse, "hc_head": ops._head_of_partials, "hc_merge": ref.hc_merge}
    for name, args in _op_args(torch.float32).items():
        got, want = ops._cuda_kernel(name, forms_of[name])(*args), forms_of[name](*args)
        if name == "hc_mix_partials":
            got, want = got.sum(0), want.sum(0)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for name in forms_of:
        monkeypatch.setattr(fm, name, lambda *a: pytest.fail("the Triton form ran"))
    for name, args in _op_args(torch.float64).items():
        ops._cuda_kernel(name, forms_of[name])(*args)
    with forms(fused="torch"):
        for name, args in _op_args(torch.float32).items():
            ops._cuda_kernel(name, forms_of[name])(*args)


def test_hc_form_auto_resolves_through_v4_auto_and_bad_form_is_one_line():
    from simtree.errors import SimtreeError
    from simtree.kernels.layers.forms import V4_AUTO, v4_form
    assert V4_AUTO["v4_hc"] in ("torch", "fused") and v4_form("v4_hc") == V4_AUTO["v4_hc"]
    with forms(v4_hc="fused"):
        assert v4_form("v4_hc") == "fused"
    with forms(v4_hc="torch"):
        assert v4_form("v4_hc") == "torch"
    with pytest.raises(SimtreeError, match="v4_hc form 'triton': use auto, fused, torch"):
        forms(v4_hc="triton").__enter__()


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


def test_fused_hc_ops_name_misshaped_weights_and_take_no_tokens():
    """A mis-shaped fn or merge input is one SimtreeError line (the kernels would read out of
    bounds); T = 0 gives empty outputs on both paths."""
    from simtree.errors import SimtreeError
    x, fn, base, scale = _streams(3, 4, 37, torch.float32, seed=3)
    with pytest.raises(SimtreeError, match="fn is"):
        fm.hc_mix_partials(x, fn[:, :-1])
    with pytest.raises(SimtreeError, match="merge"):
        fm.hc_merge(x, torch.zeros(3, 36), torch.zeros(3, 4), torch.zeros(3, 4, 4))
    x0 = x[:0]
    assert fm.hc_mix_partials(x0, fn).shape[1] == 0 and ref.hc_mix_partials(x0, fn).shape[1] == 0
    pre, post, comb = mhc.hc_pre(x0, fn, base, scale, 20, 1e-6, 1e-6)
    assert pre.shape == (0, 37) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
