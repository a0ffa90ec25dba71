"""The full runtime with the GDN commit deferred into the next verify (layer form
``gdn_commit="deferred"``): greedy speculative decoding still equals plain greedy decoding, and
the state it leaves, once the next step folds it in, is the standalone commit's."""
import pytest
import torch

from simtree.kernels.layers.forms import forms
from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.engine import FullEngine
from simtree.runtime.full.lossless import check_lossless

from full_helpers import PROMPTS, tiny_model

SPECS = [PolicySpec.from_dict("linear", {"budget": 4}),
         PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6})]


@pytest.mark.parametrize("batch", [1, 3])
def test_deferred_commit_is_lossless_float32(batch):
    model = tiny_model("tiny-gdn", dtype=torch.float32)
    with forms(gdn_commit="deferred"):
        rows = check_lossless(model, PROMPTS[:batch] if batch > 1 else PROMPTS[1:2], SPECS, 24)
    for r in rows:
        assert r["match"], r
        assert 1.2 < r["accepted_tokens_per_round"] < 3.5, r


def _run(spec, form: str, rounds: int = 6):
    engine = FullEngine(tiny_model("tiny-gdn"), round_shape(spec), 2, 96)
    with forms(gdn_commit=form):
        engine.prefill(PROMPTS[:2])
        engine.run(rounds=rounds)
        waiting = [bool(p.on.any()) for p in engine.st.gdn_path.values()]
        engine.model.decode(engine.st, engine.roots)     # a plain step folds the waiting paths as it reads them
    return engine, waiting


def test_folded_deferred_state_is_the_standalone_commits():
    """Same rounds, both forms: the outputs agree and, after one more plain step (which folds
    the waiting paths in), so do the GDN states (float64 model: rounding only); in the deferred
    form paths were waiting before it."""
    spec = SPECS[1]
    std, _ = _run(spec, "standalone")
    dfr, waiting = _run(spec, "deferred")
    assert not std.st.gdn_path and waiting and all(waiting)
    assert dfr.outputs() == std.outputs()
    for i, s in std.st.ssm.items():
        assert torch.allclose(dfr.st.ssm[i], s, rtol=1e-5, atol=1e-6)
        assert not bool(dfr.st.gdn_path[i].on.any())
    assert torch.equal(dfr.st.lengths, std.st.lengths)
