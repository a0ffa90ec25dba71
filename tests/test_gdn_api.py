"""The GDN kernels' public surface: entry points that take the math only (the launch is the
private rule's), the launch configs' own checks, and the launch rule's evidence file."""
from __future__ import annotations

import inspect
import re
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest

import simtree.kernels.gdn as kg
from simtree.errors import SimtreeError
from simtree.kernels.gdn import gdn_tree_commit, gdn_tree_verify, gdn_tree_verify_recurrent
from simtree.kernels.gdn._launch import (CommitLaunch, FoldLaunch, VerifyLaunch,
                                         commit_launch_config, verify_launch_config)
from simtree.kernels.gdn.deferred import gdn_fold_round
from simtree.kernels.gdn.verify import gdn_tree_verify_folding_round

ROOT = Path(__file__).resolve().parents[1]
MATH = ("q", "k", "v", "g", "beta", "state", "parents", "cu_nodes")


def _params(fn):
    return [(p.name, p.kind == p.KEYWORD_ONLY) for p in inspect.signature(fn).parameters.values()]


def test_entry_points_take_the_math_only():
    # how a call is launched is the rule's, chosen inside: the signatures hold the math and the
    # round's meta (given: the inputs are taken as checked, no host sync), never a launch
    math = [(x, False) for x in MATH]
    assert _params(gdn_tree_verify) == math + [(x, True) for x in ("scale", "meta")]
    folding = [(x, False) for x in MATH]
    folding.insert(6, ("pending", False))
    assert _params(kg.gdn_tree_verify_folding) == folding + [("meta", True)]
    assert _params(gdn_tree_verify_folding_round) == folding + [("meta", True)]
    assert _params(gdn_tree_commit) == [(x, False) for x in ("state", "k", "cache", "parents",
                                                            "cu_nodes", "accepted")] + \
        [("check", True)]
    assert _params(gdn_tree_verify_recurrent) == math + [(x, True) for x in (
        "scale", "node_states")]
    assert _params(kg.gdn_defer_commit) == [(x, False) for x in (
        "state", "pending", "k", "cache", "parents", "cu_nodes", "accepted")] + [("check", True)]
    for fold in (kg.gdn_fold_pending, gdn_fold_round):
        assert _params(fold) == [(x, False) for x in ("state", "pending", "sequences")]
    assert not {"VerifyLaunch", "CommitLaunch", "FoldLaunch", "verify_launch_config"} & set(kg.__all__)
    # the launch-free form is no runtime's: its entries stay in their modules, not the package's
    assert not {"GDNPendingRound", "new_pending_round", "gdn_tree_verify_folding_round",
                "gdn_fold_round"} & set(dir(kg))


def test_the_rule_sets_every_switch_a_config_leaves_open():
    assert VerifyLaunch().switches() == {} and CommitLaunch().switches() == {}
    assert FoldLaunch().switches() == {} and FoldLaunch(block_k=32).switches() == {"block_k": 32}
    for B, n, depth_first in ((1, 8, False), (4, 100, False), (16, 128, True), (64, 72, False)):
        rule = verify_launch_config(B, 48, 128, "cuda", n, depth_first, 16)
        assert rule.backend == "triton"
        assert rule.switches().keys() == {f.name for f in fields(VerifyLaunch)} - {"backend"}
        assert all(isinstance(v, int) for v in rule.switches().values()), rule
    commit = commit_launch_config(4, 48, 128, 64)
    assert commit.switches().keys() == {f.name for f in fields(CommitLaunch)} - {"backend"}


@pytest.mark.parametrize("make,text", [
    (lambda: VerifyLaunch(backend="cuda"), "unknown backend"),
    (lambda: VerifyLaunch(kside=3), "kside is the K-side kernel's warps"),
    (lambda: VerifyLaunch(kside_cuda=3), "kside_cuda is 0"),
    (lambda: VerifyLaunch(l2_prefetch=32), "l2_prefetch is a sum of the bits"),
    (lambda: CommitLaunch(block_t=48), "commit block_t must be 16, 32 or 64"),
    (lambda: CommitLaunch(backend="gpu"), "unknown backend"),
    (lambda: FoldLaunch(block_v=48), "fold block_v must be a power of two"),
    (lambda: FoldLaunch(num_warps=0), "fold num_warps must be a power of two"),
    (lambda: FoldLaunch(backend="cuda"), "unknown backend")])
def test_a_config_refuses_values_no_launch_takes(make, text):
    with pytest.raises(SimtreeError, match=text) as err:
        make()
    assert "\n" not in str(err.value)


def test_configs_are_frozen_values():
    a, b = VerifyLaunch(backend="triton", kside=1), VerifyLaunch(backend="triton", kside=1)
    assert a == b and hash(a) == hash(b) and a != VerifyLaunch(backend="triton", kside=0)
    with pytest.raises(AttributeError):
        a.kside = 2


def test_the_package_only_re_exports():
    # kernels/gdn/__init__.py holds imports and __all__, no code of its own
    src = (ROOT / "kernels" / "gdn" / "__init__.py").read_text()
    body = [ln for ln in src.split('"""', 2)[2].splitlines() if ln.strip()]
    assert all(ln.startswith(("from .", "__all__", " ")) for ln in body), body
    assert sorted(kg.__all__) == sorted(set(kg.__all__))
    assert all(hasattr(kg, name) for name in kg.__all__)


def test_the_launch_evidence_cites_files_that_exist():
    # docs/kernels/gdn_launch.md: one table, each row's sources in reports/ (the measurements
    # the rule's thresholds come from); the rule's module points at it
    doc = (ROOT / "docs" / "kernels" / "gdn_launch.md").read_text()
    # a source is a current file, or one that left the tree, named by the commit that has it
    cited = set(re.findall(r"`((?:e72a1a7:)?reports/[^`]+)`", doc))
    assert len(cited) > 20
    current = [p for p in cited if not p.startswith("e72a1a7:")]
    assert [p for p in sorted(current) if not (ROOT / p).exists()] == []
    if (ROOT / ".git").exists() and subprocess.run(["git", "cat-file", "-e", "e72a1a7"], cwd=ROOT,
                                                    capture_output=True).returncode == 0:
        gone = [p for p in sorted(cited - set(current))
                if subprocess.run(["git", "cat-file", "-e", p], cwd=ROOT, capture_output=True).returncode]
        assert gone == []
    rows = [ln for ln in doc.splitlines() if ln.startswith("| verify |")]
    assert len(rows) > 20 and all("reports/" in ln for ln in rows)
    assert "docs/kernels/gdn_launch.md" in (ROOT / "kernels" / "gdn" / "_launch.py").read_text()
