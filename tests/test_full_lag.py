"""Plain rounds of an engine with several round shapes (an online controller's tiers) let the
MTP layer fall behind and catch it up in one batch when drafting resumes (or every lag_rows
plain rounds): the plain round runs no MTP work, the draft state after the batched catch-up
equals the one a catch-up after every plain round builds, a catch-up runs over a power-of-two
bucket of rows and leaves the state the waiting rows alone build (stale rows past them), the
preparation that runs every bucket changes nothing a round reads, and greedy decoding that
switches tiers (long plain runs included) stays lossless.  Float32, both families."""
import pytest
import torch

from simtree.errors import SimtreeError
from simtree.planning.modes import PolicySpec
from simtree.runtime.full import lag as lag_mod
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.engine import FullEngine, draft_scratch_rows
from simtree.runtime.full.lag import bucket_rows, catch_up_buckets, lag_rows
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


def _engine(model, max_len: int = 96, **kw) -> FullEngine:
    engine = FullEngine(model, round_shape(PLAIN), 2, max_len, shapes=[round_shape(EAGLE)], **kw)
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
    assert counted.calls == [R] * flushes + [bucket_rows(waiting, R)] and deferred.lag.waiting == 0
    _per_round_reference(eager, rounds)
    assert torch.equal(deferred.roots, eager.roots)
    assert torch.equal(deferred.ds.lengths, eager.ds.lengths) and torch.equal(deferred.ds.lengths, deferred.st.lengths)
    tol = dict(rtol=1e-4, atol=1e-5)
    S = eager.ds.max_len    # row max_len: the trash row, written by a bucket's rows past the waiting ones
    torch.testing.assert_close(deferred.ds.kv[:, :S], eager.ds.kv[:, :S], **tol)
    torch.testing.assert_close(deferred.first_hidden, eager.first_hidden, **tol)
    torch.testing.assert_close(deferred.first_logp, eager.first_logp, **tol)
    assert torch.equal(deferred.first_ids, eager.first_ids)


def test_catch_up_buckets_are_powers_of_two_up_to_the_buffer():
    assert catch_up_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert catch_up_buckets(5) == (1, 2, 4, 5) and catch_up_buckets(1) == (1,)
    assert [bucket_rows(n, 64) for n in (1, 2, 3, 5, 33, 63, 64)] == [1, 2, 4, 8, 64, 64, 64]
    assert [bucket_rows(n, 5) for n in (3, 4, 5)] == [4, 4, 5]
    with pytest.raises(SimtreeError, match=r"1 to 5 rows, got 6"):
        bucket_rows(6, 5)


def _stale_buffer(engine: FullEngine, seed: int) -> None:
    """Random rows in the whole lag buffer and scratch: the waiting rows and stale ones past them."""
    g = torch.Generator().manual_seed(seed)
    lag = engine.lag
    lag.tokens.copy_(torch.randint(0, engine.model.vocab, lag.tokens.shape, generator=g))
    lag.hidden.copy_(torch.randn(lag.hidden.shape, generator=g, dtype=lag.hidden.dtype))
    engine.ds.scratch.copy_(torch.randn(engine.ds.scratch.shape, generator=g, dtype=engine.ds.scratch.dtype))


@torch.no_grad()
def _unpadded_catch_up(engine: FullEngine, n: int) -> None:
    """The MTP layer over the first n buffer rows alone (n rows, their own shape)."""
    m, ds, lag, B = engine.model, engine.ds, engine.lag, engine.B
    cols = torch.arange(n)
    pos, rows = ds.lengths[:, None] + cols, cols.expand(B, n)
    out = m.draft_forward(ds, lag.tokens[:, :n].contiguous(), lag.hidden[:, :n].contiguous(), pos, rows,
                          engine._chain_bits(n))
    ds.commit(rows, pos)
    ds.lengths += n
    engine._set_first(out[:, n - 1])


def _assert_same_draft_state(a: FullEngine, b: FullEngine) -> None:
    S = a.ds.max_len      # row max_len: the trash row, written by the padded rows
    tol = dict(rtol=1e-5, atol=1e-6)
    assert torch.equal(a.ds.lengths, b.ds.lengths)
    torch.testing.assert_close(a.ds.kv[:, :S], b.ds.kv[:, :S], **tol)
    torch.testing.assert_close(a.first_hidden, b.first_hidden, **tol)
    torch.testing.assert_close(a.first_logp, b.first_logp, **tol)
    assert torch.equal(a.first_ids, b.first_ids)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_bucketed_catch_up_builds_the_waiting_rows_state(name):
    """n = 1, 2, 3, R - 1, R waiting rows, stale random rows past them: the catch-up runs the MTP
    layer over the bucket's rows (one call), and the cache, lengths and first top-k are those of
    the n rows alone."""
    model = tiny_model(name, dtype=torch.float32)
    counted = _Counting(model)
    padded, alone = _engine(counted, max_len=192), _engine(model, max_len=192)
    R = padded.lag.rows
    for seed, n in enumerate(sorted({1, 2, 3, R - 1, R})):
        _stale_buffer(padded, seed)
        alone.lag.tokens.copy_(padded.lag.tokens)
        alone.lag.hidden.copy_(padded.lag.hidden)
        counted.calls.clear()
        padded.lag.waiting = n
        padded.catch_up()
        assert counted.calls == [bucket_rows(n, R)] and padded.lag.last_bucket == bucket_rows(n, R)
        assert padded.lag.waiting == 0
        _unpadded_catch_up(alone, n)
        _assert_same_draft_state(padded, alone)


@pytest.mark.parametrize("name", FAMILIES)
def test_preparing_every_bucket_leaves_the_draft_state(name):
    """The preparation a CUDA engine runs when built (every bucket once) changes nothing a later
    round reads."""
    model = tiny_model(name, dtype=torch.float32)
    counted = _Counting(model)
    warmed, cold = _engine(counted), _engine(model)
    counted.calls.clear()
    warmed._prepare_lag(graphs=False)
    assert counted.calls == list(catch_up_buckets(warmed.lag.rows))
    assert torch.equal(warmed.ds.lengths, cold.ds.lengths)
    L = int(cold.ds.lengths.min())      # the rows the preparation wrote lie past the lengths
    assert torch.equal(warmed.ds.kv[:, :L], cold.ds.kv[:, :L])
    for a, b in ((warmed.first_hidden, cold.first_hidden), (warmed.first_logp, cold.first_logp),
                 (warmed.first_ids, cold.first_ids)):
        assert torch.equal(a, b)
    warmed.run(rounds=3)
    cold.run(rounds=3)
    warmed.use(round_shape(EAGLE))
    cold.use(round_shape(EAGLE))
    _assert_same_draft_state(warmed, cold)
    assert torch.equal(warmed.roots, cold.roots)


@pytest.mark.parametrize("name", FAMILIES)
def test_switching_tiers_with_long_plain_runs_is_lossless(name, monkeypatch):
    """Plain runs longer than the buffer (flushes between plain rounds), single plain rounds,
    EAGLE and linear rounds after them: the outputs are plain greedy decoding's."""
    monkeypatch.setattr(lag_mod, "LAG_ROWS", 5)     # buckets 1, 2, 4, 5: 3 waiting rows run padded to 4
    model = tiny_model(name, dtype=torch.float32)
    ctl = TierRuns([(PLAIN, 7), (EAGLE, 2), (PLAIN, 3), (LINEAR, 1), (PLAIN, 1), (EAGLE, 1), (PLAIN, 4), (EAGLE, 1)])
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


def test_one_rule_sizes_the_lag_buffer():
    """lag_rows: LAG_ROWS, capped at the draft state's scratch rows and the MTP layer's window;
    an engine's buffer is that rule over its shapes' scratch (what scripts/serve_live.py prices)."""
    gdn, v4 = tiny_model("tiny-gdn", dtype=torch.float32), tiny_model("tiny-v4", dtype=torch.float32)
    assert lag_rows(gdn, 1000) == lag_mod.LAG_ROWS and lag_rows(gdn, 5) == 5 and lag_rows(v4, 1000) == 8
    assert lag_rows(gdn, 5, rows=3) == 3
    shapes = [round_shape(PLAIN), round_shape(EAGLE), round_shape(LINEAR)]
    engine = FullEngine(gdn, shapes[0], 2, 64, shapes=shapes[1:])
    assert engine.ds.scratch.shape[1] == draft_scratch_rows(shapes)
    assert engine.lag.rows == lag_rows(gdn, draft_scratch_rows(shapes))


def test_the_catch_up_is_timed_in_the_round_that_resumes_drafting():
    model = tiny_model("tiny-gdn", dtype=torch.float32)
    ctl = TierRuns([(PLAIN, 3), (EAGLE, 1)])
    res = generate(model, PROMPTS[:2], 12, LINEAR, controller=ctl)
    timed = [name == EAGLE.name for name in ctl.chosen]
    assert [r.catchup_ms > 0 for r in res.rounds] == timed


@pytest.mark.parametrize("name", FAMILIES)
def test_the_controller_sees_the_engines_context_and_accepted_counts(name, monkeypatch):
    """generate hands the controller context lengths and accepted drafts worked out on the host
    from the output lengths it reads once a round: they equal the engine's own device values."""
    model = tiny_model(name, dtype=torch.float32)
    seen, truth = [], []

    class Recording(TierRuns):
        def choose(self, batch_size, context_lens, rounds_done=None):
            seen.append(("ctx", list(context_lens)))
            return super().choose(batch_size, context_lens, rounds_done)

        def observe(self, tier, accepted):
            seen.append(("acc", [int(a) for a in accepted]))

    step = FullEngine.step

    def recorded_step(self):
        truth.append(("ctx", self.st.lengths.tolist()))
        step(self)
        truth.append(("acc", self.last_accepted().tolist()))

    monkeypatch.setattr(FullEngine, "step", recorded_step)
    ctl = Recording([(EAGLE, 2), (PLAIN, 2), (LINEAR, 2)])
    generate(model, PROMPTS[:2], 24, LINEAR, controller=ctl)
    assert len(seen) > 8 and seen == truth
    assert any(a > 0 for kind, acc in seen if kind == "acc" for a in acc)
