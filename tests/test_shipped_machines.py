"""Each machine's shipped defaults stay its own: `simtree plan` plans the default machine's
bundles (h200), `--machine h100` the H100 ones, and nothing that reads the shipped bundles mixes
machines; the V4-Flash ep=8 rank at FP8 fits an 80 GB H100."""
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from simtree.cli import app
from simtree.costs.model import load_costs
from simtree.deploy.memory import check_fits, largest_batch, rank_memory
from simtree.deploy.select import select_costs
from simtree.deploy.shipped import (DEFAULT_MACHINE, shipped_bundle, shipped_cost_paths, shipped_deployments, shipped_machine_for,
                                    shipped_machines)
from simtree.errors import SimtreeError
from simtree.machine.machines import get_machine

FAST = ["--workload", "gsm8k", "--batch-sizes", "1,8", "--modes", "linear,eagle", "--band-models", "0"]


def _devices(paths) -> set[str]:
    return {str(load_costs(p).meta["device"]) for p in paths}


def test_the_shipped_bundles_of_each_machine_are_its_own():
    h100, h200 = shipped_cost_paths("h100"), shipped_cost_paths("h200")
    assert DEFAULT_MACHINE == "h200" and shipped_cost_paths() == h200
    assert h100 and h200 and not set(h100) & set(h200)
    assert all(p.name.startswith("h100_") for p in h100) and all(p.name.startswith("h200_") for p in h200)
    assert {get_machine(d).key for d in _devices(h100)} == {"h100"}
    assert {get_machine(d).key for d in _devices(h200)} == {"h200"}
    # every shipped bundle belongs to exactly one machine's listed defaults
    everything = sorted(p.name for p in h100[0].parent.glob("*.json"))
    assert everything == sorted(p.name for p in h100 + h200)
    for machine in ("h100", "h200"):
        assert sorted(shipped_bundle(m, d, machine).name for m, d in shipped_deployments(machine)) == \
            sorted(p.name for p in shipped_cost_paths(machine))


def test_select_costs_picks_one_machine():
    default, _ = select_costs()
    h100, notes = select_costs(machine="h100")
    assert {b.meta["device"] for b in default} == {"NVIDIA H200"}
    assert {b.meta["device"] for b in h100} == {"NVIDIA H100 80GB HBM3"}
    assert sorted((b.meta["model"], b.meta["deployment"]) for b in h100) == \
        [("deepseek-v4-flash", "ep=8"), ("qwen3.6-27b", "tp=1")]
    assert not any("waits" in n for n in notes)   # both H100 defaults have their bundle
    assert all("earlier runtime path" in n for n in notes)       # the V4 bundle's timed path, named
    one, _ = select_costs(model="deepseek-v4-flash", machine="h100")
    assert [b.meta["device"] for b in one] == ["NVIDIA H100 80GB HBM3"]


def test_plan_defaults_to_the_default_machine_and_machine_h100_plans_the_h100_bundles(tmp_path):
    res = CliRunner().invoke(app, ["plan", *FAST, "--model", "qwen3.6-27b", "--deployment", "tp=1", "--json",
                                   "--out", str(tmp_path / "default")])
    assert res.exit_code == 0, res.output
    assert [p["device"] for p in json.loads(res.stdout)] == ["NVIDIA H200"]
    res = CliRunner().invoke(app, ["plan", *FAST, "--machine", "h100", "--json", "--out", str(tmp_path / "h100")])
    assert res.exit_code == 0, res.output
    plans = json.loads(res.stdout)
    assert sorted((p["model"], p["deployment"], p["device"]) for p in plans) == [
        ("deepseek-v4-flash", "ep=8", "NVIDIA H100 80GB HBM3"), ("qwen3.6-27b", "tp=1", "NVIDIA H100 80GB HBM3")]
    index = (tmp_path / "h100" / "plans.md").read_text()
    assert "H200" not in index and "| deepseek-v4-flash | ep=8 |" in index
    for p in plans:   # each policy is planned from the shipped H100 bundle of its deployment
        source = json.loads(open(p["policy_file"]).read())["source"]["costs"]["source"]
        assert source["profile"].startswith("simtree/data/profiles/h100/")


def test_a_plan_of_the_h100_defaults_simulates_on_them(tmp_path):
    res = CliRunner().invoke(app, ["plan", *FAST, "--machine", "h100", "--model", "qwen3.6-27b", "--json",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    policy = json.loads(res.stdout)[0]["policy_file"]
    assert shipped_machine_for(json.loads(open(policy).read())["device"]) == "h100"
    rounds_us = {}
    for machine in (None, "h100", "h200"):
        sim = CliRunner().invoke(app, ["simulate", "--policy", policy, "--workload", "gsm8k", "--batch-size", "8",
                                       "--json"] + (["--machine", machine] if machine else []))
        assert sim.exit_code == 0, sim.output
        rounds_us[machine] = json.loads(sim.stdout)["round_latency_us"]
    assert rounds_us[None] == rounds_us["h100"] != rounds_us["h200"]   # the plan's own machine by default


def test_the_v4_flash_ep8_rank_at_fp8_fits_an_h100():
    mem = check_fits("deepseek-v4-flash", "ep=8", "h100", batch_size=64, context_len=4096)
    assert mem.fits and 40e9 < mem.weight_bytes < 50e9          # 45.0 GB of weights (49.9 with bf16 attention linears)
    assert mem.usable_bytes == int(0.95 * 85017493504)     # CUDA's 79.18 GiB x the fragmentation margin
    assert rank_memory("qwen3.6-27b", "tp=1", "h100", 64, 1024).fits   # the plan's batch 64 at its context
    # four H100s split by ep=4 (79.9 GB of weights a rank) hold a batch of 4 at 4K (at 16 a rank's 4
    # sequences do not fit); tensor parallelism (74.2 GB a rank) holds more
    assert largest_batch("deepseek-v4-flash", "ep=4", "h100", 4096) == 4
    with pytest.raises(SimtreeError, match=r"does not fit ep=4 on NVIDIA H100.*79.9 GB of weights.*it needs 4 GPUs "
                                           r"\(tp=4\)"):
        check_fits("deepseek-v4-flash", "ep=4", "h100", 16, 4096)


def test_an_unknown_machine_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "simtree", "plan", "--machine", "h300"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and not proc.stdout
    line, = proc.stderr.strip().splitlines()
    assert line == ("error: no shipped defaults for machine 'h300': simtree ships them for h100, h200 "
                    "(simtree/data/deployments.yaml)")
    res = CliRunner().invoke(app, ["simulate", "--machine", "h300"])
    assert isinstance(res.exception, SimtreeError) and str(res.exception) == line[len("error: "):]


def test_machine_and_costs_together_are_one_line():
    path = str(shipped_cost_paths("h100")[0])
    res = CliRunner().invoke(app, ["plan", "--machine", "h100", "--costs", path])
    assert isinstance(res.exception, SimtreeError) and "\n" not in str(res.exception)
    assert str(res.exception).startswith("--machine h100 picks that machine's shipped bundles")


def test_the_shipped_machines_and_their_device_names():
    assert {"h100", "h200"} <= set(shipped_machines())
    assert shipped_machine_for("NVIDIA H100 80GB HBM3") == "h100"
    assert shipped_machine_for("NVIDIA H200") == "h200"
    assert shipped_machine_for("cpu") == DEFAULT_MACHINE and shipped_machine_for(None) == DEFAULT_MACHINE


def test_a_gpu_session_predicts_from_its_own_machines_defaults(monkeypatch):
    from simtree.runtime.full import gpu_run

    monkeypatch.setattr(gpu_run.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_run.torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert gpu_run.this_machine() == "h100"
    assert gpu_run.default_costs("deepseek-v4-flash", "ep=8").endswith("h100_deepseek-v4-flash_ep8.json")
    assert gpu_run.default_costs("qwen3.6-27b", "tp=2") is None       # no H100 default at tp=2
    assert gpu_run.default_costs("qwen3.6-27b", "tp=2", "h200").endswith("h200_qwen3.6-27b_tp2.json")
    assert "/h100/plan/" in gpu_run.shipped_plan("qwen3.6-27b", "tp=1")
    monkeypatch.setattr(gpu_run.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert "/h200/plan/" in gpu_run.shipped_plan("qwen3.6-27b", "tp=1")


def test_the_serving_benchmark_takes_the_default_machines_bundles():
    from simtree.serving.bench import default_models

    paths = default_models()
    assert paths and all(p.name.startswith(f"{DEFAULT_MACHINE}_") for p in paths)
    assert len({load_costs(p).meta["model"] for p in paths}) == len(paths)   # one bundle per model


def test_a_shipped_bundles_caveat_is_stamped_into_its_meta_and_carried_by_its_plan(tmp_path):
    """deployments.yaml's caveat (the H200 Qwen bundles: profiled before checkpoint parity) is in the
    shipped bundle's meta and leads its plan's notes; an entry without one (V4-Flash's on both
    machines, since its H200 profile is the real layers') ships none."""
    from simtree.deploy.shipped import caveat_for, stamp_caveat
    from simtree.parallel import parse_deployment
    from simtree.planning.planner import plan
    from simtree.acceptance.model import get_workload
    from simtree.reporting.plan_report import write_plan_report

    dep, ep8 = parse_deployment("tp=1"), parse_deployment("ep=8")
    text = caveat_for("qwen3.6-27b", dep, "h200")
    assert text and "parity" in text and caveat_for("qwen3.6-27b", dep, "h100") is None
    assert caveat_for("deepseek-v4-flash", ep8, "h200") is None and caveat_for("deepseek-v4-flash", ep8, "h100") is None
    shipped = load_costs(shipped_bundle("qwen3.6-27b", dep, "h200"))
    assert shipped.meta.get("caveat") == text
    for machine in ("h100", "h200"):
        assert "caveat" not in load_costs(shipped_bundle("deepseek-v4-flash", ep8, machine)).meta
    assert "caveat" not in load_costs(shipped_bundle("qwen3.6-27b", dep, "h100")).meta
    copy = tmp_path / "b.json"
    copy.write_text(shipped_bundle("qwen3.6-27b", dep, "h200").read_text())
    bundle = json.loads(copy.read_text())
    bundle["meta"].pop("caveat")
    copy.write_text(json.dumps(bundle))
    assert stamp_caveat(copy, "h200") == text and load_costs(copy).meta["caveat"] == text
    result = plan(load_costs(copy), [get_workload("gsm8k")], [1])
    assert result.notes[0] == f"caveat of this cost bundle: {text}"
    # plan.md: the caveat heads the report with the banners on its costs, not among the extrapolated axes
    md = write_plan_report(result, tmp_path / "plan")["markdown"].read_text()
    assert md.count(text) == 1 and md.index(text) < md.index("## Chosen policy")
