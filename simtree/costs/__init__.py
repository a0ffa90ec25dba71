"""Cost models: what one verify step and one drafting round cost, from measurements.

The profile table (:mod:`.profile_table`: one row per timed grid point, :mod:`.steps`: the
point and the step the profiler times) is fitted (:mod:`.profile_fit`, one convex program per
surface in :mod:`.surface_fit`, forms in :mod:`.forms`: basis and grid in :mod:`.base_forms`,
MoE in :mod:`.moe_forms`) into a cost bundle (:mod:`.model`):
verify C_v(n, l, b) and draft C_d(s, k, b) in microseconds, which the simulator, planner and
runtime take through the protocols :class:`VerifyCost`, :class:`DraftCost` and
:class:`Costs`.  :mod:`.synthetic` is an analytic roofline for tests and the no-data default.
Re-exported here: the numpy-only names; the fit (cvxpy, matplotlib) and the profile table
(pandas) are imported from their modules.
"""
from simtree.costs.model import (COSTS_SCHEMA, CostBundle, Costs, DraftCost, DraftCostModel, VerifyCost, VerifyCostModel,
                                 load_costs)
from simtree.costs.steps import Point, StepBuilder, Unavailable, Workload
from simtree.costs.synthetic import SYNTHETIC_LABEL, synthetic_costs

__all__ = ["VerifyCost", "DraftCost", "Costs", "VerifyCostModel", "DraftCostModel", "CostBundle", "COSTS_SCHEMA",
           "load_costs", "synthetic_costs", "SYNTHETIC_LABEL", "Point",
           "Workload", "Unavailable", "StepBuilder"]
