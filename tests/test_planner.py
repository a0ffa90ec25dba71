"""Planner: known optima, trees on under flat verify cost, off under steep cost, CLI."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from simtree.acceptance.model import AcceptanceModel, Workload, calibrate_linear
from simtree.cli import app
from simtree.deploy import shipped
from simtree.costs.synthetic import RooflineDraftCost, RooflineVerifyCost, SyntheticCostBundle
from simtree.errors import SimtreeError
from simtree.planning.modes import PolicySpec
from simtree.planning.planner import SearchSpace, plan
from simtree.planning.policy_file import Policy
from simtree.cli.plan import plan_and_write

SMALL = SearchSpace(budgets=(2, 3, 4, 6, 8), eagle_steps=(2, 3, 4), eagle_topk=(2, 3), draft_depths=(2, 3, 4),
                    adaptive_max_budget=8)


class Affine:
    """A verify cost (``simtree.costs.model.VerifyCost``) affine in n, analytic."""

    convex_in_n, valid_range, heldout_median_error = True, {}, None

    def __init__(self, base, per_n):
        self.base, self.per_n = base, per_n

    def predict(self, n, l, b):
        return self.base + self.per_n * np.asarray(n, np.float64)


def _wl(mean=2.6, spread=0.25):
    return Workload("w", calibrate_linear(mean, 4, name="w", spread=spread), np.full(4, 300), 64)


def test_linear_search_finds_the_known_optimum():
    wl = _wl(spread=0.0)
    alpha = wl.acceptance.tables[0, 0, 0]
    costs = SyntheticCostBundle(Affine(1000.0, 180.0), Affine(0.0, 0.0), {"model": "m", "device": "d"})
    space = SearchSpace(budgets=tuple(range(2, 17)), eagle_steps=(), draft_depths=(), adaptive=False)
    res = plan(costs, [wl], [1], space)
    truth = max(range(1, 17), key=lambda d: (1 + sum(alpha ** i for i in range(1, d))) / (1000 + 180 * d))
    assert res.chosen.iloc[0]["policy"] == ("none" if truth == 1 else f"linear_d{truth}")


def test_modes_restrict_the_search_to_what_a_runtime_builds():
    """--modes linear,eagle (the full-scale runtime's families): only plain, linear and EAGLE
    candidates, the same choice as the whole search where that is one of them, and a note."""
    flat = RooflineVerifyCost(per_token_us=0.0, per_seq_us=0.0, kv_per_ctx_us=0.0, attn_per_pair_us=0.0)
    costs = SyntheticCostBundle(flat, RooflineDraftCost(per_token_us=0.0))
    space = SearchSpace(**{**SMALL.__dict__, "modes": ("linear", "eagle")})
    res = plan(costs, [_wl(2.4)], [1, 8], space)
    assert set(res.candidates["mode"]) == {"none", "linear", "eagle"}
    assert res.chosen["mode"].eq("eagle").all()
    whole = plan(costs, [_wl(2.4)], [1, 8], SMALL).candidates
    eagle = whole[whole["mode"] == "eagle"]
    assert res.candidates[res.candidates["mode"] == "eagle"]["tok_s"].tolist() == eagle["tok_s"].tolist()
    assert res.source["modes"] == ["none", "linear", "eagle"] and any("--modes" in n for n in res.notes)
    assert "modes" not in plan(costs, [_wl(2.4)], [1], SMALL).source
    with pytest.raises(SimtreeError, match="plan modes dfs"):
        SearchSpace(modes=("eagle", "dfs"))


def test_a_plan_names_only_what_simtree_run_builds(monkeypatch):
    """Every candidate of the default search is a round the full runtime builds on the device
    (round_shape refuses the rest); a mode it does not build is refused by name in one line."""
    import simtree.planning.planner as planner
    from simtree.planning.modes import RUNTIME_MODES
    from simtree.runtime.full.drafting import round_shape

    from simtree.planning.modes import BLOCK_DRAFTER_MODES
    assert SearchSpace().searched == planner.FAMILIES == RUNTIME_MODES
    fixed, adaptive = planner.candidate_specs(SearchSpace())
    # the block drafters' candidates come with a bundle that prices them (test_full_block_drafters)
    assert {s.mode for s in fixed + adaptive} == set(RUNTIME_MODES) - set(BLOCK_DRAFTER_MODES)
    for spec in fixed + adaptive:
        round_shape(spec)
    monkeypatch.setattr(planner, "FAMILIES", ("none", "linear", "eagle"))
    with pytest.raises(SimtreeError, match="plan mode cost_aware: simtree run does not build it.*runs none, "
                                           "linear, eagle"):
        planner.SearchSpace(modes=("linear", "cost_aware"))


def test_flat_verify_cost_never_turns_trees_off():
    flat = RooflineVerifyCost(per_token_us=0.0, per_seq_us=0.0, kv_per_ctx_us=0.0, attn_per_pair_us=0.0)
    draft = RooflineDraftCost(per_token_us=0.0)  # memory-bound drafter: width is free too
    res = plan(SyntheticCostBundle(flat, draft), [_wl(2.4)], [1, 8, 64], SMALL)
    assert res.chosen["mode"].isin(["eagle", "best_first", "cost_aware", "batch_alloc"]).all()
    assert res.to_policy().entries[-1].tree_on


def test_steep_verify_cost_at_large_batch_picks_linear_or_none():
    steep = RooflineVerifyCost(weights_us=2000.0, per_token_us=400.0)  # compute-bound from T ~ 5
    res = plan(SyntheticCostBundle(steep, RooflineDraftCost()), [_wl(2.4)], [1, 64], SMALL)
    big = res.chosen[res.chosen["batch_size"] == 64].iloc[0]
    assert big["mode"] in ("linear", "none")
    assert not res.to_policy().lookup("w", 64).tree_on


def test_plan_policy_covers_every_batch_size_and_round_trips(tmp_path):
    res = plan(SyntheticCostBundle(RooflineVerifyCost(), RooflineDraftCost(), {"synthetic": True}),
               [_wl()], [1, 4, 16], SMALL)
    pol = res.to_policy()
    path = pol.save(tmp_path / "p.json")
    back = Policy.load(path)
    for b in range(1, 17):
        e = back.lookup("w", b)
        assert e.batch_min <= b <= e.batch_max
    assert back.source["synthetic"] is True
    assert [e.predicted_tok_s for e in back.entries] == [e.predicted_tok_s for e in pol.entries]
    chosen = res.chosen.set_index("batch_size")["tok_s"]
    assert np.all(res.candidates.groupby("batch_size")["tok_s"].max().to_numpy() <= chosen.to_numpy() + 1e-9)


def test_cli_plan_default_is_loudly_synthetic(tmp_path, monkeypatch):
    monkeypatch.setattr(shipped, "shipped_cost_paths", lambda machine=None: [])
    out = tmp_path / "plan"
    res = CliRunner().invoke(app, ["plan", "--workload", "gsm8k", "--batch-sizes", "1,64", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "SYNTHETIC" in res.output
    pol = json.loads((out / "policy.json").read_text())
    assert pol["schema"] == "simtree.policy/1" and pol["source"]["synthetic"] is True
    assert "SYNTHETIC" in (out / "plan.md").read_text()
    assert (out / "gain_heatmap.png").stat().st_size > 0 and (out / "throughput_vs_batch.png").stat().st_size > 0


def test_cli_simulate_json(tmp_path, monkeypatch):
    monkeypatch.setattr(shipped, "shipped_cost_paths", lambda machine=None: [])
    res = CliRunner().invoke(app, ["simulate", "--workload", "mbpp", "--batch-size", "2", "--policy-mode", "eagle",
                                   "--steps", "3", "--topk", "2", "--budget", "5", "--output-len", "32", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["policy"] == "eagle_s3_k2_d5" and data["synthetic"] is True
    assert data["speedup_vs_none"] > 1.0


def test_plan_reads_a_saved_cost_bundle(tmp_path):
    # a measured-style CostBundle (contract 2) saved as JSON goes through --costs, not SYNTHETIC
    from simtree.costs.forms import BasisSurface
    from simtree.costs.model import CostBundle, DraftCostModel, VerifyCostModel

    verify = BasisSurface("verify", [64.0], [900.0, 0.5, 40.0, 30.0, 0.01, 0.0005])
    draft = BasisSurface("draft", [64.0], [50.0, 2.0, 120.0, 0.1, 0.01, 0.5])
    bundle = CostBundle(VerifyCostModel(verify), DraftCostModel(draft),
                        {"model": "toy", "device": "cpu", "source": "test", "synthetic": False})
    path = bundle.save(tmp_path / "toy.json")
    out = plan_and_write([str(path)], ["sharegpt"], [1, 32], str(tmp_path / "plan"), space=SMALL)
    res = out[0]["result"]
    assert (res.model, res.device, res.synthetic) == ("toy", "cpu", False)
    assert "SYNTHETIC" not in (tmp_path / "plan" / "plan.md").read_text()
    assert Policy.load(out[0]["policy"]).lookup("sharegpt", 32).predicted_tok_s > 0


def test_plan_source_line_names_the_per_round_extras_of_the_composed_step():
    # a bundle fitted to composed steps says which per-round stages (and variants) they hold
    from simtree.reporting.plan_report import _source_line
    costs = {"model": "qwen3.6-27b", "source": {"profile": "p.csv", "sha256": "sha256:0123456789abcdef"},
             "profile_meta": {"collected": "2026-12-01", "compose": {"round_extras": {
                 "qwen3.6-27b": ["gdn_round_meta/torch_graph", "gdn_tree_commit/triton_tree"],
                 "deepseek-v4-flash": []}}}}
    line = _source_line(costs)
    assert "`gdn_round_meta/torch_graph`, `gdn_tree_commit/triton_tree`" in line
    assert "includes" not in _source_line({**costs, "model": "deepseek-v4-flash"})
    # a decode step stands in for verify + commit at n = 1: named as such, not as an extra
    costs["profile_meta"]["compose"]["round_extras"]["qwen3.6-27b"].insert(0, "gdn_decode_step/triton_recurrent")
    line = _source_line(costs)
    assert "includes `gdn_round_meta/torch_graph`, `gdn_tree_commit/triton_tree`;" in line
    assert "plain decoding (n = 1) is `gdn_decode_step/triton_recurrent` in place of" in line


def test_report_rerenders_a_plan_folder_to_the_same_choice(tmp_path):
    from simtree.reporting.plan_report import render_plan_dir, write_plan_report

    res = plan(SyntheticCostBundle(RooflineVerifyCost(), RooflineDraftCost(), {"synthetic": True}),
               [_wl()], [1, 64], SMALL)
    res.to_policy().save(tmp_path / "policy.json")
    write_plan_report(res, tmp_path)
    (tmp_path / "plan.md").unlink()
    render_plan_dir(tmp_path)
    text = (tmp_path / "plan.md").read_text()
    assert all(f"| {p} |" in text for p in res.chosen["policy"]) and "SYNTHETIC" in text


STATIC_MODES = ("none", "linear", "eagle", "best_first")


def _sibling_ranks(tree) -> list[int]:
    """Rank of each node among its siblings by draft log-prob, best first (ties: lower index)."""
    children: dict[int, list[int]] = {}
    for i in range(1, tree.num_nodes):
        children.setdefault(int(tree.parents[i]), []).append(i)
    rank = [0] * tree.num_nodes
    for kids in children.values():
        for r, i in enumerate(sorted(kids, key=lambda i: (-tree.log_probs[i], i))):
            rank[i] = r
    return rank


def _reach_probs(tree, table: np.ndarray) -> list[float]:
    """P(node accepted) under the positional model: the target picks at most one rank per depth
    (row table[depth-1], the deepest row reused below the table), so a node is accepted iff its
    parent is and the target picked its sibling rank.  Per-node loop, parents first."""
    rank, reach = _sibling_ranks(tree), [1.0] * tree.num_nodes
    for i in range(1, tree.num_nodes):
        row = table[min(int(tree.depth[i]) - 1, table.shape[0] - 1)]
        reach[i] = reach[int(tree.parents[i])] * (row[rank[i]] if rank[i] < row.shape[0] else 0.0)
    return reach


def _sample_accepted(tree, table: np.ndarray, rng, n: int) -> np.ndarray:
    """Monte-Carlo draws of the accepted draft length from the same generative model."""
    rank = _sibling_ranks(tree)
    child = {(int(tree.parents[i]), rank[i]): i for i in range(1, tree.num_nodes)}
    out = np.zeros(n, np.int64)
    for s in range(n):
        node = 0
        while True:
            row = table[min(int(tree.depth[node]), table.shape[0] - 1)]
            r = int(np.searchsorted(np.cumsum(row), rng.random(), side="right"))  # len(row): none
            node = child.get((node, r), -1)
            if node < 0:
                break
            out[s] += 1
    return out


def _independent_static_score(costs, wl, b: int, mode: str, params: dict) -> dict:
    """The planner's model written out directly: per level the planner's tree, accepted drafts
    by path enumeration; then rounds one at a time, each verifying the batch's mean tree at the
    current context (which grows by the expected tokens per round) plus the drafting cost."""
    from simtree.planning.simulate import static_round

    acc = wl.acceptance
    trees = static_round(acc, PolicySpec.from_dict(mode, params)).trees  # only the built trees are reused
    budget = 1 if mode == "none" else params["budget"]
    g, nodes = 1.0, 0.0
    for level, (tree, w) in enumerate(zip(trees, acc.weights)):
        # the tree is the policy's shape: budget nodes, within its drafted depth and width
        assert tree.num_nodes == budget
        if mode in ("none", "linear"):
            assert tree.parents.tolist() == list(range(-1, budget - 1))
        elif mode == "eagle":
            assert tree.max_depth <= params["num_steps"] and tree.num_children.max() <= params["topk"]
        else:
            assert tree.max_depth <= params["draft_depth"] and tree.num_children.max() <= acc.topk
        g += w * sum(_reach_probs(tree, acc.tables[level])[1:])
        nodes += w * tree.num_nodes
    steps, width = {"none": (0, 0), "linear": (budget - 1, 1), "eagle": (params.get("num_steps"), params.get("topk")),
                    "best_first": (params.get("draft_depth"), 1)}[mode]
    draft = float(costs.draft.predict(steps, width, b)) if steps else 0.0
    produced, ctx, total, rounds = 0.0, wl.mean_prompt_len, 0.0, 0
    while produced < wl.output_len - 1e-9:
        last = float(costs.verify.predict(nodes, ctx, b)) + draft
        total += last
        produced, ctx, rounds = produced + g, ctx + g, rounds + 1
    # each sequence outputs N tokens: the last round's surplus (produced - N) is not output
    return {"g": g, "nodes": nodes, "draft_us": draft, "round_us": total / rounds,
            # the rounds a sequence expects for N tokens: the N-th lies (N - produced) / g into the
            # last round, whose random count overshoots N by (g - 1) / 2 tokens on average
            "tok_s": b * wl.output_len / (total + (max(1.0, rounds - (produced - wl.output_len) / g
                                                       + (g - 1) / (2 * g)) - rounds) * last) * 1e6}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planner_scores_match_an_independent_computation(seed):
    # Random acceptance tables, lengths and roofline costs; every fixed-shape candidate the planner
    # scored is re-scored by _independent_static_score.  Both sides compute the same expectation in
    # float64 (different association: vectorised sums vs scalar loops), so they agree to ~1e-13;
    # rel 1e-9 leaves room for that and nothing else: one round more or less moves tok/s by
    # >= 1/rounds >= 0.5%, a wrong draft shape, tree, level weight or table row by far more than 1e-9.
    rng = np.random.default_rng(seed)
    # 2-3 levels of unequal weight; per depth a rank-sorted row summing to 0.4..0.95 (a table that
    # varies with depth and level, so a wrong row or level cannot go unnoticed)
    levels = int(rng.integers(2, 4))
    rows = rng.dirichlet(np.ones(4), (levels, 16)) * rng.uniform(0.4, 0.95, (levels, 16, 1))
    acc = AcceptanceModel("w", -np.sort(-rows, axis=2), rng.dirichlet(np.ones(levels)))
    wl = Workload("w", acc, rng.integers(50, 2000, 8), int(rng.integers(40, 200)))
    scale = lambda: float(np.exp(rng.uniform(-1.5, 1.5)))  # noqa: E731
    verify = RooflineVerifyCost(launch_us=400 * scale(), weights_us=13000 * scale(), per_token_us=78 * scale(),
                                per_seq_us=70 * scale(), kv_per_ctx_us=0.0154 * scale(), attn_per_pair_us=5.6e-4 * scale())
    costs = SyntheticCostBundle(verify, RooflineDraftCost(launch_us=60 * scale(), weights_us=800 * scale(),
                                                          per_token_us=4.8 * scale()))
    sizes = sorted(int(x) for x in rng.choice([1, 2, 8, 32, 64], 2, replace=False))
    res = plan(costs, [wl], sizes, SMALL)
    static = res.candidates[res.candidates["mode"].isin(STATIC_MODES)]
    assert set(static["mode"]) == set(STATIC_MODES)
    for b in sizes:
        rows = static[static["batch_size"] == b]
        scores = []
        for row in rows.itertuples():
            ref = _independent_static_score(costs, wl, b, row.mode, json.loads(row.params))
            assert row.tokens_per_round == pytest.approx(ref["g"], rel=1e-9), row.policy
            assert row.nodes_per_seq == pytest.approx(ref["nodes"], rel=1e-9), row.policy
            assert row.draft_us == pytest.approx(ref["draft_us"], rel=1e-9, abs=1e-9), row.policy
            assert row.round_us == pytest.approx(ref["round_us"], rel=1e-9), row.policy
            assert row.tok_s == pytest.approx(ref["tok_s"], rel=1e-9), row.policy
            scores.append(ref["tok_s"])
        # the chosen policy is at least the best fixed shape, and is that shape when it is fixed
        chosen = res.chosen[res.chosen["batch_size"] == b].iloc[0]
        assert chosen["tok_s"] >= max(scores) * (1 - 1e-9)
        if chosen["mode"] in STATIC_MODES:
            assert chosen["tok_s"] == pytest.approx(max(scores), rel=1e-9)


def test_path_enumeration_matches_sampling_the_acceptance_model():
    # The enumeration above (sum of path products) against draws of the generative model it
    # stands for, on the planner's trees of each fixed-shape family: 4000 draws per level give
    # a standard error of <= ~0.03 tokens; 5 standard errors (estimated) is the tolerance.
    from simtree.planning.simulate import static_round

    rng = np.random.default_rng(7)
    acc = calibrate_linear(2.8, 4, name="w", spread=0.3)
    for mode, params in [("linear", {"budget": 6}), ("eagle", {"num_steps": 3, "topk": 3, "budget": 8}),
                         ("best_first", {"budget": 8, "width": 1, "draft_depth": 4})]:
        for level, tree in enumerate(static_round(acc, PolicySpec.from_dict(mode, params)).trees):
            draws = _sample_accepted(tree, acc.tables[level], rng, 4000)
            exact = sum(_reach_probs(tree, acc.tables[level])[1:])
            assert abs(draws.mean() - exact) <= 5 * draws.std(ddof=1) / np.sqrt(draws.size) + 1e-12, (mode, level)


def test_cli_simulate_picks_the_shipped_bundle_by_model_and_deployment():
    # three bundles ship (V4-Flash at ep=8, Qwen3.6-27B at tp=1 and tp=2): without --model the
    # choice is one line naming them; a model alone takes its default deployment (the first
    # deployments.yaml lists); a deployment that cannot hold it is one line saying so
    res = CliRunner().invoke(app, ["simulate", "--batch-size", "2", "--output-len", "32", "--json"])
    assert isinstance(res.exception, SimtreeError) and "pick one with --model and --deployment" in str(res.exception)
    for args, model, dep, comm in ((["--model", "qwen3.6-27b"], "qwen3.6-27b", "tp=1", None),
                                   (["--model", "qwen3.6-27b", "--deployment", "tp=2"], "qwen3.6-27b", "tp=2",
                                    "communication assumed"),
                                   (["--model", "deepseek-v4-flash"], "deepseek-v4-flash", "ep=8",
                                    "communication assumed")):
        res = CliRunner().invoke(app, ["simulate", *args, "--batch-size", "2", "--output-len", "32", "--json"])
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout)
        assert (out["model"], out["deployment"], out["communication"]) == (model, dep, comm)
    res = CliRunner().invoke(app, ["simulate", "--model", "deepseek-v4-flash", "--deployment", "tp=1", "--json"])
    assert "does not fit tp=1" in str(res.exception) and "it needs 4 GPUs (ep=4), asked for 1" in str(res.exception)
    res = CliRunner().invoke(app, ["simulate", "--model", "nope", "--json"])
    assert "no cost bundle for nope" in str(res.exception)
