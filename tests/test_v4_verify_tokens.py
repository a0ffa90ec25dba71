"""The verify-tokens replay of scripts/v4_verify_tokens_gpu.py (simtree.runtime.full.verify_tokens)
on the CPU: a tiny V4 rank, every run shape, every token set, the replayed verify eager (on a CPU
an index out of range is an IndexError where it happens, not a device-side assert)."""
from __future__ import annotations

import math
import sys

import pytest
import torch

from full_helpers import drafter_costs, tiny_model
from simtree.errors import SimtreeError
from simtree.runtime.full import engine as full_engine
from simtree.runtime.full import verify_tokens as vt


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny-v4", dtype=torch.float32)


@pytest.mark.parametrize("mode, params", vt.SHAPES, ids=[m for m, _ in vt.SHAPES])
def test_each_round_replays_the_engines_own_verify(model, mode, params, monkeypatch):
    """Every token set's verify is finite and its argmax of the tree's shape (else a 'bad verify
    output' note), the drafted tokens replayed over the state the round read give the engine's
    verify output at every node, and every replay calls the verify with the engine's own
    arguments (a block drafter's layer taps)."""
    calls = {full_engine.__name__: [], vt.__name__: []}
    verify = type(model).verify

    def spy(self, st, tokens, parents, **kw):
        calls.get(sys._getframe(1).f_globals["__name__"], []).append(kw)
        return verify(self, st, tokens, parents, **kw)

    monkeypatch.setattr(type(model), "verify", spy)
    rounds, B = 2, 2
    row = vt.verify_tokens_row(model, drafter_costs(), mode, params, B, rounds=rounds, context=24, graphs=False,
                               reps=1)
    engine_kw, replay_kw = calls[full_engine.__name__], calls[vt.__name__]
    assert len(replay_kw) == rounds * len(vt.TOKEN_SETS)
    assert engine_kw and all(kw == engine_kw[0] for kw in engine_kw + replay_kw)
    assert bool(engine_kw[0].get("taps")) == (mode in ("block", "dspark"))
    assert set(row) == set(vt.COLUMNS)
    assert "bad verify output" not in row["note"]
    assert row["drafted_mismatch"] == 0, row["note"]
    assert row["nodes"] >= 2
    assert 1 <= row["distinct_tokens_per_round"] <= B * row["nodes"]
    assert all(math.isfinite(row[f"{k}_ms"]) and row[f"{k}_ms"] > 0 for k in vt.TOKEN_SETS)


def test_token_sets_keep_the_trees_shape():
    tokens = torch.tensor([[5, 7, 9], [3, 3, 4]])
    sets = vt.token_sets(tokens, 11, torch.Generator().manual_seed(0))
    assert list(sets) == list(vt.TOKEN_SETS)
    assert all(t.shape == tokens.shape and t.dtype == tokens.dtype for t in sets.values())
    assert torch.equal(sets["drafted"], tokens)
    assert bool(((sets["uniform"] >= 0) & (sets["uniform"] < 11)).all())
    assert sets["per_sequence"].tolist() == [[5, 5, 5], [3, 3, 3]]
    assert sets["one_token"].tolist() == [[5, 5, 5], [5, 5, 5]]


@pytest.mark.parametrize("tokens, parents, lengths, match", [
    ([[1, 12]], [[-1, 0]], [3], "token 12 at sequence 0 node 1 is outside the vocabulary"),
    ([[1, -1]], [[-1, 0]], [3], "token -1 at sequence 0 node 1"),
    ([[1, 2, 3]], [[-1, 2, 0]], [3], "node 1 has parent 2"),
    ([[1, 2]], [[0, 0]], [3], "node 0 has parent 0"),
    ([[1, 2, 3], [1, 2, 3]], [[-1, 0, 1], [-1, 0, 0]], [8, 4], "sequence 0 reaches position 10, past"),
])
def test_a_bad_replay_is_one_line_before_the_device_sees_it(tokens, parents, lengths, match):
    with pytest.raises(SimtreeError, match=match) as err:
        vt.check_replay(torch.tensor(tokens), torch.tensor(parents), torch.tensor(lengths), 12, 10)
    assert "\n" not in str(err.value)
    vt.check_replay(torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 0, 0]]), torch.tensor([8]), 12, 10)   # 9 < 10
