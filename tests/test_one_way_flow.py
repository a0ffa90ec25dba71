"""Planning data flows one way: acceptance -> builders -> simulate -> planner.

The acceptance model hands builders plain numbers (the drafter's probabilities per depth and
rank); builders return trees; the simulator scores them with the acceptance tables; the planner
ranks the scores.  Pinned twice: by the import statements (builders import nothing from
acceptance or planning; acceptance nothing from planning), and by the calls a plan and a
simulation make (sys.setprofile): every call between stages goes upstream, so no call stack
can enter a stage it had left (the edges form a chain, not a loop).
"""
import sys

import numpy as np
import pytest

from simtree.acceptance.model import Workload, calibrate_linear
from simtree.costs.synthetic import synthetic_costs
from simtree.planning.modes import (BatchAllocParams, BestFirstParams, CostAwareParams, EagleParams, LinearParams,
                                    NoneParams)
from simtree.planning.planner import SearchSpace, plan
from simtree.planning.simulate import simulate
from test_dependencies import imports, modules

# the data flow's stages; a call may only go upstream (the caller pulls numbers or trees), except
# that builders are pure functions of the numbers they are handed: they never call acceptance
STAGES = {"simtree.acceptance": "acceptance", "simtree.trees.builders": "builders",
          "simtree.planning.simulate": "simulate", "simtree.planning.adaptive": "simulate",
          "simtree.planning.allocation": "simulate", "simtree.planning.planner": "planner",
          "simtree.planning.compare": "planner"}
ALLOWED = {("planner", "simulate"), ("planner", "builders"), ("planner", "acceptance"), ("simulate", "builders"),
           ("simulate", "acceptance")}


def stage(module: str | None) -> str | None:
    for prefix, name in STAGES.items():
        if module and (module == prefix or module.startswith(prefix + ".")):
            return name
    return None


def test_builders_and_acceptance_import_nothing_downstream():
    bad = [(src, dst) for src, dst, _ in imports(modules())
           if (src.startswith("simtree.trees") and dst.startswith(("simtree.acceptance", "simtree.planning")))
           or (src.startswith("simtree.acceptance") and dst.startswith("simtree.planning"))]
    assert bad == []


class CallFlow:
    """sys.setprofile hook: the edges (caller's stage, callee's stage) of every Python call
    between two stages, the caller being the nearest frame on the stack that has a stage."""

    def __init__(self, outer: str | None = None):
        self.edges, self.stack = set(), [outer]

    def __call__(self, frame, event, arg):
        if event == "call":
            here = stage(frame.f_globals.get("__name__"))
            caller = next((s for s in reversed(self.stack) if s is not None), None)
            if here is not None and caller is not None and here != caller:
                self.edges.add((caller, here))
            self.stack.append(here)
        elif event == "return" and len(self.stack) > 1:
            self.stack.pop()

    def run(self, fn):
        sys.setprofile(self)
        try:
            return fn()
        finally:
            sys.setprofile(None)


@pytest.fixture(scope="module")
def flow():
    acc = calibrate_linear(2.6, 4, name="w", spread=0.3)
    wl = Workload("w", acc, np.full(4, 200), 24)
    costs = synthetic_costs()
    space = SearchSpace(budgets=(2, 4), eagle_steps=(2,), eagle_topk=(2,), draft_depths=(2,), adaptive_max_budget=4)
    specs = [NoneParams(), LinearParams(3), EagleParams(2, 2, 4), BestFirstParams(4, 2), CostAwareParams(4, 2),
             BatchAllocParams(4, 2)]

    def work():
        res = plan(costs, [wl], [1, 4], space)
        for spec in specs:
            simulate(costs, wl, 4, spec)
            simulate(costs, wl, 4, spec, mc_runs=2, seed=1)
        return res

    calls = CallFlow()
    res = calls.run(work)
    assert len(res.candidates) > 10
    return calls


def test_a_plan_calls_only_upstream(flow):
    # the plan used every stage: the planner the simulator, the simulator builders and acceptance
    assert {("planner", "simulate"), ("simulate", "builders"), ("simulate", "acceptance")} <= flow.edges
    assert flow.edges <= ALLOWED, sorted(flow.edges - ALLOWED)


def test_the_hook_sees_a_callback_into_acceptance():
    # the check itself: a builder handed a callback that reads the acceptance model (as the
    # EAGLE `propose` closure of the acceptance model did) is a builders -> acceptance edge
    from simtree.trees.builders import eagle_tree
    acc = calibrate_linear(2.6, 4, name="w")

    def propose(parents, tokens, frontier):
        row = np.log(acc.draft_table(0, 1)[0, :2])
        return np.tile(np.arange(2), (frontier.shape[0], 1)), np.tile(row, (frontier.shape[0], 1))

    calls = CallFlow(outer="simulate")
    calls.run(lambda: eagle_tree(propose, 2, 2, 4))
    assert calls.edges == {("simulate", "builders"), ("builders", "acceptance")}
