"""The runtime's block-drafter round (runtime/full/block_drafters.py): static buffers, eager on
the CPU, the same outputs as the kernels' calls, the context committed round after round."""
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.kernels.layers.drafters import backbone_forward, block_marginals, dspark_draft, tree_from_marginals
from simtree.models import get_model
from simtree.runtime.full.block_drafters import DrafterRound

SIZES = {"block": {}, "tfm": dict(cand_k=16, adapter_dim=8), "dspark": dict(markov_rank=8)}


@pytest.mark.parametrize("family", ["block", "tfm", "dspark"])
def test_round_matches_the_kernels_and_commits_the_context(family):
    d = DrafterRound(get_model("tiny-gdn"), family, batch=2, max_len=32, device="cpu", dtype=torch.float64,
                     budget=6, topk=3, width=2, layers=2, target_layers=2, block_len=4, **SIZES[family])
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 5, 2 * d.cfg.h, generator=g, dtype=torch.float64)
    n_new, anchor = torch.tensor([1, 3]), torch.tensor([7, 8])
    out = d.run(feats, n_new, anchor)
    assert d.state.lengths.tolist() == [1, 3]
    d.state.lengths.zero_()
    hid = backbone_forward(d.w, d.cfg, d.state, d.rope, feats, n_new, anchor)
    if family == "block":
        lp, ids = block_marginals(d.w, hid, 3)
        want = tree_from_marginals(lp, ids, anchor, 6)
        assert all(torch.equal(a, b) for a, b in zip(out.tree, want)) and out.lp.shape == (2, 4, 3)
    elif family == "dspark":
        lp, ids, conf = dspark_draft(d.w, hid, anchor, 3)
        assert torch.equal(out.ids, ids) and torch.equal(out.confidence, conf)
    else:
        assert out.tree.tokens.shape == (2, 6) and bool(out.tree.valid.all())
    d.run(feats, n_new, anchor)
    assert d.state.lengths.tolist() == [2, 6]


def test_round_refuses_bad_sizes():
    with pytest.raises(SimtreeError, match="budget, topk and width"):
        DrafterRound(get_model("tiny-gdn"), "block", batch=1, max_len=8, device="cpu", dtype=torch.float32, topk=0)
    with pytest.raises(SimtreeError, match="block_len 99"):
        DrafterRound(get_model("tiny-gdn"), "block", batch=1, max_len=8, device="cpu", dtype=torch.float32,
                     block_len=99)
