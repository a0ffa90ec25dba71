"""The drafter profile stages run the runtime's round, and C_d is fitted by how rows were timed.

On the CPU nothing is timed.  Float64, batch 3, fresh random drafter weights, caches, context
rows and anchors: the stage's round (``profiler.drafter_pieces.run_round``) lays the same tree
(tokens, parents, depth, rank, valid, score) as ``BlockEngine._draft`` on the same drafter state
and inputs, and for DSpark the same confidences and verified prefixes - for the tiny GDN model's
block, TfM and DSpark stages and the tiny V4 model's block stage.  The bf16 CUDA cases (both tiny
models, every family) are marked gpu.  On synthetic profile rows (no drafter runs): the fit takes
the tree-builder steps out of older ``layers`` rows only (``round`` rows are fitted as timed,
``builder_steps="keep"`` keeps the steps, a table with both drops the older rows with a note, an
unknown variant is refused), and C_d fitted at two contexts is linear in the context between
them, clamped outside, and kept across a save and load."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from simtree.costs.drafter_fit import fit_drafters, timed_rows
from simtree.costs.model import DRAFTER_STAGE
from simtree.costs.profile_table import append_rows, load_profile
from simtree.costs.steps import Point
from simtree.drafters import LOOP_BUILDER_VARIANT, ROUND_VARIANT
from simtree.errors import SimtreeError
from simtree.models import get_model
from simtree.planning.modes import PolicySpec
from simtree.profiler.drafter_pieces import DSPARK_THRESHOLD, drafter_inputs, run_round
from simtree.profiler.pieces import Ctx
from simtree.runtime.full.block_engine import make_engine
from simtree.runtime.full.drafting import round_shape

from full_helpers import drafter_costs, tiny_model
from test_fit_cli import row

CASES = {"block": ("draft_block", dict(num_steps=5, nodes_per_seq=9, topk=4),
                   {"budget": 9, "block_len": 5}),
         "tfm": ("draft_tfm", dict(num_steps=4, nodes_per_seq=8, topk=2),
                 {"budget": 8, "width": 2, "block_len": 7}),
         "dspark": ("draft_dspark", dict(num_steps=6, nodes_per_seq=1, topk=4),
                    {"block_len": 6, "threshold": DSPARK_THRESHOLD})}


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SETUPS = [pytest.param("tiny-gdn", f, "cpu", id=f"tiny-gdn-{f}-cpu") for f in CASES] + \
    [pytest.param("tiny-v4", "block", "cpu", id="tiny-v4-block-cpu")] + \
    [pytest.param(m, f, "cuda", id=f"{m}-{f}-cuda", marks=GPU) for m in ("tiny-gdn", "tiny-v4") for f in CASES]


def _model(name: str, device: str):
    if device == "cpu":
        return tiny_model(name)          # float64
    from simtree.runtime.full.qwen import QwenModel
    from simtree.runtime.full.v4_rank import V4Rank
    shape = get_model(name)
    return (QwenModel if shape.family == "gdn_hybrid" else V4Rank)(shape, device="cuda", dtype=torch.bfloat16, seed=1)


@pytest.mark.parametrize("name,family,device", SETUPS)
def test_the_stage_builds_the_trees_the_runtimes_round_builds(name, family, device):
    """Fresh random drafter weights, caches, context rows and anchors (batch 3; float64 on the
    CPU, bf16 on the GPU): the profile stage's round and BlockEngine._draft on the same drafter
    state give the same tree, node for node, and (dspark) the same confidences and verified
    prefixes."""
    stage, axes, params = CASES[family]
    model = _model(name, device)
    ctx = Ctx(model.shape, torch.device(device), model.dtype, seed=int(torch.randint(0, 10_000, ())))
    x = drafter_inputs(ctx, Point(stage, ROUND_VARIANT, model.shape.name, 3, context_len=24, tree_shape="any",
                                  **axes))
    out = run_round(x)
    engine = make_engine(model, round_shape(PolicySpec.from_dict(family, params)), 3, 64, costs=drafter_costs(),
                         sizes={"layers": 1, "cand_k": x.cfg.cand_k or 32, "adapter_dim": 16, "markov_rank": 32})
    d = engine.drafter          # the runtime's drafter holding the stage's weights, state and inputs
    d.w, d.cfg, d.state, d.rope, d.feats, d.n_new = x.w, x.cfg, x.state, x.rope, x.feats, x.n_new
    x.state.lengths.copy_(x.lengths0)
    engine.roots.copy_(x.anchor)
    engine._draft()
    n = x.tree.tokens.shape[1]
    assert engine.rs.tree_nodes == x.tree_nodes
    for name in ("tokens", "parents", "depth", "rank", "valid", "score"):
        got, want = getattr(engine.tree, name)[:, :n], getattr(x.tree, name)
        assert torch.equal(got, want), (family, name, got, want)
    assert bool(x.tree.valid[:, 1].any()) and int(x.tree.parents[:, 1:].max()) >= 0
    if family == "dspark":
        assert torch.equal(engine.confidence, out.confidence.float())
        assert torch.equal(engine.verified_len, out.verified_len)
    if family == "block":      # a tree, not a chain: some node's parent is not its predecessor
        assert bool((x.tree.parents[:, 2:].cpu() != torch.arange(1, n - 1)).any())


def _block_rows(variant, slope_us=43.0, contexts=(1024,)):
    def backbone(L, b, l):
        return 2000.0 + 12.0 * L * (1 + 0.05 * b) + 0.02 * b * l
    return [{**row(DRAFTER_STAGE["block"], n, l, b, backbone(L, b, l) + slope_us * (n - 1), num_steps=L, topk=4),
             "variant": variant, "tree_shape": "any"}
            for l in contexts for b in (1, 2, 4, 8, 16, 32) for L in (4, 7, 10) for n in (4, 8, 16, 32)], backbone


def _fit(path, rows):
    append_rows(path, rows)
    df = load_profile(path)
    return fit_drafters(df, model=df["model"].iloc[0], device=df["device"].iloc[0], dtype=df["dtype"].iloc[0],
                        deployment=df["deployment"].iloc[0], source={}, folds=4)


def test_only_rows_timed_with_the_step_builder_get_its_steps_taken_out(tmp_path):
    """The same latencies (backbone + 43 us a node): as older ``layers`` rows the fit takes the
    steps out (C_d flat in n); as ``round`` rows (the runtime's builder timed) it keeps them."""
    rows, backbone = _block_rows(LOOP_BUILDER_VARIANT)
    old, notes = _fit(tmp_path / "old.csv", rows)
    got = [float(old["block"].predict(n, 7, 8)) for n in (4, 32)]
    assert got == pytest.approx([backbone(7, 8, 1024)] * 2, rel=0.01)
    assert any("tree-builder steps taken out" in n for n in notes)
    # builder_steps="keep": the older rows as timed (the C_d runs priced before), steps and all
    df = load_profile(tmp_path / "old.csv")
    kept, notes = fit_drafters(df, model=df["model"].iloc[0], device=df["device"].iloc[0], dtype=df["dtype"].iloc[0],
                               deployment=df["deployment"].iloc[0], source={}, folds=4, builder_steps="keep")
    got = [float(kept["block"].predict(n, 7, 8)) for n in (4, 32)]
    assert got == pytest.approx([backbone(7, 8, 1024) + 43.0 * (n - 1) for n in (4, 32)], rel=0.01)
    assert not any("tree-builder" in n for n in notes)
    with pytest.raises(SimtreeError, match="builder_steps 'drop': expected one of remove, keep"):
        timed_rows(df, "block", builder_steps="drop")
    new_rows = [{**r, "variant": ROUND_VARIANT} for r in rows]
    new, notes = _fit(tmp_path / "new.csv", new_rows)
    got = [float(new["block"].predict(n, 7, 8)) for n in (4, 32)]
    assert got == pytest.approx([backbone(7, 8, 1024) + 43.0 * (n - 1) for n in (4, 32)], rel=0.01)
    assert not any("tree-builder" in n for n in notes) and new["block"].info["source"]["variant"] == ROUND_VARIANT
    # both in one table: the round rows are fitted as timed, the older ones dropped with a note
    append_rows(tmp_path / "both.csv", rows + new_rows)
    both, note = timed_rows(load_profile(tmp_path / "both.csv"), "block")
    assert set(both["variant"]) == {ROUND_VARIANT} and len(both) == len(new_rows)
    assert "older 'layers' row(s) dropped" in note[0]
    with pytest.raises(SimtreeError, match="unknown variant"):
        timed_rows(both.assign(variant="torch"), "block")


def test_c_d_at_several_contexts_is_interpolated_in_the_context(tmp_path):
    """Rounds timed at contexts 256 and 1024 (C_d grows with b x l): one surface per context, C_d at
    l between them linear in l, clamped outside, the largest context's without l; the bundle
    keeps the contexts across a save and load."""
    rows, backbone = _block_rows(ROUND_VARIANT, slope_us=5.0, contexts=(256, 1024))
    models, notes = _fit(tmp_path / "p.csv", rows)
    m = models["block"]
    assert m.contexts == [256, 1024] and any("contexts 256, 1024" in n for n in notes)
    at = {l: float(m.predict(8, 7, 32, l)) for l in (100, 256, 640, 1024, 4096)}
    assert at[256] == pytest.approx(backbone(7, 32, 256) + 35.0, rel=0.01)
    assert at[1024] == pytest.approx(backbone(7, 32, 1024) + 35.0, rel=0.01)
    assert at[640] == pytest.approx((at[256] + at[1024]) / 2, rel=1e-9)
    assert at[100] == at[256] and at[4096] == at[1024] == float(m.predict(8, 7, 32))
    grid = m.predict(np.array([8, 8]), np.array([7, 7]), np.array([32, 32]), np.array([256, 640]))
    assert np.allclose(grid, [at[256], at[640]])
    again = type(m).from_dict(m.to_dict())
    assert again.contexts == [256, 1024] and float(again.predict(8, 7, 32, 640)) == at[640]
    # surfaces not monotone in l (the smaller context timed slower): without l, C_d at the largest
    # context through the same path, the running maximum, not the largest context's raw surface
    (lo, m_lo), (hi, m_hi) = m.by_context
    flipped = replace(m, surface=m_lo.surface, by_context=((lo, m_hi), (hi, m_lo)))
    assert float(flipped.predict(8, 7, 32, hi)) == pytest.approx(at[1024]) != pytest.approx(at[256])
    no_context = float(flipped.predict(8, 7, 32))
    assert no_context == float(flipped.predict(8, 7, 32, hi)) == float(flipped.predict(8, 7, 32, 4096))
    assert np.allclose(flipped.predict(np.array([8]), np.array([7]), np.array([32])), at[1024])
    bad = m.to_dict()
    bad["by_context"][0]["context_len"] = 2048
    with pytest.raises(SimtreeError, match="ascending"):
        type(m).from_dict(bad)
