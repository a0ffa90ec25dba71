"""Triton sparse gather attention (with sink) vs its torch reference on random index lists."""
import pytest
import torch

from simtree.kernels.v4 import sparse_attention, sparse_attention_torch
from simtree.kernels.v4._launched import sparse_attention_launched


def _case(seed, N, H, D, sizes, K, dtype):
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(n, D, generator=g).to(dtype) for n in sizes]
    idx = torch.randint(-1, sum(sizes), (N, K), generator=g)
    q = torch.randn(N, H, D, generator=g).to(dtype)
    sink = torch.randn(H, generator=g)
    return q, idx, srcs, sink


@pytest.mark.parametrize("seed,N,H,D,sizes,K", [
    (0, 3, 4, 32, (7, 3, 0, 9), 37),      # an empty source, heads < 16 (padded block)
    (1, 2, 20, 64, (30, 5), 70),          # two sources, heads across two blocks
    (2, 4, 16, 16, (50,), 16),            # one source, K == BLOCK_K / 2
])
def test_triton_matches_torch_fp32(seed, N, H, D, sizes, K):
    q, idx, srcs, sink = _case(seed, N, H, D, sizes, K, torch.float32)
    out = sparse_attention(q, idx, srcs, sink, D ** -0.5)
    ref = sparse_attention_torch(q.double(), idx, [s.double() for s in srcs], sink.double(), D ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_triton_matches_torch_bf16_sources():
    q, idx, srcs, sink = _case(3, 3, 16, 64, (40, 8, 20, 4), 50, torch.bfloat16)
    out = sparse_attention(q, idx, srcs, sink, 0.125).float()
    ref = sparse_attention_torch(q.float(), idx, [s.float() for s in srcs], sink, 0.125)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_all_skipped_gives_zero_output():
    """Only the sink is left: every probability goes to it and the output is 0."""
    q, idx, srcs, sink = _case(4, 2, 4, 32, (10,), 8, torch.float32)
    out = sparse_attention(q, torch.full_like(idx, -1), srcs, sink, 0.2)
    assert torch.count_nonzero(out) == 0


def test_sink_scales_output():
    """o = sum_j p_j k_j / (1 + exp(sink - lse)) : a very negative sink changes nothing."""
    q, idx, srcs, sink = _case(5, 2, 4, 32, (12, 4), 9, torch.float64)
    no_sink = sparse_attention_torch(q, idx, srcs, torch.full_like(sink, -1e9), 0.3)
    with_sink = sparse_attention_torch(q, idx, srcs, sink, 0.3)
    keys = torch.cat(srcs)[idx.clamp(min=0)]
    logits = torch.einsum("nhd,nkd->nhk", q, keys) * 0.3
    lse = logits.masked_fill((idx < 0).unsqueeze(1), float("-inf")).logsumexp(-1)
    factor = torch.exp(lse) / (torch.exp(lse) + torch.exp(sink))
    torch.testing.assert_close(with_sink, no_sink * factor.unsqueeze(-1))


@pytest.mark.parametrize("num_splits,D", [(2, 32), (3, 32), (2, 200)])   # D 200: the merge over channel blocks
def test_split_index_list_matches_torch(num_splits, D):
    """Flash-decoding split of the index list (+ log-sum-exp merge with the sink) == unsplit."""
    q, idx, srcs, sink = _case(6, 3, 20, D, (40, 6, 30, 5), 100, torch.float32)
    idx[0, :70] = -1  # a split with no live row (lse = -inf) must weigh nothing
    out = sparse_attention(q, idx, srcs, sink, 0.2, num_splits=num_splits)
    ref = sparse_attention_torch(q.double(), idx, [s.double() for s in srcs], sink.double(), 0.2)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits,skip", [(1, True), (3, True), (2, False)])
def test_padding_blocks_skipped_or_run(num_splits, skip):
    """Blocks of -1 entries only (a list's padding: at the start, between live blocks, at the
    end, and a whole query) skipped or run: the softmax the live rows make, split or not."""
    q, idx, srcs, sink = _case(9, 4, 20, 48, (40, 6, 30, 5), 112, torch.float32)
    idx[:, 16:64] = -1
    idx[1, :16] = -1
    idx[2, 80:] = -1
    idx[3] = -1
    out = sparse_attention_launched(q, idx, srcs, sink, 0.2, block_k=16, block_h=16, num_splits=num_splits,
                                    skip=skip)
    ref = sparse_attention_torch(q.double(), idx, [s.double() for s in srcs], sink.double(), 0.2)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[3]) == 0


@pytest.mark.parametrize("num_splits,block_k,block_h,stages", [(1, 16, 16, 2), (3, 16, 16, 1), (2, 32, 32, 3)])
def test_swapped_products_match_torch(num_splits, block_k, block_h, stages):
    """The rows-as-M form (s^T = K q^T, acc^T += K^T p^T, kept transposed) == the reference,
    split or not, with a block of no live row and a split with none."""
    q, idx, srcs, sink = _case(8, 3, 20, 48, (40, 6, 30, 5), 96, torch.float32)
    idx[1, 16:48] = -1
    idx[2, :64] = -1
    out = sparse_attention_launched(q, idx, srcs, sink, 0.2, block_k=block_k, block_h=block_h,
                                    num_splits=num_splits, swap=True, stages=stages)
    ref = sparse_attention_torch(q.double(), idx, [s.double() for s in srcs], sink.double(), 0.2)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_split_rules(monkeypatch):
    """waves2 fills two waves of the GPU; wave1 one, and no split once the unsplit grid has as
    many programs as the GPU has SMs (what the H100's attention launches measured best)."""
    from types import SimpleNamespace

    from simtree.kernels.v4 import attention
    monkeypatch.setattr(attention.torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=132))
    cuda = SimpleNamespace(type="cuda")
    # (tokens, head blocks): batch 1 n 4, batch 4 n 4, batch 4 n 16, batch 16 n 16 at 64 heads, 32 a program
    got = {N: (attention._num_splits(N, 2, 640, 32, cuda, "waves2"), attention._num_splits(N, 2, 640, 32, cuda, "wave1"))
           for N in (4, 16, 64, 256)}
    assert got == {4: (20, 16), 16: (9, 4), 64: (3, 1), 256: (1, 1)}
    assert attention._num_splits(4, 2, 640, 32, SimpleNamespace(type="cpu"), "wave1") == 1


def test_an_unknown_split_rule_is_one_line():
    q, idx, srcs, sink = _case(9, 2, 4, 32, (10,), 8, torch.float32)
    with pytest.raises(ValueError, match="split rule"):
        sparse_attention_launched(q, idx, srcs, sink, 0.2, split_rule="wave3")
