"""Block-scaled FP8 weights and GEMMs (kernels/layers/fp8.py, fp8_kernel.py): the quantisers'
error bounds, the Triton grouped kernel (through the interpreter) against the FP8 GEMM's math,
that math against the dequantised reference, and the V4 MoE on FP8 experts."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from simtree.errors import SimtreeError
from simtree.kernels.layers import fp8
from simtree.kernels.layers import v4 as L
from simtree.kernels.layers.forms import current, set_forms
from simtree.kernels.layers.fp8_kernel import grouped_fp8_gemm
from simtree.kernels.layers.weights import make_weights, spec_bytes
from simtree.models import get_model
from simtree.quant import expert_dtype_from_hf, expert_format_from_hf

torch.set_num_threads(1)
E4M3_REL = 2.0 ** -4           # half a unit in the last place of a 3-bit mantissa
E4M3_SUB = 2.0 ** -9           # the subnormal step (times the block's scale)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _w(shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)) / shape[-1] ** 0.5


def _expanded(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return s.repeat_interleave(128, -2)[..., :rows, :].repeat_interleave(128, -1)[..., :cols]


@pytest.mark.parametrize("pow2", [False, True])
def test_weight_round_trip_is_within_e4m3_rounding(pow2):
    w = _w((3, 200, 300), seed=1)
    w[1, :5, :7] *= 1e-4                      # a block with tiny values next to large ones: subnormals
    q = fp8.quantize_weight(w, pow2=pow2)
    assert q.weight.dtype == torch.float8_e4m3fn and q.scale_inv.shape == (3, 2, 3)
    if pow2:
        assert torch.equal(q.scale_inv, torch.exp2(torch.log2(q.scale_inv).round()))
    err = (fp8.dequantize_weight(q) - w).abs()
    bound = E4M3_REL * w.abs() + E4M3_SUB * _expanded(q.scale_inv, 200, 300)
    assert (err <= bound * (1 + 1e-6)).all()
    # each block's largest value lands on the e4m3 maximum (without power-of-two rounding)
    if not pow2:
        assert q.weight.float().abs().amax() == fp8.FP8_MAX
        again = fp8.quantize_weight(fp8.dequantize_weight(q))
        assert torch.equal(fp8.dequantize_weight(again), fp8.dequantize_weight(q))


def test_activation_groups_are_per_row_and_128_channels():
    x = torch.randn(5, 300, generator=_gen(2))
    x[2] = 0.0                                 # an all-zero row: scale at the floor, values 0
    x[3, 130:140] *= 1000                      # a loud group does not move its neighbours' scales
    q, s = fp8.quantize_act(x)
    assert q.shape == (5, 300) and s.shape == (5, 3)
    assert torch.equal(q[2].float(), torch.zeros(300))
    assert s[3, 1] > 100 * s[3, 0] and s[3, 2] < 10 * s[4, 2]
    back = q.float() * s.repeat_interleave(128, -1)[:, :300]
    assert ((back - x).abs() <= E4M3_REL * x.abs() + E4M3_SUB * s.repeat_interleave(128, -1)[:, :300] + 1e-30).all()


def test_the_fp8_gemm_math_is_the_dequantised_linear_within_activation_rounding():
    w = fp8.quantize_weight(_w((256, 384), seed=3))
    x = torch.randn(33, 384, generator=_gen(4))
    ref = fp8.linear_ref(x, w)
    assert torch.allclose(ref, F.linear(x, fp8.dequantize_weight(w)), rtol=1e-6, atol=1e-6)
    emu = fp8.linear_emulated(x, w)
    rel = (emu - ref).norm() / ref.norm()
    assert 1e-4 < rel < 0.06            # the activations' FP8 rounding, no more
    assert torch.equal(fp8.linear(x, w), ref)                      # CPU: the reference
    assert torch.equal(fp8.linear(x, w.weight.float()), F.linear(x, w.weight.float()))   # a plain weight


@pytest.mark.parametrize("dtype, pow2", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_triton_grouped_kernel_is_the_fp8_gemm_math(dtype, pow2):
    """Experts with no rows, rows across several row tiles, sizes that are not multiples of 128."""
    E, N, K = 4, 200, 300
    w = fp8.quantize_weight(_w((E, N, K), seed=5))
    ends = [10, 10, 47, 60]                    # expert 1 gets no rows, expert 2 spans tiles
    x = torch.randn(60, K, generator=_gen(6)).to(dtype)
    y = grouped_fp8_gemm(x, w.weight, w.scale_inv, torch.tensor(ends, dtype=torch.int32), pow2=pow2)
    start, parts = 0, []
    for e, end in enumerate(ends):
        parts.append(fp8.linear_emulated(x[start:end], fp8.Fp8Weight(w.weight[e], w.scale_inv[e]), pow2))
        start = end
    ref = torch.cat(parts)
    assert y.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    else:                                      # the float32 sum rounded once: one bf16 step apart at most
        assert torch.allclose(y.float(), ref.float(), rtol=2.0 ** -7, atol=1e-3)


def test_grouped_linear_on_the_cpu_is_one_reference_linear_per_expert():
    w = fp8.quantize_weight(_w((3, 64, 96), seed=7))
    x = torch.randn(9, 96, generator=_gen(8))
    out = fp8.grouped_linear(x, w, torch.tensor([4, 4, 9]))
    assert torch.equal(out[:4], fp8.linear_ref(x[:4], fp8.Fp8Weight(w.weight[0], w.scale_inv[0])))
    assert torch.equal(out[4:], fp8.linear_ref(x[4:], fp8.Fp8Weight(w.weight[2], w.scale_inv[2])))


def test_a_malformed_fp8_weight_is_one_line():
    w = fp8.quantize_weight(_w((64, 256)))
    with pytest.raises(SimtreeError, match=r"scales \(1, 1\): expected .* scales \(1, 2\)"):
        fp8.Fp8Weight(w.weight, w.scale_inv[:, :1])
    with pytest.raises(SimtreeError, match="expected torch.float8_e4m3fn"):
        fp8.Fp8Weight(w.weight.float(), w.scale_inv)


def test_checkpoint_scales_are_widened_to_float32_and_checked():
    w = fp8.quantize_weight(_w((256, 256)), pow2=True)
    ue8m0 = w.scale_inv.to(torch.float8_e8m0fnu)                  # power-of-two scales: exact
    got = fp8.from_checkpoint("layers.0.mlp.experts.down_proj", w.weight, ue8m0)
    assert got.scale_inv.dtype == torch.float32 and torch.equal(got.scale_inv, w.scale_inv)
    with pytest.raises(SimtreeError, match=r"^layers.0.x: .*scales \(2, 1\): expected"):
        fp8.from_checkpoint("layers.0.x", w.weight, w.scale_inv[:, :1])
    with pytest.raises(SimtreeError, match="layers.0.x: block scales of dtype torch.int32"):
        fp8.from_checkpoint("layers.0.x", w.weight, w.scale_inv.int())


def test_mxfp4_experts_become_fp8_exactly():
    """FP4 values with per-32 power-of-two scales spanning 2^4 inside a block: the FP8 copy with
    power-of-two block scales holds every value exactly."""
    g = _gen(12)
    N, K = 160, 256
    nib = torch.randint(0, 16, (2, N, K), generator=g, dtype=torch.uint8)
    packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).view(torch.int8)
    exps = torch.randint(120, 125, (2, N, K // 32), generator=g, dtype=torch.uint8)     # 2^-7 .. 2^-3
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    want = lut[nib.long()] * (exps.float() - 127).exp2().repeat_interleave(32, -1)
    for scales in (exps, (exps.float() - 127).exp2().to(torch.float8_e8m0fnu)):
        w = fp8.fp4_to_fp8("experts.w1", packed, scales)
        assert w.weight.shape == (2, N, K) and w.scale_inv.shape == (2, 2, 2)
        assert torch.equal(fp8.dequantize_weight(w), want)
    with pytest.raises(SimtreeError, match=r"experts.w1: MXFP4 weight \(2, 160, 128\) with scales \(2, 160, 4\)"):
        fp8.fp4_to_fp8("experts.w1", packed, exps[..., :4])
    with pytest.raises(SimtreeError, match="experts.w1: MXFP4 weight of dtype torch.float32"):
        fp8.fp4_to_fp8("experts.w1", packed.float(), exps)


def test_checkpoint_configs_name_the_experts_format():
    block = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
    assert expert_dtype_from_hf({}) == "bf16"
    assert expert_dtype_from_hf({"quantization_config": block}) == "fp8"
    assert expert_dtype_from_hf({"quantization_config": {**block, "expert_dtype": "fp8"}}) == "fp8"
    fp4 = {"quantization_config": {**block, "expert_dtype": "fp4"}}
    assert expert_format_from_hf(fp4) == "fp4" and expert_dtype_from_hf(fp4) == "fp8"   # converted on load
    assert expert_format_from_hf({"expert_dtype": "fp4", "quantization_config": block}) == "fp4"
    for bad, what in (({**block, "expert_dtype": "int4"}, "expert_dtype 'int4'"),
                      ({**block, "weight_block_size": [1, 128]}, "weight_block_size"),
                      ({**block, "quant_method": "awq"}, "quant_method 'awq'"),
                      ({**block, "activation_scheme": "static"}, "activation_scheme")):
        with pytest.raises(SimtreeError, match=what):
            expert_dtype_from_hf({"quantization_config": bad})


# ---- the V4 MoE on FP8 experts ---------------------------------------------------------------
def _fp8_tiny():
    shape = get_model("tiny-v4")
    return dataclasses.replace(shape, mlp={**shape.mlp, "expert_dtype": "fp8"})


def test_fp8_experts_are_made_allocated_and_counted_at_their_bytes():
    shape = _fp8_tiny()
    specs = L.model_specs(shape, dtype=torch.float32)
    w = make_weights(specs, "cpu", torch.float32, seed=0)
    assert w["layers.0.experts_gu"].dtype == torch.float8_e4m3fn
    assert w["layers.0.experts_gu_scale_inv"].shape == (4, 1, 1) and w["layers.0.shared_down_scale_inv"].shape == (1, 1)
    assert w["layers.0.wqkv_a"].dtype == torch.float32 and w["layers.1.comp.wkv"].dtype == torch.float32
    held = sum(t.numel() * t.element_size() for t in w.values())
    assert held == spec_bytes(specs, torch.float32)
    # the registry's bytes move with the experts' format exactly as the allocated ones do
    bf16 = dataclasses.replace(shape, mlp={**shape.mlp, "expert_dtype": "bf16"})
    saved = spec_bytes(L.model_specs(bf16, dtype=torch.float32), torch.float32) - held
    assert saved > 0 and bf16.shard("ep=2").weight_bytes() - shape.shard("ep=2").weight_bytes() == saved
    real = fp8.dequantize_weight(fp8.weight(w, "layers.0.experts_gu"))
    assert abs(real.std().item() * 64 ** 0.5 - 1.0) < 0.05           # linear()'s std, in^-1/2
    again = make_weights(specs, "cpu", torch.float32, seed=0)
    assert torch.equal(again["layers.0.experts_gu"].view(torch.uint8), w["layers.0.experts_gu"].view(torch.uint8))


def _moe_inputs():
    shape = _fp8_tiny()
    d = L.V4Dims.of(shape)
    specs = [s for s in L.layer_specs("", "csa", d, 0.5, torch.float32) if s.name.startswith(("ln2", "router",
                                                                                              "experts", "shared"))]
    w = make_weights(specs, "cpu", torch.float32, seed=3)
    x = torch.randn(7, d.h, generator=_gen(9))
    dense = {k: v for k, v in w.items() if not k.endswith(fp8.SCALE_SUFFIX)}
    for k in ("experts_gu", "experts_down", "shared_gu", "shared_down"):
        dense[k] = fp8.dequantize_weight(fp8.weight(w, k))
    return d, w, dense, x


def test_v4_moe_on_fp8_experts_is_the_moe_on_their_dequantised_weights():
    d, w, dense, x = _moe_inputs()
    assert d.experts == "fp8"
    out = L.moe(w, d, x)
    assert torch.allclose(out, L.moe(dense, dataclasses.replace(d, experts="bf16"), x), rtol=1e-5, atol=1e-6)


@pytest.fixture
def fp8_gemm():
    """Sets the FP8 GEMM's form for one test (as a caller does), restored after it."""
    old = current().fp8_gemm
    yield lambda choice: set_forms(fp8_gemm=choice)
    set_forms(fp8_gemm=old)


def test_the_fp8_gemm_form_is_set_by_the_caller_and_checked(fp8_gemm):
    assert fp8.gemm_choice() == "auto"
    fp8_gemm("scaled_mm")
    assert fp8.gemm_choice() == "scaled_mm"
    with pytest.raises(SimtreeError, match="fp8_gemm form 'cublas'"):
        fp8_gemm("cublas")
    assert fp8.gemm_choice() == "scaled_mm"


def test_v4_moe_through_the_fp8_kernels_is_within_activation_rounding(monkeypatch, fp8_gemm):
    """The GPU path (Triton grouped kernel for routed and shared experts), run by the interpreter."""
    d, w, dense, x = _moe_inputs()
    ref = L.moe(dense, dataclasses.replace(d, experts="bf16"), x)
    fp8_gemm("triton")
    monkeypatch.setattr(fp8, "gpu_fp8", lambda t: True)
    out = L.moe(w, d, x)
    rel = ((out - x) - (ref - x)).norm() / (ref - x).norm()
    assert 0 < rel < 0.06


def test_the_lossless_checks_scale_an_fp8_projection_through_its_scales():
    from types import SimpleNamespace

    from simtree.runtime.full.lossless import make_predictable

    down = fp8.quantize_weight(_w((4, 64, 32), seed=11))
    model = SimpleNamespace(hidden=8, w={"layers.0.experts_down": down.weight, "layers.0.experts_down_scale_inv":
                                         down.scale_inv, "mtp.fc": torch.randn(8, 16)})
    before = model.w["layers.0.experts_down_scale_inv"].clone()
    raw = model.w["layers.0.experts_down"].view(torch.uint8).clone()
    make_predictable(model, 0.5)
    assert torch.equal(model.w["layers.0.experts_down_scale_inv"], before * 0.5)
    assert torch.equal(model.w["layers.0.experts_down"].view(torch.uint8), raw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("choice", ["scaled_mm", "triton"])
def test_gpu_fp8_gemms_are_the_fp8_gemm_math(fp8_gemm, choice):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    fp8_gemm(choice)
    dev = torch.device("cuda")
    w = fp8.quantize_weight(_w((4, 512, 1024), seed=10).to(dev))
    x = torch.randn(40, 1024, device=dev).to(torch.bfloat16)
    one = fp8.Fp8Weight(w.weight[0], w.scale_inv[0])
    ref = fp8.linear_emulated(x, one).float()
    assert torch.allclose(fp8.linear(x, one).float(), ref, rtol=2.0 ** -7, atol=2e-2)
    offs = torch.tensor([5, 5, 30, 40], dtype=torch.int32, device=dev)
    y = fp8.grouped_linear(x, w, offs)
    start, parts = 0, []
    for e, end in enumerate(offs.tolist()):
        parts.append(fp8.linear_emulated(x[start:end], fp8.Fp8Weight(w.weight[e], w.scale_inv[e])))
        start = end
    assert torch.allclose(y.float(), torch.cat(parts).float(), rtol=2.0 ** -7, atol=2e-2)


def test_a_plan_says_which_expert_format_its_profile_timed():
    from simtree.reporting.plan_report import _source_line

    costs = {"model": "deepseek-v4-flash", "source": {"profile": "p.csv", "sha256": "sha256:0123456789abcdef"},
             "profile_meta": {"collected": "2026-12-06", "expert_dtypes": {"deepseek-v4-flash": "fp8"}}}
    assert "experts timed in fp8" in _source_line(costs)
    assert "experts timed" not in _source_line({**costs, "profile_meta": {"collected": "2026-12-01"}})
