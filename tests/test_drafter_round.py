"""The runtime's block drafter (runtime/full/block_drafters.py) in static buffers, eager on the
CPU: its backbone and then ``draft_round`` (the block engine's and the profiler's draft code)
commit the context round after round, and the trees agree with independent references (the
step-by-step best-first tree, the survival prefix).  On CUDA the block engine's own captured
stages (its draft stage among them) decode as its eager rounds and plain greedy (gpu)."""
from typing import NamedTuple

import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.layers.device_trees import TreeBuffers
from simtree.kernels.layers.drafters import (DraftShape, draft_round, survival, threshold_keep,
                                             tree_from_marginals)
from simtree.models import get_model
from simtree.planning.modes import PolicySpec
from simtree.runtime.full.block_drafters import DrafterRound

SIZES = {"block": {}, "tfm": dict(cand_k=16, adapter_dim=8), "dspark": dict(markov_rank=8)}


class _Output(NamedTuple):
    """The round's tree and what ``draft_round`` returns besides."""
    tree: TreeBuffers
    lp: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    verified_len: torch.Tensor | None = None


class _Round:
    """A whole round on a DrafterRound's static buffers: the inputs copied in, the backbone, then
    ``draft_round`` into the round's tree (a budget of 6 nodes, top-3, width 2, DSpark's prefix at
    survival 0.3)."""

    def __init__(self, d: DrafterRound):
        self.d = d
        self.tree = TreeBuffers.empty(d.n_new.shape[0], 6, d.n_new.device)
        self.keep = threshold_keep(0.3) if d.cfg.family == "dspark" else None

    def run(self, feats, n_new, anchor) -> _Output:
        d = self.d
        d.feats.copy_(feats)
        d.n_new.copy_(n_new)
        out = draft_round(d.cfg.family, d.w, d.cfg, d.hidden(anchor), anchor, self.tree, DraftShape(6, 2, 3),
                          keep=self.keep)
        return _Output(self.tree, *out)


def _round(family):
    d = DrafterRound(get_model("tiny-gdn"), family, batch=2, max_len=32, device="cpu", dtype=torch.float64,
                     layers=2, target_layers=2, block_len=4, **SIZES[family])
    return _Round(d)


def _inputs(r):
    d = r.d
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 5, 2 * d.cfg.h, generator=g, dtype=torch.float64).to(d.feats.dtype)
    return feats, torch.tensor([1, 3]), torch.tensor([7, 8])


@pytest.mark.parametrize("family", ["block", "tfm", "dspark"])
def test_round_matches_the_kernels_and_commits_the_context(family):
    r = _round(family)
    d = r.d
    feats, n_new, anchor = _inputs(r)
    out = r.run(feats, n_new, anchor)
    assert d.state.lengths.tolist() == [1, 3]
    t = out.tree
    if family == "block":
        assert out.lp.shape == (2, 4, 3) and bool(t.valid.all())
        # the sort-based builder's tree holds the step-by-step best-first tree's path scores
        ref = tree_from_marginals(out.lp, out.ids, anchor, 6)
        assert torch.allclose(t.score.sort(1).values, ref.score.sort(1).values, atol=1e-6)
    elif family == "dspark":
        n = (survival(out.confidence) >= 0.3).sum(1)
        assert torch.equal(out.verified_len, n) and torch.equal(t.valid[:, :5].sum(1), n + 1)
        assert torch.equal(t.tokens[:, 1:5], out.ids[..., 0])
        assert torch.equal(t.parents[:, 1:5], torch.arange(4).expand(2, 4))
    else:
        assert out.lp is None and t.tokens.shape == (2, 6) and bool(t.valid.all())
    r.run(feats, n_new, anchor)
    assert d.state.lengths.tolist() == [2, 6]


ENGINE_SPECS = [PolicySpec.from_dict("block", {"budget": 6, "block_len": 7}),
                PolicySpec.from_dict("dspark", {"block_len": 5, "threshold": 0.05}),
                PolicySpec.from_dict("dspark", {"block_len": 5})]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ENGINE_SPECS, ids=lambda s: s.name)
def test_the_block_engines_captured_rounds_decode_as_eager_and_plain(spec):
    """The runtime's path (not ``_Round``): a BlockEngine on CUDA (tiny-gdn, float32) captures its
    stages, its draft stage among them, and replays them - the eager draft is never called - with
    the eager engine's accepted lengths, DSpark prefixes and outputs, which are plain greedy's."""
    from simtree.runtime.full.block_engine import make_engine
    from simtree.runtime.full.drafting import round_shape
    from simtree.runtime.full.lossless import make_predictable
    from simtree.runtime.full.qwen import QwenModel

    from full_helpers import PROMPTS, drafter_costs

    model = QwenModel(get_model("tiny-gdn"), device="cuda", dtype=torch.float32, seed=1)
    make_predictable(model, 0.3)
    tiny = {"sizes": {"layers": 1, "markov_rank": 32}}
    prompts, new_tokens = PROMPTS[:2], 16

    def decode(rs, graphs):
        engine = make_engine(model, rs, 2, 200, graphs=graphs, costs=drafter_costs(), **tiny)
        engine.capture()
        if graphs:
            assert [name for name, _ in engine.graphs or []] == ["draft", "verify", "commit"], engine.capture_error

            def eager_draft():
                raise AssertionError("the draft stage ran eagerly, not from its graph")
            engine._draft = eager_draft
        engine.prefill(prompts)
        stats = engine.run(max_new_tokens=new_tokens)
        torch.cuda.synchronize()
        return ([o[:new_tokens] for o in engine.outputs()], stats.accepted.tolist(),
                getattr(engine, "verified_len", torch.zeros(0)).tolist())

    plain = decode(round_shape(PolicySpec.from_dict("none")), False)[0]
    eager, graphed = decode(round_shape(spec), False), decode(round_shape(spec), True)
    assert graphed == eager
    assert graphed[0] == plain
    assert sum(map(sum, graphed[1])) > 0          # drafts were accepted, not only rejected

def test_round_refuses_bad_sizes():
    with pytest.raises(SimtreeError, match="block_len 99"):
        DrafterRound(get_model("tiny-gdn"), "block", batch=1, max_len=8, device="cpu", dtype=torch.float32,
                     block_len=99)
