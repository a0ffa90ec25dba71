"""The models built from the layer code: a tree verify followed by the commit of one root path
is plain decoding of that path, token by token (float64, both families, random trees, lengths
across the conv window and the V4 compression boundaries): the same hidden states at the
path's nodes, the same persistent state afterwards, siblings never written."""
import numpy as np
import pytest
import torch

from simtree.kernels.v4 import random_tree
from simtree.models import get_model
from simtree.runtime.full.qwen import QwenModel
from simtree.runtime.full.v4_rank import V4Rank

torch.set_num_threads(1)


def _model(name):
    shape = get_model(name)
    return (QwenModel if shape.family == "gdn_hybrid" else V4Rank)(shape, "cpu", torch.float64, 2)


def _sequence_state(model, st, b: int) -> list[torch.Tensor]:
    """Everything sequence b's future depends on: the cached rows below its length and the
    recurrent / conv / compressor state."""
    L = int(st.lengths[b])
    if isinstance(model, QwenModel):
        return [t[b, :L] for t in st.kv.values()] + [t[b] for t in st.ssm.values()] + [t[b] for t in st.conv.values()]
    out = []
    for cache in st.caches.values():
        cache.lens[:] = st.lengths.numpy()
        seq = cache.sequence_state(b)
        out += [t for t in (seq.kv, seq.comp, seq.idx, seq.comp_kv, seq.comp_score, seq.idx_kv, seq.idx_score)
                if t is not None]
    return out


def _fill(model, st, lens, seed):
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, QwenModel):
        for t in [*st.kv.values(), *st.conv.values()]:
            t.normal_(generator=g)
        for t in st.ssm.values():
            t.normal_(0, 0.1, generator=g)
    else:
        for cache in st.caches.values():
            for t in cache.persistent_tensors().values():
                t.normal_(generator=g)
    st.lengths.copy_(torch.as_tensor(lens))


def _path(parents: np.ndarray, node: int) -> list[int]:
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(int(parents[out[-1]]))
    return out[::-1]


@pytest.mark.parametrize("name, lens", [("tiny-gdn", [0, 2, 9]), ("tiny-v4", [3, 14, 30])])
def test_verify_then_commit_is_decoding_the_accepted_path(name, lens):
    model = _model(name)
    B, n = len(lens), 7
    rng = np.random.default_rng(5)
    trees = [random_tree(n, rng).parents for _ in range(B)]
    parents = torch.as_tensor(np.stack(trees))
    tokens = torch.randint(0, model.vocab, (B, n), generator=torch.Generator().manual_seed(6))
    depth = [np.array([len(_path(t, j)) for j in range(n)]) for t in trees]
    accepted = [int(np.argmax(d)) if b != 1 else int(rng.integers(n)) for b, d in enumerate(depth)]
    tree_st, seq_st = model.new_state(B, 64), model.new_state(B, 64)
    for st in (tree_st, seq_st):
        _fill(model, st, lens, seed=7)
    hidden, pend = model.verify(tree_st, tokens, parents)
    model.commit(tree_st, pend, torch.as_tensor(accepted))
    paths = [_path(trees[b], accepted[b]) for b in range(B)]
    hidden = hidden.view(B, n, -1)
    for depth in range(max(map(len, paths))):
        # every sequence decodes its path's token at this depth (sequences past their path's
        # end decode a token too, and are compared only up to their path)
        tok = torch.as_tensor([tokens[b, p[min(depth, len(p) - 1)]] for b, p in enumerate(paths)])
        h = model.decode(seq_st, tok)
        for b, p in enumerate(paths):
            if depth < len(p):
                torch.testing.assert_close(h[b], hidden[b, p[depth]], rtol=1e-7, atol=1e-8)
    for b, p in enumerate(paths):
        assert int(tree_st.lengths[b]) == lens[b] + len(p)
    # the sequences whose paths are the longest decoded exactly their path
    assert max(map(len, paths)) >= 3
    for b in (b for b, p in enumerate(paths) if len(p) == max(map(len, paths))):
        state_tree, state_seq = _sequence_state(model, tree_st, b), _sequence_state(model, seq_st, b)
        assert len(state_tree) >= 3
        for t_tree, t_seq in zip(state_tree, state_seq):
            torch.testing.assert_close(t_tree, t_seq, rtol=1e-6, atol=1e-7)
