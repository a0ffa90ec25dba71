"""The layer code (kernels/layers) against the previous full-runtime models (tests/legacy_full:
the code before the move, kept until these pass): the same weights (the fused projections are
the old ones stacked), the same states, the same trees -> the same hidden states, committed
states and decode steps, in float64 on the CPU."""
import numpy as np
import pytest
import torch

from simtree.kernels.v4 import random_tree
from simtree.models import get_model
from simtree.runtime.full.qwen import QwenModel
from simtree.runtime.full.v4_rank import V4Rank

from legacy_full.qwen import QwenModel as OldQwen
from legacy_full.v4_rank import V4Rank as OldV4

torch.set_num_threads(1)


def _trees(B, n, seed):
    rng = np.random.default_rng(seed)
    return torch.as_tensor(np.stack([random_tree(n, rng).parents for _ in range(B)]))


def _qwen_pair(seed=3):
    shape = get_model("tiny-gdn")
    old = OldQwen(shape, "cpu", torch.float64, seed)
    new = QwenModel(shape, "cpu", torch.float64, seed)
    for name, t in new.w.items():
        if name.endswith("in_proj"):
            p = name[:-len("in_proj")]
            t.copy_(torch.cat([old.w[p + "qkvz"], old.w[p + "ba"]]))
        elif name.endswith("qkv"):
            p = name[:-len("qkv")]
            t.copy_(torch.cat([old.w[p + "q"], old.w[p + "k"], old.w[p + "v"]]))
        else:
            t.copy_(old.w[name])
    for i, w in enumerate(new._layer_w):       # derived from the copied weights
        if "A_log" in w:
            w["neg_A"].copy_(-w["A_log"].double().exp())
    return old, new


def _qwen_states(old, new, B, S, ctx, seed):
    g = torch.Generator().manual_seed(seed)
    so, sn = old.new_state(B, S), new.new_state(B, S)
    for i in so.k:
        so.k[i].normal_(generator=g)
        so.v[i].normal_(generator=g)
        sn.kv[i][:, :, 0].copy_(so.k[i])
        sn.kv[i][:, :, 1].copy_(so.v[i])
    for i in so.ssm:
        so.ssm[i].normal_(0, 0.1, generator=g)
        so.conv[i].normal_(generator=g)
        sn.ssm[i].copy_(so.ssm[i])
        sn.conv[i].copy_(so.conv[i].transpose(1, 2))
    so.lengths.copy_(torch.as_tensor(ctx))
    sn.lengths.copy_(torch.as_tensor(ctx))
    return so, sn


def _qwen_states_equal(so, sn):
    for i in so.k:
        L = int(so.lengths.max())
        torch.testing.assert_close(sn.kv[i][:, :L, 0], so.k[i][:, :L], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(sn.kv[i][:, :L, 1], so.v[i][:, :L], rtol=1e-10, atol=1e-12)
    for i in so.ssm:
        torch.testing.assert_close(sn.ssm[i], so.ssm[i], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sn.conv[i], so.conv[i].transpose(1, 2), rtol=1e-10, atol=1e-12)
    assert torch.equal(sn.lengths, so.lengths)


def test_qwen_layers_verify_commit_and_decode_like_the_old_model():
    old, new = _qwen_pair()
    B, n = 3, 7
    so, sn = _qwen_states(old, new, B, 40, [0, 2, 17], seed=1)
    tokens = torch.randint(0, 512, (B, n), generator=torch.Generator().manual_seed(2))
    parents = _trees(B, n, 4)
    ho, po = old.verify(so, tokens, parents)
    hn, pn = new.verify(sn, tokens, parents)
    torch.testing.assert_close(hn, ho, rtol=1e-9, atol=1e-10)
    accepted = torch.tensor([0, n - 1, 3])
    old.commit(so, po, accepted)
    new.commit(sn, pn, accepted)
    _qwen_states_equal(so, sn)
    nxt = torch.tensor([5, 6, 7])
    torch.testing.assert_close(new.decode(sn, nxt), old.decode(so, nxt), rtol=1e-9, atol=1e-10)
    _qwen_states_equal(so, sn)
    assert torch.equal(new.greedy(hn), old.logits(ho).argmax(-1))


def test_qwen_mtp_layer_like_the_old_model():
    old, new = _qwen_pair()
    B, Q = 2, 3
    so, sn = _qwen_states(old, new, B, 30, [5, 9], seed=3)
    do, dn = old.new_draft_state(so, 8), new.new_draft_state(sn, 8)
    g = torch.Generator().manual_seed(4)
    do.k.normal_(generator=g)
    do.v.normal_(generator=g)
    dn.kv[:, :, 0].copy_(do.k)
    dn.kv[:, :, 1].copy_(do.v)
    tokens = torch.randint(0, 512, (B, Q), generator=g)
    prev = torch.randn(B, Q, 64, generator=g, dtype=torch.float64)
    do.lengths.copy_(so.lengths)
    dn.lengths.copy_(sn.lengths)
    pos = so.lengths[:, None] + torch.arange(Q)
    rows = torch.arange(Q).expand(B, Q)
    from simtree.kernels.layers.attention import chain_bits
    bits = chain_bits(B, Q, "cpu")
    out_o = old.draft_forward(do, tokens, prev, pos, rows, bits)
    out_n = new.draft_forward(dn, tokens, prev, pos, rows, bits)
    torch.testing.assert_close(out_n, out_o, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(new.draft_logits(out_n), old.draft_logits(out_o), rtol=1e-9, atol=1e-10)


def _v4_pair(seed=5):
    shape = get_model("tiny-v4")
    old = OldV4(shape, "cpu", torch.float64, seed)
    new = V4Rank(shape, "cpu", torch.float64, seed)
    for name, t in new.w.items():
        if name.endswith("wqkv_a"):
            p = name[:-len("wqkv_a")]
            parts = [old.w[p + "wq_a"], old.w[p + "wkv"]] + ([old.w[p + "w_idx"]] if p + "w_idx" in old.w else [])
            t.copy_(torch.cat(parts))
        else:
            t.copy_(old.w[name])
    return old, new


def test_v4_rank_layers_verify_commit_and_decode_like_the_old_rank():
    old, new = _v4_pair()
    B, n = 2, 6
    so, sn = old.new_state(B, 60), new.new_state(B, 60)
    g = torch.Generator().manual_seed(6)
    ctx = [13, 20]
    for i in so.caches:
        for name, t in so.caches[i].persistent_tensors().items():
            t.normal_(generator=g)
            sn.caches[i].persistent_tensors()[name].copy_(t)
        so.caches[i].lens[:] = ctx
    so.lengths.copy_(torch.as_tensor(ctx))
    sn.lengths.copy_(torch.as_tensor(ctx))
    tokens = torch.randint(0, 512, (B, n), generator=g)
    parents = _trees(B, n, 7)
    ho, po = old.verify(so, tokens, parents)
    hn, pn = new.verify(sn, tokens, parents)
    torch.testing.assert_close(hn, ho, rtol=1e-9, atol=1e-10)
    accepted = torch.tensor([n - 1, 2])
    old.commit(so, po, accepted)
    new.commit(sn, pn, accepted)
    for i in so.caches:
        for name, t in so.caches[i].persistent_tensors().items():
            torch.testing.assert_close(sn.caches[i].persistent_tensors()[name], t, rtol=1e-10, atol=1e-12)
    assert torch.equal(sn.lengths, so.lengths)
    nxt = torch.tensor([3, 4])
    torch.testing.assert_close(new.decode(sn, nxt), old.decode(so, nxt), rtol=1e-9, atol=1e-10)
