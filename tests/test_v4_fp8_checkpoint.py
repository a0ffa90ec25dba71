"""DeepSeek-V4 checkpoints with quantised experts: a tiny float checkpoint (transformers'
save_pretrained) whose routed and shared experts are re-saved block-scaled FP8 (``weight_scale_inv``
companions, a ``quantization_config``; two attention linears FP8 too), or the routed ones MXFP4 (``expert_dtype`` fp4: e2m1
pairs and UE8M0 scales per 32 channels), loads as an FP8-expert rank and decodes as the float
model whose experts are the dequantised values.  CPU, float32."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from simtree.checkpoints.quantized import FP8_DTYPE, dequantize_weight, quantize_weight
from simtree.errors import SimtreeError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from v4_checkpoint_helpers import save_tiny  # noqa: E402

VOCAB = 101
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128]}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _is_expert(key: str) -> bool:
    return (".ffn.experts." in key or ".shared_experts." in key) and key.endswith(".weight")


def _fp8_elsewhere(key: str) -> bool:
    """The attention's linears, which DeepSeek's checkpoint stores FP8 as well (the indexer's
    wq_b too; its head weights and the compressors bf16)."""
    return key.endswith(("attn.wq_a.weight", "attn.wkv.weight", "attn.wq_b.weight", "attn.wo_a.weight",
                         "attn.wo_b.weight", "attn.indexer.wq_b.weight"))


def _mxfp4(shape, g: torch.Generator):
    """Random MXFP4 weight [N, K]: (packed int8 [N, K/2], UE8M0 uint8 scales [N, ceil(K/32)], its real values)."""
    N, K = shape
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    exps = torch.randint(121, 125, (N, -(-K // 32)), generator=g, dtype=torch.uint8)
    real = E2M1[codes.long()] * (exps.float() - 127).exp2().repeat_interleave(32, -1)[:, :K]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, exps, real


def _quantised_pair(src, root, fmt: str):
    """(folder of the quantised checkpoint, folder of the float one with the dequantised experts)."""
    tensors = safetensors_torch.load_file(src / "model.safetensors")
    quant, real, g = {}, {}, torch.Generator().manual_seed(5)
    for key, t in tensors.items():
        if not _is_expert(key) and not _fp8_elsewhere(key):
            quant[key] = real[key] = t
        elif fmt == "fp4" and ".ffn.experts." in key:
            packed, scales, real[key] = _mxfp4(t.shape, g)
            quant[key], quant[key[:-len(".weight")] + ".weight_scale_inv"] = packed, scales
        else:
            q = quantize_weight(t, pow2=True)
            quant[key], quant[key[:-len(".weight")] + ".weight_scale_inv"] = q.weight, q.scale_inv
            real[key] = dequantize_weight(q)
    config = json.loads((src / "config.json").read_text())
    out = []
    for name, ts, cfg in (("q", quant, {**config, "quantization_config": QUANT, "expert_dtype": fmt}),
                          ("ref", real, config)):
        folder = root / f"{fmt}_{name}"
        folder.mkdir()
        safetensors_torch.save_file(ts, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(cfg))
        out.append(folder)
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4float")
    save_tiny(path, moe_intermediate_size=128)       # whole 128-row blocks: w1 | w3 keep their scales
    return path


def _rank(path):
    from simtree.runtime.full.v4_rank import V4Rank
    return V4Rank.from_checkpoint(path, device="cpu", dtype=torch.float32, note=lambda s: None)


@torch.no_grad()
def _decode_logits(rank, ids: list[int]) -> torch.Tensor:
    st = rank.new_state(1, 64)
    return torch.stack([rank.logits(rank.decode(st, torch.tensor([t])))[0] for t in ids])


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_a_quantised_checkpoint_decodes_as_its_dequantised_float_model(src, tmp_path, fmt):
    qpath, refpath = _quantised_pair(src, tmp_path, fmt)
    rank, ref = _rank(qpath), _rank(refpath)
    assert rank.d.experts == "fp8" and ref.d.experts == "bf16"
    for name in ("layers.2.experts_gu", "layers.2.experts_down", "layers.2.shared_gu", "mtp.experts_gu"):
        if name in rank.w:
            assert rank.w[name].dtype == FP8_DTYPE and rank.w[name + "_scale_inv"].dtype == torch.float32
    # the attention's linears stay FP8 where their rope rows stay inside their 128-blocks (wq_b,
    # the indexer's wq_b) or nothing moves (wo_b); wo_a (12-row groups) and wq_a | wkv (a 20-row
    # first part) run dequantised, without scales; the indexer's head weights apart, in fp32
    assert rank.d.proj == "fp8" and ref.d.proj == "bf16"
    for name in ("layers.1.wq_b", "layers.1.wq_idx", "layers.1.wo_b", "mtp.wq_b"):
        assert rank.w[name].dtype == FP8_DTYPE and rank.w[name + "_scale_inv"].dtype == torch.float32, name
    for name in ("layers.1.wo_a", "layers.1.wqkv_a", "layers.1.wi_head"):
        assert rank.w[name].dtype == torch.float32 and name + "_scale_inv" not in rank.w, name
    assert rank.w["layers.1.wqkv_a"].shape[0] == ref.w["layers.1.wqkv_a"].shape[0] - rank.w["layers.1.wi_head"].shape[0]
    # the loaded FP8 experts are the checkpoint's values exactly
    from simtree.checkpoints.quantized import Fp8Weight
    gu = dequantize_weight(Fp8Weight(rank.w["layers.2.experts_gu"], rank.w["layers.2.experts_gu_scale_inv"]))
    assert torch.equal(gu, ref.w["layers.2.experts_gu"])
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    out, want = _decode_logits(rank, ids), _decode_logits(ref, ids)
    assert float((out - want).abs().max() / want.abs().max()) <= 1e-4
    assert torch.equal(out.argmax(-1), want.argmax(-1))
    # the package's reader (simtree run --model PATH) loads the same weights
    from simtree.runtime.full.build import build_model
    built = build_model(str(qpath), device="cpu", dtype=torch.float32)
    assert set(built.w) == set(rank.w) and all(torch.equal(built.w[k], rank.w[k]) for k in rank.w)


@torch.no_grad()
def test_speculative_decoding_of_an_fp8_checkpoint_is_lossless(src, tmp_path):
    from simtree.planning.simulate import PolicySpec
    from simtree.runtime.full.lossless import check_lossless
    rank = _rank(_quantised_pair(src, tmp_path, "fp8")[0])
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 12)]
    rows = check_lossless(rank, prompts, [PolicySpec.from_dict("linear", {"budget": 3})], 12, 128)
    assert rows and all(r["match"] for r in rows), rows


def test_the_form_v4_proj_bf16_loads_the_fp8_linears_dequantised(src, tmp_path):
    """Form v4_proj "bf16": the checkpoint's FP8 attention linears dequantised on load (the
    indexer's head weights back in the first GEMM), the experts still FP8; the same logits."""
    from simtree.kernels.layers.forms import forms
    qpath, _ = _quantised_pair(src, tmp_path, "fp8")
    fp8_rank = _rank(qpath)
    with forms(v4_proj="bf16"):
        rank = _rank(qpath)
    assert rank.d.proj == "bf16" and rank.w["layers.1.wq_b"].dtype == torch.float32
    assert "layers.1.wq_b_scale_inv" not in rank.w and "layers.1.wi_head" not in rank.w
    assert rank.w["layers.2.experts_gu"].dtype == FP8_DTYPE
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    out, want = _decode_logits(rank, ids), _decode_logits(fp8_rank, ids)
    assert float((out - want).abs().max() / want.abs().max()) <= 1e-4


def test_a_quantised_expert_without_its_scales_is_named(src, tmp_path):
    qpath, _ = _quantised_pair(src, tmp_path, "fp8")
    tensors = safetensors_torch.load_file(qpath / "model.safetensors")
    key = "model.layers.2.ffn.experts.1.w2.weight_scale_inv"
    tensors.pop(key)
    safetensors_torch.save_file(tensors, qpath / "model.safetensors")
    with pytest.raises(SimtreeError, match=f"missing tensor {key}"):
        _rank(qpath)
    shutil.rmtree(qpath)
