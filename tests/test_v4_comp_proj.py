"""The compressors' projections in one launch (kernels/v4/_proj_kernel.py) against the float64
torch form, on fresh random inputs (Triton's interpreter on the CPU)."""
import pytest
import torch

from simtree.kernels.v4._proj_kernel import MAX_ROWS, project_compressors, project_compressors_torch
from simtree.kernels.v4.compressor import random_compressor


def _comps(gen, hidden, pairs):
    return [random_compressor(dim, ratio, hidden, 8, ratio == 4, gen, torch.float32) for dim, ratio in pairs]


@pytest.mark.parametrize("N,pairs", [(3, [(32, 4), (16, 4)]), (20, [(24, 8)]), (100, [(16, 4), (48, 4)])])
def test_matches_the_float64_form(N, pairs):
    gen = torch.Generator().manual_seed(N)
    hidden = 200                                  # not a multiple of the K block
    comps = _comps(gen, hidden, pairs)
    x = torch.randn(N, hidden, generator=gen).to(torch.bfloat16)
    ratio = pairs[0][1]
    pos_mod = torch.randint(0, ratio, (N,), generator=gen)
    got = project_compressors(comps, x, pos_mod)
    ref = project_compressors_torch([p.to(dtype=torch.float64) for p in comps], x.double(), pos_mod)
    assert len(got) == len(comps)
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32 and g.shape == r.shape
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


def test_refuses_what_it_does_not_run():
    gen = torch.Generator().manual_seed(0)
    comps = _comps(gen, 32, [(16, 4)])
    with pytest.raises(ValueError):
        project_compressors(comps, torch.randn(MAX_ROWS + 1, 32), torch.zeros(MAX_ROWS + 1, dtype=torch.int64))
    with pytest.raises(ValueError):
        project_compressors([c.to(dtype=torch.float64) for c in comps], torch.randn(2, 32), torch.zeros(2, dtype=torch.int64))
