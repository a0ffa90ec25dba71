"""The home side of a GPU session (scripts/full_report.sh -> runtime/full/session_report.py) on
fake session outputs: a layer profile whose composed steps follow a known formula, the
runtime's whole steps 2% slower than composed, and the measured runs of a tiny model."""
import csv
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
import pytest

from simtree.costs import profile_table as pt
from simtree.costs.model import load_costs
from simtree.errors import SimtreeError
from simtree.models import get_model
from simtree.planning.simulate import PolicySpec
from simtree.runtime.full.measure import full_run
from simtree.runtime.full.session_report import choose_plan, rank_profile, read_lossless_check, session_report

from full_helpers import tiny_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-gdn"


def _row(stage, variant, b, n, l, us, s=0, k=0):
    return {"stage": stage, "model": MODEL, "device": "cpu", "dtype": "fp32", "variant": variant, "batch_size": b,
            "nodes_per_seq": n, "total_tokens": b * n, "context_len": l, "tree_shape": "eagle", "num_steps": s,
            "topk": k, "latency_us_median": us, "latency_us_p10": us, "latency_us_p90": us, "repeats": 10,
            "torch_version": "2.11", "triton_version": "3.5", "timestamp": "2026-01-01T00:00:00+00:00"}


def composed_us(b, n, l):
    return 1000.0 + 50.0 * b * n + 0.1 * b * l


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A session folder as full_gpu.sh leaves it (profile/, steps_profile.csv, summary.json, ...)."""
    folder = tmp_path_factory.mktemp("full_tiny")
    (folder / "profile").mkdir()
    comp = [_row("model_verify_step", "composed", b, n, l, composed_us(b, n, l))
            for b in (1, 2, 4) for n in (1, 2, 4, 6, 8) for l in (16, 64, 256)]
    pt.write_table(folder / "profile" / "profile.csv", pt.validate_profile(pd.DataFrame(comp)))
    steps = [_row("model_verify_step", "full_runtime", b, n, l, 1.02 * composed_us(b, n, l))
             for b, n, l in ((1, 1, 40), (2, 4, 40), (4, 8, 200))]
    steps += [_row("draft_step", "full_runtime", b, k, 40, 200.0 + 30.0 * b * k * s, s, k)
              for b in (1, 2, 4) for s, k in ((1, 1), (3, 1), (2, 2), (3, 2), (4, 3))]
    pt.write_table(folder / "steps_profile.csv", pt.validate_profile(pd.DataFrame(steps)))
    full_run(tiny_model(MODEL), device="cpu", costs="simtree/data/costs/h200_qwen3.6-27b_tp1.json", batch_sizes=(1, 2),
             acceptance="gsm8k", out=folder, context_len=24, rounds=2, warmup_rounds=1,
             extra=[("eagle", PolicySpec.from_dict("eagle", {"num_steps": 2, "topk": 2, "budget": 4}))])
    (folder / "lossless.csv").write_text("policy,batch_size,match,first_diff,margin,accepted_tokens_per_round\n"
                                         "linear_d4,2,True,,,1.8\n")
    return folder


def test_session_report_fits_plans_predicts_and_compares(session, tmp_path):
    res = session_report([session], tmp_path / "live")
    out = tmp_path / "live"
    for name in ("summary.csv", "summary.md", "predicted_vs_measured.png", "composed_vs_measured.csv",
                 "composed_vs_measured.md", f"costs_{MODEL}.json", "alternatives.csv", "lossless.csv"):
        assert (out / name).exists(), name
    costs = load_costs(out / f"costs_{MODEL}.json")
    assert costs.verify.predict(4, 40, 2) == pytest.approx(composed_us(2, 4, 40), rel=0.1)   # fitted to the profile
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [r["policy"].split(":")[0] for r in rows if r["batch_size"] == "1"] == ["plain", "linear_d4", "plan"]
    cvm = res["composed_vs_measured"]
    assert len(cvm) == 3
    assert all(r["rel_err"] == pytest.approx(1 / 1.02 - 1, abs=1e-9) for r in cvm)   # interpolated in l exactly
    assert "median 2.0%" in (out / "composed_vs_measured.md").read_text()
    assert json.loads((session / "summary.json").read_text())["runs"][0]["stats"]["rounds"] == 2
    # the rank's profile, tagged with its deployment: what scripts/ship_defaults.sh fits once shipped
    from simtree.parallel import parse_deployment
    from simtree.deploy.shipped import profile_for
    rank = pt.load_profile(out / f"profile_{MODEL}_tp1.csv")
    assert set(rank.deployment) == {"tp=1"} and set(zip(rank.stage, rank.variant)) == {
        ("model_verify_step", "composed"), ("draft_step", "full_runtime")}
    shipped = tmp_path / "profiles"   # as copied into simtree/data/profiles/h200/
    shipped.mkdir()
    (shipped / f"profile_{MODEL}_tp1.csv").write_bytes((out / f"profile_{MODEL}_tp1.csv").read_bytes())
    assert profile_for(MODEL, parse_deployment("tp=1"), shipped) == shipped / f"profile_{MODEL}_tp1.csv"
    assert costs.meta["deployment"] == "tp=1"


def test_a_session_whose_sweep_and_steps_name_different_ranks_is_refused(session, tmp_path):
    import shutil
    other = tmp_path / "other"
    shutil.copytree(session, other)
    steps = pt.load_profile(other / "steps_profile.csv")
    pt.write_table(other / "steps_profile.csv", pt.validate_profile(steps.assign(deployment="tp=2")))
    with pytest.raises(SimtreeError, match="name different deployments"):
        session_report([other], tmp_path / "live")


def _strip_deployment(path: Path) -> None:
    df = pd.read_csv(path)
    df.drop(columns=[c for c in ("deployment", "message_bytes") if c in df]).to_csv(path, index=False)


def test_untagged_sessions_take_the_rank_they_name_and_tagged_ones_refuse_it(session, tmp_path):
    import shutil
    old = tmp_path / "old"
    shutil.copytree(session, old)
    for path in (old / "profile" / "profile.csv", old / "steps_profile.csv"):
        _strip_deployment(path)
    session_report([old], tmp_path / "live", {MODEL: "tp=2"})
    rank = pt.load_profile(tmp_path / "live" / f"profile_{MODEL}_tp2.csv")
    assert set(rank.deployment) == {"tp=2"}
    assert load_costs(tmp_path / "live" / f"costs_{MODEL}.json").meta["deployment"] == "tp=2"
    with pytest.raises(SimtreeError, match="name their deployment"):
        session_report([session], tmp_path / "live2", {MODEL: "tp=2"})


def test_a_sweep_only_session_gives_its_composed_rank_profile(session, tmp_path):
    import shutil
    sweep = tmp_path / "sweep"
    shutil.copytree(session / "profile", sweep / "profile")
    path = rank_profile(sweep, tmp_path / "out")
    rank = pt.load_profile(path)
    assert path.name == f"profile_{MODEL}_tp1.csv" and len(rank) == 45
    assert set(zip(rank.stage, rank.variant)) == {("model_verify_step", "composed")}


def test_a_lossless_check_that_is_not_there_or_not_named_is_one_line(session, tmp_path, capsys):
    from simtree.runtime.full.session_report import main
    with pytest.raises(SimtreeError, match="no lossless check of"):
        read_lossless_check(MODEL, tmp_path / "absent.csv")
    assert main([str(session), "--out", str(tmp_path / "o"), "--lossless", "nomodel.csv"]) == 2
    assert "expected MODEL=CSV" in capsys.readouterr().err
    bare = tmp_path / "bare.csv"
    bare.write_text("policy,match\nlinear_d4,True\n")
    assert main([str(session), "--out", str(tmp_path / "o"), "--lossless", f"{MODEL}={bare}"]) == 2
    assert "needs the columns dtype, layers" in capsys.readouterr().err and not (tmp_path / "o").exists()
    other = tmp_path / "other.csv"
    other.write_text("model,dtype,layers,policy,match\ntiny-v4,fp32,5/5,linear_d4,True\n")
    with pytest.raises(SimtreeError, match="its rows are of tiny-v4, not tiny-gdn"):
        read_lossless_check(MODEL, other)


def test_the_plan_is_the_measured_run_predicted_fastest():
    rows = [{"model": "m", "batch_size": 1, "policy": p, "predicted_tok_s": t, "measured_tok_s": 1.0}
            for p, t in (("plain:none", 10.0), ("eagle:eagle_s3_k2_d6", 30.0), ("linear_d4:linear_d4", 20.0))]
    assert [r["policy"] for r in choose_plan(rows)] == ["plan:eagle_s3_k2_d6"]


def test_full_report_script_unpacks_sessions_and_writes_the_report(session, tmp_path):
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    with tarfile.open(fetched / f"full_{MODEL}.tgz", "w:gz") as tar:
        tar.add(session, arcname=".")
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "scripts/full_report.sh"), str(fetched), str(tmp_path / "rep")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "composed vs measured step: median 2.0%" in run.stdout
    assert (tmp_path / "rep" / "summary.csv").exists()
    # a lossless check run apart (lossless_<model>_<dtype>.csv) joins the session's, rows named by model
    (fetched / f"lossless_{MODEL}_fp64.csv").write_text(
        "dtype,layers,policy,batch_size,match,accepted_tokens_per_round\nfp64,2/4,linear_d4,2,True,1.5\n")
    run = subprocess.run(["bash", str(ROOT / "scripts/full_report.sh"), str(fetched), str(tmp_path / "rep2")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lossless = pd.read_csv(tmp_path / "rep2" / "lossless.csv")
    session_rows = pd.read_csv(session / "lossless.csv")
    assert len(lossless) == len(session_rows) + 1 and set(lossless.model) == {MODEL}
    # the session's own rows: its profile's dtype and the whole model; the extra row as it was written
    layers = f"{get_model(MODEL).num_layers}/{get_model(MODEL).num_layers}"
    assert lossless.iloc[:-1][["dtype", "layers"]].drop_duplicates().values.tolist() == [["fp32", layers]]
    assert lossless.iloc[-1][["dtype", "layers", "policy"]].tolist() == ["fp64", "2/4", "linear_d4"]
    # a check file named without its dtype is refused in one line, before anything is fitted
    (fetched / f"lossless_{MODEL}_fp64.csv").rename(fetched / f"lossless_{MODEL}.csv")
    bad = subprocess.run(["bash", str(ROOT / "scripts/full_report.sh"), str(fetched), str(tmp_path / "rep3")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "name it lossless_<model>_<dtype>.csv" in bad.stderr
    assert not (tmp_path / "rep3").exists()
    empty = subprocess.run(["bash", str(ROOT / "scripts/full_report.sh"), str(tmp_path / "rep")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "no full_<model>*.tgz" in empty.stderr


def test_full_report_composes_a_layer_profile_cut_short_before_its_composition(session, tmp_path):
    """A session whose sweep was stopped before composing: the script composes the pieces."""
    cut = tmp_path / "cut"
    (cut / "profile").mkdir(parents=True)
    for name in ("steps_profile.csv", "summary.json", "lossless.csv"):
        (cut / name).write_bytes((session / name).read_bytes())
    rows = []
    for b in (1, 2, 4):
        for n in (1, 2, 4, 6, 8):
            rows += [_row(s, "layers", b, n, 0, 10.0 * b * n + 5) for s in
                     ("round_meta_step", "lm_head_step", "mlp_step", "gdn_proj_step", "attn_proj_step", "attn_kv_commit")]
            rows += [_row(s, "layers", b, n, 0, 20.0 * b + n) for s in
                     (("gdn_decode_step",) if n == 1 else ("gdn_tree_verify", "gdn_tree_commit"))]
            rows += [_row("attn_tree_verify", "layers", b, n, l, 3.0 * b * n + 0.1 * l) for l in (16, 64, 256)]
    pt.write_table(cut / "profile" / "profile.csv", pt.validate_profile(pd.DataFrame(rows)))
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    with tarfile.open(fetched / f"full_{MODEL}.tgz", "w:gz") as tar:
        tar.add(cut, arcname=".")
    run = subprocess.run(["bash", str(ROOT / "scripts/full_report.sh"), str(fetched), str(tmp_path / "rep")],
                         cwd=ROOT, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert "composing" in run.stdout and "45 rows" in run.stdout     # 3 b x 5 n x 3 contexts
    assert (tmp_path / "rep" / "composed_vs_measured.csv").exists()
