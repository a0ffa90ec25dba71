"""Policy modes (contract 3; their params as :mod:`simtree.planning.policy_file` lists them) and
:class:`PolicySpec`: one policy as the simulator, planner and runtime take it, a mode with
validated, normalised params, its name, fixed budget and draft shape.  Validation only, no
simulation (:mod:`simtree.planning.simulate` re-exports PolicySpec).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from simtree.trees.builders import eagle_max_nodes
from simtree.errors import SimtreeError, check_whole

__all__ = ["MODES", "TREE_MODES", "MAX_BATCH_SIZE", "PolicySpec", "check_params", "check_batch_size",
           "params_from_flags"]

MODES = ("none", "linear", "eagle", "best_first", "cost_aware", "batch_alloc")
TREE_MODES = ("eagle", "best_first", "cost_aware", "batch_alloc")   # the rest verify a chain (or nothing)
MARGINAL_MODES = ("best_first", "cost_aware", "batch_alloc")         # drafted as draft_depth positions
_REQUIRED = {"none": (), "linear": ("budget",), "eagle": ("num_steps", "topk", "budget"),
             "best_first": ("budget",), "cost_aware": ("max_budget",), "batch_alloc": ("max_budget_per_seq",)}
_ALLOWED = {"none": (), "linear": ("budget",), "eagle": ("num_steps", "topk", "budget"),
            "best_first": ("budget", "width", "draft_depth"), "cost_aware": ("max_budget", "draft_depth"),
            "batch_alloc": ("max_budget_per_seq", "draft_depth")}
DEFAULT_DRAFT_DEPTH = 3  # the public V4 MTP recipe drafts 3 steps
# Largest batch size simulated or planned: far beyond any serving batch, small enough that token
# counts stay exact in float64 / int64 arithmetic.
MAX_BATCH_SIZE = 1_000_000


def check_batch_size(batch_size, what: str = "batch size") -> int:
    """``batch_size`` as an int in [1, MAX_BATCH_SIZE]; a one-line SimtreeError otherwise."""
    return check_whole(batch_size, what, 1, MAX_BATCH_SIZE)


def params_from_flags(mode: str, steps: int, topk: int, budget: int, width: int = 1,
                      draft_depth: int | None = None) -> dict:
    """Policy params from the command-line flags of `simtree simulate` / `simtree run`
    (--budget is the max budget of the adaptive modes)."""
    params = {"none": {}, "linear": {"budget": budget},
              "eagle": {"num_steps": steps, "topk": topk, "budget": budget},
              "best_first": {"budget": budget, "width": width},
              "cost_aware": {"max_budget": budget}, "batch_alloc": {"max_budget_per_seq": budget}}
    if mode not in params:
        raise SimtreeError(f"unknown policy mode {mode!r}: use one of {', '.join(MODES)}")
    p = params[mode]
    if draft_depth is not None:
        if mode not in MARGINAL_MODES:
            raise SimtreeError(f"--draft-depth applies to {', '.join(MARGINAL_MODES)}, not to mode {mode!r}"
                               + (" (eagle drafts --steps levels)" if mode == "eagle" else ""))
        p["draft_depth"] = draft_depth
    return p


def check_params(mode: str, params: dict) -> dict:
    """Validated, normalised params of a policy mode (contract 3 names, plus draft_depth/width)."""
    if mode not in MODES:
        raise SimtreeError(f"unknown policy mode {mode!r}: use one of {', '.join(MODES)}")
    if not isinstance(params, dict):
        raise SimtreeError(f"params of mode {mode!r} must be an object, got {type(params).__name__}")
    out = {}
    for key in _REQUIRED[mode]:
        if key not in params:
            raise SimtreeError(f"mode {mode!r} needs the parameter {key!r}")
    unknown = [k for k in params if k not in _ALLOWED[mode]]
    if unknown:
        allowed = ", ".join(_ALLOWED[mode]) or "none"
        raise SimtreeError(f"mode {mode!r} has no parameter {unknown[0]!r} (its parameters: {allowed})")
    for key, value in params.items():   # every allowed parameter is a count >= 1
        out[key] = check_whole(value, f"parameter {key} of mode {mode!r}", 1)
    budget = out.get("budget", out.get("max_budget", out.get("max_budget_per_seq", 1)))
    if mode in ("best_first", "cost_aware", "batch_alloc"):
        out.setdefault("draft_depth", max(1, min(DEFAULT_DRAFT_DEPTH, budget - 1)))
    if mode == "best_first":
        out.setdefault("width", 1)
    if mode == "eagle" and out["budget"] > eagle_max_nodes(out["num_steps"], out["topk"]):
        raise SimtreeError(f"eagle budget {out['budget']} exceeds the {eagle_max_nodes(out['num_steps'], out['topk'])} "
                           f"nodes that {out['num_steps']} steps of top-{out['topk']} generate")
    return out


@dataclass(frozen=True)
class PolicySpec:
    """A policy mode and its params (contract 3): e.g. PolicySpec("eagle", {"num_steps": 4, ...})."""

    mode: str
    params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", check_params(self.mode, dict(self.params)))

    @property
    def name(self) -> str:
        p = self.params
        return {"none": lambda: "none", "linear": lambda: f"linear_d{p['budget']}",
                "eagle": lambda: f"eagle_s{p['num_steps']}_k{p['topk']}_d{p['budget']}",
                "best_first": lambda: f"best_first_d{p['budget']}_w{p['width']}_p{p['draft_depth']}",
                "cost_aware": lambda: f"cost_aware_max{p['max_budget']}_p{p['draft_depth']}",
                "batch_alloc": lambda: f"batch_alloc_max{p['max_budget_per_seq']}_p{p['draft_depth']}"}[self.mode]()

    @property
    def budget(self) -> int | None:
        """Fixed verify budget (nodes incl. root) or None for the adaptive modes."""
        return {"none": 1}.get(self.mode, self.params.get("budget"))

    def draft_shape(self) -> tuple[int, int]:
        """(num_steps, topk) fed to the draft cost model; (0, 0) = no drafting."""
        p = self.params
        if self.mode == "none":
            return 0, 0
        if self.mode == "linear":
            return p["budget"] - 1, 1
        if self.mode == "eagle":
            return p["num_steps"], p["topk"]
        return p["draft_depth"], 1
