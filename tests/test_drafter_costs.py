"""C_d of the block-drafter families: profiled on the CPU (stage -> profile table rows over each
family's axes), fitted with the convex programs, carried by the cost bundle (old bundles still
load), and the bad inputs refused in one line."""
import json

import numpy as np
import pytest

from simtree.costs.model import DRAFTER_STAGE, CostBundle, load_costs
from simtree.costs.profile_fit import fit_profile
from simtree.costs.profile_table import append_rows, load_profile
from simtree.errors import SimtreeError

from test_fit_cli import make_profile, row


def _truth(fam, x, y, b):
    """A plausible round cost: backbone over block rows, per-node or per-step work."""
    if fam == "block":      # x tree nodes, y block length
        return 400 + 30 * y * (1 + 0.05 * b) + 4 * x + 0.2 * x * b
    if fam == "tfm":        # x tree nodes, y adapter steps
        return 450 + 20 * y + 1.5 * x * (1 + 0.02 * b) + 5 * b
    return 380 + 45 * y + 3 * x * y * (1 + 0.01 * b) + 6 * b     # dspark: x topk, y block length


def _drafter_rows(rng, noise):
    rows = []
    for b in (1, 2, 4, 8, 16):
        for fam in ("block", "tfm", "dspark"):
            grid = {"block": [(n, L, 8) for n in (4, 8, 16, 32) for L in (4, 7, 10)],
                    "tfm": [(n, -(-(n - 1) // w), w) for n in (4, 8, 16, 32) for w in (1, 2, 4)],
                    "dspark": [(1, L, k) for L in (2, 4, 7, 10) for k in (1, 4, 8)]}[fam]
            for n, s, k in grid:
                x = k if fam == "dspark" else n
                lat = _truth(fam, x, s, b) * (1 + noise * rng.standard_normal())
                rows.append({**row(DRAFTER_STAGE[fam], n, 1024, b, lat, num_steps=s, topk=k), "variant": "layers",
                             "tree_shape": "any"})
    return rows


def _profile(tmp_path, noise=0.005):
    rng = np.random.default_rng(0)
    path = make_profile(tmp_path / "p.csv", rng)
    append_rows(path, _drafter_rows(rng, noise))
    return path


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    return fit_profile(_profile(tmp_path_factory.mktemp("fit")), folds=4)


def test_fit_carries_every_family_with_small_heldout_error(fitted):
    rep = fitted
    b = rep.bundle
    assert sorted(b.drafters) == ["block", "dspark", "tfm"]
    for fam, m in b.drafters.items():
        med = m.info["fit_error"]["heldout"][m.info["form"]]["median"]
        assert med < 0.03, (fam, med)
        assert m.block_len == 7 and m.info["source"]["stage"] == DRAFTER_STAGE[fam]
    # the block round without the stage's per-node builder steps: the truth's n - 1 = 0 value
    assert b.drafter("block").predict(16, 7, 4) == pytest.approx(_truth("block", 1, 7, 4), rel=0.03)
    assert b.drafter("tfm").predict(32, 8, 8) > b.drafter("tfm").predict(32, 4, 8)
    assert "drafters" in rep.summary()


def test_bundle_round_trips_drafters_and_old_bundles_load(fitted, tmp_path):
    b = fitted.bundle
    out = b.save(tmp_path / "b.json")
    again = load_costs(out)
    for fam in b.drafters:
        assert again.drafter(fam).predict(8, 7, 2) == b.drafter(fam).predict(8, 7, 2)
    d = json.loads(out.read_text())
    del d["drafters"]
    old = CostBundle.from_dict(d)
    assert old.drafters == {} and "drafters" not in old.to_dict()
    with pytest.raises(SimtreeError, match=r"no cost for drafter 'dspark' \(drafters with costs: none\)"):
        old.drafter("dspark")


def test_bad_drafter_input_is_one_line(fitted):
    b = fitted.bundle
    with pytest.raises(SimtreeError, match="beyond the block drafter's 7 positions"):
        b.drafter("block").check_block_len(8)
    assert b.drafter("block").check_block_len(7) == 7
    d = b.to_dict()
    d["drafters"]["tfm"]["family"] = "medusa"
    with pytest.raises(SimtreeError, match="drafter 'tfm'.*family 'tfm'"):
        CostBundle.from_dict(d)
    d = b.to_dict()
    d["drafters"]["block"]["surface"] = {"form": "nope"}
    with pytest.raises(SimtreeError, match="drafter 'block'"):
        CostBundle.from_dict(d)


def test_cpu_profile_stage_writes_rows_over_each_familys_axes(tmp_path):
    """A few points of the drafters' stages timed on the CPU (perf_counter), then fitted."""
    import yaml

    from simtree.profiler.sweep import run_sweep

    sweep = {"name": "t", "device": "cpu", "dtype": "fp32", "max_minutes": 1.0, "target_s": 0.001, "seed": 0,
             "models": ["tiny-gdn"], "grid": {"batch_size": [1, 2], "context_len": [16], "tree_shape": ["any"]},
             "stages": [{"stage": "draft_block", "grid": {"num_steps": [2, 3], "nodes_per_seq": [3, 5], "topk": [2]}},
                        {"stage": "draft_tfm", "grid": {"nodes_per_seq": [3, 5], "topk": [1, 2]}},
                        {"stage": "draft_dspark", "grid": {"num_steps": [2, 3], "topk": [1, 2]}}],
             "compose": False}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(sweep))
    res = run_sweep(tmp_path / "s.yaml", tmp_path / "prof.csv", progress=False, echo=lambda s: None)
    assert res.exit_code == 0
    df = load_profile(tmp_path / "prof.csv")
    assert set(df["stage"]) == set(DRAFTER_STAGE.values()) and set(df["variant"]) == {"round"}
    tfm = df[df["stage"] == "draft_tfm"]
    assert sorted(zip(tfm["nodes_per_seq"], tfm["topk"], tfm["num_steps"]))[:4] == \
        [(3, 1, 2), (3, 1, 2), (3, 2, 1), (3, 2, 1)]        # steps = ceil((n - 1) / w), per batch size
    assert set(df[df["stage"] == "draft_dspark"]["nodes_per_seq"]) == {1}
    assert (df["latency_us_median"] > 0).all() and len(df) == 8 + 8 + 8


def test_a_family_with_too_few_points_is_left_out_with_a_note(tmp_path):
    from simtree.costs.drafter_fit import fit_drafters

    rows = [{**row("draft_dspark", 1, 64, 1, 100.0 + s, num_steps=s, topk=1), "variant": "layers"} for s in (2, 4)]
    append_rows(tmp_path / "p.csv", rows)
    models, notes = fit_drafters(load_profile(tmp_path / "p.csv"), model="toy", device="cpu", dtype="bf16",
                                 deployment="tp=1", source={})
    assert models == {} and any("dspark drafter not fitted" in n for n in notes)


def test_the_block_round_is_priced_without_the_profile_stages_tree_builder_steps(tmp_path):
    """The draft_block stage builds its tree in n - 1 sequential steps (kernels' tree_from_marginals);
    the runtime's block round does not run them (a sort-based builder): C_d of the block drafter is
    the stage's backbone + marginals, the same for every tree size, and the note names the step."""
    from simtree.costs.drafter_fit import fit_drafters, loop_free_block_rows

    def backbone(L, b):
        return 2000.0 + 12.0 * L * (1 + 0.05 * b)

    rows = [{**row(DRAFTER_STAGE["block"], n, 1024, b, backbone(L, b) + 43.0 * (n - 1), num_steps=L, topk=8),
             "variant": "layers", "tree_shape": "any"}
            for b in (1, 2, 4, 8, 16, 32) for L in (4, 7, 10) for n in (4, 8, 16, 32)]
    path = tmp_path / "p.csv"
    append_rows(path, rows)
    df = load_profile(path)
    free, note = loop_free_block_rows(df)
    want = np.array([backbone(L, b) for L, b in zip(free["num_steps"], free["batch_size"])])
    assert np.allclose(free["latency_us_median"], want, rtol=1e-9) and "43.0 us a node" in note
    models, notes = fit_drafters(df, model=df["model"].iloc[0], device=df["device"].iloc[0], dtype=df["dtype"].iloc[0],
                                 deployment=df["deployment"].iloc[0], source={}, folds=4)
    m = models["block"]
    for L, b in ((7, 8), (4, 32), (10, 2)):
        got = [float(m.predict(n, L, b)) for n in (4, 8, 16, 32)]
        assert got == pytest.approx([backbone(L, b)] * 4, rel=0.01), (L, b, got)
    assert any("tree-builder steps taken out" in n for n in notes + m.info["notes"])
    # one tree size only: nothing to split, kept as timed and said so
    one = df[df["nodes_per_seq"] == 8]
    kept, note1 = loop_free_block_rows(one)
    assert np.array_equal(kept["latency_us_median"], one["latency_us_median"]) and "builder steps kept in" in note1
