"""The fused CSA top-k + attention list (kernels/v4/_topk_kernel.py) against torch.topk and the
same row mapping, on fresh random scores (Triton's interpreter on the CPU)."""
import pytest
import torch

from simtree.kernels.v4._topk_kernel import topk_to_list, topk_to_list_torch


def _case(N, B, emax, smax, W, gen, hidden=0.3):
    L = emax + smax
    scores = torch.randn(N, L, generator=gen) * 5
    scores[torch.rand(N, L, generator=gen) < hidden] = float("-inf")       # entries a node does not see
    persist = torch.randperm(B * max(emax, 1) * 2, generator=gen)[:B * emax].view(B, emax)
    vis = torch.randint(-1, 7, (N, smax), generator=gen)
    seq = torch.randint(0, B, (N,), generator=gen)
    win = torch.randint(-1, 1000, (N, W), generator=gen)
    return scores, win, persist, vis, seq


@pytest.mark.parametrize("N,B,emax,smax,k", [(5, 2, 40, 3, 8), (3, 1, 13, 0, 13), (7, 3, 0, 5, 4),
                                             (4, 2, 300, 2, 64)])
def test_same_rows_as_torch_topk(N, B, emax, smax, k):
    gen = torch.Generator().manual_seed(N * 100 + emax)
    scores, win, persist, vis, seq = _case(N, B, emax, smax, 6, gen)
    got = topk_to_list(scores, k, win, persist, vis, seq, 500, 2000)
    ref = topk_to_list_torch(scores, k, win, persist, vis, seq, 500, 2000)
    assert got.dtype == torch.int32 and got.shape == ref.shape == (N, 6 + k)
    assert torch.equal(got[:, :6], ref[:, :6])
    assert torch.equal(got[:, 6:].sort(1).values, ref[:, 6:].sort(1).values)      # the same set


def test_fewer_visible_than_k_pads_with_minus_one():
    gen = torch.Generator().manual_seed(3)
    scores, win, persist, vis, seq = _case(2, 1, 20, 0, 4, gen, hidden=0.0)
    scores[:, 5:] = float("-inf")
    got = topk_to_list(scores, 10, win, persist, vis, seq, 100, 50)
    assert (got[:, 4 + 5:] == -1).all()
    assert torch.equal(got[:, 4:9].sort(1).values, (persist[seq][:, :5] + 50).to(torch.int32).sort(1).values)


def test_ties_take_the_lowest_columns():
    scores = torch.zeros(2, 32)
    scores[1, 30] = 1.0
    persist = torch.arange(32)[None]
    seq = torch.zeros(2, dtype=torch.int64)
    got = topk_to_list(scores, 4, torch.zeros(2, 0, dtype=torch.int64), persist, torch.zeros(2, 0, dtype=torch.int64),
                       seq, 0, 0)
    assert got[0].tolist() == [0, 1, 2, 3] and sorted(got[1].tolist()) == [0, 1, 2, 30]


def test_negative_and_extreme_scores_keep_their_order():
    scores = torch.tensor([[-3.0, -0.0, 0.0, -1e-30, 7.5, float("-inf"), -1e30, 2.0]])
    got = topk_to_list(scores, 4, torch.zeros(1, 0, dtype=torch.int64), torch.arange(8)[None],
                       torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0, 0)
    assert sorted(got[0].tolist()) == [1, 2, 4, 7]      # 7.5, 2.0, 0.0, -0.0
