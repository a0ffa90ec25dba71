"""A GPU session of the full runtime names the rank it measures: the layer sweep times each
model's rank of the session's deployment (its shard shapes) and tags its rows with it, and
gpu_run builds only the runtime's own ranks, tags its whole steps and predicts from that
deployment's shipped bundle (or measures only where none ships)."""
import csv
from pathlib import Path

import pytest
import torch
import yaml

from simtree.acceptance.model import get_workload
from simtree.costs.profile_table import load_profile
from simtree.errors import SimtreeError
from simtree.fileio import read_yaml
from simtree.models import get_model
from simtree.profiler import pieces, sweep
from simtree.runtime.full import gpu_run
from simtree.runtime.full.build import build_model
from simtree.runtime.full.measure import full_run

from full_helpers import tiny_model

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
FULL_LAYERS = ROOT / "simtree/data/sweeps/full_layers_gpu.yaml"


def test_the_session_sweep_times_the_runtime_ranks_unless_told_otherwise():
    spec = read_yaml(FULL_LAYERS, "sweep")
    assert sweep.deployment_of(spec, "deepseek-v4-flash") == "ep=8"
    assert sweep.deployment_of(spec, "qwen3.6-27b") == "tp=1"
    assert sweep.deployment_of(spec, "qwen3.6-27b", "tp=2") == "tp=2"


def test_a_layer_sweep_times_and_tags_each_models_rank(tmp_path, monkeypatch):
    spec = read_yaml(FULL_LAYERS, "sweep")
    spec.update(name="layers_rank_cpu", device="cpu", dtype="fp32", target_s=0.002, max_minutes=3,
                models=["tiny-gdn", "tiny-v4"], deployment={"tiny-gdn": "tp=2", "tiny-v4": "ep=2"}, compose=False,
                grid={"batch_size": [1], "nodes_per_seq": [2], "context_len": [0], "tree_shape": ["eagle"]},
                stages=[{"stage": "mlp_step", "variants": ["layers"]}, {"stage": "proj", "variants": ["layers"]}])
    path = tmp_path / "rank.yaml"
    path.write_text(yaml.safe_dump(spec))
    timed = {}
    real_ctx = pieces.Ctx

    def ctx(model, *args, **kw):
        timed[model.name] = model
        return real_ctx(model, *args, **kw)
    monkeypatch.setattr(pieces, "Ctx", ctx)   # the sweep imports it when it runs
    res = sweep.run_sweep(path, tmp_path / "profile.csv", progress=False, echo=lambda s: None)
    assert res.failed == 0 and res.measured > 0, res.summary()
    df = load_profile(tmp_path / "profile.csv")
    assert dict(df.groupby("model")["deployment"].unique().map(list)) == {"tiny-gdn": ["tp=2"], "tiny-v4": ["ep=2"]}
    assert timed["tiny-gdn"].gdn["value_heads"] == 2 and timed["tiny-gdn"].deployment == "tp=2"   # 4 heads / 2
    assert timed["tiny-v4"].mlp["n_experts"] == 4 and timed["tiny-v4"].deployment == "ep=2"       # 8 experts / 2


def test_gpu_run_builds_only_the_runtime_ranks():
    assert gpu_run.runtime_deployment("deepseek-v4-flash", None) == "ep=8"
    assert gpu_run.runtime_deployment("qwen3.6-27b", None) == "tp=1"
    assert gpu_run.runtime_deployment("tiny-v4", None) == "ep=2"     # no shipped deployment: the runtime's rank
    with pytest.raises(SimtreeError, match="builds qwen3.6-27b only as tp=1"):
        gpu_run.runtime_deployment("qwen3.6-27b", "tp=2")
    with pytest.raises(SimtreeError, match="only as ep=8"):
        gpu_run.runtime_deployment("deepseek-v4-flash", "tp=1")
    # the shipped bundle of the deployment, where one ships; none for a deployment without one
    assert gpu_run.default_costs("qwen3.6-27b", "tp=1").endswith("h200_qwen3.6-27b_tp1.json")
    assert gpu_run.default_costs("deepseek-v4-flash", "ep=8").endswith("h200_deepseek-v4-flash_ep8.json")
    assert gpu_run.default_costs("qwen3.6-27b", "tp=4") is None


def test_gpu_run_cuts_a_model_for_the_lossless_check_only(tmp_path, capsys):
    """--dtype / --layers build another model than the profile's: measured phases are refused in
    one line; the lossless check runs on the cut model (every kind kept) and its rows say so."""
    assert gpu_run.main(["--model", "tiny-v4", "--deployment", "ep=2", "--device", "cpu", "--out", str(tmp_path),
                         "--layers", "3"]) == 2
    assert "--layers 3 builds another model" in capsys.readouterr().err
    assert gpu_run.main(["--model", "tiny-v4", "--device", "cpu", "--out", str(tmp_path), "--layers", "2",
                         "--phases", "build,lossless"]) == 2
    assert "tiny-v4 has 3 layer kinds" in capsys.readouterr().err
    assert gpu_run.main(["--model", "tiny-v4", "--device", "cpu", "--out", str(tmp_path),
                         "--dtype", "fp32", "--layers", "3", "--phases", "build,lossless"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "lossless.csv")))
    assert len(rows) == 4 and {(r["model"], r["dtype"], r["layers"]) for r in rows} == {("tiny-v4", "fp32", "3/5")}
    assert all(r["match"] == "True" for r in rows)
    assert "3/5 layers, fp32" in (tmp_path / "log.txt").read_text()


def test_a_cut_model_keeps_every_layer_kind():
    """What gpu_run --layers builds: the first layers of the pattern, one of each kind swapped in."""
    import dataclasses
    for name, n in (("tiny-v4", 3), ("deepseek-v4-flash", 24), ("qwen3.6-27b", 2)):
        shape = get_model(name)
        cut = dataclasses.replace(shape, layer_kinds=shape.stack(n))
        assert cut.num_layers == n and set(cut.kinds()) == set(shape.kinds())
    model = build_model(dataclasses.replace(get_model("tiny-v4"), layer_kinds=get_model("tiny-v4").stack(3)), "cpu")
    assert model.shape.num_layers == 3 and len(model.layer_weights) == 3


def test_gpu_run_steps_rows_carry_the_deployment(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_run, "VERIFY_GRID", [(1, 2, 16)])
    monkeypatch.setattr(gpu_run, "DRAFT_GRID", [(1, 2, 2)])
    model = build_model("tiny-v4", "cpu")
    s = gpu_run.Session(tmp_path, 120)
    gpu_run._steps(s, model, get_workload("gsm8k").acceptance, 16, "ep=2")
    df = load_profile(tmp_path / "steps_profile.csv")
    assert set(df.stage) == {"model_verify_step", "draft_step"} and set(df.deployment) == {"ep=2"}


def test_a_run_without_a_bundle_is_measured_only(tmp_path):
    res = full_run(tiny_model("tiny-gdn"), device="cpu", costs=None, batch_sizes=(1,), acceptance="gsm8k",
                   out=tmp_path, context_len=16, rounds=2, warmup_rounds=1)
    assert res["rows"] and all(r["measured_tok_s"] > 0 for r in res["rows"])
    assert all(r["predicted_tok_s"] != r["predicted_tok_s"] for r in res["rows"])   # NaN: nothing predicted
    assert any("no cost bundle" in n for n in res["notes"]) and (tmp_path / "summary.json").exists()
