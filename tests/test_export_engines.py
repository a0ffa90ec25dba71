"""simtree export sglang|vllm: every SGLang file is read back by SGLang's own parser and
loaders (skipped where sglang is not importable); vLLM's tiers cover batch 1."""
import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simtree.cli import app
from simtree.costs.model import load_costs
from simtree.engines.export import export_policy, parse_vllm_tiers
from simtree.errors import SimtreeError

PLANS = Path(__file__).resolve().parents[1] / "reports" / "h200" / "plan"
QWEN, V4 = PLANS / "qwen3.6-27b_NVIDIA_H200", PLANS / "deepseek-v4-flash_ep8_NVIDIA_H200"
runner = CliRunner()


@pytest.fixture(scope="module")
def sglang_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang")
    r = runner.invoke(app, ["export", "sglang", str(QWEN), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "lost:" in r.output and "% predicted" in r.output and "controller: adaptive_controller.json" in r.output
    return out


def test_sglang_files_load_with_sglangs_own_loaders(sglang_dir):
    adaptive = pytest.importorskip("sglang.srt.speculative.adaptive_spec_params")
    sps_mod = pytest.importorskip("sglang.srt.speculative.dspark_components.dspark_sps")
    server_args = pytest.importorskip("sglang.srt.server_args")
    cfg, slots = adaptive._load_adaptive_config(str(sglang_dir / "adaptive_config.json"))
    assert 1 in slots and all(isinstance(s, int) for e in slots.values() for s in e["candidate_steps"])
    params = adaptive.AdaptiveSpeculativeParams(3, str(sglang_dir / "adaptive_config.json"))
    assert params.get_steps_for_batch(1) in slots[1]["candidate_steps"]

    table = sps_mod.load_sps_table_from_path(str(sglang_dir / "sps_table.json"))
    assert type(table).__name__ == "SpsAdditiveCostTable"
    manifest = json.loads((sglang_dir / "export.json").read_text())
    sps = manifest["sps_table"]
    costs = load_costs(sps["costs"])
    for b, budget in [(1, 0), (4, 8), (16, 40), (64, 128)]:   # SGLang's step time vs simtree's costs
        ours = (costs.draft.predict(sps["gamma"], 1, b) + costs.verify.predict((b + budget) / b,
                                                                               sps["context_len"], b)) * 1e-6
        assert table.step_time(num_reqs=b, budget=budget) == pytest.approx(float(ours), rel=max(0.05, sps["max_rel_error"]))

    for name, algo in [("launch_static.txt", "EAGLE"), ("launch_adaptive.txt", "EAGLE"), ("launch_dspark.txt", "DSPARK")]:
        argv = shlex.split((sglang_dir / name).read_text())[3:]   # drop "python -m sglang.launch_server"
        argv = [str(sglang_dir / a) if (sglang_dir / a).is_file() else a for a in argv]
        parsed = server_args.prepare_server_args(argv)
        assert parsed.speculative_algorithm == algo
        if name == "launch_adaptive.txt":
            assert parsed.speculative_adaptive and parsed.speculative_eagle_topk == 1
            assert parsed.speculative_num_steps >= max(max(e["candidate_steps"]) for e in slots.values())
        if name == "launch_adaptive.txt":   # SGLang's own gate and buffer sizing accept the launch
            assert adaptive.adaptive_unsupported_reason(parsed) is None
            steps = adaptive.resolve_candidate_steps_from_config(parsed.speculative_adaptive_config)
            assert max(steps) <= parsed.speculative_num_steps
        if name == "launch_dspark.txt":
            assert Path(parsed.speculative_dspark_sps_table_path).is_file()
            dspark = parsed
    for bs, entry in slots.items():   # each slot as SGLang builds it, fed a verify's accepted drafts
        slot = adaptive.AdaptiveStepSlot(3, {**cfg, **entry})
        assert slot.candidate_steps == sorted(set(entry["candidate_steps"]))
        for _ in range(slot.warmup_batches + slot.update_interval):
            slot.update([slot.current_steps] * 4)
        assert slot.current_steps in slot.candidate_steps

    # DSpark's own budget planner over the exported table, at the launch's block size
    torch = pytest.importorskip("torch")
    from simtree.engines.sglang_dspark import load_dspark_planner
    sched_cfg, budget_fn, _ = load_dspark_planner()
    gamma = int(dspark.speculative_dspark_block_size)
    loaded = sps_mod.load_sps_table_from_path(dspark.speculative_dspark_sps_table_path)
    for b in (1, 8, 64):
        surv = torch.cumprod(torch.full((b, gamma), 0.7, dtype=torch.float64), dim=1)
        decision = budget_fn(history_survival_probs=surv, sps_table=loaded, cfg=sched_cfg(gamma=gamma))
        assert 0 <= int(decision.budget) <= b * gamma


def test_losses_are_predictions_of_the_plan(sglang_dir):
    m = json.loads((sglang_dir / "export.json").read_text())
    assert m["tiers"][0]["batch_min"] == 1
    for t in m["tiers"]:
        assert t["loss"] == pytest.approx(max(0.0, 1 - t["exported_tok_s"] / t["planned_tok_s"]))
        assert 0 <= t["loss"] < 0.5


def test_vllm_tiers(tmp_path):
    m = export_policy("vllm", V4 / "policy.json", tmp_path)
    spec = json.loads((tmp_path / "speculative_config.json").read_text())
    tiers = parse_vllm_tiers(spec["num_speculative_tokens_per_batch_size"], "test")
    assert tiers[0][0] == 1 and spec["num_speculative_tokens"] >= max(k for _, _, k in tiers)
    assert [(lo, hi) for lo, hi, _ in tiers] == [(t["batch_min"], t["batch_max"]) for t in m["tiers"]]
    with pytest.raises(SimtreeError, match="does not cover batch 1"):
        parse_vllm_tiers({"2-8": 3, "9-64": 0}, "tiers.json")


def test_bad_policy_writes_nothing(tmp_path):
    r = runner.invoke(app, ["export", "sglang", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_plan_not_covering_batch_1_is_one_line_and_writes_nothing(tmp_path, engine):
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "candidates.csv").write_text((QWEN / "candidates.csv").read_text())
    policy = json.loads((QWEN / "policy.json").read_text())
    policy["entries"] = [e for e in policy["entries"] if e["batch_min"] > 1]
    (plan / "policy.json").write_text(json.dumps(policy))
    out = tmp_path / "o"
    r = runner.invoke(app, ["export", engine, str(plan), "--out", str(out)])
    assert isinstance(r.exception, SimtreeError) and "\n" not in str(r.exception)
    assert "not 1" in str(r.exception) or "batch 1" in str(r.exception)
    assert not out.exists()


@pytest.mark.parametrize("engine, bundle, message", [
    ("sglang", "h200_deepseek-v4-flash_ep8.json", "times deepseek-v4-flash at ep=8; the policy plans qwen3.6-27b at tp=1"),
    ("sglang", "h200_qwen3.6-27b_tp2.json", "times qwen3.6-27b at tp=2; the policy plans qwen3.6-27b at tp=1"),
    ("vllm", "h200_qwen3.6-27b_tp1.json", "the vllm export writes neither"),
])
def test_costs_of_another_model_or_deployment_or_for_vllm_are_refused(tmp_path, engine, bundle, message):
    """The SPS table was fitted to whatever --costs gave (another model's timings, silently), and
    the vllm export ignored --costs."""
    from simtree.data import data_path

    out = tmp_path / "o"
    r = runner.invoke(app, ["export", engine, str(QWEN), "--out", str(out), "--costs",
                            str(data_path("costs", bundle))])
    assert isinstance(r.exception, SimtreeError) and message in str(r.exception)
    assert "\n" not in str(r.exception) and not out.exists()


def test_a_model_path_with_a_space_stays_one_shell_word(tmp_path):
    """The launch lines are copied into a shell: an unquoted 'my models/qwen' split in two."""
    r = runner.invoke(app, ["export", "sglang", str(QWEN), "--out", str(tmp_path), "--model-path", "my models/qwen"])
    assert r.exit_code == 0, r.output
    for name in ("launch_static.txt", "launch_adaptive.txt", "launch_dspark.txt"):
        words = shlex.split((tmp_path / name).read_text())
        assert words[words.index("--model-path") + 1] == "my models/qwen", name
    r = runner.invoke(app, ["export", "vllm", str(QWEN), "--out", str(tmp_path / "v"), "--model-path", "my models/qwen"])
    assert r.exit_code == 0, r.output
    assert shlex.split((tmp_path / "v" / "launch.txt").read_text())[2] == "my models/qwen"
