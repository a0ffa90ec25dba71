"""V4 compressor: the online (token by token) and batched (per completing window) forms agree."""
import pytest
import torch

from simtree.kernels.v4 import V4AttnConfig, empty_state, decode_tokens, random_inputs, random_layer_weights
from simtree.kernels.v4.compressor import (init_state, online_step, pool_window, project,
                                           random_compressor)


def _windows_batched(p, kv, score):
    """Every completed entry from whole-sequence projections kv, score [T, C] (batched form)."""
    T = kv.shape[0]
    n_entries = T // p.ratio
    S = p.num_slots
    kv_slots = torch.zeros(n_entries, S, kv.shape[1], dtype=kv.dtype)
    sc_slots = torch.full_like(kv_slots, float("-inf"))
    for i in range(n_entries):
        first = (i - 1) * p.ratio if p.overlap else i * p.ratio
        for s in range(S):
            q = first + s
            if q >= 0:
                kv_slots[i, s], sc_slots[i, s] = kv[q], score[q]
    return pool_window(p, kv_slots, sc_slots, torch.arange(n_entries))


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False), (16, False)])
@pytest.mark.parametrize("seed", [0, 1])
def test_online_equals_batched(ratio, overlap, seed):
    gen = torch.Generator().manual_seed(seed)
    p = random_compressor(32, ratio, 24, 8, overlap, gen)
    T = 5 * ratio + 3
    x = torch.randn(T, 24, generator=gen, dtype=torch.float64)
    kv, score = project(p, x, torch.arange(T))
    kv_state, sc_state = init_state(p)
    online = []
    for t in range(T):
        k1, s1 = project(p, x[t:t + 1], torch.tensor([t]))
        e = online_step(p, kv_state, sc_state, k1[0], s1[0], t)
        if e is not None:
            online.append(e)
    batched = _windows_batched(p, kv, score)
    assert len(online) == T // ratio
    torch.testing.assert_close(torch.stack(online), batched, rtol=1e-12, atol=1e-12)


def test_first_c4_entry_ignores_missing_previous_window():
    """Entry 0 of C4 pools only its own 4 tokens: the empty first half (score -inf) adds nothing."""
    gen = torch.Generator().manual_seed(3)
    p = random_compressor(16, 4, 12, 8, True, gen)
    x = torch.randn(4, 12, generator=gen, dtype=torch.float64)
    kv, s = project(p, x, torch.arange(4))
    d = p.dim
    w = torch.softmax(s[:, d:], dim=0)
    pooled = (kv[:, d:] * w).sum(0)
    normed = pooled * torch.rsqrt(pooled.pow(2).mean() + p.eps) * p.norm  # RoPE at position 0 is identity
    kv_state, sc_state = init_state(p)
    assert torch.isneginf(sc_state).all()
    for t in range(4):
        e = online_step(p, kv_state, sc_state, kv[t], s[t], t)
    torch.testing.assert_close(e, normed, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_entries_complete_every_ratio_tokens(kind):
    """After L tokens there are exactly L // r compressed (and indexer) entries."""
    cfg = V4AttnConfig.tiny()
    w = random_layer_weights(cfg, kind, seed=2)
    gen = torch.Generator().manual_seed(2)
    st = empty_state(cfg, w)
    r = cfg.ratio(kind)
    for step in (r - 1, 1, 2 * r - 1):  # stop just before, at, and past window boundaries
        decode_tokens(cfg, w, st, random_inputs(cfg, step, gen))
        assert st.comp.shape[0] == st.length // r
        if kind == "csa":
            assert st.idx.shape[0] == st.length // r


def test_rope_rotates_only_last_channels():
    from simtree.kernels.v4.compressor import apply_rope
    x = torch.randn(3, 16, dtype=torch.float64)
    y = apply_rope(x, torch.tensor([0, 5, 9]), 8, 10000.0)
    torch.testing.assert_close(y[:, :8], x[:, :8])
    torch.testing.assert_close(y[0], x[0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(y[1, 8:], x[1, 8:])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="the tensor-core form needs CUDA"))])
def test_bf16_projections_multiply_into_fp32(device):
    """The checkpoint's bf16 compressor projections: project() gives fp32 kv / score, equal to
    float64 of the same (bf16) operands to fp32 rounding (CUDA: torch.mm / addmm with out_dtype,
    the bias in the GEMM), and the verify's stacked form equals it."""
    import torch

    from simtree.kernels.v4.compressor import matmul_t, project, random_compressor
    from simtree.kernels.v4.verify import project_stacked
    g = torch.Generator().manual_seed(7)
    p = random_compressor(16, 4, 96, 8, True, g, dtype=torch.float32).to(device)
    p.wkv, p.wgate = p.wkv.bfloat16(), p.wgate.bfloat16()
    x = torch.randn(5, 96, generator=g).bfloat16().to(device)
    pos = torch.arange(7, 12, device=device)
    kv, score = project(p, x, pos)
    assert kv.dtype == score.dtype == torch.float32
    ref_kv = x.double() @ p.wkv.double().T
    ref_score = x.double() @ p.wgate.double().T + p.ape.double()[pos % 4]
    assert torch.allclose(kv.double(), ref_kv, rtol=1e-5, atol=1e-5)
    assert torch.allclose(score.double(), ref_score, rtol=1e-5, atol=1e-5)
    st = project_stacked(p, x, pos % 4)
    assert st.shape == (2, 5, p.wkv.shape[0]) and torch.equal(st[0], kv) and torch.equal(st[1], score)
    out = torch.empty(5, p.wkv.shape[0], device=device)
    assert matmul_t(x, p.wkv, torch.float32, out=out) is out and torch.equal(out, kv)
