"""The engine's round bookkeeping (runtime/full/engine.py): each round's accepted lengths and
tree sizes go to a device log that the host counts and reads once, after the rounds (``run``,
or ``begin`` / ``step`` / ``stats``); only a traced engine keeps the copies ``last_round``
reads, and it reads them in one copy; the chain layout (``best_first.lay_chain``) is one tree
for linear and DSpark rounds; the drafting pass's contexts are the engine's."""
import numpy as np
import pytest
import torch

from simtree.costs.synthetic import synthetic_costs
from simtree.errors import SimtreeError
from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.best_first import lay_chain
from simtree.runtime.full.drafting import TreeBuffers, round_shape
from simtree.runtime.full.block_engine import make_engine
from simtree.runtime.full.engine import FullEngine

from full_helpers import PROMPTS, drafter_costs, tiny_model
from test_capture_safe import SPECS, TINY_DRAFTER

COSTLY = synthetic_costs(weights_us=0.0, per_token_us=10.0)


def test_the_round_log_holds_tree_sizes_and_is_counted_on_the_host():
    """cost_aware's per-round budgets: the log's tree sizes are each round's valid nodes and the
    context each round began at; a second run reads on from the host's count (the accepted paths
    of every round add up to the outputs)."""
    engine = FullEngine(tiny_model("tiny-gdn"), round_shape(PolicySpec.from_dict(
        "cost_aware", {"max_budget": 10, "draft_depth": 3})), 2, 128, costs=COSTLY)
    engine.prefill(PROMPTS[:2])
    sizes, ctx = [], []
    engine.begin()
    for _ in range(4):
        ctx.append(float(engine.st.lengths.double().mean()))
        engine.step()
        sizes.append(engine.tree.valid.sum(1).tolist())
    first = engine.stats(wall_s=1.0)
    assert first.rounds == 4 and first.nodes.tolist() == sizes and np.allclose(first.context_lens, ctx)
    assert (first.verify_ms > 0).all()     # a one-shape engine: no lag, no catch-ups (test_full_lag times them)
    more = engine.run(rounds=3)
    assert more.rounds == 3 and engine.rounds_logged == 7
    gained = (first.accepted + 1).sum(0) + (more.accepted + 1).sum(0)
    assert (1 + gained).tolist() == engine.out_len.tolist()
    end = float(engine.st.lengths.double().mean())
    assert more.context_lens[0] == pytest.approx(end - (more.accepted + 1).sum() / 2)


@pytest.mark.parametrize("trace_topk", [0, 4])
def test_only_a_traced_engine_keeps_what_last_round_reads(trace_topk):
    """A plain round clones its root for last_round only when traced; an untraced engine's
    last_round is refused in one line."""
    engine = FullEngine(tiny_model("tiny-gdn"), round_shape(PolicySpec.from_dict("none")), 2, 64,
                        trace_topk=trace_topk)
    engine.prefill(PROMPTS[:2])
    root = engine.roots.tolist()
    stats = engine.run(rounds=1)
    assert stats.nodes.tolist() == [[1, 1]] and stats.accepted.tolist() == [[0, 0]]
    assert hasattr(engine, "_plain_root") == bool(trace_topk)
    if trace_topk:
        rec = engine.last_round()
        assert rec["tokens"][:, 0].tolist() == root and rec["valid"].all()
    else:
        with pytest.raises(SimtreeError, match="traced engine") as err:
            engine.last_round()
        assert "\n" not in str(err.value)


def test_a_chain_is_laid_with_its_valid_prefix_and_padding():
    """lay_chain: root -> tokens, scores the prefix sums, ``keep`` marks each sequence's valid
    prefix; the bucket past the chain is padding (never accepted)."""
    B, m, N = 2, 3, 6
    out = TreeBuffers.empty(B, N, "cpu")
    roots = torch.tensor([7, 8])
    tok = torch.tensor([[1, 2, 3], [4, 5, 6]])
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.8, 0.7]]))
    lay_chain(out, roots, lp, tok, keep=torch.tensor([1, 3]))
    assert out.tokens[:, :m + 1].tolist() == [[7, 1, 2, 3], [8, 4, 5, 6]]
    assert out.parents[0, :m + 1].tolist() == [-1, 0, 1, 2] and out.depth[1, :m + 1].tolist() == [0, 1, 2, 3]
    assert out.valid.tolist() == [[True, True, False, False, False, False], [True, True, True, True, False, False]]
    assert torch.allclose(out.score[:, 1:m + 1].exp(), torch.tensor([[0.5, 0.25, 0.125], [0.9, 0.72, 0.504]]))
    assert torch.isinf(out.score[:, m + 1:]).all() and (out.parents[:, m + 1:] == 0).all()
    lay_chain(out, roots, lp, tok)
    assert out.valid[:, :m + 1].all()


def _round_on_device(engine) -> dict:
    """What last_round must return, read from the engine's device tensors one by one."""
    host = lambda t: t.cpu().numpy()  # noqa: E731
    if engine.rs.plain:
        root = host(engine._plain_root)[:, None]
        return {"tokens": root, "parents": np.full_like(root, -1), "score": np.zeros(root.shape, np.float32),
                "valid": np.ones(root.shape, bool), "accepted": np.zeros(len(root), np.int64),
                "target_next": host(engine._target_next), "marginals": None, "drafter": "mtp"}
    t, d = engine.tree, getattr(engine.rs, "drafter", "mtp")
    want = {name: host(getattr(t, name)) for name in ("tokens", "parents", "score", "valid")}
    want.update(accepted=host(engine._accepted), target_next=host(engine._target_next), marginals=None,
                drafter=d if engine.rs.block_drafter else "mtp")
    if d in ("block", "dspark"):
        want["marginals"] = (host(engine.marginal_lp), host(engine.marginal_ids))
    elif not engine.rs.block_drafter and (engine.rs.marginal or engine._keeps_chain_topk()):
        want["marginals"] = tuple(host(x) for x in engine._marginals)
    if d == "dspark":
        want.update(confidence=host(engine.confidence), verified_len=host(engine.verified_len))
    return want


@pytest.mark.parametrize("label", ["none", "linear", "eagle", "best_first", "block", "tfm", "dspark"])
def test_last_round_reads_the_round_in_one_copy(label, monkeypatch):
    """A traced round's trees, accepted nodes, target tokens and the drafter's marginals (and
    DSpark's confidences) come to the host in one device -> host copy, each value as it is."""
    rs = round_shape(SPECS[label])
    engine = make_engine(tiny_model("tiny-gdn"), rs, 2, 96, costs=drafter_costs(), trace_topk=4,
                         **(TINY_DRAFTER if rs.block_drafter else {}))
    engine.prefill(PROMPTS[:2])
    engine.run(rounds=2)
    want = _round_on_device(engine)
    reads, cpu, tolist = [], torch.Tensor.cpu, torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: reads.append("cpu") or cpu(t, *a, **k))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append("tolist") or tolist(t))
    rec = engine.last_round()
    monkeypatch.undo()
    assert reads == ["cpu"]
    assert rec.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert rec[key].dtype == value.dtype and np.array_equal(rec[key], value), key
        elif isinstance(value, tuple):
            assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(rec[key], value)), key
        else:
            assert rec[key] == value, key


def test_the_drafting_pass_records_the_context_each_round_began_at(monkeypatch):
    """draft_confidences works each round's context out on the host (one token a round): it is
    the target's length on the device when the round began."""
    from simtree.runtime.target_trace import draft_confidences
    model = tiny_model("tiny-gdn")
    seen, step = [], FullEngine.step

    def recorded_step(self):
        seen.append(self.st.lengths.tolist())
        step(self)

    monkeypatch.setattr(FullEngine, "step", recorded_step)
    recs = draft_confidences(model, PROMPTS[:2], depth=3, max_new_tokens=5, workload="w")["records"]
    assert len(seen) == 4 and len(recs) == 8
    assert [[r["context_len"] for r in recs if r["position"] == i] for i in range(4)] == seen
