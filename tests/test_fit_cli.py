"""`simtree fit` and fit_profile on synthetic profile tables."""
import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from simtree.cli import app
from simtree.costs.forms import touched_experts
from simtree.costs.model import load_costs
from simtree.errors import SimtreeError
from simtree.costs.profile_fit import fit_profile
from simtree.costs.profile_table import append_rows


def row(stage, n, l, b, lat, **kw):
    return dict(stage=stage, model="toy", device="cpu", dtype="bf16", variant="composed",
                batch_size=b, nodes_per_seq=n, context_len=l, tree_shape="linear",
                latency_us_median=lat, latency_us_p10=lat * 0.95, latency_us_p90=lat * 1.05,
                repeats=10, **kw)


def make_profile(path, rng, draft=True, device="cpu", deployment="tp=1"):
    rows = []
    for b in (1, 4, 16):
        for l in (1024, 8192):
            for n in (1, 2, 4, 8, 16):
                lat = (50 + 0.4 * max(n * b - 32, 0) + b + 2e-3 * b * l) * (1 + 0.02 * rng.standard_normal())
                rows.append({**row("model_verify_step", n, l, b, lat), "device": device, "deployment": deployment})
        if draft:
            for s in (1, 2, 4):
                for k in (1, 2, 4):
                    lat = (10 + s * (8 + 0.1 * max(b * k - 8, 0))) * (1 + 0.02 * rng.standard_normal())
                    rows.append({**row("draft_step", k, 1024, b, lat, num_steps=s, topk=k),
                                 "device": device, "variant": "torch_ref", "tree_shape": "eagle",
                                 "deployment": deployment})
    append_rows(path, rows)
    return path


def test_fit_command_writes_bundle_png_and_error_table(tmp_path):
    prof = make_profile(tmp_path / "profile.csv", np.random.default_rng(0))
    out = tmp_path / "costs.json"
    result = CliRunner().invoke(app, ["fit", str(prof), "-o", str(out), "--folds", "3"])
    assert result.exit_code == 0, result.output
    assert "ho med" in result.output and "worst in-sample residuals" in result.output
    assert "worst held-out residuals" in result.output
    assert out.with_suffix(".png").stat().st_size > 10_000
    bundle = load_costs(out)
    assert bundle.meta["model"] == "toy" and bundle.meta["synthetic"] is False
    assert bundle.meta["source"]["sha256"].startswith("sha256:")
    heldout = bundle.verify.info["fit_error"]["heldout"]
    assert set(heldout) == {"basis", "grid", "grid_lin", "per_bin"} and heldout["per_bin"]["reference"]
    worst = bundle.verify.info["worst_heldout_residuals"]
    assert len(worst) == 5 and abs(worst[0]["rel_err"]) == pytest.approx(heldout[bundle.verify.info["form"]]["max"])
    assert heldout[bundle.verify.info["form"]]["median"] < 0.05
    assert bundle.verify.predict(4, 8192, 16) > bundle.verify.predict(4, 1024, 16)


def test_fit_json_output_is_machine_readable(tmp_path):
    prof = make_profile(tmp_path / "profile.csv", np.random.default_rng(1))
    result = CliRunner().invoke(app, ["fit", str(prof), "-o", str(tmp_path / "c.json"), "--json",
                                      "--no-png", "--form", "basis", "--folds", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verify"]["form"] == "basis" and data["draft"]["form"] == "basis"
    assert data["png"] is None


def test_fit_form_grid_lin_is_selectable_and_convex(tmp_path):
    prof = make_profile(tmp_path / "profile.csv", np.random.default_rng(2))
    result = CliRunner().invoke(app, ["fit", str(prof), "-o", str(tmp_path / "c.json"), "--json",
                                      "--no-png", "--form", "grid_lin", "--folds", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verify"]["form"] == "grid_lin" and data["verify"]["convex_in_n"] is True
    assert load_costs(tmp_path / "c.json").verify.surface.form == "grid"
    bad = CliRunner().invoke(app, ["fit", str(prof), "--form", "spline", "--no-png"])
    assert bad.exit_code != 0


def test_missing_draft_rows_needs_the_explicit_assumption(tmp_path):
    prof = make_profile(tmp_path / "profile.csv", np.random.default_rng(2), draft=False)
    with pytest.raises(SimtreeError, match="no draft_step rows.*--draft-from-verify"):
        fit_profile(prof, folds=2, forms=("basis",))
    report = fit_profile(prof, folds=2, forms=("basis",), draft_from_verify=True, draft_fraction=0.1)
    v, d = report.bundle.verify, report.bundle.draft
    assert d.predict(3, 2, 4) == pytest.approx(0.1 * 3 * v.predict(2, np.median([1024, 8192]), 4))
    assert "assumed" in d.info["assumption"]


def test_mixed_devices_are_refused_in_one_line(tmp_path):
    prof = make_profile(tmp_path / "profile.csv", np.random.default_rng(3))
    make_profile(prof, np.random.default_rng(4), device="NVIDIA H200")
    result = CliRunner().invoke(app, ["fit", str(prof), "-o", str(tmp_path / "c.json")])
    assert isinstance(result.exception, SimtreeError)
    assert "mixed devices in one fit: NVIDIA H200, cpu" in str(result.exception)
    assert "\n" not in str(result.exception)
    report = fit_profile(prof, device="NVIDIA H200", folds=2, forms=("basis",))
    assert report.bundle.meta["device"] == "NVIDIA H200"


def test_single_n_value_is_refused(tmp_path):
    rows = [row("model_verify_step", 4, l, b, 100.0 + b + l / 100) for b in (1, 2, 4) for l in (1, 2)]
    append_rows(tmp_path / "p.csv", rows)
    with pytest.raises(SimtreeError, match="only one nodes_per_seq value"):
        fit_profile(tmp_path / "p.csv", draft_from_verify=True)


def test_unknown_stage_lists_what_the_table_has(tmp_path):
    prof = make_profile(tmp_path / "profile.csv", np.random.default_rng(5))
    with pytest.raises(SimtreeError, match="no rows with stage='gdn_tree_verify' .*model_verify_step"):
        fit_profile(prof, stage="gdn_tree_verify")


def make_moe_profile(path, rng, model):
    """Verify + draft rows with DeepSeek-V4-Flash's expert saturation (E=256, k=6)."""
    rows = []
    for b in (1, 4, 16):
        for l in (1024, 8192):
            for n in (1, 2, 4, 8, 16, 32):
                lat = (2000 + 5 * max(n * b - 64, 0) + 20 * b + 1e-2 * b * l
                       + 1e5 * float(touched_experts(n * b, 256, 6)) / 256) * (1 + 0.01 * rng.standard_normal())
                rows.append({**row("model_verify_step", n, l, b, lat), "model": model})
        for s in (1, 2, 4):
            for k in (1, 2, 4):
                lat = (100 + s * (300 + 2e3 * float(touched_experts(k * b, 256, 6)) / 256)) * (1 + 0.01 * rng.standard_normal())
                rows.append({**row("draft_step", k, 1024, b, lat, num_steps=s, topk=k), "model": model,
                             "variant": "torch_ref", "tree_shape": "eagle"})
    append_rows(path, rows)
    return path


def test_moe_model_gets_the_saturation_form_reported_loudly(tmp_path):
    prof = make_moe_profile(tmp_path / "profile.csv", np.random.default_rng(6), "deepseek-v4-flash")
    out = tmp_path / "costs.json"
    result = CliRunner().invoke(app, ["fit", str(prof), "-o", str(out), "--folds", "3", "--no-png"])
    assert result.exit_code == 0, result.output
    assert "C_v is NOT convex in n" in result.output and "E(1-(1-k/E)^T) experts touched" in result.output
    bundle = load_costs(out)
    v = bundle.verify
    assert v.info["form"] in ("moe", "moe_grid") and v.info["convex_in_n"] is False
    assert v.convex_in_n is False and set(v.info["fit_error"]["heldout"]) >= {"basis", "grid", "grid_lin",
                                                                               "moe", "moe_grid"}
    assert v.info["fit_error"]["heldout"][v.info["form"]]["median"] < 0.02
    assert bundle.meta["moe"] == {"n_experts": 256, "experts_per_token": 6, "routing": "uniform"}   # no sidecar


def test_dense_model_never_gets_an_moe_form(tmp_path):
    # Same saturating data under a dense registry model: only convex forms are tried.
    prof = make_moe_profile(tmp_path / "profile.csv", np.random.default_rng(7), "qwen3.6-27b")
    # the forms alone (the measured-cell corrections would make C_v non-convex in n at its worst cells)
    report = fit_profile(prof, folds=2, reference_forms=(), verify_cells=False)
    assert set(report.verify.heldout) == {"basis", "grid", "grid_lin"} and report.bundle.verify.convex_in_n
    assert report.bundle.verify.info["convex_in_n"] is True and report.bundle.meta["moe"] is None
    with pytest.raises(SimtreeError, match="need an MoE model; 'qwen3.6-27b' is dense"):
        fit_profile(prof, folds=2, forms=("moe",))


def make_decode_jump_profile(path, rng, jump: float, ns=(1, 2, 4, 8, 16)):
    """Verify rows whose n = 1 points come from a cheaper, separate decode step: ``jump`` us
    more for every n >= 2 (0: one smooth surface), 2% noise; plus draft rows."""
    rows = []
    for b in (1, 2, 4, 8, 16):
        for l in (256, 1024, 8192):
            for n in ns:
                lat = (400 + 3 * b + 0.01 * l + 20 * n * b + (jump if n >= 2 else 0)) \
                    * (1 + 0.02 * rng.standard_normal())
                rows.append(row("model_verify_step", n, l, b, lat))
        for s in (1, 2, 4):
            for k in (1, 2, 4):
                lat = (10 + s * (8 + 0.1 * b * k)) * (1 + 0.02 * rng.standard_normal())
                rows.append({**row("draft_step", k, 1024, b, lat, num_steps=s, topk=k),
                             "variant": "torch_ref", "tree_shape": "eagle"})
    append_rows(path, rows)
    return path


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_decoding_gets_its_own_curve_where_cv_jumps(tmp_path, seed):
    # n = 1 a separate, cheaper step (a runtime's fused decode, no tree): one convex surface
    # cannot follow the jump to n = 2, so C_v(n = 1) is fitted on its own, the bundle says C_v
    # is not convex in n (budget searches take the global argmax), and predictions stay
    # non-decreasing in n and match both sides of the jump
    rng = np.random.default_rng(seed)
    prof = make_decode_jump_profile(tmp_path / "p.csv", rng, jump=2000.0)
    report = fit_profile(prof)
    verify = report.bundle.verify
    assert verify.info["decode_split"]["kept"] and not verify.convex_in_n
    assert "n = 1" in verify.info["nonconvex_reason"]
    assert any("fitted on its own" in n for n in report.notes)
    assert verify.valid_range["nodes_per_seq"][0] == 1.0
    for b in (1, 3, 8, 16):
        for l in (256, 2000, 8192):
            truth1 = 400 + 3 * b + 0.01 * l + 20 * b
            assert abs(verify.predict(1, l, b) / truth1 - 1) < 0.05, (b, l)
            ns = np.arange(1, 17)
            pred = np.asarray(verify.predict(ns, l, b))
            assert np.all(np.diff(pred) >= -1e-9)
            assert pred[1] > 1.5 * pred[0]          # the jump is kept, not smoothed away
            assert [verify.predict(int(n), l, b) for n in ns] == pytest.approx(pred.tolist(), rel=1e-12)
    report.bundle.save(tmp_path / "c.json")
    again = load_costs(tmp_path / "c.json").verify
    grid = (np.arange(1, 17)[:, None], 1024, np.array([1, 4, 16]))
    assert np.array_equal(again.predict(*grid), verify.predict(*grid))
    assert not again.convex_in_n


@pytest.mark.parametrize("seed", [0, 1])
def test_smooth_profile_keeps_one_surface(tmp_path, seed):
    # no jump at n = 1: the split is tried, recorded and not kept (C_v stays convex in n)
    prof = make_decode_jump_profile(tmp_path / "p.csv", np.random.default_rng(seed), jump=0.0)
    verify = fit_profile(prof).bundle.verify
    record = verify.info["decode_split"]
    assert not record["kept"] and verify.convex_in_n
    assert set(record) >= {"heldout_split", "heldout_joint", "main_form", "decode_form"}


def test_decode_split_bridges_a_gap_above_n_1_without_extrapolating(tmp_path):
    # the smallest tree measured is n = 4: between n = 1 and 4 the split interpolates linearly
    # (no query of the n >= 2 surface below its range: no out-of-range warning), non-decreasing
    import warnings
    prof = make_decode_jump_profile(tmp_path / "p.csv", np.random.default_rng(5), jump=2000.0,
                                    ns=(1, 4, 8, 16))
    verify = fit_profile(prof).bundle.verify
    assert verify.info["decode_split"]["kept"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in (1, 4, 16):
            pred = np.asarray(verify.predict(np.arange(1, 17), 1024, b))
            assert np.all(np.diff(pred) >= -1e-9)
            d, m4 = pred[0], pred[3]
            assert pred[1] == pytest.approx(d + (m4 - d) / 3) and pred[2] == pytest.approx(d + 2 * (m4 - d) / 3)
            assert verify.predict(3, 1024, b) == pytest.approx(pred[2], rel=1e-12)


def test_moe_forms_only_for_stages_that_read_experts(tmp_path):
    # The same saturating rows under an attention-core stage of the MoE model: no experts
    # there, so only convex forms are tried, and asking for an MoE form is refused.
    prof = make_moe_profile(tmp_path / "profile.csv", np.random.default_rng(8), "deepseek-v4-flash")
    df = pd.read_csv(prof)
    df.loc[df.stage == "model_verify_step", "stage"] = "v4_swa_verify"
    df.to_csv(prof, index=False)
    report = fit_profile(prof, stage="v4_swa_verify", folds=2, reference_forms=(), verify_cells=False)   # forms alone
    assert set(report.verify.heldout) == {"basis", "grid", "grid_lin"} and report.bundle.verify.convex_in_n
    assert report.draft is not None and {"moe", "moe_grid"} <= set(report.draft.heldout)  # the draft has an MLP
    with pytest.raises(SimtreeError, match="stage v4_swa_verify reads no experts"):
        fit_profile(prof, stage="v4_swa_verify", folds=2, forms=("moe",))


def test_unregistered_model_is_fitted_dense_with_a_note(tmp_path):
    prof = make_moe_profile(tmp_path / "profile.csv", np.random.default_rng(9), "my-moe-model")
    report = fit_profile(prof, folds=2, reference_forms=())
    assert set(report.verify.heldout) == {"basis", "grid", "grid_lin"}
    assert any("'my-moe-model' is not in the model registry" in n for n in report.notes)


@pytest.mark.parametrize("args, match", [
    (["-o", "{prof}"], "would overwrite the profile table"),
    (["-o", "{meta}"], "would overwrite the profile table"),
    (["--png", "{dir}/plot"], "--png must name a .png file"),
    (["--png", "{dir}/plot.txt"], "--png must name a .png file"),
    (["-o", "{dir}"], "is a folder"),
    (["--stage", "draft_step"], "draft_step rows are C_d's"),
])
def test_fit_refuses_outputs_over_its_inputs_and_bad_paths(tmp_path, args, match):
    prof = make_profile(tmp_path / "profile.csv", np.random.default_rng(10))
    (tmp_path / "profile.meta.json").write_text("{}")
    before = prof.read_bytes()
    fmt = {"prof": prof, "meta": tmp_path / "profile.meta.json", "dir": tmp_path}
    result = CliRunner().invoke(app, ["fit", str(prof), *[a.format(**fmt) for a in args]])
    assert result.exit_code != 0 and match in str(result.exception)
    assert prof.read_bytes() == before and not list(tmp_path.glob("*.costs.json"))


@pytest.mark.parametrize("meta, mlp_variant, want", [
    ({"moe_routing": "balanced"}, "layers", "balanced"),      # recorded: as recorded
    (None, "torch", "uniform"),                               # no sidecar: a runtime rank profile
    ({"sweep": "default_gpu"}, "torch", "balanced"),          # before the record, the profiler's piece
    ({"sweep": "full_layers_gpu"}, "layers", "uniform"),      # before the record, the runtime's layers
])
def test_the_profile_says_how_its_moe_layers_routed(tmp_path, meta, mlp_variant, want):
    from simtree.costs.profile_fit import profile_moe_routing
    from simtree.costs.profile_table import write_meta

    path = tmp_path / "profile.csv"
    append_rows(path, [{**row("mlp_step", 1, 1024, 1, 10.0), "variant": mlp_variant},
                       row("model_verify_step", 1, 1024, 1, 50.0)])
    if meta is not None:
        write_meta(path, meta)
    assert profile_moe_routing(path) == want


def test_a_form_that_misses_its_own_profile_is_warned_about(tmp_path):
    # a staircase no monotone surface convex in n follows: flat at 400 us up to 4 tokens a step, 1000 us
    # beyond (a kernel switch); the fit keeps a form anyway and says, with its worst point, how far off it is
    rng = np.random.default_rng(3)
    rows = []
    for b in (1, 2, 4, 8):
        for l in (64, 256):
            for n in (1, 2, 4, 8, 16):
                lat = (400 if n * b <= 4 else 1000) * (1 + 0.01 * rng.standard_normal())
                rows.append(row("model_verify_step", n, l, b, lat))
        for s in (1, 2, 4):
            for k in (1, 2, 4):
                rows.append({**row("draft_step", k, 64, b, (10 + s * (8 + 0.1 * b * k)) * (1 + 0.01 * rng.standard_normal()),
                                   num_steps=s, topk=k), "variant": "torch_ref", "tree_shape": "eagle"})
    prof = tmp_path / "stairs.csv"
    append_rows(prof, rows)
    report = fit_profile(prof, folds=2)
    warned = report.misfit_warnings()
    assert len(warned) == 1 and warned[0].startswith("C_v (")
    p90 = report.verify.in_sample["p90"]
    assert p90 > 0.10 and f"in-sample p90 {100 * p90:.0f}%" in warned[0]
    worst = report.verify.worst[0]
    assert f"measured {worst['measured_us']:.0f} us" in warned[0] and "batch_size=" in warned[0]
    result = CliRunner().invoke(app, ["fit", str(prof), "-o", str(tmp_path / "c.json"), "--no-png", "--folds", "2"])
    assert result.exit_code == 0, result.output
    assert "misses its own profile" in " ".join(result.output.split())
    data = json.loads(CliRunner().invoke(app, ["fit", str(prof), "-o", str(tmp_path / "c.json"), "--no-png",
                                               "--folds", "2", "--json"]).stdout)
    assert data["warnings"] == warned


def test_a_smooth_profile_gets_no_misfit_warning(tmp_path):
    report = fit_profile(make_profile(tmp_path / "profile.csv", np.random.default_rng(0)), folds=2)
    assert report.verify.in_sample["p90"] < 0.10 and report.misfit_warnings() == []


def test_moe_routing_unknown_or_for_a_dense_model_is_refused(tmp_path):
    """--moe-routing was read only for an MoE model: a dense model's fit ignored it, whatever it said."""
    prof = make_profile(tmp_path / "profile.csv", np.random.default_rng(0))
    with pytest.raises(SimtreeError, match="MoE routing 'balnced' unknown: one of uniform, balanced"):
        fit_profile(prof, folds=2, forms=("basis",), moe_routing="balnced")
    with pytest.raises(SimtreeError, match="--moe-routing uniform applies to MoE models; toy has no MoE layers"):
        fit_profile(prof, folds=2, forms=("basis",), moe_routing="uniform")


def _with_collectives(path, rng, verify=True):
    """A profile table with all-reduce rows over 2 ranks (and make_profile's verify and draft rows of a
    tp=2 rank, whose bundle records the collectives' model)."""
    if verify:
        make_profile(path, rng, deployment="tp=2")
    append_rows(path, [{**row("comm_all_reduce", 1, 0, 1, 9.0 + s / 3e5 * (1 + 0.01 * rng.standard_normal())),
                        "deployment": "tp=2", "variant": "gloo", "message_bytes": s} for s in 2.0 ** np.arange(12, 24, 2)])
    return path


@pytest.mark.parametrize("args, match", [
    (["--moe-routing", "balnced"], "MoE routing 'balnced' unknown"),
    (["--moe-routing", "uniform"], "--moe-routing uniform applies to MoE models"),   # known once the table is read
    (["--pad-min-saving", "1.5"], "the minimum saving must be in (0, 1)"),
    (["--deployment", "tp=x"], "tp=x"),
    (["--comm", "{dir}/none.comm.json"], "none.comm.json"),
    (["--form", "bogus"], "--form must be auto"),
    (["--draft-from-verify", "--draft-fraction", "0"], "draft fraction must be > 0"),
    (["--stage", "no_such_stage"], "no_such_stage"),
])
def test_fit_writes_nothing_when_an_option_or_the_fit_fails(tmp_path, args, match):
    """A table with collective rows beside its verify rows: the .comm.json was written before the
    options were checked and the bundle fitted, so a bad --moe-routing left it behind; now every
    option is checked first and the files are written once the fits are done."""
    prof = _with_collectives(tmp_path / "profile.csv", np.random.default_rng(0))
    before = sorted(tmp_path.iterdir())
    result = CliRunner().invoke(app, ["fit", str(prof), "--no-png", "--folds", "2",
                                      *[a.format(dir=tmp_path) for a in args]])
    assert result.exit_code != 0 and isinstance(result.exception, SimtreeError), result.output
    assert match in str(result.exception)
    assert sorted(tmp_path.iterdir()) == before


def test_fit_of_collectives_and_verify_rows_writes_both_and_of_collectives_checks_options_first(tmp_path):
    prof = _with_collectives(tmp_path / "profile.csv", np.random.default_rng(0))
    result = CliRunner().invoke(app, ["fit", str(prof), "--no-png", "--folds", "2", "--form", "basis"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "profile.costs.comm.json").is_file() and (tmp_path / "profile.costs.json").is_file()
    only = _with_collectives(tmp_path / "comm" / "only.csv", np.random.default_rng(1), verify=False)
    result = CliRunner().invoke(app, ["fit", str(only), "--moe-routing", "balnced"])
    assert "MoE routing 'balnced' unknown" in str(result.exception) and not (only.parent / "only.comm.json").exists()
    assert CliRunner().invoke(app, ["fit", str(only)]).exit_code == 0 and (only.parent / "only.comm.json").is_file()


def test_fit_of_one_gpu_verify_rows_beside_collectives_writes_both_without_a_comm_complaint(tmp_path):
    """A table whose verify rows are one GPU's (tp=1) and which also holds all-reduce rows: the
    collectives are fitted into their .comm.json and the bundle, of one GPU, records none - it
    was refused with a line about --comm, which the user had not given."""
    rng = np.random.default_rng(2)
    prof = make_profile(tmp_path / "profile.csv", rng, deployment="tp=1") or tmp_path / "profile.csv"
    append_rows(prof, [{**row("comm_all_reduce", 1, 0, 1, 9.0 + s / 3e5), "deployment": "tp=2", "variant": "gloo",
                        "message_bytes": s} for s in 2.0 ** np.arange(12, 24, 2)])
    result = CliRunner().invoke(app, ["fit", str(prof), "--no-png", "--folds", "2", "--form", "basis"])
    assert result.exit_code == 0, result.output
    assert "--comm" not in result.output
    bundle = json.loads((tmp_path / "profile.costs.json").read_text())
    assert (tmp_path / "profile.costs.comm.json").is_file() and bundle["meta"].get("communication") is None
    assert "collectives are fitted apart" in " ".join(result.output.split())
    given = CliRunner().invoke(app, ["fit", str(prof), "--no-png", "--folds", "2", "--form", "basis",
                                     "--comm", str(tmp_path / "profile.costs.comm.json"), "--out", str(tmp_path / "b.json")])
    assert "--comm: the rows are of tp=1, one GPU" in str(given.exception)      # a given --comm is still refused
