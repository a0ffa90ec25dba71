"""The layers' fused Triton kernels (kernels/layers/fused.py, through Triton's interpreter on the
CPU) against their torch definitions (reference.py), on fresh random inputs read through the
strides the layers give them (slices of a fused projection's output)."""
import pytest
import torch
import torch.nn.functional as F

from simtree.kernels.layers import fused, ops
from simtree.kernels.layers import reference as ref

G = torch.Generator().manual_seed(0)


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=G).to(dtype)


def _close(got, want, tol=1e-5):
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("D, weighted", [(24, True), (64, False)])
def test_rms_norm_reads_strided_rows(D, weighted):
    x = _r(5, 3 * D)[:, D:2 * D]
    w = _r(D) if weighted else None
    _close(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    _close(ref.rms_norm(x, w, 1e-6), F.rms_norm(x, (D,), w, 1e-6))


def test_gated_rms_norm():
    o, z, w = _r(4, 3, 16), _r(4, 80)[:, 8:56], _r(16)
    want = ref.gated_rms_norm(o, z, w, 1e-6)
    _close(fused.gated_rms_norm(o, z, w, 1e-6), want)
    _close(want, (F.rms_norm(o, (16,), w, 1e-6) * F.silu(z.reshape(4, 3, 16))).reshape(4, 48))


def test_silu_mul_and_sigmoid_mul():
    gu = _r(6, 50)[:, 2:42]
    _close(fused.silu_mul(gu), ref.silu_mul(gu))
    _close(ref.silu_mul(gu), F.silu(gu[:, :20]) * gu[:, 20:])
    qg = _r(5, 4, 32)
    o, gate = _r(5, 4, 16), qg[..., 16:]
    _close(fused.sigmoid_mul(o, gate), ref.sigmoid_mul(o, gate))


def test_gdn_gates_with_large_arguments():
    ba = _r(7, 20)[:, 2:18] * 12                     # a + dt_bias past softplus' threshold of 20
    neg_a, dt = -torch.rand(8, generator=G) * 3, _r(8) * 10
    g, beta = fused.gdn_gates(ba, neg_a, dt)
    g_ref, beta_ref = ref.gdn_gates(ba, neg_a, dt)
    _close(g, g_ref)
    _close(beta, beta_ref)
    assert bool((g <= 0).all())


@pytest.mark.parametrize("lo, norm, weighted, inverse", [(0, True, True, False), (24, False, False, False),
                                                          (24, True, True, True), (8, False, False, True)])
def test_norm_rope(lo, norm, weighted, inverse):
    T, H, D, R = 5, 3, 32, 8
    x = _r(T, H, 2 * D)[..., :D]                      # a strided view (q of a q|gate projection)
    w = _r(D) if weighted else None
    ang = _r(T, R // 2) * 3
    cs = torch.cat([torch.cos(ang), torch.sin(ang)], -1)
    want = ref.norm_rope(x, w, cs, lo, inverse, 1e-6, norm)
    _close(fused.norm_rope(x, w, cs, lo, inverse, 1e-6, norm), want)
    out = torch.zeros(T, 2, H, D)[:, 1]                # into a strided destination
    fused.norm_rope(x, w, cs, lo, inverse, 1e-6, norm, out=out)
    _close(out, want)
    # the rotation by the opposite angles undoes it: back to the normed (or plain) rows
    unrotated = ref.norm_rope(x, w, torch.cat([torch.ones_like(ang), torch.zeros_like(ang)], -1), lo, False,
                              1e-6, norm)
    _close(ref.norm_rope(want, None, cs, lo, not inverse, 1e-6, False), unrotated)
    assert not torch.allclose(want, unrotated)


def _conv_case(N=7, B=3, W=4, C=40):
    x = _r(N, C + 9)[:, 3:3 + C]
    state = _r(B, W - 1, C)
    idx = torch.randint(-B * (W - 1), N, (N, W), generator=G)
    return x, state, idx, _r(C, W)


def test_tree_conv_matches_the_reference_and_the_tap_sum():
    x, state, idx, w = _conv_case()
    splits = (10, 22)
    want = ref.tree_conv(x, state, idx, w, splits)
    _close(fused.tree_conv(x, state, idx, w, splits), want)
    rows = state.reshape(-1, 40)
    n, c = 4, 13
    taps = [x[i] if i >= 0 else rows[-1 - i] for i in idx[n].tolist()]
    y = F.silu(sum(taps[t][c] * w[c, t] for t in range(4)))
    assert abs(float(want[7 * 10 + n * 12 + (c - 10)]) - float(y)) < 1e-5   # k block, row n


@pytest.mark.parametrize("R", [1, 2, 3])
def test_gather_rows_reads_every_source_before_writing(R):
    x, state, _, _ = _conv_case(W=R + 1)
    B = state.shape[0]
    idx = torch.stack([torch.tensor([-1 - (b * R + (s + 1) % R) if s % 2 == 0 else s for s in range(R)])
                       for b in range(B)])                 # shifts read rows that are rewritten
    want = state.clone()
    ref.gather_rows(want, x, idx)
    got = state.clone()
    fused.gather_rows(got, x, idx)
    _close(got, want)
    assert torch.equal(want[1, 0], state[1, 1 % R])


def test_custom_ops_are_the_references_on_the_cpu():
    x, state, idx, w = _conv_case()
    assert torch.equal(ops.tree_conv(x, state, idx, w, [10, 22], True), ref.tree_conv(x, state, idx, w, (10, 22)))
    s1, s2 = state.clone(), state.clone()
    ops.gather_rows(s1, x, idx[:3, :3])
    ref.gather_rows(s2, x, idx[:3, :3])
    assert torch.equal(s1, s2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_ops_on_the_gpu_at_qwen_shapes():
    """bf16 at Qwen3.6-27B's widths (hidden 5120, MLP 17408, GDN 48 x 128, conv 10240, attention
    24 x 256): each custom op's Triton kernel against its torch form."""
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=dev).to(bf)  # noqa: E731
    T = 24
    x, gu, o, z = r(T, 5120), r(T, 2 * 17408), r(T, 48, 128), r(T, 48 * 128)
    cases = [(ops.rms_norm, (x, r(5120), 1e-6), ref.rms_norm), (ops.silu_mul, (gu,), ref.silu_mul),
             (ops.gated_rms_norm, (o, z, r(128), 1e-6), ref.gated_rms_norm)]
    qg = r(T, 24, 512)
    ang = torch.randn(T, 32, device=dev)
    cs = torch.cat([ang.cos(), ang.sin()], -1)
    cases += [(ops.sigmoid_mul, (r(T, 24, 256), qg[..., 256:]), ref.sigmoid_mul),
              (ops.norm_rope, (qg[..., :256], r(256), cs, 0, False, 1e-6, True), ref.norm_rope)]
    for op, args, want in cases:
        got, exp = op(*args).float(), want(*args).float()
        assert float((got - exp).abs().max() / exp.abs().max()) < 2e-2, op
    proj = r(T, 10240 + 6144 + 96)
    state, w = r(4, 3, 10240), r(10240, 4)
    idx = torch.randint(-12, T, (T, 4), device=dev)
    got = ops.tree_conv(proj[:, :10240], state, idx, w, [2048, 4096], True).float()
    exp = ref.tree_conv(proj[:, :10240], state, idx, w, (2048, 4096)).float()
    assert float((got - exp).abs().max() / exp.abs().max()) < 2e-2
    neg_a, dt = -torch.rand(48, device=dev), torch.randn(48, device=dev)
    for got, exp in zip(ops.gdn_gates(proj[:, -96:], neg_a, dt), ref.gdn_gates(proj[:, -96:], neg_a, dt)):
        assert got.dtype == torch.float32 and float((got - exp).abs().max()) < 1e-4
