"""SGLang's DSpark verify-budget planner, loaded for use off the GPU.

``compute_verify_token_budget`` (``sglang/srt/speculative/dspark_components/dspark_planner.py``)
is plain torch over an SPS table, but its module imports SGLang's scheduler, distributed and
model-config stack, which a CPU machine without SGLang's GPU dependencies cannot import.  Where
the module imports, it is used as is; otherwise the planner's own definitions
(``DSparkScheduleConfig``, ``VerifyBudgetDecision``, ``compute_verify_token_budget`` and its two
table helpers) are compiled from the installed module's source file, unchanged, beside the
installed ``dspark_sps`` tables they read.  Either way the code that runs is the installed
SGLang's.
"""
from __future__ import annotations

import ast
import importlib.util
from typing import Optional, Union

__all__ = ["load_dspark_planner", "PLANNER_NAMES"]

PLANNER_NAMES = ("DSparkScheduleConfig", "VerifyBudgetDecision", "compute_verify_token_budget",
                 "_lookup_sps_tensor", "_additive_step_time_tensor")


def load_dspark_planner():
    """(DSparkScheduleConfig, compute_verify_token_budget, how it was loaded); ImportError when
    sglang is not installed."""
    try:
        from sglang.srt.speculative.dspark_components import dspark_planner as mod
        return mod.DSparkScheduleConfig, mod.compute_verify_token_budget, "imported"
    except ImportError:
        pass
    import msgspec
    import torch
    from sglang.srt.speculative.dspark_components import dspark_sps

    spec = importlib.util.find_spec("sglang.srt.speculative.dspark_components.dspark_planner")
    if spec is None or not spec.origin:
        raise ImportError("sglang's dspark_planner module is not installed")
    with open(spec.origin, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), spec.origin)
    keep = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and node.name in PLANNER_NAMES]
    if {n.name for n in keep} != set(PLANNER_NAMES):
        raise ImportError(f"{spec.origin} lacks {sorted(set(PLANNER_NAMES) - {n.name for n in keep})}")
    namespace = {"__name__": "sglang_dspark_planner", "msgspec": msgspec, "torch": torch,
                 "Optional": Optional, "Union": Union, "SpsCostTable": dspark_sps.SpsCostTable,
                 "SpsAdditiveCostTable": dspark_sps.SpsAdditiveCostTable,
                 "_interp_clamped": dspark_sps._interp_clamped}
    exec(compile(ast.Module(body=keep, type_ignores=[]), spec.origin, "exec"), namespace)  # noqa: S102
    return namespace["DSparkScheduleConfig"], namespace["compute_verify_token_budget"], f"compiled from {spec.origin}"
