"""Greedy speculative decoding on the full runtime equals plain greedy decoding, token for token,
for both model families, batch 1 and 3, plain / linear D=4 / EAGLE s3 k2 D6."""
import pytest

from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.lossless import check_lossless

from full_helpers import FAMILIES, PROMPTS, tiny_model

BF16_ROUNDING = 4 * 2.0 ** -6      # four ulps of a bf16 logit below 4 in magnitude
SPECS = [PolicySpec.from_dict("linear", {"budget": 4}), PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6})]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_output_equals_plain_greedy(name, batch):
    rows = check_lossless(tiny_model(name), PROMPTS[:batch] if batch > 1 else PROMPTS[1:2], SPECS, 24)
    assert [r["policy"] for r in rows] == ["linear_d4", "eagle_s3_k2_d6"]
    for r in rows:
        assert r["match"], r
        # drafts were accepted and rejected: the check exercised both paths of a round
        assert 1.2 < r["accepted_tokens_per_round"] < 3.5, r


def test_a_different_model_gives_different_outputs():
    """The check can fail: two seeds decode differently (the outputs depend on the weights)."""
    from simtree.runtime.full.drafting import round_shape
    from simtree.runtime.full.engine import FullEngine

    outs = []
    for seed in (1, 2):
        engine = FullEngine(tiny_model("tiny-gdn", seed), round_shape(PolicySpec.from_dict("none")), 1, 64)
        engine.prefill(PROMPTS[1:2])
        engine.run(max_new_tokens=8)
        outs.append(engine.outputs()[0][:8])
    assert outs[0] != outs[1]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_verify_probe_agrees_with_decode_at_a_plain_position(name):
    """The diagnosis of a mismatch: through the verify forward (a chain of the policy's rows) the
    position's logits are the decode step's (float64: rounding only), and so is its token."""
    from simtree.runtime.full.drafting import round_shape
    from simtree.runtime.full.engine import FullEngine
    from simtree.runtime.full.lossless import _probe

    model = tiny_model(name)
    engine = FullEngine(model, round_shape(PolicySpec.from_dict("none")), 1, 96)
    engine.prefill(PROMPTS[1:2])
    engine.run(max_new_tokens=10)
    out = engine.outputs()[0][:10]
    for at, nodes in ((3, 6), (7, 16), (9, 1)):
        probe = _probe(model, PROMPTS[1], out, at, nodes, 96)
        assert probe["margin"] > 0 and probe["deviation"] < 1e-9, probe
        assert probe["verify_token"] == out[at]


def test_a_broken_verify_is_caught_and_the_probe_shows_it():
    """A round whose verify forward is wrong (noise on its hidden rows) decodes differently; the
    row names the first difference and a verify-vs-decode deviation far above rounding."""
    import torch

    model = tiny_model.__wrapped__("tiny-gdn")          # a private copy: the cached one stays intact
    verify = model.verify
    gen = torch.Generator().manual_seed(0)

    def noisy(st, tokens, parents):
        hidden, pend = verify(st, tokens, parents)
        return hidden + 2.0 * torch.randn(hidden.shape, generator=gen, dtype=hidden.dtype), pend

    model.verify = noisy
    rows = check_lossless(model, PROMPTS[:2], SPECS[:1], 16)
    assert not rows[0]["match"] and rows[0]["first_diff"].startswith("sequence")
    assert rows[0]["deviation"] > 1e-3 and rows[0]["plain_token"] != rows[0]["spec_token"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_speculative_output_equals_plain_up_to_near_ties(name, seed):
    """In bf16 (the GPU's dtype) the verify and decode forwards sum in different orders: the
    outputs must still match, or differ first where the plain run's top-2 gap is within twice
    the two forwards' logit deviation there (a rounding near-tie, what the probe reports)."""
    _bf16_lossless(name, seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_v4_with_every_layer_fusion_is_lossless(seed):
    """The V4 forms the runtime does not run by default yet (the CSA top-k and list in one launch,
    the fused hyper-connections, the checkpoint's bf16 compressor projections): built and decoded
    under them, speculative output equals plain up to near ties as with the defaults.  (On the
    CPU the runtime's tree verify takes the torch attention path, where the Triton-only launches,
    v4_topk's and v4_pool's, do not run: tests/test_v4_fused_verify.py checks those.)"""
    import torch

    from simtree.kernels.layers.forms import forms
    with forms(v4_topk="fused", v4_hc="fused", v4_comp="model"):
        model = _bf16_lossless("tiny-v4", seed)
    comp = [t for k, t in model.w.items() if k.endswith(("comp.wkv", "idx.wgate"))]
    assert comp and all(t.dtype == torch.bfloat16 for t in comp)       # built at the checkpoint's dtype


def _bf16_lossless(name, seed):
    import numpy as np
    import torch

    from simtree.models import get_model
    from simtree.runtime.full.qwen import QwenModel
    from simtree.runtime.full.v4_rank import V4Rank
    from simtree.runtime.full.lossless import make_predictable

    shape = get_model(name)
    model = (QwenModel if shape.family == "gdn_hybrid" else V4Rank)(shape, device="cpu", dtype=torch.bfloat16,
                                                                     seed=seed)
    make_predictable(model, 0.3)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, model.vocab, 12).tolist() for _ in range(3)]
    for r in check_lossless(model, prompts, SPECS, 24):
        assert 1.2 < r["accepted_tokens_per_round"] < 3.5, r
        # a near-tie, not a bug: a deviation of a few bf16 ulps at the tiny models' logits (|l| < 4:
        # ulp 2^-6), within which the plain top-2 gap lies
        assert r["match"] or r["margin"] <= 2 * r["deviation"] <= 2 * BF16_ROUNDING, r
    return model
