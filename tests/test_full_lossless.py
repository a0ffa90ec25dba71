"""Greedy speculative decoding on the full runtime equals plain greedy decoding, token for token,
for both model families, batch 1 and 3, plain / linear D=4 / EAGLE s3 k2 D6."""
import pytest

from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.lossless import check_lossless

from full_helpers import FAMILIES, PROMPTS, tiny_model

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
