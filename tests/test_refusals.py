"""Sizes and files a new user gets wrong: each is refused before any work with one `error:` line
(exit 2) that names the limit or the mismatch, and leaves no output folder behind."""
import subprocess
import sys
from pathlib import Path

import pytest

from simtree.errors import SimtreeError

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "reports" / "h200" / "plan"


def _simtree(*args):
    return subprocess.run([sys.executable, "-m", "simtree", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def _one_line_error(proc, *fragments: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr
    return proc.stderr


# ---- train: the memory a step needs, before the folder is made -------------------------------

def test_train_too_large_a_batch_names_need_and_available_and_writes_nothing(tmp_path):
    out = tmp_path / "models"
    line = _one_line_error(_simtree("train", "--size", "test", "--batch-size", "4096", "--seq-len", "4096",
                                    "--out", out),
                           "--batch-size 4096 x --seq-len 4096: training the target needs about",
                           "GB are available")
    need = float(line.split("needs about ")[1].split(" GB")[0])
    assert need > 1e3   # 4096 windows of 4096 tokens: far beyond any host
    assert not out.exists()


def test_simulate_refuses_trees_beyond_its_limits_in_one_line():
    from simtree.planning.modes import BestFirstParams, CostAwareParams, EagleParams
    from simtree.planning.simulate import MAX_DRAFT_STEPS, MAX_TREE_NODES, check_simulable

    assert check_simulable(EagleParams(MAX_DRAFT_STEPS, 2, MAX_TREE_NODES // 16)).budget == MAX_TREE_NODES // 16
    for spec, name in [(EagleParams(3, MAX_DRAFT_STEPS + 1, 4), "topk"),
                       (EagleParams(MAX_DRAFT_STEPS + 1, 2, 4), "num_steps"),
                       (BestFirstParams(MAX_TREE_NODES + 1, 3), "budget"),
                       (CostAwareParams(16, MAX_DRAFT_STEPS + 1), "draft_depth")]:
        with pytest.raises(SimtreeError, match=f"{spec.mode} {name} .*: the simulator takes at most"):
            check_simulable(spec)
    _one_line_error(_simtree("simulate", "--model", "qwen3.6-27b", "--steps", "50", "--topk", "50",
                             "--budget", "100000"), "eagle budget 100000: the simulator takes at most 1024")


def test_run_refuses_more_new_tokens_than_the_model_has_positions(tmp_path):
    out = tmp_path / "run"
    _one_line_error(_simtree("run", "--max-new-tokens", "100000", "--out", out),
                    "--max-new-tokens 100000: at most 2048", "max_position_embeddings")
    assert not out.exists()


# ---- policies planned for another model -------------------------------------------------------

def _policy_of(model: str, path: Path) -> Path:
    from simtree.planning.modes import EagleParams
    from simtree.planning.policy_file import Policy, PolicyEntry

    return Policy(model, "NVIDIA H200", [PolicyEntry("sharegpt", 1, 8, EagleParams(2, 2, 4), 1000.0, 1.1, 1.5)]
                  ).save(path)


def test_run_refuses_a_policy_planned_for_another_model(tmp_path):
    from simtree.planning.modes import EagleParams
    from simtree.runtime.live import live_run

    pol = _policy_of("qwen3.6-27b", tmp_path / "p.json")
    with pytest.raises(SimtreeError, match="is a plan for qwen3.6-27b, not runtime-tiny"):
        live_run(policy=pol, spec=EagleParams(2, 2, 4), batch_size=1, max_new_tokens=4, out=tmp_path / "o")
    assert not (tmp_path / "o").exists()
    _one_line_error(_simtree("run", "--model", "tiny-gdn", "--device", "cpu", "--policy", pol, "--acceptance",
                             "gsm8k", "--out", tmp_path / "full"), "is a plan for qwen3.6-27b, not tiny-gdn (--model)")


def test_profile_refuses_a_deployment_that_cannot_hold_the_model(tmp_path):
    out = tmp_path / "prof"
    _one_line_error(_simtree("profile", "--model", "deepseek-v4-flash", "--deployment", "tp=1", "--device", "cpu",
                             "--out", out / "profile.csv"),
                    "deepseek-v4-flash does not fit tp=1", "it needs 4 GPUs (ep=4)")
    assert not out.exists()


# ---- sglang given a folder --------------------------------------------------------------------

def test_sglang_takes_a_plan_folder_with_one_policy(tmp_path):
    import shutil

    from simtree.cli.sglang import policy_file

    one = PLANS / "qwen3.6-27b_NVIDIA_H200"
    assert policy_file(str(one)) == str(one / "policy.json")
    shutil.copytree(one, tmp_path / "my_plan" / one.name)   # a plan folder holding one deployment's folder
    assert policy_file(str(tmp_path / "my_plan")) == str(tmp_path / "my_plan" / one.name / "policy.json")
    with pytest.raises(SimtreeError, match=r"holds \d+ policy files \(deepseek-v4-flash_ep8_NVIDIA_H200/policy.json, "
                                           r".*\): give one of them"):
        policy_file(str(PLANS))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SimtreeError, match="without a policy.json"):
        policy_file(str(tmp_path / "empty"))
    proc = _simtree("sglang", tmp_path / "my_plan", "--workload", "sharegpt", "--batch-size", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("--speculative-algorithm EAGLE")
