"""Kernel entry points take the math only (fla's ``chunk_gated_delta_rule(q, k, v, g, beta,
scale, ...)``): every function a public module under kernels/ exports has at most
MAX_PARAMETERS parameters and none is a launch config; how a call is launched is chosen
inside (the private ``_launch.py`` / ``_launched.py`` modules, which the benchmarks and tests
may call with switches of their own).  Read from the source (ast), no import."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMETERS = 10
# exported functions that are not kernel entries, and why: the plain torch references state
# the math with every knob (reference modules, ``*_ref``, ``*_torch``); these compose a model
# or a check and are no operator's entry
NOT_ENTRIES = {
    ("kernels/layers/qwen.py", "mtp_forward"): "a model's MTP layer, composed of the ops",
    ("kernels/layers/v4.py", "mtp_forward"): "a model's MTP layer, composed of the ops",
    ("kernels/v4/check.py", "check_against_reference"): "the verify + commit check harness",
    ("kernels/v4/steps.py", "make_verify_step"): "the profiler's step builder",
}


def public_modules():
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        if not any(part.startswith("_") and part != "__init__.py"
                   for part in path.relative_to(ROOT).parts):
            yield path


def exported_functions(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names = set(ast.literal_eval(node.value))
    return [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]


def parameters(fn: ast.FunctionDef) -> list[ast.arg]:
    a = fn.args
    return a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]


def test_entries_take_the_math_only():
    bad, seen = [], 0
    for path in public_modules():
        rel = path.relative_to(ROOT).as_posix()
        for fn in exported_functions(path):
            if path.name == "reference.py" or fn.name.endswith(("_ref", "_torch")) \
                    or (rel, fn.name) in NOT_ENTRIES:
                continue
            seen += 1
            params = parameters(fn)
            launch = [p.arg for p in params if p.arg == "launch"
                      or (p.annotation is not None and "Launch" in ast.unparse(p.annotation))]
            if len(params) > MAX_PARAMETERS or launch:
                bad.append(f"{rel}::{fn.name}: {len(params)} parameters" + (f", launch {launch}" if launch else ""))
    assert seen > 30 and bad == [], bad


def test_the_exceptions_still_exist():
    for (rel, name) in NOT_ENTRIES:
        assert name in {fn.name for fn in exported_functions(ROOT / rel)}, (rel, name)


def test_the_gdn_entries_and_the_launched_forms():
    # the entries in verify.py / commit.py take no launch; _launched.py holds the forms that do
    verify = {fn.name: fn for fn in exported_functions(ROOT / "kernels/gdn/verify.py")}
    assert [p.arg for p in parameters(verify["gdn_tree_verify"])] == [
        "q", "k", "v", "g", "beta", "state", "parents", "cu_nodes", "scale", "meta"]
    launched = {fn.name: fn for fn in exported_functions(ROOT / "kernels/gdn/_launched.py")}
    assert {"launched_verify", "launched_commit", "launched_recurrent"} <= set(launched)
    assert "launch" in [p.arg for p in parameters(launched["launched_verify"])]
