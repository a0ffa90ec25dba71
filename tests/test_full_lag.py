"""Plain rounds of an engine with several round shapes (an online controller's tiers) let the
MTP layer fall behind and catch it up in one batch when drafting resumes (or every lag_rows
plain rounds): the plain round runs no MTP work, the draft state after the batched catch-up
equals the one a catch-up after every plain round builds, and greedy decoding that switches
tiers (long plain runs included) stays lossless.  Float32, both families."""
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.planning.modes import PolicySpec
from simtree.runtime.full import lag as lag_mod
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.engine import FullEngine
from simtree.runtime.full.generate import generate, greedy_decode

from full_helpers import FAMILIES, PROMPTS, TierRuns, tiny_model

PLAIN = PolicySpec.from_dict("none")
EAGLE = PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6})
LINEAR = PolicySpec.from_dict("linear", {"budget": 4})


class _Counting:
    """The model with its MTP forwards counted (rows per call)."""

    def __init__(self, model):
        self._model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def draft_forward(self, ds, tokens, *args):
        self.calls.append(tokens.shape[1])
        return self._model.draft_forward(ds, tokens, *args)


def _engine(model, **kw) -> FullEngine:
    engine = FullEngine(model, round_shape(PLAIN), 2, 96, shapes=[round_shape(EAGLE)], **kw)
    engine.prefill(PROMPTS[:2])
    return engine


@torch.no_grad()
def _per_round_reference(engine: FullEngine, rounds: int) -> None:
    """Plain rounds as a catch-up after each one builds the draft state: the target's decode step,
    then the MTP layer over its one row (hidden_q, token_q+1) at position q."""
    m, ds, B = engine.model, engine.ds, engine.B
    one_row = engine._chain_bits(1)
    for _ in range(rounds):
        pos = engine.st.lengths.clone()[:, None]
        hidden = m.decode(engine.st, engine.roots)
        nxt = m.greedy(hidden)
        rows = torch.zeros(B, 1, dtype=torch.int64)
        out = m.draft_forward(ds, nxt[:, None], hidden[:, None], pos, rows, one_row)
        ds.commit(rows, pos)
        ds.lengths += 1
        engine._set_first(out[:, 0])
        engine.roots.copy_(nxt)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("rounds, lag_rows", [(5, None), (11, 4)])
def test_deferred_catch_up_builds_the_per_round_draft_state(name, rounds, lag_rows):
    model = tiny_model(name, dtype=torch.float32)
    counted = _Counting(model)
    deferred, eager = _engine(counted, lag_rows=lag_rows), _engine(model)
    R = deferred.lag.rows
    flushes = (rounds - 1) // R
    waiting = rounds - R * flushes
    start = deferred.ds.lengths.clone()
    counted.calls.clear()
    deferred.run(rounds=rounds)
    # the plain rounds ran no MTP row; a full buffer was caught up whole before the next plain round
    assert counted.calls == [R] * flushes
    assert deferred.lag.waiting == waiting and torch.equal(deferred.ds.lengths, start + R * flushes)
    deferred.use(round_shape(EAGLE))        # drafting resumes: one catch-up over the waiting rows
    assert counted.calls == [R] * flushes + [waiting] and deferred.lag.waiting == 0
    _per_round_reference(eager, rounds)
    assert torch.equal(deferred.roots, eager.roots)
    assert torch.equal(deferred.ds.lengths, eager.ds.lengths) and torch.equal(deferred.ds.lengths, deferred.st.lengths)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(deferred.ds.kv, eager.ds.kv, **tol)
    torch.testing.assert_close(deferred.first_hidden, eager.first_hidden, **tol)
    torch.testing.assert_close(deferred.first_logp, eager.first_logp, **tol)
    assert torch.equal(deferred.first_ids, eager.first_ids)


@pytest.mark.parametrize("name", FAMILIES)
def test_switching_tiers_with_long_plain_runs_is_lossless(name, monkeypatch):
    """Plain runs longer than the buffer (flushes between plain rounds), single plain rounds,
    EAGLE and linear rounds after them: the outputs are plain greedy decoding's."""
    monkeypatch.setattr(lag_mod, "LAG_ROWS", 3)
    model = tiny_model(name, dtype=torch.float32)
    ctl = TierRuns([(PLAIN, 7), (EAGLE, 2), (PLAIN, 1), (LINEAR, 1), (PLAIN, 4), (EAGLE, 1)])
    got = generate(model, PROMPTS[:2], 40, LINEAR, controller=ctl).outputs
    assert len(ctl.chosen) > 16         # the whole plan ran at least once
    assert got == greedy_decode(model, PROMPTS[:2], 40)


def test_single_shape_engines_keep_no_lag_buffer():
    model = tiny_model("tiny-gdn", dtype=torch.float32)
    for spec in (PLAIN, EAGLE):
        assert FullEngine(model, round_shape(spec), 2, 64).lag is None
    assert _engine(model).lag.rows == lag_mod.LAG_ROWS
    v4 = tiny_model("tiny-v4", dtype=torch.float32)
    assert _engine(v4).lag.rows == 8        # the MTP layer's window: a catch-up's rows see each other
    with pytest.raises(SimtreeError, match=r"lag_rows must be in \[1, 8\]"):
        _engine(v4, lag_rows=9)


def test_the_catch_up_is_timed_in_the_round_that_resumes_drafting():
    model = tiny_model("tiny-gdn", dtype=torch.float32)
    ctl = TierRuns([(PLAIN, 3), (EAGLE, 1)])
    res = generate(model, PROMPTS[:2], 12, LINEAR, controller=ctl)
    timed = [name == EAGLE.name for name in ctl.chosen]
    assert [r.catchup_ms > 0 for r in res.rounds] == timed
