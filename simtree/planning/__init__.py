"""Planning: which speculation policy to run per workload and batch size.

A policy is a :class:`PolicySpec` (:mod:`.modes`: one frozen dataclass per mode, e.g.
:class:`EagleParams`); :mod:`.simulate` predicts its decode throughput from cost models and an
acceptance model; :mod:`.planner` scores every candidate policy and chooses per (workload,
batch size), writing a :class:`Policy` (:mod:`.policy_file`, the policy JSON); :mod:`.bundles`
plans every cost bundle as `simtree plan` does and saves each policy; :mod:`.ranges`
names the cost-model axes a plan extrapolates; :mod:`.sglang` turns a plan into SGLang server
arguments.  Re-exported here: the numpy-only names; the planner and the SGLang export (pandas)
are imported from their modules.
"""
from simtree.planning.modes import (MODES, TREE_MODES, BatchAllocParams, BestFirstParams, CostAwareParams, EagleParams,
                                    LinearParams, NoneParams, PolicySpec, params_from_flags)
from simtree.planning.policy_file import Policy, PolicyEntry
from simtree.planning.simulate import SimResult, simulate

__all__ = ["PolicySpec", "NoneParams", "LinearParams", "EagleParams", "BestFirstParams", "CostAwareParams",
           "BatchAllocParams", "MODES", "TREE_MODES", "params_from_flags", "Policy", "PolicyEntry", "simulate",
           "SimResult"]
