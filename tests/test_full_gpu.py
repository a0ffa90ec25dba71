"""The full runtime's CUDA paths (skipped without a GPU): the tree attention kernel compiled,
CUDA-graph rounds equal to eager rounds, and lossless decoding with graphs."""
import pytest
import torch

from simtree.models import get_model
from simtree.planning.simulate import PolicySpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model(name="tiny-gdn", dtype=torch.float32):
    from simtree.runtime.full.lossless import make_predictable
    from simtree.runtime.full.qwen import QwenModel
    from simtree.runtime.full.v4_rank import V4Rank
    shape = get_model(name)
    model = (QwenModel if shape.family == "gdn_hybrid" else V4Rank)(shape, device="cuda", dtype=dtype, seed=1)
    make_predictable(model, 0.3)
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D, Hq, Hkv, window", [(256, 24, 4, 0), (512, 64, 1, 128)])
def test_tree_attention_kernel_on_the_gpu(D, Hq, Hkv, window, dtype):
    """Both models' head shapes, in bf16 and in fp32 (the fp32 lossless check's tiles are smaller)."""
    from simtree.kernels.layers.attention import chain_bits, tree_attention_ref
    from simtree.kernels.layers._attention_kernel import tree_attention_triton
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)  # noqa: E731
    B, Q, S = 3, 8, 300
    lens = torch.tensor([1, 150, 300], device="cuda")
    args = (r(B, Q, Hq, D), r(B, S, Hkv, D), r(B, S, Hkv, D), lens, lens[:, None] + torch.arange(Q, device="cuda"),
            r(B, Q, Hkv, D), r(B, Q, Hkv, D), chain_bits(B, Q, "cuda"))
    sink = torch.randn(Hq, device="cuda") if window else None
    got = tree_attention_triton(*args, scale=D ** -0.5, window=window, sink=sink).float()
    want = tree_attention_ref(*args, scale=D ** -0.5, window=window, sink=sink).float()
    assert float((got - want).abs().max()) < (2e-2 if dtype == torch.bfloat16 else 1e-4)


# nodes cost verify time: cost_aware's budgets move from round to round
def _costs():
    from simtree.costs.synthetic import synthetic_costs
    return synthetic_costs(weights_us=0.0, per_token_us=10.0)


EAGLE_S3 = PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6})
COST_AWARE = PolicySpec.from_dict("cost_aware", {"max_budget": 10, "draft_depth": 3})


@pytest.mark.parametrize("spec", [EAGLE_S3, COST_AWARE], ids=["eagle", "cost_aware"])
@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
def test_graph_rounds_equal_eager_rounds(name, spec):
    """Replayed rounds (the live rounds of test_lossless_on_the_gpu use graphs too): same
    accepted lengths, lengths and output tokens with and without CUDA graphs; the V4 rank's
    rounds (device plans) captured as the Qwen model's are."""
    from simtree.acceptance.model import calibrate_linear
    from simtree.runtime.full.acceptance import DraftScores, TraceReplay
    from simtree.runtime.full.drafting import round_shape
    from simtree.runtime.full.engine import FullEngine
    # the V4 rank in bf16: its fp32 routed experts take the host-looped reference path, which
    # cannot be captured (the engine then runs eagerly, as it says in capture_error)
    model = _model(name, torch.bfloat16 if name == "tiny-v4" else torch.float32)
    rs = round_shape(spec)
    outs = []
    for graphs in (False, True):
        source = TraceReplay.fixed(2, 4, "cuda")
        # one level: the trees do not depend on the random level draws (graph and eager draw apart)
        source.scores = DraftScores(calibrate_linear(2.6, 4, spread=0.0), rs, "cuda", weights=[1.0])
        engine = FullEngine(model, rs, 4, 256, source, graphs=graphs, costs=_costs())
        engine.capture()
        assert (engine.graphs is not None) == graphs, engine.capture_error
        engine.fill_context(40, seed=1)
        stats = engine.run(rounds=8)
        outs.append((stats.accepted.tolist(), engine.st.lengths.tolist(), engine.outputs()))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
def test_lossless_on_the_gpu(name):
    from simtree.runtime.full.lossless import check_lossless
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5]]
    specs = [PolicySpec.from_dict("linear", {"budget": 4}), EAGLE_S3, COST_AWARE,
             PolicySpec.from_dict("batch_alloc", {"max_budget_per_seq": 6, "draft_depth": 4})]
    for row in check_lossless(_model(name), prompts, specs, 24, costs=_costs()):
        assert row["match"], row


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
def test_profiled_draft_step_replays_its_graphs(name):
    """The profiler's draft step replays draft and catch-up without the verify whose outputs the
    catch-up reads: its graphs must not share memory with a stage it does not replay."""
    from simtree.acceptance.model import get_workload
    from simtree.runtime.full.steps import draft_step
    model = _model(name, torch.bfloat16)
    for s, k in ((3, 1), (3, 2)):
        step = draft_step(model, 1, s, k, 64, tree_model=get_workload("gsm8k").acceptance)
        assert step.describe()["graphs"], step.engine.capture_error
        for _ in range(12):
            step.run()
        torch.cuda.synchronize()
        step.close()


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
def test_stratified_replay_under_graphs_commits_its_table(name):
    """The stratified replay's device counter advances inside the captured rounds: graph rounds
    commit the table's depths row by row, as eager rounds do, and draft from its levels."""
    from simtree.acceptance.model import get_workload
    from simtree.runtime.full.acceptance import StratifiedReplay
    from simtree.runtime.full.drafting import round_shape
    from simtree.runtime.full.engine import FullEngine
    import numpy as np
    model = _model(name, torch.bfloat16 if name == "tiny-v4" else torch.float32)
    rs = round_shape(PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6}))
    acc = get_workload("gsm8k").acceptance
    outs = []
    for graphs in (False, True):
        src = StratifiedReplay(acc, rs, "cuda", batch_size=2, rows=12, seed=5)
        engine = FullEngine(model, rs, 2, 256, src, graphs=graphs)
        engine.capture()
        assert (engine.graphs is not None) == graphs, engine.capture_error
        engine.fill_context(40, seed=1)
        src.rewind()
        stats = engine.run(rounds=12)
        assert np.array_equal(stats.accepted, src.table.cpu().numpy())
        outs.append((engine.st.lengths.tolist(), engine.tree.parents.tolist()))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
def test_tiers_switching_with_graphs_are_lossless(name, monkeypatch):
    """An engine with several round shapes (the controller's tiers) captures each shape's graphs
    and replays the one in use: switching tiers every round, and after plain runs longer than
    the MTP layer's lag buffer (caught up between graph replays), decodes as plain greedy does."""
    from simtree.runtime.full import lag as lag_mod
    from simtree.runtime.full.generate import generate, greedy_decode
    from full_helpers import TierRuns
    monkeypatch.setattr(lag_mod, "LAG_ROWS", 3)
    model = _model(name, torch.bfloat16 if name == "tiny-v4" else torch.float32)
    prompts = [[3, 17, 5, 9], [11, 2, 7, 1, 30, 4]]
    plain, linear = PolicySpec.from_dict("none"), PolicySpec.from_dict("linear", {"budget": 4})
    want = greedy_decode(model, prompts, 24)
    for plan in ([(plain, 1), (EAGLE_S3, 1), (linear, 1)], [(plain, 7), (EAGLE_S3, 2), (plain, 4), (linear, 1)]):
        ctl = TierRuns(plan)
        got = generate(model, prompts, 24, plain, controller=ctl).outputs
        assert len(ctl.chosen) >= 6
        assert got == want


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
def test_captured_catch_up_buckets_build_the_eager_state(name):
    """An engine with a plain and an EAGLE shape captures one graph per catch-up bucket; after plain
    runs of 1, 2, 3, R - 1 and R rounds, the replayed catch-up leaves the draft state the eager
    one (graphs off) leaves, in every row below each sequence's length (rows from the length on are
    not read before they are written; an H100 run found the row at the length of one sequence
    differing after a bucket-1 catch-up, every row below it equal)."""
    from simtree.runtime.full.drafting import round_shape
    from simtree.runtime.full.engine import FullEngine
    model = _model(name, torch.bfloat16 if name == "tiny-v4" else torch.float32)
    plain, eagle = round_shape(PolicySpec.from_dict("none")), round_shape(EAGLE_S3)
    prompts = [[3, 17, 5, 9], [11, 2, 7, 1, 30, 4]]
    engines = []
    for graphs in (True, False):
        engine = FullEngine(model, plain, 2, 256, shapes=[eagle], graphs=graphs)
        engine.capture()
        assert sorted(engine.lag._graphs) == (sorted(engine.lag.buckets) if graphs else []), engine.capture_error
        engine.prefill(prompts)
        engines.append(engine)
    R = engines[0].lag.rows
    tol = dict(rtol=2e-2, atol=2e-2) if name == "tiny-v4" else dict(rtol=1e-4, atol=1e-5)
    for n in sorted({1, 2, 3, R - 1, R}):
        for engine in engines:
            engine.use(plain)
            engine.run(rounds=n)
            engine.use(eagle)       # the catch-up: a graph replay / eager
        a, b = engines
        assert a.lag.last_bucket == b.lag.last_bucket and torch.equal(a.ds.lengths, b.ds.lengths)
        for i, length in enumerate(a.ds.lengths.tolist()):   # the rows a draft can read: those below each length
            torch.testing.assert_close(a.ds.kv[i, :length].float(), b.ds.kv[i, :length].float(), **tol,
                                       msg=lambda m, n=n, i=i: f"after {n} plain rounds, sequence {i}: {m}")
        torch.testing.assert_close(a.first_hidden.float(), b.first_hidden.float(), **tol)
        assert torch.equal(a.roots, b.roots)


def test_a_traced_controller_run_reads_each_shapes_own_outputs(tmp_path):
    """A traced run switching tiers under graphs: every round's record is read from the outputs of
    the shape that ran it (the host-side check in round_records refuses another shape's), and the
    recorded accepted paths add up to the tokens produced."""
    from simtree.runtime.full.generate import generate, greedy_decode
    from simtree.acceptance.traces import read_traces
    from simtree.runtime.trace import TraceWriter
    from full_helpers import TierRuns
    model = _model("tiny-gdn")
    prompts = [[3, 17, 5, 9], [11, 2, 7, 1, 30, 4]]
    plain, linear = PolicySpec.from_dict("none"), PolicySpec.from_dict("linear", {"budget": 4})
    ctl = TierRuns([(EAGLE_S3, 2), (linear, 2), (plain, 1)])
    with TraceWriter(tmp_path / "t.jsonl") as tw:
        res = generate(model, prompts, 24, plain, controller=ctl, trace=tw, workload="sharegpt")
    assert res.outputs == greedy_decode(model, prompts, 24)
    assert len(read_traces(tmp_path / "t.jsonl")) > 0
