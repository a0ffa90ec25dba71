"""Variant ``layers``: the profiler times the full runtime's own layer calls, and a step composed
of them is the runtime's step.  Checked on the CPU at tiny shapes by the op-count proxy
(kernels/layers/opcount.py): each piece's ops, weighted as profiler/compose.py weighs their
latencies, add up to exactly the ops of the runtime model's verify + greedy pick + commit (and
of its plain decoding step) - the composition misses nothing and counts nothing twice."""
from pathlib import Path

import pandas as pd
import pytest
import torch

from simtree.costs.steps import Point, Unavailable
from simtree.kernels.layers.opcount import OpCounter
from simtree.models import COMMIT_STAGE, DECODE_STAGE, VERIFY_STAGE, get_model
from simtree.profiler.compose import compose_rows
from simtree.profiler.layer_pieces import layer_stages
from simtree.profiler.pieces import Ctx, tree_batch
from simtree.profiler.stages import build_workload, check_variant
from simtree.runtime.full.qwen import QwenModel
from simtree.runtime.full.v4_rank import V4Rank

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
B, N, L = 2, 4, 12


def _ctx(name):
    return Ctx(get_model(name), torch.device("cpu"), torch.float32, seed=0)


def _piece_ops(ctx, stage, n) -> int:
    """Launches of one piece's step (its second run: per-shape caches filled by the first)."""
    step, inst = build_workload(ctx, Point(stage, "layers", ctx.model.name, B, n, L, "eagle")).make()
    assert inst > 0
    step()
    with OpCounter() as c:
        step()
    return c.launches


def _runtime_ops(name, n) -> int:
    shape = get_model(name)
    model = (QwenModel if shape.family == "gdn_hybrid" else V4Rank)(shape, "cpu", torch.float32, 0)
    st = model.new_state(B, L + 4 * n + 8)
    tokens = torch.randint(0, 100, (B, n), generator=torch.Generator().manual_seed(1))
    tb = tree_batch(B, n, "eagle", 0)
    parents = torch.as_tensor(tb.parents).view(B, n)
    accepted = torch.as_tensor(tb.deepest_nodes)

    def step():
        st.lengths.fill_(L)
        if n == 1:
            return model.greedy(model.decode(st, tokens[:, 0]))
        h, pend = model.verify(st, tokens, parents)
        model.greedy(h)
        model.commit(st, pend, accepted)

    step()
    st.lengths.fill_(L)
    with OpCounter() as c:
        step()
    return c.launches - 1    # the fill_ of the lengths (the test's, not the step's)


def _table(name, n) -> pd.DataFrame:
    """A profile table whose latencies are the pieces' launch counts."""
    ctx = _ctx(name)
    rows = []
    for stage in layer_stages(ctx.model):
        try:
            ops = _piece_ops(ctx, stage, n)
        except Unavailable:
            continue
        rows.append({"stage": stage, "model": name, "device": "cpu", "dtype": "fp32", "variant": "layers",
                     "batch_size": B, "nodes_per_seq": n, "total_tokens": B * n, "context_len": L, "tree_shape": "eagle",
                     "num_steps": 0, "topk": 0, "latency_us_median": float(ops), "latency_us_p10": float(ops),
                     "latency_us_p90": float(ops), "repeats": 1})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("name", ["tiny-gdn", "tiny-v4"])
@pytest.mark.parametrize("n", [1, N])
def test_the_composed_step_is_the_runtimes_step_op_for_op(name, n):
    df = _table(name, n)
    stages = set(df.stage)
    kinds = get_model(name).kinds()
    assert {VERIFY_STAGE[k] for k in kinds if not (k == "gdn" and n == 1)} <= stages
    assert {COMMIT_STAGE[k] for k in kinds if not (k == "gdn" and n == 1)} <= stages
    if n == 1 and "gdn" in kinds:
        assert DECODE_STAGE["gdn"] in stages
    rows = compose_rows(df, name)
    assert len(rows) == 1
    assert rows[0]["latency_us_median"] == _runtime_ops(name, n)


def test_layer_pieces_unavailable_where_the_model_has_no_such_call():
    ctx = _ctx("tiny-gdn")
    for stage, n in (("v4_csa_verify", 4), ("gdn_decode_step", 4), ("gdn_tree_verify", 1)):
        with pytest.raises(Unavailable):
            build_workload(ctx, Point(stage, "layers", "tiny-gdn", 2, n, 8, "eagle"))
    with pytest.raises(Unavailable, match="variant 'layers' only"):
        build_workload(ctx, Point("round_meta_step", "torch", "tiny-gdn", 2, 4, 8, "eagle"))


def test_layer_checks_say_what_they_compared():
    assert check_variant(_ctx("tiny-gdn"), "mlp_step", "layers").startswith("no reference")   # Triton is CUDA's


def test_a_sweep_of_the_layer_pieces_composes_both_models(tmp_path):
    """The GPU session's sweep (full_layers_gpu.yaml's stages) at tiny shapes on the CPU: every
    piece measured, composed model_verify_step rows for both families at every (b, n)."""
    from simtree.costs.profile_table import load_profile
    from simtree.fileio import read_yaml
    from simtree.profiler.sweep import run_sweep

    spec = read_yaml(ROOT / "simtree/data/sweeps/full_layers_gpu.yaml", "sweep")
    spec.update(name="layers_cpu", device="cpu", dtype="fp32", target_s=0.002, max_minutes=5,
                models=["tiny-gdn", "tiny-v4"],
                grid={"batch_size": [1, 2], "nodes_per_seq": [1, 3], "context_len": [0], "tree_shape": ["eagle"]})
    for entry in spec["stages"]:
        grid = entry.get("grid") or {}
        if "nodes_per_seq" in grid:
            grid["nodes_per_seq"] = [n for n in (1, 3) if n in grid["nodes_per_seq"]]
        if "context_len" in grid:
            grid["context_len"] = [16, 48]
    # the dense node counts at batch >= 16 (the GEMMs' buckets) are the same pieces at more points
    spec["stages"] = [e for e in spec["stages"] if (e.get("grid") or {}).get("nodes_per_seq") != []]
    path = tmp_path / "layers_cpu.yaml"
    import yaml
    path.write_text(yaml.safe_dump(spec))
    res = run_sweep(path, tmp_path / "profile.csv", progress=False, echo=lambda s: None)
    assert res.failed == 0 and res.oom == 0 and res.not_run == 0, res.summary()
    df = load_profile(tmp_path / "profile.csv")
    composed = df[(df.stage == "model_verify_step") & (df.variant == "composed")]
    for model in ("tiny-gdn", "tiny-v4"):
        got = composed[composed.model == model]
        assert set(zip(got.batch_size, got.nodes_per_seq)) == {(1, 1), (1, 3), (2, 1), (2, 3)}, model
